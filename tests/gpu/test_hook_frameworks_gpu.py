"""The job's own leaking line, named first under the frameworks users train with, on a real GPU,
through `gpuwarden watch` (tests/gpu/hook_jobs.py's ``trainer`` and ``lightning`` jobs: a small GPT-2
from its config, a score of each batch kept as a tensor with its graph, so each step keeps that
step's logits).

Run on a GPU machine, never in CI (no driver there); needs torch, transformers and lightning:

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_hook_frameworks_gpu.py -s

- A ``transformers.Trainer`` whose ``compute_loss`` override keeps the score, and a ``LightningModule``
  whose ``training_step`` keeps it, each about 3.75 GiB a minute, beside their fixed twins (``.item()``
  of the score) on the same GPU: both leaks are flagged at the rate their hooks' readings show, each
  naming its own leaking line first; the twins never.
- A Trainer job that leaks about 34 GiB a minute (its card full in about 4 minutes) is flagged at
  least 2 minutes before it runs out of memory, naming its line first; its fixed twin beside it never.

The rule is the plain one a user writes, ``memoryGrowth: {rate: 20Mi/m}``; the hooks run at their
defaults (4 frames, paced readings) but for tracemalloc, which is on.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from watch_support import LEAK_POLICY, Recorder, launch, rate_of, started, stop, up, watching

pytestmark = pytest.mark.gpu

JOBS = Path(__file__).with_name("hook_jobs.py")


def jobs_argv(kinds: tuple[str, ...], socket: Path, *flags: str) -> dict[str, list[str]]:
    """hook_jobs.py's command line for each kind (``trainer``, ``trainer-fixed``, …)."""
    argvs = {}
    for kind in kinds:
        job, _, fixed = kind.partition("-")
        argvs[kind] = [str(JOBS), job, f"--socket={socket}", *flags, *(["--fixed"] if fixed else [])]
    return argvs


def first_line(text: str) -> str:
    """The first of a message's top growing lines: ``gpu/hook_jobs.py:241``."""
    match = re.search(r"top growing lines: (\S+:\d+) \+", text)
    assert match is not None, text
    return match.group(1)


def test_the_leaking_line_of_a_trainer_override_and_a_lightning_step_is_named_first(tmp_path: Path) -> None:
    socket = tmp_path / "hook.sock"
    seen: list[str] = []
    with watching(LEAK_POLICY, tmp_path, socket, "480s") as (watch, address):
        assert watch.stdout is not None
        flags = ("--seconds=420", "--steps-per-second=4")
        kinds = ("trainer", "trainer-fixed", "lightning", "lightning-fixed")
        jobs = launch(jobs_argv(kinds, socket, *flags), tmp_path)
        recorder = None
        try:
            info, pids = up(jobs, address)
            recorder = Recorder(address, pids)
            recorder.start()
            found = started(
                watch.stdout, {("tensor-leak", pids["trainer"]), ("tensor-leak", pids["lightning"])}, seen
            )
            measured = {kind: recorder.rate(kind) for kind in ("trainer", "lightning")}
        finally:
            stop(jobs, recorder, tmp_path)
    seen.append(watch.stdout.read())  # to its end: what watch said after the leaks were flagged
    print("".join(seen))
    for kind in ("trainer", "lightning"):
        _, text = found[("tensor-leak", pids[kind])]
        assert "allocated memory (live tensors, not the cache) grows" in text, text
        assert first_line(text).endswith(f"hook_jobs.py:{info[kind]['leakLine']}"), text
        assert 0.7 * measured[kind] < rate_of(text) < 1.3 * measured[kind], (kind, text, measured)
        print(f"{kind}: flagged {text.strip()}; measured {measured[kind] / 2**30:.2f}Gi/m")
    for kind in ("trainer-fixed", "lightning-fixed"):
        assert not re.search(rf"STARTED \S+ pid {pids[kind]}\b", "".join(seen)), kind


def test_a_leak_that_fills_the_card_in_4_minutes_is_flagged_2_minutes_before_it_runs_out(
    tmp_path: Path,
) -> None:
    socket = tmp_path / "hook.sock"
    seen: list[str] = []
    with watching(LEAK_POLICY, tmp_path, socket, "420s") as (watch, address):
        assert watch.stdout is not None
        # 32 sequences of 128 tokens keep 128 MiB of logits a step: 4.5 steps a second fill 140 GiB in
        # about 4 minutes.
        flags = ("--seconds=400", "--steps-per-second=4.5", "--sequences=32")
        jobs = launch(jobs_argv(("trainer", "trainer-fixed"), socket, *flags), tmp_path)
        recorder = None
        try:
            info, pids = up(jobs, address)
            onset = time.monotonic()
            recorder = Recorder(address, pids)
            recorder.start()
            found = started(watch.stdout, {("tensor-leak", pids["trainer"])}, seen)
            flagged, text = found[("tensor-leak", pids["trainer"])]
            rc = jobs["trainer"].wait(timeout=400)  # it runs until the card is full
            out_of_memory = time.monotonic()
            measured = recorder.rate("trainer", until=flagged)
        finally:
            stop(jobs, recorder, tmp_path)
    seen.append(watch.stdout.read())
    print("".join(seen))
    assert rc != 0
    assert "OutOfMemoryError" in (tmp_path / "trainer.log").read_text()
    ahead = out_of_memory - flagged
    print(
        f"flagged {flagged - onset:.0f}s after the first reading, {ahead:.0f}s before the job ran out of"
        f" memory at {out_of_memory - onset:.0f}s; {text.strip()}; measured {measured / 2**30:.1f}Gi/m"
    )
    assert ahead >= 120, (ahead, text)
    assert first_line(text).endswith(f"hook_jobs.py:{info['trainer']['leakLine']}"), text
    assert 0.7 * measured < rate_of(text) < 1.3 * measured, (text, measured)
    assert not re.search(rf"STARTED \S+ pid {pids['trainer-fixed']}\b", "".join(seen))

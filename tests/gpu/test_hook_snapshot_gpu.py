"""Seen before the crash, on a real GPU through `gpuwarden watch`: the leaking job's GPU bytes by line,
and a snapshot of the allocator written before the job runs out of memory (docs/hook.md, "Requests").

Run on a GPU machine, never in CI (no driver there); needs torch, transformers and lightning:

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_hook_snapshot_gpu.py -s

Each case runs a leaking job (tests/gpu/hook_jobs.py's ``trainer``, whose ``compute_loss`` override keeps
a score with its graph, or ``lightning``, whose ``training_step`` does) beside its fixed twin, both
opted in to snapshots, tracemalloc off:

- ``fast``: about 34 GiB a minute (32 sequences a step at 4.5 steps a second), a ballast leaving
  ``FAST_FREE_GIB`` of the card free; ``slow``: about 3.75 GiB a minute (4 sequences at 4 a second),
  a ballast leaving ``SLOW_FREE_GIB`` free, so that both reach the OOM within minutes.

Each asserts that watch asked for GPU bytes by line and got a snapshot (``SNAPSHOT`` line) before the
leaking job died of ``OutOfMemoryError``; that the file is on disk, loads with pickle in torch's
snapshot format and is read by ``torch.cuda._memory_viz``; that the line it names first is the job's
own (the override's forward or its leaking line) with GiB within 10% of what the snapshot's own blocks
credit to that line; and that the twin never had a snapshot.

How many runs of each: ``GPUWARDEN_SNAPSHOT_RUNS``, e.g. ``trainer-fast=5,trainer-slow=2`` (default
one of each of the four cases; a case left out runs none when the variable is set).

``test_recording_costs_nothing_before_suspicion`` times a small torch step with no hook, with a hook
opted in (not recording), and recording, and a snapshot's time on its thread and the steps meanwhile.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from watch_support import LEAK_POLICY, launch, stop, up, watching

pytestmark = pytest.mark.gpu

JOBS = Path(__file__).with_name("hook_jobs.py")
FAST_FREE_GIB = float(os.environ.get("GPUWARDEN_SNAPSHOT_FAST_FREE_GIB", "80"))
SLOW_FREE_GIB = float(os.environ.get("GPUWARDEN_SNAPSHOT_SLOW_FREE_GIB", "10"))
SPEEDS = {
    "fast": ("--sequences=32", "--steps-per-second=4.5", f"--ballast-free-gib={FAST_FREE_GIB}"),
    "slow": ("--sequences=4", "--steps-per-second=4", f"--ballast-free-gib={SLOW_FREE_GIB}"),
}
CASES = ("trainer-fast", "trainer-slow", "lightning-fast", "lightning-slow")
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def runs() -> list[tuple[str, int]]:
    """(case, run number) from ``GPUWARDEN_SNAPSHOT_RUNS`` (see the module doc)."""
    spec = os.environ.get("GPUWARDEN_SNAPSHOT_RUNS")
    counts = dict.fromkeys(CASES, 1)
    if spec:
        counts = dict.fromkeys(CASES, 0)
        for part in spec.split(","):
            case, _, n = part.partition("=")
            assert case.strip() in CASES, f"GPUWARDEN_SNAPSHOT_RUNS: unknown case {case!r}"
            counts[case.strip()] = int(n or 1)
    return [(case, i) for case in CASES for i in range(1, counts[case] + 1)]


def size_of(text: str) -> float:
    """``41.2Gi`` in bytes."""
    match = re.fullmatch(r"([\d.]+)(Ki|Mi|Gi)?", text)
    assert match is not None, text
    return float(match.group(1)) * UNITS.get(match.group(2) or "", 1)


def by_job_line(snapshot: dict[str, Any], job_file: str) -> dict[int, int]:
    """The live bytes the snapshot's own blocks credit to each line of ``job_file``: the first frame
    of that file in each block's stack (torch lists frames innermost first)."""
    lines: dict[int, int] = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frame = next((f for f in block.get("frames", ()) if f["filename"].endswith(job_file)), None)
            if frame is not None:
                lines[frame["line"]] = lines.get(frame["line"], 0) + block["size"]
    return lines


@pytest.mark.parametrize(("case", "run"), runs(), ids=[f"{c}-{i}" for c, i in runs()])
def test_a_snapshot_is_on_disk_before_the_oom_and_names_the_jobs_line(
    case: str, run: int, tmp_path: Path
) -> None:
    job, speed = case.split("-")
    socket_path = Path(tempfile.mkdtemp(prefix="gw-snap-")) / "hook.sock"
    dirs = {kind: tmp_path / f"snapshots-{kind}" for kind in (job, f"{job}-fixed")}
    argvs = {
        kind: [
            str(JOBS),
            job,
            f"--socket={socket_path}",
            "--seconds=400",
            "--no-tracemalloc",
            f"--snapshots={dirs[kind]}",
            *(SPEEDS[speed] if kind == job else SPEEDS[speed][:2]),
            *(["--fixed"] if kind != job else []),
        ]
        for kind in dirs
    }
    seen: list[str] = []
    snapshots: list[tuple[float, str]] = []  # (monotonic time read, line) of the leaking job's SNAPSHOT lines
    with watching(LEAK_POLICY, tmp_path, socket_path, "390s") as (watch, address):
        assert watch.stdout is not None
        # The twin first, so that the leaking job's ballast leaves the card's free memory as said.
        jobs = launch({f"{job}-fixed": argvs[f"{job}-fixed"]}, tmp_path)
        info, pids = up(jobs, address)
        leaking = launch({job: argvs[job]}, tmp_path)
        jobs.update(leaking)
        more, more_pids = up(leaking, address)
        info.update(more)
        pids.update(more_pids)
        onset = time.monotonic()
        out = watch.stdout

        def read() -> None:
            for line in out:
                seen.append(line)
                if re.search(rf"\bSNAPSHOT tensor-leak pid {pids[job]}:", line):
                    snapshots.append((time.monotonic(), line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = jobs[job].wait(timeout=400)  # it runs until the card is full
            died = time.monotonic()
            twin_alive = jobs[f"{job}-fixed"].poll() is None
        finally:
            stop(jobs, None, tmp_path)
    reader.join(timeout=60)
    print("".join(seen))
    assert rc != 0
    assert "OutOfMemoryError" in (tmp_path / f"{job}.log").read_text(), rc
    assert twin_alive, "the twin died too"
    assert snapshots, f"no snapshot before the job died ({died - onset:.0f}s in)"
    snapped, snapshot_line = snapshots[0]
    match = re.search(
        r": (\S+\.pickle) \((\S+)\); top lines: (\S+):(\d+) holds (\S+?)(?: \(\+(\S+)/m\))?[,\n]",
        snapshot_line,
    )
    assert match is not None, snapshot_line
    path, named_line, named = Path(match.group(1)), int(match.group(4)), size_of(match.group(5))
    assert path.parent == dirs[job], path
    assert path.stat().st_mtime < time.time() - (time.monotonic() - died)  # written before the OOM
    snapshot = pickle.loads(path.read_bytes())
    from torch.cuda import _memory_viz

    assert set(snapshot) >= {"segments", "device_traces"}
    own = by_job_line(snapshot, JOBS.name)
    job_lines = {int(str(info[job]["forwardLine"])), int(str(info[job]["leakLine"]))}
    assert match.group(3).endswith(JOBS.name), snapshot_line
    assert named_line in job_lines, snapshot_line
    assert abs(named - own[named_line]) <= 0.1 * own[named_line], (named, own)
    assert not list(dirs[f"{job}-fixed"].glob("*.pickle")), "the fixed twin had a snapshot"
    assert not re.search(rf"SNAPSHOT \S+ pid {pids[f'{job}-fixed']}\b", "".join(seen))
    print(
        f"{case} run {run}: snapshot {snapped - onset:.0f}s after the job was up,"
        f" {died - snapped:.0f}s before it ran out of memory; {path.stat().st_size / 2**20:.1f} MiB;"
        f" line {named_line} holds"
        f" {named / 2**30:.2f}Gi, its blocks in the file {own[named_line] / 2**30:.2f}Gi;"
        f" {sum(len(t) for t in snapshot['device_traces'])} trace entries"
    )
    summary = _memory_viz.segsum(snapshot)  # torch's own tooling reads it
    assert summary.strip(), "segsum read nothing"


@pytest.fixture
def drained_socket() -> Iterator[str]:
    """A Unix socket whose reader takes every line and answers ``+`` (as the agent would)."""
    path = Path(tempfile.mkdtemp(prefix="gw-cost-")) / "hook.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(b"+" * data.count(b"\n"))

    threading.Thread(target=drain, daemon=True).start()
    yield str(path)
    server.close()


def test_recording_costs_nothing_before_suspicion(drained_socket: str, tmp_path: Path) -> None:
    import torch

    from gpuwarden.hook import HookClient, StepHook

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(256, 1024, device="cuda")
    kept: list[Any] = []

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        kept.append(torch.empty(4096, device="cuda"))  # live blocks a snapshot must walk
        torch.cuda.synchronize()

    def block(hook: StepHook | None, n: int = 300) -> float:
        start = time.perf_counter()
        for _ in range(n):
            step()
            if hook is not None:
                hook.step()
        return (time.perf_counter() - start) / n

    hook = StepHook(
        interval=1.0, memory=None, tracemalloc=False, client=HookClient(drained_socket), snapshots=tmp_path
    )
    assert hook.lines is not None
    assert hook.writer is not None
    for _ in range(3):
        block(None, 100)  # warm up
    none, idle = [], []
    for _ in range(8):
        none.append(block(None))
        idle.append(block(hook))
    hook.lines.start()
    recording, plain = [], []
    for _ in range(8):
        plain.append(block(None))
        recording.append(block(hook))
    hook.writer.request(1)
    during = []
    while hook.writer._thread is not None and hook.writer._thread.is_alive():
        start = time.perf_counter()
        step()
        during.append(time.perf_counter() - start)
    hook.writer.wait()
    [answer] = hook.writer.done()
    hook.close()
    m = {
        k: statistics.median(v) * 1e3
        for k, v in (("none", none), ("idle", idle), ("plain", plain), ("rec", recording))
    }
    print(
        f"step ms (median of 8 blocks of 300): no hook {m['none']:.3f}, hook opted in and not recording"
        f" {m['idle']:.3f} ({m['idle'] / m['none']:.3f}x), recording: no hook {m['plain']:.3f}"
        f" ({m['plain'] / m['none']:.3f}x), hook reading GPU lines every second {m['rec']:.3f}"
        f" ({m['rec'] / m['none']:.3f}x); snapshot of {len(kept)} kept blocks + the model's:"
        f" {hook.writer.seconds[0] * 1e3:.1f} ms on its thread, {answer.size_bytes} bytes,"
        f" {len(during)} steps meanwhile, the longest {max(during, default=0) * 1e3:.2f} ms"
    )
    assert answer.status == "ok", answer
    assert m["idle"] / m["none"] < 1.05, m  # before suspicion: within noise of no hook

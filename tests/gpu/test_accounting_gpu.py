"""GPU time accounted per process on a real GPU: `gpuwarden watch`'s summary of the time each process
held the GPU and its GPU-seconds allocated, used and idle, for processes sharing one GPU: a busy and an
idle one, then a busy one and three idle ones (issue 40's case).

Run on a GPU machine, never in CI (no driver there):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_accounting_gpu.py -s

The busy child (``busy_job``, tests/gpu/conftest.py) runs bf16 matmuls without pause; an idle one
holds 2 GiB and launches no kernel. All live for the whole watch, so each held the GPU for the time
watch sampled it (its ``--duration``, less its start-up). The rule (docs/accounting.md): per interval,
each process is allocated what it used and an even part of what nobody used, so the allocations add up
to the GPU's own seconds, nobody's used exceeds its allocated, and an idle holder's allocation is idle.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
from watch_support import watch_for

pytestmark = pytest.mark.gpu

RULE = "{name: idle, utilizationFloor: {percent: 10, for: 20s}}"


class Usage(NamedTuple):
    held: float
    """Wall-clock seconds."""
    allocated: float
    used: float
    efficiency: float
    idle: float


def usage(out: str, pid: int) -> Usage:
    """One process's figures in watch's summary."""
    line = (
        rf"pid {pid}\b[^\n]* on [^:\n]+: held (\d+) s, ([\d.]+) GPU-s allocated, "
        rf"([\d.]+) used \((\d+)%\), ([\d.]+) idle"
    )
    match = re.search(line, out)
    assert match is not None, out
    return Usage(*(float(g) for g in match.groups()))


def check(out: str, seconds: int, busy: int, idle: list[int]) -> None:
    """The rule's invariants and the processes' truths on one GPU watched for ``seconds``."""
    assert "GPU time per process" in out, out
    figures = [usage(out, pid) for pid in (busy, *idle)]
    held = figures[0].held
    for u in figures:
        # Every process held the GPU for the sampled time (start-up takes a few of the seconds).
        assert seconds - 10 <= u.held <= seconds + 1, out
        assert abs(u.held - held) <= 1, out
        assert u.used <= u.allocated + 0.1, out  # printed to a tenth
        assert u.efficiency <= 100, out
    # The allocations add up to the GPU's seconds (one GPU, held the whole time by these processes).
    assert sum(u.allocated for u in figures) == pytest.approx(held, abs=1.0), out
    # Matmuls without pause keep the SMs busy: nearly all of the GPU used, none of it idle.
    b = figures[0]
    assert b.used >= 0.8 * held, out
    assert b.idle == 0, out
    # An idle holder ran no kernel: nothing used, all it was allocated idle, and its part is small.
    for u in figures[1:]:
        assert u.used <= 0.1, out
        assert u.idle == pytest.approx(u.allocated, abs=0.1), out
        assert u.allocated <= 0.2 * held, out


def test_watch_accounts_a_busy_and_an_idle_process_on_one_gpu(
    busy_job: subprocess.Popen[str], idle_job: subprocess.Popen[str], tmp_path: Path
) -> None:
    seconds = 40
    out = watch_for(seconds, RULE, tmp_path)
    check(out, seconds, busy_job.pid, [idle_job.pid])


def test_watch_accounts_a_busy_and_three_idle_processes_on_one_gpu(
    busy_job: subprocess.Popen[str], three_idle_jobs: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    seconds = 60
    out = watch_for(seconds, RULE, tmp_path)
    check(out, seconds, busy_job.pid, [job.pid for job in three_idle_jobs])

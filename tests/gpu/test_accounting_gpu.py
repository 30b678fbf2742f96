"""GPU time accounted per process on a real GPU: `gpuwarden watch`'s summary of GPU-seconds held, used
and idle, for a busy and an idle torch process sharing one GPU.

Run on a GPU machine, never in CI (no driver there):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_accounting_gpu.py -s

The busy child (``busy_job``, tests/gpu/conftest.py) runs bf16 matmuls without pause; the idle one
holds 2 GiB and launches no kernel. Both live for the whole watch, so each held the GPU for the time
watch sampled it (its ``--duration``, less its start-up); the busy one used nearly all of it, the idle
one none (docs/accounting.md: on a shared GPU each process's share of the device's activity is its
share of the per-process SM utilization).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from watch_support import watch_for

pytestmark = pytest.mark.gpu

WATCHED_SECONDS = 40


def usage(out: str, pid: int) -> tuple[float, float, float]:
    """``(held, used, idle)`` GPU-seconds of one process in watch's summary."""
    line = rf"pid {pid}\b[^\n]* on [^:\n]+: (\d+) GPU-s held, (\d+) used \(\d+%\), (\d+) idle"
    match = re.search(line, out)
    assert match is not None, out
    held, used, idle = (float(g) for g in match.groups())
    return held, used, idle


def test_watch_accounts_a_busy_and_an_idle_process_on_one_gpu(
    busy_job: subprocess.Popen[str], idle_job: subprocess.Popen[str], tmp_path: Path
) -> None:
    out = watch_for(WATCHED_SECONDS, "{name: idle, utilizationFloor: {percent: 10, for: 20s}}", tmp_path)
    assert "GPU time per process" in out, out
    busy = usage(out, busy_job.pid)
    idle = usage(out, idle_job.pid)
    # Held: the sampled time, every second of it, for both (start-up takes a few of the 40).
    for held, _, _ in (busy, idle):
        assert WATCHED_SECONDS - 10 <= held <= WATCHED_SECONDS + 1, out
    # The idle child ran no kernel: nothing used, every held second idle (under the floor).
    assert idle[1] <= 1, out
    assert idle[2] >= idle[0] - 1, out
    # Matmuls without pause keep the SMs busy: nearly all used, no second idle.
    assert busy[1] >= 0.8 * busy[0], out
    assert busy[2] <= 1, out

"""`gpuwarden watch` on a real GPU: a torch job that leaks GPU memory is reported by its PID, and
of two processes sharing the GPU the idle one is reported idle and the busy one is not.

Run on a GPU machine, never in CI (no driver there):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_watch_gpu.py -s
    # GPUWARDEN_GPU_PLOT=path.png keeps the shared-GPU test's plot

A torch child (``leaking_job``, tests/gpu/conftest.py) creates its CUDA context, says so,
then keeps 32 MiB more of GPU memory every quarter second (~7.5 GiB a minute) and never
frees it. ``watch`` starts after the
context exists, with a policy whose memoryGrowth window is one minute, so the leak must
be reported a little over a minute later: a ``STARTED leak pid <child's PID>`` line, and
``gpuwarden_local_finding_active`` for ``pod="pid/<PID>"`` on /metrics.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

import pytest

pytestmark = pytest.mark.gpu

WATCH_CAP = "180s"
"""watch stops by itself after this, so a missed leak fails the test instead of hanging it."""

LEAK_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: leak-fast}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: leak
      memoryGrowth: {rate: 500Mi/m, window: 1m, minFit: 0.8}
"""


def lines_until(out: IO[str], pattern: str, seen: list[str]) -> re.Match[str]:
    """Read lines (kept in ``seen``) until one matches; fail if the output ends first."""
    for line in out:
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"watch ended without {pattern!r}:\n" + "".join(seen))


def start_watch(policy: Path, plot: Path, *flags: str) -> subprocess.Popen[str]:
    """``gpuwarden watch`` on this host's GPUs, plain lines, capped at :data:`WATCH_CAP`; a plot if it can."""
    argv = [sys.executable, "-m", "gpuwarden", "watch", f"--policy={policy}", "--listen=127.0.0.1:0"]
    argv += [f"--duration={WATCH_CAP}", "--plain", *flags]
    if importlib.util.find_spec("matplotlib") is not None:
        argv.append(f"--plot={plot}")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_watch_reports_a_leaking_torch_job_by_its_pid(
    leaking_job: subprocess.Popen[str], tmp_path: Path
) -> None:
    policy = tmp_path / "leak.yaml"
    policy.write_text(LEAK_POLICY)
    plot = tmp_path / "watch.png"
    watch = start_watch(policy, plot)
    seen: list[str] = []
    try:
        assert watch.stdout is not None
        address = lines_until(watch.stdout, r"/metrics on (\S+);", seen).group(1)
        pid = leaking_job.pid
        started = lines_until(watch.stdout, rf"STARTED leak pid {pid}\b", seen).string
        assert "GPUMemoryLeakSuspected: GPU memory grows" in started
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert re.search(rf'gpuwarden_local_finding_active\{{[^}}]*pod="pid/{pid}"[^}}]*rule="leak"', body)
        assert re.search(rf'gpuwarden_process_gpu_memory_used_bytes\{{[^}}]*pid="{pid}"', body)
    finally:
        if watch.poll() is None:
            watch.send_signal(signal.SIGINT)
        rest, _ = watch.communicate(timeout=60)
        seen.append(rest)
    assert watch.returncode == 0, "".join(seen)
    summary = "".join(seen)
    # Its own line under its GPU, or (when another process holds a context there: the Lightning
    # test's, in this pytest process) its line among the GPU's processes.
    assert re.search(rf"pid {pid} [^\n]*(\n\s+|: )leak \(GPUMemoryLeakSuspected\) since", summary)
    print("".join(seen))
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


SHARED_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: shared-fast}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: idle
      utilizationFloor: {percent: 10, for: 20s}
"""


def test_watch_finds_the_idle_process_beside_a_busy_one_on_one_gpu(
    busy_job: subprocess.Popen[str], idle_job: subprocess.Popen[str], tmp_path: Path
) -> None:
    # The idle job holds 2 GiB and runs no kernel: NVML's per-process reading leaves it out,
    # which is 0%, so the 20 s floor must flag it; the busy job's own share is far above it.
    policy = tmp_path / "shared.yaml"
    policy.write_text(SHARED_POLICY)
    plot = Path(os.environ.get("GPUWARDEN_GPU_PLOT") or tmp_path / "shared.png")
    watch = start_watch(policy, plot, "--process-interval=2s")
    seen: list[str] = []
    try:
        assert watch.stdout is not None
        started = lines_until(watch.stdout, rf"STARTED idle pid {idle_job.pid}\b", seen).string
        assert "GPUUnderutilized: mean per-process SM utilization 0% over 20s, floor 10%" in started
        # Ten more seconds of evaluations (one a second) in which the busy job must not be flagged: an
        # observation window, not a wait for an event. Reading lines here would block until watch's cap,
        # since plain output only prints changes; what watch prints meanwhile stays in the pipe.
        time.sleep(10)
    finally:
        if watch.poll() is None:
            watch.send_signal(signal.SIGINT)
        rest, _ = watch.communicate(timeout=60)
        seen.append(rest)
    out = "".join(seen)
    print(out)
    assert watch.returncode == 0, out
    assert f"idle pid {busy_job.pid}" not in out
    # The summary says whose finding it is on the shared GPU.
    assert re.search(rf"\n\s+pid {idle_job.pid} [^\n]*: idle \(GPUUnderutilized\) since ", out)
    # The status lines list both under their GPU, each with its own share.
    assert re.search(rf"\]   pid {idle_job.pid} [^\n]*: util 0%, mem [\d.]+Gi; findings:", out), out
    busy = re.search(rf"\]   pid {busy_job.pid} .*: util (\d+)%", out)
    assert busy is not None
    assert int(busy.group(1)) >= 50
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

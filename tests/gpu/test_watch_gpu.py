"""`gpuwarden watch` on a real GPU: a torch job that leaks GPU memory is reported by its PID.

Run on a GPU machine, never in CI (no driver there):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_watch_gpu.py -s

A torch child creates its CUDA context, says so, then keeps 32 MiB more of GPU memory
every quarter second (~7.5 GiB a minute) and never frees it. ``watch`` starts after the
context exists, with a policy whose memoryGrowth window is one minute, so the leak must
be reported a little over a minute later: a ``STARTED leak pid <child's PID>`` line, and
``gpuwarden_local_finding_active`` for ``pod="pid/<PID>"`` on /metrics.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
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

CHILD = r"""
import time, torch
device = torch.device("cuda")
torch.zeros(1, device=device)  # the CUDA context
torch.cuda.synchronize()
print("ready", flush=True)
kept = []
while True:
    kept.append(torch.empty(32 * 2**20, dtype=torch.uint8, device=device))
    torch.cuda.synchronize()
    time.sleep(0.25)
"""


@pytest.fixture
def leaking_job() -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", "the torch child did not start"
        yield child
    finally:
        child.kill()
        child.wait()


def lines_until(out: IO[str], pattern: str, seen: list[str]) -> re.Match[str]:
    """Read lines (kept in ``seen``) until one matches; fail if the output ends first."""
    for line in out:
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"watch ended without {pattern!r}:\n" + "".join(seen))


def test_watch_reports_a_leaking_torch_job_by_its_pid(
    leaking_job: subprocess.Popen[str], tmp_path: Path
) -> None:
    policy = tmp_path / "leak.yaml"
    policy.write_text(LEAK_POLICY)
    plot = tmp_path / "watch.png"
    argv = [
        sys.executable,
        "-m",
        "gpuwarden",
        "watch",
        f"--policy={policy}",
        "--listen=127.0.0.1:0",
        f"--duration={WATCH_CAP}",
        "--plain",
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        argv.append(f"--plot={plot}")
    watch = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    assert re.search(rf"pid {pid} .*\n\s+leak \(GPUMemoryLeakSuspected\) since", summary)
    print("".join(seen))
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

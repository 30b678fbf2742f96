"""idleGpus on real GPUs: one torch process holding two GPUs and working on one of them.

Needs a machine with two GPUs or more (the device kind ``nvidia-h200-x2``); run there, never in CI:

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_idle_gpus_gpu.py -s

The child loads a copy of its weights on ``cuda:1`` and never uses it (what a script that dropped its
``DataParallel`` wrapper, or sets a device too late, does): bf16 matmuls without pause on ``cuda:0``,
2 GiB held on ``cuda:1`` with no kernel after the copy. `gpuwarden watch` judges each process on the
GPUs it holds memory on, so the process's two GPUs are judged together, as a pod's are in a cluster.
A second child works on both GPUs; the two share each GPU, so each is judged by its own per-process
SM utilization (read every 2 s here). The rule's window is 20 s: watch must start ``GPUIdleInPod``
naming one of two GPUs idle for the first child, and nothing for the second.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

WATCHED_SECONDS = 45

POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: any}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: unused
      idleGpus: {for: 20s}
"""

JOB = r"""
import sys, torch
assert torch.cuda.device_count() >= 2, "needs two GPUs"
both = sys.argv[1] == "both"
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
spare = [a.to("cuda:1"), b.to("cuda:1"), torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda:1")]
torch.cuda.synchronize("cuda:1")
print("ready", flush=True)
while True:
    for _ in range(20):
        c = a @ b
        if both:
            d = spare[0] @ spare[1]
    torch.cuda.synchronize("cuda:0")
    if both:
        torch.cuda.synchronize("cuda:1")
"""


def _job(mode: str) -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", JOB, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", "the torch child did not start"
        yield child
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def one_of_two() -> Iterator[subprocess.Popen[str]]:
    """Works on cuda:0, holds cuda:1 idle."""
    yield from _job("one")


@pytest.fixture
def both_gpus() -> Iterator[subprocess.Popen[str]]:
    """Works on both GPUs it holds."""
    yield from _job("both")


def test_watch_finds_the_gpu_a_process_holds_and_leaves_idle(
    one_of_two: subprocess.Popen[str], both_gpus: subprocess.Popen[str], tmp_path: Path
) -> None:
    policy = tmp_path / "any.yaml"
    policy.write_text(POLICY)
    argv = [sys.executable, "-m", "gpuwarden", "watch", f"--policy={policy}", "--listen=127.0.0.1:0"]
    argv += [f"--duration={WATCHED_SECONDS}s", "--plain", "--process-interval=2s"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=WATCHED_SECONDS + 120, check=False)
    out = done.stdout + done.stderr
    print(out)
    assert done.returncode == 0, out
    found = re.search(rf"STARTED unused pid {one_of_two.pid}\b[^\n]*GPUIdleInPod: 1 of 2 GPUs idle", out)
    assert found is not None, out
    assert not re.search(rf"STARTED unused pid {both_gpus.pid}\b", out), out

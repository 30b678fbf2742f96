"""Two CUDA processes sharing one GPU, for the shared-GPU tests: one busy, one idle.

``busy_job`` runs bf16 matmuls without pause; ``idle_job`` holds 2 GiB and launches no
kernel at all (``torch.empty`` allocates, it does not fill), the process NVML's per-process
utilization leaves out. Both say ``ready`` once their context exists; both run on the
first visible GPU.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

BUSY = r"""
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
"""

IDLE = r"""
import time, torch
held = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # allocates; runs no kernel
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _start(code: str) -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", "the torch child did not start"
        yield child
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def busy_job() -> Iterator[subprocess.Popen[str]]:
    """A process that keeps the GPU's SMs busy."""
    yield from _start(BUSY)


@pytest.fixture
def idle_job() -> Iterator[subprocess.Popen[str]]:
    """A process that holds GPU memory and never computes."""
    yield from _start(IDLE)

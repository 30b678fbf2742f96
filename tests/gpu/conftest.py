"""Torch processes for the GPU tests, each on the first visible GPU, each ``ready`` once its context exists.

``busy_job`` runs bf16 matmuls without pause; ``idle_job`` holds 2 GiB and launches no
kernel at all (``torch.empty`` allocates, it does not fill), the process NVML's per-process
utilization leaves out; together they share one GPU. ``leaking_job`` keeps 32 MiB more
every quarter second and never frees it.
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

LEAKING = r"""
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


@pytest.fixture
def leaking_job() -> Iterator[subprocess.Popen[str]]:
    """A process that leaks GPU memory, ~7.5 GiB a minute."""
    yield from _start(LEAKING)

"""Torch processes for the GPU tests, each ``ready`` once its contexts exist.

On the first visible GPU: ``busy_job`` runs bf16 matmuls without pause; ``idle_job`` holds 2 GiB and
launches no kernel at all (``torch.empty`` allocates, it does not fill), the process NVML's per-process
utilization leaves out; together they share one GPU. ``leaking_job`` keeps 32 MiB more every quarter
second and never frees it. On two GPUs: ``one_of_two_job`` runs matmuls on ``cuda:0`` and holds a copy
of its weights on ``cuda:1`` that it never uses (a script that dropped its ``DataParallel`` wrapper, or
set its device too late); ``both_gpus_job`` works on both.
"""

from __future__ import annotations

import contextlib
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

TWO_GPUS = r"""
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


def _start(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
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
def three_idle_jobs() -> Iterator[list[subprocess.Popen[str]]]:
    """Three processes that hold GPU memory and never compute (issue 40's shared GPU)."""
    with contextlib.ExitStack() as stack:
        jobs = [stack.enter_context(contextlib.contextmanager(_start)(IDLE)) for _ in range(3)]
        yield jobs


@pytest.fixture
def leaking_job() -> Iterator[subprocess.Popen[str]]:
    """A process that leaks GPU memory, ~7.5 GiB a minute."""
    yield from _start(LEAKING)


@pytest.fixture
def one_of_two_job() -> Iterator[subprocess.Popen[str]]:
    """A process that works on cuda:0 and holds cuda:1 idle."""
    yield from _start(TWO_GPUS, "one")


@pytest.fixture
def both_gpus_job() -> Iterator[subprocess.Popen[str]]:
    """A process that works on both GPUs it holds."""
    yield from _start(TWO_GPUS, "both")

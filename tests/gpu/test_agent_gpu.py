"""The NVML backend against a real GPU and a real CUDA process (run on a GPU machine, never in CI).

A torch child allocates GPU memory in four 512 MiB steps, waiting for the test between
steps, then runs bf16 matmuls for a while. The backend must report the child's PID with
its memory (the allocator's reservation plus the CUDA context, ~500 MiB) at every step,
and real activity while it computes: utilization.gpu, GPM SM activity where the GPU
has GPM, and the child's per-process SM utilization.

Then two processes on one GPU, one busy, one holding memory and computing nothing: the idle
one must read 0% SM utilization (NVML's per-process reading leaves it out, or lists it at 0),
not unknown, and the busy one must read busy.

    pytest -m gpu tests/gpu -s        # GPUWARDEN_GPU_REPORT=path.json keeps the readings
                                      # (GPUWARDEN_GPU_SHARED_REPORT for the shared-GPU test)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

import pytest

from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.wire.node import DeviceState, GpuSample, device_key, merge_process_utilization

pytestmark = pytest.mark.gpu

MIB = 2**20
STEP = 512 * MIB
CONTEXT_ALLOWANCE = 1024 * MIB
"""NVML's per-process figure is the allocator's reservation plus the CUDA context (~500 MiB on an H200)."""

CHILD = r"""
import sys, time, torch
device = torch.device("cuda")
torch.zeros(1, device=device)  # the CUDA context
print("context", torch.cuda.memory_reserved(), flush=True)
sys.stdin.readline()
blocks = []
for _ in range(4):
    blocks.append(torch.empty(512 * 2**20, dtype=torch.uint8, device=device))
    torch.cuda.synchronize()
    print("allocated", torch.cuda.memory_reserved(), flush=True)
    sys.stdin.readline()
a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
torch.cuda.synchronize()
print("computing", torch.cuda.memory_reserved(), flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
print("done", flush=True)
sys.stdin.readline()
"""


class Child:
    """The torch process, driven line by line over its stdin/stdout."""

    def __init__(self, compute_seconds: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(compute_seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid

    def expect(self, word: str) -> int:
        """Wait for the child's next line, which must start with ``word``; its number, if any."""
        out: IO[str] | None = self.process.stdout
        assert out is not None
        line = out.readline().split()
        assert line, f"the child ended; expected {word!r}"
        assert line[0] == word, f"child said {line!r}, expected {word!r}"
        return int(line[1]) if len(line) > 1 else 0

    def go_on(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write("\n")
        stdin.flush()


@pytest.fixture
def backend() -> Iterator[NvmlBackend]:
    nvml = NvmlBackend()
    nvml.open()
    yield nvml
    nvml.close()


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child(compute_seconds=6.0)
    yield c
    c.process.kill()
    c.process.wait()


def find(samples: list[GpuSample], pid: int) -> tuple[GpuSample, int | None]:
    for gpu in samples:
        for proc in gpu.processes:
            if proc.pid == pid:
                return gpu, proc.used_memory_bytes
    raise AssertionError(
        f"PID {pid} is on no GPU: {[(g.uuid, [p.pid for p in g.processes]) for g in samples]}"
    )


def test_nvml_backend_reports_a_real_cuda_process(backend: NvmlBackend, child: Child) -> None:
    report: dict[str, Any] = {
        "devices": [
            {
                "uuid": d.uuid,
                "index": d.index,
                "model": d.model,
                "mig_capable": d.mig_capable,
                "gpm": d.gpm_note,
            }
            for d in backend.devices()
        ]
    }
    started = time.time()
    rows: list[dict[str, Any]] = []

    def sample(phase: str, reserved: int) -> tuple[GpuSample, int | None]:
        samples = backend.sample_devices(time.time())
        gpu, used = find(samples, child.pid)
        rows.append(
            {
                "states": [s.state.value for s in samples],
                "t": round(time.time() - started, 2),
                "phase": phase,
                "reserved_mib": reserved // MIB,
                "process_mib": None if used is None else used // MIB,
                "device_used_mib": None if gpu.memory_used_bytes is None else gpu.memory_used_bytes // MIB,
                "util": gpu.utilization_gpu,
                "sm_active": gpu.sm_active,
                "tensor_active": gpu.tensor_active,
                "dram_active": gpu.dram_active,
                "power_w": gpu.power_watts,
                "sm_clock_mhz": gpu.sm_clock_mhz,
            }
        )
        return gpu, used

    try:
        # memory: the PID appears with the context, then grows with each allocation
        reserved = child.expect("context")
        gpu, used = sample("context", reserved)
        assert used is not None
        assert reserved <= used <= reserved + CONTEXT_ALLOWANCE
        assert gpu.memory_total_bytes is not None
        assert gpu.memory_total_bytes > 100 * 2**30
        previous = used
        for _ in range(4):
            child.go_on()
            reserved = child.expect("allocated")
            gpu, used = sample("allocated", reserved)
            assert used is not None
            assert reserved <= used <= reserved + CONTEXT_ALLOWANCE
            assert used - previous == pytest.approx(STEP, abs=64 * MIB)
            previous = used

        # activity: while the matmuls run, the device and the process read busy
        child.go_on()
        reserved = child.expect("computing")
        backend.sample_process_utilization(time.time())  # start the per-process window here
        deadline = time.time() + 4.0
        while time.time() < deadline:
            sample("computing", reserved)
            time.sleep(0.25)  # pacing the readings, not waiting for an event
        per_process = backend.sample_process_utilization(time.time())
        assert child.expect("done") == 0
    finally:
        report["timeline"] = rows

    computing = [r for r in rows if r["phase"] == "computing"]
    busy = max(r["util"] or 0 for r in computing)
    sm_util = per_process.get(gpu.mig_id or gpu.uuid, {}).get(child.pid)
    report["process_sm_util"] = sm_util
    report["max_util"] = busy
    report["max_sm_active"] = max((r["sm_active"] or 0 for r in computing), default=None)
    print(json.dumps(report, indent=1))
    if path := os.environ.get("GPUWARDEN_GPU_REPORT"):
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    # every reading trusted: no NVML error turned a device "unknown" on the way
    assert all(state == DeviceState.OK.value for r in rows for state in r["states"]), rows
    assert busy >= 50
    assert sm_util is not None
    assert sm_util >= 10
    if backend.devices()[0].gpm:
        # GPM needs two samples: the first reading of the phase may be None, later ones not
        active = [r["sm_active"] for r in computing[1:]]
        assert all(a is not None for a in active)
        assert max(active) >= 20


def test_an_idle_process_beside_a_busy_one_reads_0_not_unknown(
    backend: NvmlBackend, busy_job: subprocess.Popen[str], idle_job: subprocess.Popen[str]
) -> None:
    backend.sample_process_utilization(time.time())  # start the per-process window here
    time.sleep(3.0)  # the window the reading covers: pacing, not waiting for an event
    now = time.time()
    devices = backend.sample_devices(now)
    raw = backend.sample_process_utilization(now)
    merged = merge_process_utilization(devices, raw)
    gpu, _ = find(merged, idle_job.pid)
    busy_gpu, _ = find(merged, busy_job.pid)
    assert device_key(gpu) == device_key(busy_gpu), "the two jobs were meant to share one GPU"
    by_pid = {p.pid: p for p in gpu.processes}
    idle, busy = by_pid[idle_job.pid], by_pid[busy_job.pid]
    listed = raw.get(device_key(gpu), {})
    report = {
        "device": device_key(gpu),
        "listed_by_nvml": {str(pid): util for pid, util in listed.items()},
        "idle": {
            "pid": idle.pid,
            "sm_util": idle.sm_util,
            "memory_mib": (idle.used_memory_bytes or 0) // MIB,
        },
        "busy": {
            "pid": busy.pid,
            "sm_util": busy.sm_util,
            "memory_mib": (busy.used_memory_bytes or 0) // MIB,
        },
        "device_util": gpu.utilization_gpu,
        "device_sm_active": gpu.sm_active,
    }
    print(json.dumps(report, indent=1))
    if path := os.environ.get("GPUWARDEN_GPU_SHARED_REPORT"):
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    assert idle.sm_util == 0.0  # left out of a good reading (or listed at 0): ran no kernel
    assert busy.sm_util is not None
    assert busy.sm_util >= 50
    assert (idle.used_memory_bytes or 0) >= 2 * 2**30

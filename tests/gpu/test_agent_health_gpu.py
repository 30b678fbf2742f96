"""GPU health against a real GPU (run on a GPU machine, never in CI).

The XID event thread must start and wait on NVML's event set while the sampler keeps sampling at
its usual cost; every sample must carry the clock event reasons and the ECC counters (volatile and
aggregate uncorrected, remapped rows on Ampere and later), idle and under load. A torch child runs
bf16 matmuls for a while (test_agent_gpu's child): the GPU it runs on must not read ``gpuIdle`` then.

No XID can be injected on a real GPU (the driver raises them on faults only), so this test checks
that the thread runs and that a healthy GPU raises none; what an XID does downstream is played by
the scripted backend (tests/unit/agent/test_agent_health.py, tests/integration/test_operator_node_health.py).

    pytest -m gpu tests/gpu/test_agent_health_gpu.py -s -o addopts=''   # GPUWARDEN_GPU_REPORT=path.json
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_agent_gpu import Child

from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.wire.node import ClockEventReason, DeviceState, GpuSample

pytestmark = pytest.mark.gpu

LOAD_SECONDS = 8.0
SAMPLE_BUDGET_SECONDS = 0.05
"""A whole device sample of a GPU node takes about a millisecond; the event thread must not add its wait."""


@pytest.fixture
def backend() -> Iterator[NvmlBackend]:
    nvml = NvmlBackend()
    nvml.open()
    yield nvml
    nvml.close()


def row(sample: GpuSample, seconds: float) -> dict[str, Any]:
    health = sample.health
    return {
        "uuid": sample.uuid,
        "state": sample.state.value,
        "sample_ms": round(seconds * 1000, 2),
        "util": sample.utilization_gpu,
        "power_w": sample.power_watts,
        "temperature_c": sample.temperature_c,
        "sm_clock_mhz": sample.sm_clock_mhz,
        "ecc_volatile": sample.ecc_uncorrected,
        "ecc_aggregate": None if health is None else health.ecc_uncorrected_aggregate,
        "remapped_rows_uncorrectable": None if health is None else health.remapped_rows_uncorrectable,
        "row_remap_pending": None if health is None else health.row_remap_pending,
        "row_remap_failed": None if health is None else health.row_remap_failed,
        "retired_pages_double_bit": None if health is None else health.retired_pages_double_bit,
        "clock_event_reasons": None if health is None else [str(r) for r in health.clock_event_reasons or ()],
        "xids": [] if health is None else [x.code for x in health.xids],
    }


def test_the_event_thread_runs_and_health_is_read_idle_and_under_load(backend: NvmlBackend) -> None:
    watcher = backend.xids
    assert watcher is not None
    report: dict[str, Any] = {"xid_events": dict(watcher.notes), "idle": [], "load": []}

    def take(phase: str) -> list[GpuSample]:
        started = time.perf_counter()
        samples = backend.sample_devices(time.time())
        took = time.perf_counter() - started
        report[phase].extend(row(s, took) for s in samples)
        assert took < SAMPLE_BUDGET_SECONDS, f"a device sample took {took * 1000:.1f} ms"
        return samples

    for _ in range(4):
        take("idle")
        time.sleep(0.25)  # pacing the readings, not waiting for an event

    child = Child(compute_seconds=LOAD_SECONDS)
    try:
        child.expect("context")
        for _ in range(4):  # its memory steps, not what this test is about
            child.go_on()
            child.expect("allocated")
        child.go_on()
        child.expect("computing")
        loaded: str | None = None
        deadline = time.time() + LOAD_SECONDS - 1.0
        while time.time() < deadline:
            for sample in take("load"):
                if any(p.pid == child.pid for p in sample.processes):
                    loaded = sample.uuid
            time.sleep(0.25)
        child.expect("done")
    finally:
        child.process.kill()
        child.process.wait()
    report["loaded_gpu"] = loaded
    report["xids_received"] = watcher.received
    print(json.dumps(report, indent=1))
    if path := os.environ.get("GPUWARDEN_GPU_REPORT"):
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    # The event thread waits on NVML's event set for every GPU that supports XID events.
    assert watcher.running
    assert "registered" in watcher.notes.values(), watcher.notes
    rows = report["idle"] + report["load"]
    assert all(r["state"] == DeviceState.OK.value for r in rows)
    # A healthy GPU raises no XID (and none can be injected).
    assert all(r["xids"] == [] for r in rows)
    # Clock event reasons and ECC counters on every sample (an H200 has ECC on and remaps rows).
    assert all(r["clock_event_reasons"] is not None for r in rows)
    assert all(r["ecc_volatile"] is not None and r["ecc_aggregate"] is not None for r in rows)
    assert all(r["remapped_rows_uncorrectable"] is not None for r in rows)
    # Under load the GPU the matmuls run on is not idle.
    assert loaded is not None, "the child's PID was on no GPU"
    busy = [r for r in report["load"] if r["uuid"] == loaded and (r["util"] or 0) >= 50]
    assert busy, report["load"]
    assert all(ClockEventReason.GPU_IDLE.value not in r["clock_event_reasons"] for r in busy)
    backend.close()
    assert not watcher.running

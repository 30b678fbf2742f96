"""Attaching hook readings to snapshots: the right process, the right GPU, only while fresh."""

from __future__ import annotations

import collections
import json
from typing import Any

from gpuwarden.agent.hookattach import HookStage, attach_hook
from gpuwarden.agent.hooksocket import HookReading, HookReadings
from gpuwarden.wire.hook import parse_message
from gpuwarden.wire.node import (
    SCHEMA_VERSION,
    GpuSample,
    NodeReport,
    ProcessSample,
    Snapshot,
    dump_report,
    parse_report,
)

NOW = 1_800_000_000.0
GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
GPU1 = "GPU-11111111-1111-4111-8111-111111111111"
MIG = "MIG-22222222-2222-4222-8222-222222222222"
GI = 2**30
SITE = {"file": "train.py", "line": 88, "sizeBytes": 50 * 2**20, "growthBytes": 49 * 2**20, "count": 1200}


def snapshot() -> Snapshot:
    """pid 10 trains on GPU 0 and 1; pid 20 on GPU 0 too; pid 30 on a MIG instance of GPU 1."""
    return Snapshot(
        timestamp=NOW,
        gpus=[
            GpuSample(uuid=GPU0, index=0, processes=[ProcessSample(pid=10), ProcessSample(pid=20)]),
            GpuSample(uuid=GPU1, index=1, processes=[ProcessSample(pid=10)]),
            GpuSample(uuid=GPU1, index=1, mig_id=MIG, processes=[ProcessSample(pid=30)]),
        ],
    )


def reading(pid: int, *, at: float = NOW - 1, received: float | None = None, **fields: Any) -> HookReading:
    message = parse_message(json.dumps({"v": 1, "timestamp": at, **fields}))
    return HookReading(
        pid=pid, uid=1000, message=message, received_at=received if received is not None else at
    )


def hooks(snap: Snapshot) -> dict[tuple[int, str, int], Any]:
    """(gpu index, mig id, pid) → the hook on that entry."""
    return {(g.index, g.mig_id or "", p.pid): p.hook for g in snap.gpus for p in g.processes}


def test_each_gpu_entry_of_the_process_gets_its_devices_numbers_and_the_processs_own() -> None:
    devices = [
        {"uuid": GPU0, "allocatedBytes": 20 * GI, "reservedBytes": 24 * GI, "maxAllocatedBytes": 22 * GI},
        {"uuid": GPU1, "allocatedBytes": 3 * GI},
    ]
    r = reading(10, step=1200, devices=devices, hostRssBytes=6 * GI, sites=[SITE])
    before = snapshot()
    out = attach_hook(before, {10: r}, NOW)
    on0, on1 = hooks(out)[(0, "", 10)], hooks(out)[(1, "", 10)]
    assert (on0.allocated_bytes, on0.reserved_bytes, on0.max_allocated_bytes) == (20 * GI, 24 * GI, 22 * GI)
    assert (on1.allocated_bytes, on1.reserved_bytes) == (3 * GI, None)
    for hook in (on0, on1):
        assert (hook.timestamp, hook.step, hook.host_rss_bytes) == (NOW - 1, 1200, 6 * GI)
        assert [(s.file, s.line, s.growth_bytes) for s in hook.sites] == [("train.py", 88, 49 * 2**20)]
    assert hooks(out)[(0, "", 20)] is None  # another process on the same GPU: nothing of 10's
    assert all(h is None for h in hooks(before).values())  # the input is not changed


def test_a_gpu_the_message_does_not_name_gets_the_host_memory_and_sites_only() -> None:
    out = attach_hook(snapshot(), {10: reading(10, devices=[{"uuid": GPU0}], hostRssBytes=GI)}, NOW)
    on1 = hooks(out)[(1, "", 10)]
    assert on1 is not None
    assert (on1.allocated_bytes, on1.reserved_bytes, on1.host_rss_bytes) == (None, None, GI)


def test_a_mig_instance_is_matched_by_its_own_uuid_only() -> None:
    by_mig = reading(30, devices=[{"uuid": MIG, "allocatedBytes": GI}])
    assert hooks(attach_hook(snapshot(), {30: by_mig}, NOW))[(1, MIG, 30)].allocated_bytes == GI
    by_parent = reading(30, devices=[{"uuid": GPU1, "allocatedBytes": GI}])
    assert hooks(attach_hook(snapshot(), {30: by_parent}, NOW))[(1, MIG, 30)].allocated_bytes is None


def test_a_reading_older_than_a_minute_is_not_attached() -> None:
    assert hooks(attach_hook(snapshot(), {20: reading(20, at=NOW - 60)}, NOW))[(0, "", 20)] is not None
    assert hooks(attach_hook(snapshot(), {20: reading(20, at=NOW - 60.5)}, NOW))[(0, "", 20)] is None
    # A hook whose clock runs ahead reads as when its line arrived, never later.
    ahead = reading(20, at=NOW + 3600, received=NOW - 61)
    assert hooks(attach_hook(snapshot(), {20: ahead}, NOW))[(0, "", 20)] is None


def test_a_reading_of_a_pid_nvml_does_not_list_attaches_nothing() -> None:
    out = attach_hook(snapshot(), {99: reading(99, hostRssBytes=GI)}, NOW)
    assert all(h is None for h in hooks(out).values())


class Events:
    def __init__(self) -> None:
        self.refusals: collections.Counter[str] = collections.Counter()

    def accepted(self) -> None:
        pass

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1


def test_the_stage_refuses_and_forgets_a_pid_on_no_gpu_once_a_snapshot_after_it_shows_that() -> None:
    readings, events = HookReadings(), Events()
    stage = HookStage(readings, events)
    readings.put(reading(10, hostRssBytes=GI))
    readings.put(reading(99, hostRssBytes=GI))  # arrived before the snapshot: judged by it
    readings.put(reading(98, at=NOW + 0.5))  # arrived after the snapshot was read: judged by the next
    out = stage.annotate(snapshot())
    assert hooks(out)[(0, "", 10)].host_rss_bytes == GI
    assert events.refusals == {"unknownProcess": 1}
    assert set(readings.fresh(NOW)) == {10, 98}
    stage.annotate(snapshot().model_copy(update={"timestamp": NOW + 1}))
    assert events.refusals == {"unknownProcess": 2}
    assert set(readings.fresh(NOW + 1)) == {10}


def test_a_report_carries_the_hook_to_the_operator() -> None:
    out = attach_hook(snapshot(), {10: reading(10, devices=[{"uuid": GPU0, "allocatedBytes": GI}])}, NOW)
    report = NodeReport(schema_version=SCHEMA_VERSION, node="n", agent_id="a", seq=0, snapshots=[out])
    parsed = parse_report(dump_report(report))
    assert parsed.snapshots[0].gpus[0].processes[0].hook == out.gpus[0].processes[0].hook
    assert json.loads(dump_report(report))["snapshots"][0]["gpus"][0]["processes"][0]["hook"] == {
        "timestamp": NOW - 1,
        "allocatedBytes": GI,
        "sites": [],
    }

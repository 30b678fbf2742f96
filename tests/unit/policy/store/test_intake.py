"""From node reports to series points: who each GPU reading belongs to."""

from __future__ import annotations

from gpuwarden.policy import (
    SeriesKey,
    SeriesStore,
    UtilizationSource,
    points_from_processes,
    points_from_report,
)
from gpuwarden.policy.store.intake import pods_of, points_from_snapshot
from gpuwarden.wire.node import (
    SCHEMA_VERSION,
    DeviceState,
    GpuSample,
    NodeReport,
    PodRef,
    ProcessSample,
    Snapshot,
)

T = 1_750_000_000.0
GI = 2**30
A = PodRef(namespace="ml", name="train-a", container="main")
B = PodRef(namespace="ml", name="serve-b")


def gpu(**fields: object) -> GpuSample:
    base: dict[str, object] = {
        "uuid": "GPU-1",
        "index": 0,
        "utilization_gpu": 40.0,
        "sm_active": 30.0,
        "memory_used_bytes": 10 * GI,
        "memory_total_bytes": 80 * GI,
        "power_watts": 250.0,
    }
    base.update(fields)
    return GpuSample.model_validate(base)


def proc(pid: int, pod: PodRef | None, mem: int | None, sm: float | None) -> ProcessSample:
    return ProcessSample(pid=pid, pod=pod, used_memory_bytes=mem, sm_util=sm)


def snapshot(*gpus: GpuSample, t: float = T) -> Snapshot:
    return Snapshot(timestamp=t, gpus=list(gpus))


def test_exclusive_gpu_gives_the_pod_the_device_readings() -> None:
    points = list(points_from_snapshot(snapshot(gpu(pods=[A]))))
    assert len(points) == 1
    key, point = points[0]
    assert key == SeriesKey("ml", "train-a", "GPU-1")
    assert (point.t, point.gpu_util, point.sm_active, point.power_w) == (T, 40.0, 30.0, 250.0)
    assert (point.mem_used, point.mem_total) == (10 * GI, 80 * GI)


def test_allocated_but_unused_gpu_reads_idle_for_its_pod() -> None:
    # The most common waste: allocated, nothing running. The device readings are the pod's.
    idle = gpu(pods=[A], utilization_gpu=0.0, sm_active=0.0, memory_used_bytes=0, processes=[])
    ((key, point),) = points_from_snapshot(snapshot(idle))
    assert key.pod == "train-a"
    assert (point.gpu_util, point.sm_active, point.mem_used) == (0.0, 0.0, 0.0)


def test_containers_of_one_pod_count_once() -> None:
    other_container = PodRef(namespace="ml", name="train-a", container="sidecar")
    points = list(points_from_snapshot(snapshot(gpu(pods=[A, other_container]))))
    assert [k.pod for k, _ in points] == ["train-a"]
    assert points[0][1].sm_active == 30.0


def test_allocated_gpu_with_another_pods_process_is_shared() -> None:
    # One allocated pod, but a process of another pod runs there: both pods, split by process.
    mixed = gpu(pods=[A], processes=[proc(1, A, 2 * GI, 10.0), proc(2, B, 3 * GI, 20.0)])
    points = dict(points_from_snapshot(snapshot(mixed)))
    assert [k.pod for k in points] == ["train-a", "serve-b"]
    assert points[SeriesKey("ml", "train-a", "GPU-1")].mem_used == 2 * GI
    assert points[SeriesKey("ml", "serve-b", "GPU-1")].gpu_util == 20.0


def test_shared_gpu_splits_by_process_memory_and_sm_util() -> None:
    shared = gpu(
        pods=[A, B],
        processes=[
            proc(10, A, 3 * GI, 20.0),
            proc(11, A, 1 * GI, 15.0),
            proc(20, B, 5 * GI, 5.0),
            proc(30, None, GI, 1.0),  # a host process: nobody's
        ],
    )
    points = dict(points_from_snapshot(snapshot(shared)))
    a = points[SeriesKey("ml", "train-a", "GPU-1")]
    b = points[SeriesKey("ml", "serve-b", "GPU-1")]
    assert (a.mem_used, a.gpu_util) == (4 * GI, 35.0)
    assert (b.mem_used, b.gpu_util) == (5 * GI, 5.0)
    # SM activity and power cannot be split per pod; memory total is the device's.
    assert (a.sm_active, a.power_w, a.mem_total) == (None, None, 80 * GI)


def test_shared_gpu_reading_absent_when_a_process_lacks_it() -> None:
    shared = gpu(pods=[A, B], processes=[proc(10, A, 3 * GI, None), proc(11, A, None, 20.0)])
    points = dict(points_from_snapshot(snapshot(shared)))
    a = points[SeriesKey("ml", "train-a", "GPU-1")]
    assert (a.mem_used, a.gpu_util) == (None, None)  # unknown, never a partial sum
    b = points[SeriesKey("ml", "serve-b", "GPU-1")]
    assert (b.mem_used, b.gpu_util) == (0.0, 0.0)  # runs nothing there: idle and empty
    unread = gpu(pods=[A, B], utilization_gpu=None, sm_active=None, memory_used_bytes=None)
    b2 = dict(points_from_snapshot(snapshot(unread)))[SeriesKey("ml", "serve-b", "GPU-1")]
    assert (b2.mem_used, b2.gpu_util) == (None, None)


def test_a_pod_without_a_process_of_its_own_is_unknown_while_a_process_there_is_nobodys() -> None:
    # Time-slicing without the pod list: the agent cannot tell whose pid 10 is, so neither
    # allocated pod is idle on the evidence; once it can, the one without a process is.
    unowned = gpu(pods=[A, B], processes=[proc(10, None, 3 * GI, 90.0)])
    points = dict(points_from_snapshot(snapshot(unowned)))
    assert [(p.gpu_util, p.mem_used) for p in points.values()] == [(None, None), (None, None)]
    owned = gpu(pods=[A, B], processes=[proc(10, A, 3 * GI, 90.0)])
    points = dict(points_from_snapshot(snapshot(owned)))
    assert points[SeriesKey("ml", "serve-b", "GPU-1")].gpu_util == 0.0
    assert points[SeriesKey("ml", "serve-b", "GPU-1")].util_source is UtilizationSource.NO_PROCESS
    assert points[SeriesKey("ml", "train-a", "GPU-1")].util_source is UtilizationSource.PROCESSES


def test_sm_util_sum_is_capped() -> None:
    shared = gpu(pods=[A, B], processes=[proc(10, A, GI, 70.0), proc(11, A, GI, 60.0)])
    assert dict(points_from_snapshot(snapshot(shared)))[SeriesKey("ml", "train-a", "GPU-1")].gpu_util == 100.0


def test_unhealthy_gpu_leaves_a_gap_not_zeros() -> None:
    lost = gpu(pods=[A], state=DeviceState.LOST, utilization_gpu=None, sm_active=None)
    unknown = gpu(uuid="GPU-2", pods=[B], state=DeviceState.UNKNOWN)
    assert list(points_from_snapshot(snapshot(lost, unknown))) == []


def test_mig_devices_are_keyed_by_mig_uuid() -> None:
    mig1 = gpu(mig_id="MIG-aaa", pods=[A], memory_total_bytes=10 * GI)
    mig2 = gpu(mig_id="MIG-bbb", pods=[B], memory_total_bytes=10 * GI)
    keys = [k for k, _ in points_from_snapshot(snapshot(mig1, mig2))]
    assert keys == [SeriesKey("ml", "train-a", "MIG-aaa"), SeriesKey("ml", "serve-b", "MIG-bbb")]


def test_unallocated_gpu_attributes_by_processes_or_not_at_all() -> None:
    # No PodResources allocation (e.g. a privileged pod seeing every GPU): its processes say whose it is.
    by_proc = gpu(pods=[], processes=[proc(10, B, 2 * GI, 50.0)])
    ((key, point),) = points_from_snapshot(snapshot(by_proc))
    assert key.pod == "serve-b"
    assert point.sm_active == 30.0  # alone on the device: the device readings
    assert list(points_from_snapshot(snapshot(gpu(pods=[], processes=[proc(1, None, GI, 1.0)])))) == []
    # Allocated to A while B's process runs there: shared, by process.
    assert pods_of(gpu(pods=[A], processes=[proc(10, B, GI, 1.0)])) == [("ml", "train-a"), ("ml", "serve-b")]


def test_report_snapshots_feed_a_store_in_order() -> None:
    report = NodeReport(
        schema_version=SCHEMA_VERSION,
        node="node-1",
        agent_id="agent",
        seq=1,
        snapshots=[snapshot(gpu(pods=[A], sm_active=float(i)), t=T + i) for i in range(5)],
    )
    store = SeriesStore(retention_seconds=600, max_points=600)
    assert store.extend(points_from_report(report)) == 5
    assert store.extend(points_from_report(report)) == 0  # a retried report changes nothing
    window = store.window(SeriesKey("ml", "train-a", "GPU-1"))
    assert window is not None
    assert [p.sm_active for p in window.points()] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_watch_mode_subjects_are_host_processes() -> None:
    alone = gpu(processes=[proc(4242, None, 2 * GI, None)])
    shared = gpu(
        uuid="GPU-2",
        processes=[proc(1, None, GI, 10.0), proc(2, None, 3 * GI, 30.0), proc(2, None, GI, 5.0)],
    )
    idle = gpu(uuid="GPU-3", processes=[])
    points = dict(points_from_processes(snapshot(alone, shared, idle)))
    assert set(points) == {
        SeriesKey("", "pid/4242", "GPU-1"),
        SeriesKey("", "pid/1", "GPU-2"),
        SeriesKey("", "pid/2", "GPU-2"),
    }
    lone = points[SeriesKey("", "pid/4242", "GPU-1")]
    assert (lone.sm_active, lone.mem_used) == (30.0, 10 * GI)  # alone: the device's readings
    two = points[SeriesKey("", "pid/2", "GPU-2")]
    assert (two.mem_used, two.gpu_util, two.sm_active) == (4 * GI, 35.0, None)

"""The ledger's rule (gpuwarden/accounting/ledger.py's doc), each case on readings whose truth is known,
and its invariants on any readings: per device and interval the holders' allocated seconds add up to
the device's physical seconds, used <= allocated, idle = allocated - used under the floor."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting import MIG_FALLBACK_FRACTION, Bound, Device, Ledger, Pod, Usage, devices_of
from gpuwarden.policy import Point, UtilizationSource
from gpuwarden.wire.node import DeviceState, GpuSample, PodRef, ProcessSample, Snapshot

H200 = "NVIDIA H200"
TRAIN: Pod = ("ml", "train")
ALONE = Device(H200, 1.0, (TRAIN,), "GPU-1")


def play(
    ledger: Ledger,
    device: Device,
    readings: list[tuple[float, Mapping[Pod, float | None]]],
    *,
    device_id: str = "GPU-1",
    node: str = "n1",
) -> None:
    """Each ``(t, {pod: util})`` as one snapshot of ``device``."""
    for t, utils in readings:
        points = {pod: Point(t, gpu_util=util) for pod, util in utils.items()}
        ledger.observe(node, t, {device_id: device}, {device_id: points})


def alone(readings: list[tuple[float, float | None]]) -> list[tuple[float, Mapping[Pod, float | None]]]:
    return [(t, {TRAIN: u}) for t, u in readings]


def total(ledger: Ledger, pod: Pod = TRAIN) -> Usage:
    return ledger.pod_totals(*pod)[H200]


def test_a_pod_alone_on_a_gpu_is_allocated_the_time_between_readings_and_uses_its_activity() -> None:
    ledger = Ledger()
    play(ledger, ALONE, alone([(float(t), 40.0) for t in range(101)]))
    assert total(ledger).allocated == pytest.approx(100.0)
    assert total(ledger).used == pytest.approx(40.0)
    assert total(ledger).idle == 0.0
    assert total(ledger).held == pytest.approx(100.0)
    assert total(ledger).efficiency == pytest.approx(0.4)


def test_sm_activity_wins_over_utilization_where_gpm_gives_it() -> None:
    ledger = Ledger()
    for t in range(11):
        point = Point(float(t), gpu_util=100.0, sm_active=10.0)
        ledger.observe("n1", float(t), {"GPU-1": ALONE}, {"GPU-1": {TRAIN: point}})
    assert total(ledger).used == pytest.approx(1.0)


def test_under_the_floor_the_unused_part_of_the_allocation_is_idle() -> None:
    ledger = Ledger(idle_floor=5.0)
    play(ledger, ALONE, alone([(float(t), 3.0 if t <= 50 else 60.0) for t in range(101)]))
    # 50 s at 3%: 1.5 GPU-s used, 48.5 idle; 50 s at 60%: not idle.
    assert total(ledger).idle == pytest.approx(48.5)
    assert total(ledger).allocated == pytest.approx(100.0)


def test_a_gap_longer_than_the_store_bound_counts_nothing_and_a_stale_reading_is_ignored() -> None:
    ledger = Ledger()
    # 0..10 read, then nothing until 70 (a 60 s gap), then 70..80; a replayed old reading at 75.
    play(ledger, ALONE, alone([(float(t), 50.0) for t in range(11)]))
    play(ledger, ALONE, alone([(float(t), 50.0) for t in range(70, 81)]))
    play(ledger, ALONE, alone([(75.0, 100.0), (80.0, 100.0)]))
    assert total(ledger).allocated == pytest.approx(20.0)
    assert total(ledger).used == pytest.approx(10.0)


def test_a_first_interval_at_the_bound_counts_and_one_past_it_does_not() -> None:
    ledger = Ledger()
    play(ledger, ALONE, alone([(0.0, 50.0), (5.0, 50.0)]))
    play(ledger, ALONE, alone([(0.0, 50.0), (5.001, 50.0)]), device_id="GPU-2")
    assert total(ledger).allocated == pytest.approx(5.0)


def test_a_slow_sampler_is_counted_from_its_second_interval_on() -> None:
    # An agent sampling every 10 s: its first interval is past the 5 s bound (nothing before it to
    # tell a slow sampler from a silence); from then on intervals up to 3 x 10 s count.
    ledger = Ledger()
    play(ledger, ALONE, alone([(float(t), 50.0) for t in range(0, 101, 10)]))
    assert total(ledger).allocated == pytest.approx(90.0)
    play(ledger, ALONE, alone([(125.0, 50.0), (156.0, 50.0)]))  # 25 s counts, then 31 s is a gap
    assert total(ledger).allocated == pytest.approx(115.0)


def test_the_interval_after_an_outage_does_not_excuse_a_second_outage() -> None:
    ledger = Ledger()
    # 1 s readings, an hour's silence, one reading, then a minute's silence: both are gaps.
    play(ledger, ALONE, alone([(float(t), 50.0) for t in range(11)]))
    play(ledger, ALONE, alone([(3610.0, 50.0), (3670.0, 50.0), (3671.0, 50.0)]))
    assert total(ledger).allocated == pytest.approx(11.0)


def test_a_shared_gpu_bills_each_holder_its_use_and_an_even_part_of_what_nobody_used() -> None:
    # Four holders of one GPU for 100 s: one at 97%, three idle (issue 40's H200 run). The busy one
    # is allocated its 97 GPU-s and a quarter of the 3 nobody used; each idle one 0.75, all idle.
    pods = [("ml", "busy"), ("ml", "a"), ("ml", "b"), ("ml", "c")]
    device = Device(H200, 1.0, tuple(pods), "GPU-1")
    ledger = Ledger()
    play(ledger, device, [(float(t), {pods[0]: 97.0} | dict.fromkeys(pods[1:], 0.0)) for t in range(101)])
    busy, idle = total(ledger, pods[0]), [total(ledger, p) for p in pods[1:]]
    assert busy.allocated == pytest.approx(97.75)
    assert busy.used == pytest.approx(97.0)
    assert busy.idle == 0.0
    for u in idle:
        assert (u.allocated, u.used, u.idle) == pytest.approx((0.75, 0.0, 0.75))
        assert u.held == pytest.approx(100.0)  # the wall clock beside the share
    assert sum(u.allocated for u in [busy, *idle]) == pytest.approx(100.0)
    assert busy.efficiency == pytest.approx(97.0 / 97.75)


def test_holders_claiming_more_than_the_device_are_scaled_down_to_it() -> None:
    pods = [("ml", "a"), ("ml", "b")]
    device = Device(H200, 1.0, tuple(pods), "GPU-1")
    ledger = Ledger()
    play(ledger, device, [(float(t), {pods[0]: 90.0, pods[1]: 60.0}) for t in range(11)])
    a, b = total(ledger, pods[0]), total(ledger, pods[1])
    assert [a.used, b.used] == pytest.approx([6.0, 4.0])
    assert [a.allocated, b.allocated] == pytest.approx([6.0, 4.0])


def test_a_holder_of_unknown_activity_gets_its_even_part_counted_unknown() -> None:
    pods = [("ml", "a"), ("ml", "b")]
    device = Device(H200, 1.0, tuple(pods), "GPU-1")
    ledger = Ledger(carry_seconds=0.0)
    play(ledger, device, [(float(t), {pods[0]: 40.0, pods[1]: None}) for t in range(11)])
    a, b = total(ledger, pods[0]), total(ledger, pods[1])
    assert (a.allocated, a.used) == pytest.approx((7.0, 4.0))
    assert (b.allocated, b.unknown, b.used, b.idle) == pytest.approx((3.0, 3.0, 0.0, 0.0))


def test_a_pod_running_on_a_gpu_allocated_to_another_holds_nothing_there() -> None:
    ledger = Ledger()
    play(ledger, ALONE, [(float(t), {("ops", "debug"): 10.0, TRAIN: 50.0}) for t in range(3)])
    assert ledger.pod_totals("ops", "debug") == {}
    assert total(ledger).allocated == pytest.approx(2.0)


def test_unknown_activity_carries_the_last_known_for_a_while_then_counts_neither_used_nor_idle() -> None:
    ledger = Ledger(carry_seconds=30.0)
    play(ledger, ALONE, alone([(0.0, 50.0)] + [(float(t), None) for t in range(1, 61)]))
    assert total(ledger).allocated == pytest.approx(60.0)
    assert total(ledger).used == pytest.approx(15.0)  # 30 s carried at 50%
    assert total(ledger).unknown == pytest.approx(30.0)
    assert total(ledger).idle == 0.0


def test_a_gpu_nobody_holds_is_unallocated_per_node_and_model() -> None:
    ledger = Ledger()
    free = Device(H200, 1.0, (), "GPU-2")
    for t in range(11):
        ledger.observe(
            "n1", float(t), {"GPU-1": ALONE, "GPU-2": free}, {"GPU-1": {TRAIN: Point(t, gpu_util=50.0)}}
        )
    assert ledger.unallocated()[("n1", H200)].allocated == pytest.approx(10.0)
    assert total(ledger).allocated == pytest.approx(10.0)


def test_mig_devices_count_their_memory_share_of_the_gpu() -> None:
    gib = 2**30
    pod = PodRef(namespace="ml", name="small")
    snapshot = Snapshot(
        timestamp=1.0,
        gpus=[
            GpuSample(uuid="GPU-1", index=0, model=H200, memory_total_bytes=144 * gib),
            GpuSample(
                uuid="GPU-1", index=0, model=H200, mig_id="MIG-a", memory_total_bytes=18 * gib, pods=[pod]
            ),
            GpuSample(uuid="GPU-2", index=1, model=H200, mig_id="MIG-b", pods=[pod]),
        ],
    )
    devices = devices_of(snapshot)
    assert devices["MIG-a"].fraction == pytest.approx(1 / 8)
    assert devices["MIG-b"].fraction == MIG_FALLBACK_FRACTION
    ledger = Ledger()
    play(ledger, devices["MIG-a"], [(0.0, {("ml", "small"): 100.0}), (4.0, {("ml", "small"): 100.0})])
    assert ledger.pod_totals("ml", "small")[H200].allocated == pytest.approx(0.5)
    assert ledger.pod_totals("ml", "small")[H200].used == pytest.approx(0.5)


def test_a_gpu_in_mig_mode_counts_its_mig_devices_and_the_rest_unallocated_once() -> None:
    # NVML lists a GPU in MIG mode once for itself (held by nobody) and once per MIG device: the GPU's
    # seconds are its MIG devices' (a quarter held, an eighth nobody's) and the 5/8 no MIG device covers.
    gib = 2**30
    small, big = PodRef(namespace="ml", name="small"), PodRef(namespace="ml", name="big")
    ledger = Ledger()
    for t in range(1, 12):
        snapshot = Snapshot(
            timestamp=float(t),
            gpus=[
                GpuSample(uuid="GPU-1", index=0, model=H200, memory_total_bytes=144 * gib),
                GpuSample(uuid="GPU-1", index=0, model=H200, mig_id="MIG-a", memory_total_bytes=36 * gib,
                          pods=[big]),
                GpuSample(uuid="GPU-1", index=0, model=H200, mig_id="MIG-b", memory_total_bytes=18 * gib),
            ],
        )  # fmt: skip
        devices = devices_of(snapshot)
        assert devices["GPU-1"] == Device(H200, 5 / 8, (), "GPU-1")
        readings = {"MIG-a": {("ml", "big"): Point(float(t), sm_active=70.0)}}
        ledger.observe("n1", float(t), devices, readings)
    assert ledger.pod_totals("ml", "big")[H200].allocated == pytest.approx(10 / 4)
    assert ledger.pod_totals("ml", "big")[H200].used == pytest.approx(0.7 * 10 / 4)
    assert ledger.unallocated()[("n1", H200)].allocated == pytest.approx(10 * (1 / 8 + 5 / 8))
    assert small.name not in {name for _, name in ledger.pods()}
    # Covered whole by its MIG devices, the GPU's own entry counts nothing.
    full = Snapshot(
        timestamp=1.0,
        gpus=[
            GpuSample(uuid="GPU-1", index=0, model=H200, memory_total_bytes=144 * gib),
            *(
                GpuSample(uuid="GPU-1", index=0, model=H200, mig_id=f"MIG-{i}", memory_total_bytes=72 * gib)
                for i in range(2)
            ),
        ],
    )
    assert set(devices_of(full)) == {"MIG-0", "MIG-1"}


def test_devices_of_names_the_pods_each_device_is_allocated_to() -> None:
    snapshot = Snapshot(
        timestamp=1.0,
        gpus=[
            GpuSample(
                uuid="GPU-1",
                index=0,
                model=H200,
                pods=[PodRef(namespace="ml", name="a"), PodRef(namespace="ml", name="b")],
                processes=[ProcessSample(pid=1, pod=PodRef(namespace="ops", name="x"))],
            ),
            GpuSample(uuid="GPU-2", index=1, model=H200, state=DeviceState.LOST),
        ],
    )
    devices = devices_of(snapshot)
    assert devices == {"GPU-1": Device(H200, 1.0, (("ml", "a"), ("ml", "b")), "GPU-1")}


def test_a_bound_caps_a_pod_at_its_gpus_since_its_start_and_counts_the_rest_refused() -> None:
    # A node says its one-GPU pod holds 8 GPUs, with readings from before the pod started.
    ledger = Ledger()
    devices = {f"GPU-{i}": Device(H200, 1.0, (TRAIN,), f"GPU-{i}") for i in range(8)}
    for t in range(0, 101):
        readings = {d: {TRAIN: Point(float(t), gpu_util=90.0)} for d in devices}
        ledger.observe("n1", float(t), devices, readings, bound=lambda pod: Bound(1.0, 50.0), until=90.0)
    # From its start (50) until the receiver's now (90): 40 s of one GPU.
    assert total(ledger).allocated == pytest.approx(40.0)
    assert total(ledger).used <= total(ledger).allocated
    assert ledger.refused == pytest.approx(800.0 - 40.0)


def test_the_same_readings_give_the_same_totals_and_forget_hands_them_over() -> None:
    def run() -> Ledger:
        ledger = Ledger()
        for t in range(1000):
            util = (t * 37 % 101) * 1.0 if t % 13 else None
            point = Point(t * 0.7, gpu_util=util, util_source=UtilizationSource.DEVICE)
            ledger.observe("n1", t * 0.7, {"GPU-1": ALONE}, {"GPU-1": {TRAIN: point}})
        return ledger

    first, second = run(), run()
    assert first.totals() == second.totals()
    handed = first.forget(*TRAIN)
    assert handed[H200] == second.pod_totals(*TRAIN)[H200]
    assert first.pods() == []


def test_silent_pods_are_those_with_no_recent_reading() -> None:
    ledger = Ledger()
    play(ledger, ALONE, alone([(0.0, 1.0), (1.0, 1.0)]))
    other = Device(H200, 1.0, (("ml", "other"),), "GPU-2")
    play(ledger, other, [(t, {("ml", "other"): 1.0}) for t in (0.0, 100.0, 101.0)], device_id="GPU-2")
    assert ledger.silent_pods(before=50.0) == [TRAIN]


# -- the invariants, on any readings --

POD_NAMES = [("ml", f"p{i}") for i in range(4)]
# Whole percents (and a few fractions): the invariants are checked on differences of running sums,
# which a reading of 1e-38% would fall below the precision of.
utils = st.one_of(st.none(), st.integers(0, 150).map(float), st.sampled_from([0.5, 2.5, 4.99, 5.01]))
step = st.tuples(
    st.floats(0.2, 4.0),  # seconds since the previous snapshot
    st.lists(st.sampled_from(POD_NAMES), min_size=0, max_size=4, unique=True),  # the holders
    st.lists(utils, min_size=4, max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(
    fraction=st.sampled_from([1.0, 1 / 7, 0.5]),
    floor=st.sampled_from([0.0, 1.0, 5.0, 20.0, 100.0]),
    steps=st.lists(step, max_size=40),
)
def test_allocated_sums_to_the_physical_time_used_never_exceeds_allocated_and_idle_is_the_rest(
    fraction: float, floor: float, steps: list[tuple[float, list[Pod], list[float | None]]]
) -> None:
    ledger = Ledger(idle_floor=floor)
    t = 0.0
    physical = 0.0
    opened = False
    for dt, holders, values in steps:
        t += dt
        device = Device(H200, fraction, tuple(holders), "GPU-1")
        points = {
            pod: Point(t, gpu_util=u) for pod, u in zip(POD_NAMES, values, strict=True) if pod in holders
        }
        before = {
            pod: Usage(u.allocated, u.used, u.idle, u.unknown)
            for pod in POD_NAMES
            for u in [_of(ledger, pod)]
        }
        ledger.observe("n1", t, {"GPU-1": device}, {"GPU-1": points})
        if opened:  # the device's first reading opens it; every later one counts its interval
            physical += fraction * dt
        opened = True
        for pod in POD_NAMES:
            now, was = _of(ledger, pod), before[pod]
            allocated, used, idle = now.allocated - was.allocated, now.used - was.used, now.idle - was.idle
            assert used <= allocated + 1e-9
            known = now.unknown == was.unknown
            if known and allocated > 0 and used < (floor / 100) * allocated * (1 - 1e-9):
                assert idle == pytest.approx(allocated - used)
            else:
                assert idle == pytest.approx(0.0, abs=1e-9)
    counted = sum(_of(ledger, pod).allocated for pod in POD_NAMES) + _free(ledger)
    assert counted == pytest.approx(physical, rel=1e-9, abs=1e-9)


def _of(ledger: Ledger, pod: Pod) -> Usage:
    return ledger.pod_totals(*pod).get(H200, Usage())


def _free(ledger: Ledger) -> float:
    return sum(u.allocated for u in ledger.unallocated().values())


def test_every_finite_reading_is_clamped_to_the_device() -> None:
    ledger = Ledger()
    play(ledger, ALONE, alone([(0.0, 250.0), (1.0, 250.0), (2.0, -5.0)]))
    assert total(ledger).used == pytest.approx(1.0)
    assert math.isfinite(total(ledger).allocated)

"""The ledger's rules (gpuwarden/accounting/ledger.py's doc), each on readings whose truth is known."""

from __future__ import annotations

import pytest

from gpuwarden.accounting import MIG_FALLBACK_FRACTION, Device, Ledger, Usage, devices_of
from gpuwarden.policy import Point, SeriesKey, UtilizationSource
from gpuwarden.wire.node import GpuSample, PodRef, ProcessSample, Snapshot

H200 = "NVIDIA H200"
ALONE = Device(H200, 1.0, frozenset({("ml", "train")}))
KEY = SeriesKey("ml", "train", "GPU-1")


def play(ledger: Ledger, key: SeriesKey, device: Device, readings: list[tuple[float, float | None]]) -> None:
    for t, util in readings:
        ledger.observe(key, Point(t, gpu_util=util), device)


def total(ledger: Ledger, namespace: str = "ml", pod: str = "train") -> Usage:
    return ledger.pod_totals(namespace, pod)[H200]


def test_a_pod_alone_on_a_gpu_is_allocated_the_time_between_readings_and_uses_its_activity() -> None:
    ledger = Ledger()
    play(ledger, KEY, ALONE, [(float(t), 40.0) for t in range(101)])
    assert total(ledger).allocated == pytest.approx(100.0)
    assert total(ledger).used == pytest.approx(40.0)
    assert total(ledger).idle == 0.0
    assert total(ledger).efficiency == pytest.approx(0.4)


def test_sm_activity_wins_over_utilization_where_gpm_gives_it() -> None:
    ledger = Ledger()
    for t in range(11):
        ledger.observe(KEY, Point(float(t), gpu_util=100.0, sm_active=10.0), ALONE)
    assert total(ledger).used == pytest.approx(1.0)


def test_activity_under_the_floor_counts_the_interval_idle() -> None:
    ledger = Ledger(idle_floor=5.0)
    play(ledger, KEY, ALONE, [(float(t), 3.0 if t <= 50 else 60.0) for t in range(101)])
    assert total(ledger).idle == pytest.approx(50.0)
    assert total(ledger).allocated == pytest.approx(100.0)


def test_a_gap_longer_than_the_store_bound_counts_nothing_and_a_stale_reading_is_ignored() -> None:
    ledger = Ledger()
    # 0..10 read, then nothing until 70 (a 60 s gap), then 70..80; a replayed old reading at 75.
    play(ledger, KEY, ALONE, [(float(t), 50.0) for t in range(11)])
    play(ledger, KEY, ALONE, [(float(t), 50.0) for t in range(70, 81)])
    play(ledger, KEY, ALONE, [(75.0, 100.0), (80.0, 100.0)])
    assert total(ledger).allocated == pytest.approx(20.0)
    assert total(ledger).used == pytest.approx(10.0)


def test_a_first_interval_at_the_bound_counts_and_one_past_it_does_not() -> None:
    ledger = Ledger()
    play(ledger, KEY, ALONE, [(0.0, 50.0), (5.0, 50.0)])
    play(ledger, SeriesKey("ml", "train", "GPU-2"), ALONE, [(0.0, 50.0), (5.001, 50.0)])
    assert total(ledger).allocated == pytest.approx(5.0)


def test_a_slow_sampler_is_counted_from_its_second_interval_on() -> None:
    # An agent sampling every 10 s: its first interval is past the 5 s bound (nothing before it to
    # tell a slow sampler from a silence); from then on intervals up to 3 x 10 s count.
    ledger = Ledger()
    play(ledger, KEY, ALONE, [(float(t), 50.0) for t in range(0, 101, 10)])
    assert total(ledger).allocated == pytest.approx(90.0)
    play(ledger, KEY, ALONE, [(125.0, 50.0), (156.0, 50.0)])  # 25 s counts, then 31 s is a gap
    assert total(ledger).allocated == pytest.approx(115.0)


def test_the_interval_after_an_outage_does_not_excuse_a_second_outage() -> None:
    ledger = Ledger()
    # 1 s readings, an hour's silence, one reading, then a minute's silence: both are gaps.
    play(ledger, KEY, ALONE, [(float(t), 50.0) for t in range(11)])
    play(ledger, KEY, ALONE, [(3610.0, 50.0), (3670.0, 50.0), (3671.0, 50.0)])
    assert total(ledger).allocated == pytest.approx(11.0)


def test_a_time_sliced_gpu_is_split_evenly_and_each_pod_uses_its_processes_share() -> None:
    device = Device(H200, 1.0, frozenset({("ml", "a"), ("ml", "b")}))
    ledger = Ledger()
    for t in range(11):
        ledger.observe(SeriesKey("ml", "a", "GPU-1"), Point(float(t), gpu_util=30.0), device)
        ledger.observe(SeriesKey("ml", "b", "GPU-1"), Point(float(t), gpu_util=2.0), device)
    a, b = total(ledger, pod="a"), total(ledger, pod="b")
    assert (a.allocated, b.allocated) == (pytest.approx(5.0), pytest.approx(5.0))
    assert (a.used, b.used) == (pytest.approx(3.0), pytest.approx(0.2))
    # b uses 2% of the GPU, 4% of its half: under the 5% floor. a is not idle.
    assert (a.idle, b.idle) == (0.0, pytest.approx(5.0))


def test_a_pod_running_on_a_gpu_allocated_to_another_is_allocated_nothing_there() -> None:
    device = Device(H200, 1.0, frozenset({("ml", "train")}))
    ledger = Ledger()
    play(ledger, SeriesKey("ops", "debug", "GPU-1"), device, [(0.0, 10.0), (1.0, 10.0)])
    assert ledger.pod_totals("ops", "debug")[H200].allocated == 0.0
    assert ledger.pod_totals("ops", "debug")[H200].idle == 0.0


def test_unknown_activity_carries_the_last_known_for_a_while_then_counts_neither_used_nor_idle() -> None:
    ledger = Ledger(carry_seconds=30.0)
    readings: list[tuple[float, float | None]] = [(0.0, 50.0)] + [(float(t), None) for t in range(1, 61)]
    play(ledger, KEY, ALONE, readings)
    assert total(ledger).allocated == pytest.approx(60.0)
    assert total(ledger).used == pytest.approx(15.0)  # 30 s carried at 50%
    assert total(ledger).unknown == pytest.approx(30.0)
    assert total(ledger).idle == 0.0


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
    play(ledger, SeriesKey("ml", "small", "MIG-a"), devices["MIG-a"], [(0.0, 100.0), (8.0 / 2, 100.0)])
    assert ledger.pod_totals("ml", "small")[H200].allocated == pytest.approx(0.5)
    assert ledger.pod_totals("ml", "small")[H200].used == pytest.approx(0.5)


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
            GpuSample(uuid="GPU-2", index=1, model=H200, state="lost"),
        ],
    )
    devices = devices_of(snapshot)
    assert devices == {"GPU-1": Device(H200, 1.0, frozenset({("ml", "a"), ("ml", "b")}))}


def test_the_same_readings_give_the_same_totals_and_forget_hands_them_over() -> None:
    def run() -> Ledger:
        ledger = Ledger()
        for t in range(1000):
            util = (t * 37 % 101) * 1.0 if t % 13 else None
            ledger.observe(KEY, Point(t * 0.7, gpu_util=util, util_source=UtilizationSource.DEVICE), ALONE)
        return ledger

    first, second = run(), run()
    assert first.totals() == second.totals()
    handed = first.forget("ml", "train")
    assert handed[H200] == second.pod_totals("ml", "train")[H200]
    assert first.pods() == []


def test_silent_pods_are_those_with_no_recent_reading() -> None:
    ledger = Ledger()
    play(ledger, KEY, ALONE, [(0.0, 1.0), (1.0, 1.0)])
    play(ledger, SeriesKey("ml", "other", "GPU-2"), ALONE, [(0.0, 1.0), (100.0, 1.0), (101.0, 1.0)])
    assert ledger.silent_pods(before=50.0) == [("ml", "train")]

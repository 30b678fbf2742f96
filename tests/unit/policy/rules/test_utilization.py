"""utilizationFloor and utilizationCeiling: window means, spikes, coverage, signal choice, power, GPUs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuwarden.policy.rules.common import Outcome, WindowParams, covered, readings
from gpuwarden.policy.rules.utilization import (
    UtilizationCeiling,
    UtilizationFloor,
    evaluate_ceiling,
    evaluate_floor,
)
from gpuwarden.policy.spec.model import Signal
from gpuwarden.policy.store.intake import points_from_snapshot
from gpuwarden.policy.store.series import Column, PodId, Point, SeriesKey, SeriesStore, UtilizationSource
from gpuwarden.wire.node import GpuSample, PodRef, ProcessSample, Snapshot

T0 = 1_750_000_000.0
POD = PodId("ns", "pod")
PARAMS = WindowParams()
FLOOR = UtilizationFloor(name="idle", percent=20, for_seconds=300)
CEILING = UtilizationCeiling(name="hot", percent=90, for_seconds=120)


def feed(
    store: SeriesStore,
    gpu: str,
    seconds: int,
    *,
    sm: Callable[[int], float | None] = lambda i: None,
    util: Callable[[int], float | None] = lambda i: None,
    power: Callable[[int], float | None] = lambda i: None,
    skip: Callable[[int], bool] = lambda i: False,
) -> float:
    """One point a second for ``seconds``; returns the last timestamp."""
    key = SeriesKey(POD.namespace, POD.name, gpu)
    for i in range(seconds):
        if not skip(i):
            store.add(key, Point(T0 + i, gpu_util=util(i), sm_active=sm(i), power_w=power(i)))
    return T0 + seconds - 1


def new_store() -> SeriesStore:
    return SeriesStore(retention_seconds=3600, max_points=3600)


def test_idle_gpu_trips_the_floor_with_a_readable_message() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 400, sm=lambda i: 3.0, util=lambda i: 100.0)
    out = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert not out.clears
    assert out.value is not None
    assert abs(out.value - 3.0) < 1e-6
    # auto prefers SM activity: gpuUtil reads 100 under a trickle of tiny kernels.
    assert out.message == "mean SM activity (GPM) 3% over 5m, floor 20%"
    assert out.gpus == ("GPU-1",)


def test_auto_falls_back_to_gpu_util_and_explicit_signal_is_obeyed() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 400, util=lambda i: 5.0)
    out = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.message.startswith("mean GPU utilization (device counter) 5%")
    store2 = new_store()
    now = feed(store2, "GPU-1", 400, sm=lambda i: 5.0, util=lambda i: 60.0)
    rule = UtilizationFloor(name="idle", percent=20, for_seconds=300, signal=Signal.GPU_UTIL)
    out = evaluate_floor(rule, POD, store2.series_of("ns", "pod"), now, PARAMS)
    assert not out.holds
    assert out.value == 60.0


def test_noise_floor_counts_chatter_as_zero() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 400, sm=lambda i: 4.0 if i % 2 else 14.0)  # mean 9
    plain = evaluate_floor(UtilizationFloor("idle", 8, 300), POD, store.series_of("ns", "pod"), now, PARAMS)
    assert not plain.holds
    quiet = UtilizationFloor("idle", 8, 300, noise_floor=4.0)  # "at or below" counts as 0
    out = evaluate_floor(quiet, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.value is not None
    assert abs(out.value - 7.0) < 0.05


def test_power_threshold_marks_a_gpu_busy() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 400, sm=lambda i: 2.0, power=lambda i: 310.0)
    rule = UtilizationFloor("idle", 20, 300, power_threshold_watts=300)
    out = evaluate_floor(rule, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert not out.holds
    assert out.clears
    assert "busy by power (310 W)" in out.message
    lower = UtilizationFloor("idle", 20, 300, power_threshold_watts=400)
    assert evaluate_floor(lower, POD, store.series_of("ns", "pod"), now, PARAMS).holds


def test_multi_gpu_pod_value_is_the_mean_of_its_gpus() -> None:
    store = new_store()
    feed(store, "GPU-1", 400, sm=lambda i: 100.0)
    now = feed(store, "GPU-2", 400, sm=lambda i: 0.0)
    out = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.value == 50.0
    assert not out.holds
    assert out.gpus == ("GPU-1", "GPU-2")
    assert "across 2 GPUs" in out.message

    store8 = new_store()
    now = feed(store8, "GPU-0", 400, sm=lambda i: 100.0)
    for g in range(1, 8):
        feed(store8, f"GPU-{g}", 400, sm=lambda i: 0.0)
    out = evaluate_floor(FLOOR, POD, store8.series_of("ns", "pod"), now, PARAMS)
    assert out.value == 12.5
    assert out.holds


def test_one_gpu_with_a_gap_keeps_the_pod_from_starting() -> None:
    store = new_store()
    feed(store, "GPU-1", 400, sm=lambda i: 0.0)
    now = feed(store, "GPU-2", 400, sm=lambda i: 0.0, skip=lambda i: 200 <= i < 230)
    assert not evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS).holds


def test_a_gpu_silent_for_the_whole_window_leaves_the_pods_view() -> None:
    store = new_store()
    feed(store, "GPU-lost", 60, sm=lambda i: 90.0)
    now = feed(store, "GPU-1", 400, sm=lambda i: 0.0)
    out = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.gpus == ("GPU-1",)


def test_stale_pod_and_empty_pod_are_unknown() -> None:
    store = new_store()
    last = feed(store, "GPU-1", 400, sm=lambda i: 0.0)
    stale = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), last + 61, PARAMS)
    assert stale.value is None
    assert not stale.holds
    assert not stale.clears
    assert evaluate_floor(FLOOR, POD, [], last, PARAMS).value is None
    assert stale.message == "no data to judge"


def test_window_ends_at_the_newest_sample_not_now() -> None:
    store = new_store()
    last = feed(store, "GPU-1", 400, sm=lambda i: 0.0)
    # Reports arrive late: judging 30 s after the newest sample still sees a covered window.
    assert evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), last + 30, PARAMS).holds


def test_ceiling_holds_above_and_clears_below_the_margin() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 200, sm=lambda i: 97.0)
    out = evaluate_ceiling(CEILING, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.message == "mean SM activity (GPM) 97% over 2m, ceiling 90%"
    store2 = new_store()
    now = feed(store2, "GPU-1", 200, sm=lambda i: 87.0)
    out = evaluate_ceiling(CEILING, POD, store2.series_of("ns", "pod"), now, PARAMS)
    assert not out.holds
    assert not out.clears
    store3 = new_store()
    now = feed(store3, "GPU-1", 200, sm=lambda i: 85.0)
    assert evaluate_ceiling(CEILING, POD, store3.series_of("ns", "pod"), now, PARAMS).clears


@settings(max_examples=40, deadline=None)
@given(
    base=st.floats(0, 5),
    spikes=st.lists(st.tuples(st.integers(0, 290), st.integers(1, 20)), max_size=12),
)
def test_idle_gpu_with_brief_spikes_trips_the_floor_unless_they_lift_the_mean(
    base: float, spikes: list[tuple[int, int]]
) -> None:
    """Spikes to 100% count for what they add to the window's mean: no more, no less."""
    seconds = 400
    window_start = seconds - 1 - int(FLOOR.for_seconds)
    busy: set[int] = set()
    for at, length in spikes:
        busy.update(range(window_start + at, window_start + at + length))
    store = new_store()
    now = feed(store, "GPU-1", seconds, sm=lambda i: 100.0 if i in busy else base)
    in_window = [100.0 if i in busy else base for i in range(window_start, seconds)]
    mean = sum(in_window) / len(in_window)
    out = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.value is not None
    assert abs(out.value - mean) < 1e-3
    if mean < FLOOR.percent - 1e-3:
        assert out.holds  # brief spikes do not spare an idle GPU
    if mean >= FLOOR.percent:
        assert not out.holds  # spikes that lift the mean over the window do
    # A ceiling never holds on spikes over an idle base.
    if mean <= CEILING.percent:
        assert not evaluate_ceiling(CEILING, POD, store.series_of("ns", "pod"), now, PARAMS).holds


@settings(max_examples=50, deadline=None)
@given(
    gap_start=st.integers(80, 398),
    gap_length=st.integers(1, 120),
    as_missing=st.booleans(),
    explicit=st.sampled_from([None, 3.0, 5.0, 10.0]),
)
# The window starts at second 99. A 6 s hole across it leaves its first 4 s unread: not covered.
@example(gap_start=97, gap_length=6, as_missing=False, explicit=None)
# A 4 s hole across it is an ordinary 5 s interval from the reading at 97: covered.
@example(gap_start=98, gap_length=4, as_missing=False, explicit=None)
def test_missing_samples_never_satisfy_for(
    gap_start: int, gap_length: int, as_missing: bool, explicit: float | None
) -> None:
    """An idle GPU holds the floor exactly when its readings cover the window.

    The gap is absent points, or points without a utilization reading (the
    agent read the GPU but not that metric); only the latter can sit at the
    window's tail, since the window ends at the newest point. Covered: no gap
    over max_gap between readings or after the last; and at the window's start,
    the first reading at most one interval (1 s) in, or the point just before
    the window read within max_gap of it.
    """
    seconds = 400
    gap_length = min(gap_length, seconds - 1 - gap_start) if not as_missing else gap_length
    hole = set(range(gap_start, gap_start + gap_length))
    store = new_store()
    if as_missing:
        now = feed(store, "GPU-1", seconds, sm=lambda i: None if i in hole else 0.0, power=lambda i: 50.0)
    else:
        now = feed(store, "GPU-1", seconds, sm=lambda i: 0.0, skip=lambda i: i in hole)
    out = evaluate_floor(
        FLOOR, POD, store.series_of("ns", "pod"), now, WindowParams(max_gap_seconds=explicit)
    )

    # A plain reference: readings are at every second outside the hole.
    end = now
    start = end - FLOOR.for_seconds
    times = [T0 + i for i in range(seconds) if i not in hole and start <= T0 + i <= end]
    if not times:
        assert not out.holds
        return
    intervals = [b - a for a, b in itertools.pairwise(times)]
    longest = max([end - times[-1], *intervals])
    allowed = explicit if explicit is not None else 5.0  # 1 s sampling: 3 x 1 s is below the 5 s minimum
    # The point just before the window: in `as_missing` every second has a point, read or not.
    points = [i for i in range(seconds) if T0 + i < start and (as_missing or i not in hole)]
    before = T0 + points[-1] if points and points[-1] not in hole else None
    edge = times[0] - start <= 1.0 or (before is not None and times[0] - before <= allowed)
    expected = longest <= allowed and edge
    assert out.holds == expected
    r = readings(store.series_of("ns", "pod")[0][1], Column.SM_ACTIVE, start, end)
    assert covered(r, start, end, explicit) == expected


def test_adaptive_max_gap_follows_a_slow_sampling_rate() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 600, sm=lambda i: 0.0, skip=lambda i: i % 10 != 0)  # 0.1 Hz
    assert evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS).holds
    tight = WindowParams(max_gap_seconds=5.0)
    assert not evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, tight).holds
    # ...but a 40 s hole is more than 3 intervals of 10 s.
    store2 = new_store()
    now = feed(store2, "GPU-1", 600, sm=lambda i: 0.0, skip=lambda i: i % 10 != 0 or 400 < i < 440)
    assert not evaluate_floor(FLOOR, POD, store2.series_of("ns", "pod"), now, PARAMS).holds


def test_a_hole_that_leaves_few_readings_is_not_its_own_yardstick() -> None:
    """Two readings a second apart, a 9 s hole, one more: the median interval is 1 s, so the hole is
    over the 5 s limit and the 10 s window is not covered. (The mean of the middle intervals, 1 and
    9, made the hole a 5 s "interval" and the limit 15 s: a GPU lost for 8 s of a 10 s window
    started an idle finding on three readings.)"""
    floor = UtilizationFloor(name="idle", percent=20, for_seconds=10)
    store = new_store()
    key = SeriesKey("ns", "pod", "GPU-1")
    for t in (T0 - 1, T0, T0 + 1, T0 + 10):
        store.add(key, Point(t, sm_active=3.0))
    assert not evaluate_floor(floor, POD, store.series_of("ns", "pod"), T0 + 10, PARAMS).holds
    for t in range(11, 21):  # a whole window of readings after the hole
        store.add(key, Point(T0 + t, sm_active=3.0))
    assert evaluate_floor(floor, POD, store.series_of("ns", "pod"), T0 + 20, PARAMS).holds


def test_the_windows_start_is_covered_by_one_interval_or_by_the_reading_before_it() -> None:
    """No earlier reading: one sampling interval of lead at most. An earlier one: a gap like any other."""
    window_start, end = T0 + 100.0, T0 + 400.0

    def covers(times: list[float], *, explicit: float | None = None) -> bool:
        store = new_store()
        for t in times:
            store.add(SeriesKey("ns", "pod", "GPU-1"), Point(t, sm_active=0.0))
        window = store.series_of("ns", "pod")[0][1]
        r = readings(window, Column.SM_ACTIVE, window_start, end)
        return covered(r, window_start, end, explicit)

    every_second_from = [window_start + 1.0 + i for i in range(300)]
    assert covers(every_second_from)  # first reading one interval in
    late = [window_start + 1.5 + i for i in range(299)]
    assert not covers(late)  # 1.5 s: more than an interval, though under the 5 s max_gap
    assert not covers(late, explicit=10.0)
    # Jitter: the reading before the window at start - 0.2 s, the next at start + 1.5 s (1.7 s apart).
    assert covers([window_start - 0.2, *late])
    # A reading before the window helps only within max_gap of the first one inside it.
    assert not covers([window_start - 6.0, *late])
    assert covers([window_start - 6.0, *late], explicit=10.0)
    # Slow sampling: one interval is one median interval (10 s here), at the edge as inside.
    ten = [window_start + 9.0 + 10 * i for i in range(30)]
    assert covers(ten)
    assert not covers([t + 2.0 for t in ten])  # 11 s before the first reading, intervals of 10 s
    assert covers([window_start - 19.0, *[t + 2.0 for t in ten]])  # 30 s across the start: 3 intervals


# -- shared GPUs: each pod judged on its own processes, and the message says on what ----------


@dataclass
class Shared:
    """Pods a (busy), b (holds memory, runs no kernel), c (allocated, runs nothing) on one GPU, 400 s.

    The device is sampled every second, per-process utilization every 10 s (as the agent
    does): b is left out of NVML's per-process reading, which the agent turns into 0%.
    """

    store: SeriesStore
    now: float

    def judge(self, pod: str, rule: UtilizationFloor | UtilizationCeiling = FLOOR) -> Outcome:
        series = self.store.series_of("ns", pod)
        if isinstance(rule, UtilizationFloor):
            return evaluate_floor(rule, PodId("ns", pod), series, self.now, PARAMS)
        return evaluate_ceiling(rule, PodId("ns", pod), series, self.now, PARAMS)


@pytest.fixture(scope="module")
def shared() -> Shared:
    store = new_store()
    a, b, c = (PodRef(namespace="ns", name=n) for n in "abc")
    for i in range(400):
        read = i % 10 == 0
        gpu = GpuSample(
            uuid="GPU-1",
            index=0,
            utilization_gpu=95.0,
            sm_active=80.0,
            memory_used_bytes=20 * 2**30,
            memory_total_bytes=80 * 2**30,
            pods=[a, b, c],
            processes=[
                ProcessSample(pid=1, pod=a, used_memory_bytes=4 * 2**30, sm_util=95.0 if read else None),
                ProcessSample(pid=2, pod=b, used_memory_bytes=8 * 2**30, sm_util=0.0 if read else None),
            ],
        )
        store.extend(points_from_snapshot(Snapshot(timestamp=T0 + i, gpus=[gpu])))
    return Shared(store, T0 + 399)


def test_on_a_shared_gpu_the_process_that_runs_no_kernel_is_idle_and_the_busy_one_is_not(
    shared: Shared,
) -> None:
    idle = shared.judge("b")
    assert idle.holds
    assert idle.message == "mean per-process SM utilization 0% over 5m, floor 20%"
    busy = shared.judge("a")
    assert not busy.holds
    assert busy.value == 95.0  # its own share, not the device's 80% SM activity
    hot = shared.judge("a", CEILING)
    assert hot.holds
    assert hot.message == "mean per-process SM utilization 95% over 2m, ceiling 90%"


def test_a_pod_allocated_a_shared_gpu_without_a_process_on_it_is_idle(shared: Shared) -> None:
    nothing = shared.judge("c")
    assert nothing.holds
    assert nothing.message == (
        "mean per-process SM utilization (no process of its own on the shared GPU) 0% over 5m, floor 20%"
    )


def test_smactive_cannot_be_split_per_process_so_a_shared_gpu_has_nothing_to_judge(shared: Shared) -> None:
    gpm_only = UtilizationFloor(name="idle", percent=20, for_seconds=300, signal=Signal.SM_ACTIVE)
    assert shared.judge("b", gpm_only).value is None


def test_a_pod_judged_on_different_signals_on_its_gpus_names_each() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 400, sm=lambda i: 3.0)
    key = SeriesKey(POD.namespace, POD.name, "GPU-2")
    for i in range(0, 400, 10):
        store.add(key, Point(T0 + i, gpu_util=1.0, util_source=UtilizationSource.PROCESSES))
    out = evaluate_floor(FLOOR, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    signals = "GPU activity (SM activity (GPM); per-process SM utilization)"
    assert out.message == f"mean {signals} 2% over 5m across 2 GPUs, floor 20%"

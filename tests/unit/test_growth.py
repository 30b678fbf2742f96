"""memoryGrowth and Theil-Sen: leaks are found with the right slope; staircases and sawtooths are not."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuwarden.policy.growth import (
    BUCKETS,
    GrowthCache,
    evaluate_growth,
    gpu_growth,
    growth_window,
)
from gpuwarden.policy.model import MemoryGrowth
from gpuwarden.policy.rules import Outcome, WindowParams
from gpuwarden.policy.series import PodId, Point, SeriesKey, SeriesStore
from gpuwarden.policy.slope import bucket_medians, fit_line, median, r_squared, theil_sen

T0 = 1_749_999_960.0  # a multiple of 90 s: buckets of a 30m window start on it
POD = PodId("ns", "pod")
PARAMS = WindowParams()
MI = 2**20
GI = 2**30
CARD = 141 * GI
WINDOW = 1800.0
SECONDS = 2000  # a 30m window plus a bucket and some


def leak_rule(rate_mi_per_min: float, min_fit: float = 0.8) -> MemoryGrowth:
    return MemoryGrowth(
        name="leak", rate_bytes_per_second=rate_mi_per_min * MI / 60, window_seconds=WINDOW, min_fit=min_fit
    )


def judge(used: Callable[[int], float | None], rule: MemoryGrowth, seconds: int = SECONDS) -> Outcome:
    return judge_at(used, rule, seconds, [seconds - 1])[0]


def judge_at(
    used: Callable[[int], float | None], rule: MemoryGrowth, seconds: int, at: list[int]
) -> list[Outcome]:
    """Feed ``seconds`` of 1 s readings, then judge as of each second in ``at``."""
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    key = SeriesKey(POD.namespace, POD.name, "GPU-1")
    for i in range(seconds):
        store.add(key, Point(T0 + i, mem_used=used(i), mem_total=CARD))
    series = store.series_of("ns", "pod")
    return [evaluate_growth(rule, POD, series, T0 + i, PARAMS) for i in at]


@settings(max_examples=25, deadline=None)
@given(
    rate=st.floats(20, 1500),  # MiB per minute
    noise=st.floats(0, 0.1),  # per-reading standard deviation, as a share of the window's total growth
    start=st.floats(1, 40),  # GiB
    spikes=st.floats(0, 0.02),  # share of readings with a transient +2 GiB allocation
    seed=st.integers(0, 2**32 - 1),
)
def test_noisy_linear_leak_is_found_with_its_slope_and_time_to_oom(
    rate: float, noise: float, start: float, spikes: float, seed: int
) -> None:
    """Tolerance: slope within 10% of the true rate; time to full within 10% plus what the noise explains."""
    rng = random.Random(seed)
    per_second = rate * MI / 60
    sigma = noise * per_second * WINDOW

    def used(i: int) -> float:
        spike = 2 * GI if rng.random() < spikes else 0.0
        return start * GI + per_second * i + rng.gauss(0, sigma) + spike

    out = judge(used, leak_rule(rate / 2))
    assert out.holds, out.message
    assert out.value is not None
    assert abs(out.value - per_second) <= 0.1 * per_second
    assert out.fit is not None
    assert out.fit >= 0.8
    true_eta = (CARD - (start * GI + per_second * (SECONDS - 1))) / per_second
    assert out.seconds_to_full is not None
    assert (
        abs(out.seconds_to_full - true_eta)
        <= 0.1 * true_eta + (4 * sigma + 2 * GI * (spikes > 0)) / per_second
    )


@settings(max_examples=25, deadline=None)
@given(
    steps=st.integers(1, 8),
    height=st.floats(0.25, 4),  # GiB per step
    every=st.integers(30, 150),  # seconds between steps
    jitter=st.floats(0, 30),  # MiB of reading noise
    seed=st.integers(0, 2**32 - 1),
)
def test_caching_allocator_staircase_that_plateaus_is_not_a_leak(
    steps: int, height: float, every: int, jitter: float, seed: int
) -> None:
    """Steps while warming up, then flat: never a leak once the plateau fills the window's recent part.

    The threshold is set at half the staircase's average rise over the window, so
    a fit that ignored the plateau would fire.
    """
    rng = random.Random(seed)
    climb_from = SECONDS - int(WINDOW)

    def used(i: int) -> float:
        done = min(steps, max(0, (i - climb_from) // every + 1))
        return 4 * GI + done * height * GI + rng.gauss(0, jitter * MI)

    rise_per_minute = steps * height * GI / WINDOW * 60 / MI
    plateau_from = climb_from + (steps - 1) * every
    ends = list(range(plateau_from + int(0.4 * WINDOW) + 1, SECONDS + 600, 90))
    for end, out in zip(
        ends, judge_at(used, leak_rule(rise_per_minute / 2, 0.5), SECONDS + 600, ends), strict=True
    ):
        assert not out.holds, (end, out.message)


@settings(max_examples=25, deadline=None)
@given(
    period=st.integers(30, 600),
    amplitude=st.floats(0.5, 20),  # GiB
    phase=st.integers(0, 599),
    shape=st.sampled_from(["ramp", "step"]),
    jitter=st.floats(0, 50),  # MiB
    seed=st.integers(0, 2**32 - 1),
)
def test_sawtooth_allocate_and_free_is_not_a_leak(
    period: int, amplitude: float, phase: int, shape: str, jitter: float, seed: int
) -> None:
    """Allocate (gradually or at once), free, repeat: however fast the allocation, no leak."""
    rng = random.Random(seed)

    def used(i: int) -> float:
        at = (i + phase) % period / period
        level = at if shape == "ramp" else float(at >= 0.5)
        return 8 * GI + level * amplitude * GI + rng.gauss(0, jitter * MI)

    tooth_rate = amplitude * GI / period * 60 / MI  # MiB per minute while allocating
    out = judge(used, leak_rule(tooth_rate / 4))
    assert not out.holds, out.message


def test_message_states_rate_fit_and_time_to_full() -> None:
    per_second = 212 * MI / 60
    now_used = CARD - 212 * MI * 14  # 14 minutes of growth left

    out = judge(lambda i: now_used - per_second * (SECONDS - 1 - i), leak_rule(100))
    assert out.holds
    assert out.message == "GPU memory grows 212Mi/m, fit 1.00; the card (141Gi) is full in 14m"
    assert out.unit == "bytes/s"
    assert out.threshold == pytest.approx(100 * MI / 60)


def test_growth_needs_a_covered_window() -> None:
    per_second = 500 * MI / 60
    out = judge(lambda i: None if 900 < i < 960 else GI + per_second * i, leak_rule(100))
    assert not out.holds
    assert out.value is not None
    young = judge(lambda i: GI + per_second * i, leak_rule(100), seconds=1500)
    assert not young.holds  # not yet a whole window of data


def test_a_leak_that_slows_a_little_stays_and_one_that_stops_clears() -> None:
    per_second = 100 * MI / 60
    slower = judge(lambda i: GI + 0.9 * per_second * i, leak_rule(100))
    assert not slower.holds
    assert not slower.clears
    stopped = judge(lambda i: GI + per_second * min(i, 1300), leak_rule(100))
    assert stopped.clears  # the recent part is flat


def test_only_the_leaking_gpu_is_named() -> None:
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    per_second = 300 * MI / 60
    for i in range(SECONDS):
        store.add(SeriesKey("ns", "pod", "GPU-a"), Point(T0 + i, mem_used=10 * GI, mem_total=CARD))
        store.add(
            SeriesKey("ns", "pod", "GPU-b"), Point(T0 + i, mem_used=GI + per_second * i, mem_total=CARD)
        )
    out = evaluate_growth(leak_rule(100), POD, store.series_of("ns", "pod"), T0 + SECONDS - 1, PARAMS)
    assert out.holds
    assert out.gpus == ("GPU-b",)
    assert "(on 1 of 2 GPUs)" in out.message


def test_window_is_bucket_aligned_and_the_cache_agrees_with_a_fresh_fit() -> None:
    width = WINDOW / BUCKETS
    assert growth_window(WINDOW, T0 + 100) == (T0 + 90 - WINDOW, T0 + 90)
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    key = SeriesKey("ns", "pod", "GPU-1")
    rng = random.Random(7)
    cache = GrowthCache()
    for i in range(SECONDS + 400):
        store.add(key, Point(T0 + i, mem_used=GI + 3 * MI * i + rng.gauss(0, 200 * MI), mem_total=CARD))
        if i >= SECONDS and i % 10 == 0:
            window = store.window(key)
            assert window is not None
            start, end = growth_window(WINDOW, T0 + i)
            assert end - start == WINDOW
            assert end % width == 0
            assert cache.trend(key, window, start, end, None) == gpu_growth("GPU-1", window, start, end)
            cache.sweep()
    assert cache.hits > cache.misses  # evaluations every 10 s refit once per 90 s bucket
    cache.sweep()
    cache.sweep()
    assert len(cache) == 0


def test_gpus_get_their_own_bucket_phase() -> None:
    ends = {growth_window(WINDOW, T0 + 1000, f"GPU-{g}")[1] for g in range(50)}
    assert len(ends) > 40  # refits spread over the bucket, not all at one instant
    for g in range(50):
        start, end = growth_window(WINDOW, T0 + 1000, f"GPU-{g}")
        assert end - start == pytest.approx(WINDOW)
        assert T0 + 1000 - WINDOW / BUCKETS < end <= T0 + 1000
    assert growth_window(WINDOW, T0 + 1000, "GPU-7") == growth_window(WINDOW, T0 + 1000, "GPU-7")


def test_theil_sen_shrugs_off_outliers() -> None:
    xs = [float(i) for i in range(20)]
    ys = [3.0 * x + 1 for x in xs]
    for i in (2, 9, 15):
        ys[i] += 1000.0
    slope, intercept = theil_sen(xs, ys)
    assert slope == pytest.approx(3.0)
    assert intercept == pytest.approx(1.0)
    assert fit_line(xs, [5.0] * 20).fit == 0.0
    assert r_squared(xs, [3.0 * x for x in xs], 3.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="ascending"):
        theil_sen([1.0, 1.0], [0.0, 1.0])
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5


@given(st.lists(st.floats(-1e12, 1e12), min_size=2, max_size=30), st.integers(0, 2**32))
def test_theil_sen_equals_the_lag_by_lag_definition_exactly(ys: list[float], seed: int) -> None:
    # The cached pair getters must give bit-for-bit the slopes (and order) of the plain definition.
    rng = random.Random(seed)
    xs = sorted({rng.uniform(-3600.0, 0.0) for _ in ys})
    ys = ys[: len(xs)]
    if len(xs) < 2:
        return
    slopes: list[float] = []
    for lag in range(1, len(xs)):
        slopes += [(ys[i + lag] - ys[i]) / (xs[i + lag] - xs[i]) for i in range(len(xs) - lag)]
    slope = median(slopes)
    intercept = median([y - slope * x for x, y in zip(xs, ys, strict=True)])
    assert theil_sen(xs, ys) == (slope, intercept)


def test_bucket_medians_skip_empty_buckets() -> None:
    times = [0.0, 1.0, 2.0, 8.0, 9.0]
    values = [1.0, 2.0, 100.0, 5.0, 7.0]
    xs, ys = bucket_medians(times, values, 0.0, 10.0, 5)
    assert xs == [-9.0, -7.0, -1.0]
    assert ys == [1.5, 100.0, 6.0]


@settings(max_examples=30, deadline=None)
@given(
    window=st.sampled_from([60.0, 300.0, 1800.0]),
    per_bucket=st.integers(1, 30),  # readings per bucket: dt = window / 20 / per_bucket
    offset=st.floats(0.0, 1.0),  # where the series starts, as a share of a bucket
    explicit=st.sampled_from([None, 5.0]),
)
@example(window=60.0, per_bucket=3, offset=0.0, explicit=None)  # dt 1 s, buckets of 3 s
@example(window=1800.0, per_bucket=9, offset=0.2, explicit=None)  # dt 10 s: a window 19 s before t0
def test_a_young_series_holds_only_once_the_window_is_covered_but_one_interval(
    window: float, per_bucket: int, offset: float, explicit: float | None
) -> None:
    """A leak from the first reading at ``t0``, sampled every ``dt``: the rule never holds on a
    window that starts before ``t0 - dt``, and holds once the window starts at ``t0`` or later.

    The window's leading edge may be uncovered by one sampling interval, never by
    ``max_gap``. The 1 µs slack absorbs float rounding of epoch timestamps.
    """
    width = window / BUCKETS
    dt = width / per_bucket
    t0 = T0 + offset * width
    rule = MemoryGrowth(name="leak", rate_bytes_per_second=100 * MI / 60, window_seconds=window, min_fit=0.8)
    params = WindowParams(max_gap_seconds=explicit)
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    key = SeriesKey(POD.namespace, POD.name, "GPU-1")
    cache = GrowthCache()
    held = False
    k = 0
    while True:
        t = t0 + k * dt
        store.add(key, Point(t, mem_used=GI + 500 * MI / 60 * (t - t0), mem_total=CARD))
        out = evaluate_growth(rule, POD, store.series_of("ns", "pod"), t, params, cache)
        cache.sweep()
        start = growth_window(window, t, key.gpu)[0]
        if out.holds:
            assert start >= t0 - dt - 1e-6, (start - t0, dt)
            held = True
        if start >= t0 and (explicit is None or explicit >= dt):
            assert out.holds, (start - t0, dt)
        if start >= t0 + width:
            break
        k += 1
    assert held or (explicit is not None and explicit < dt)

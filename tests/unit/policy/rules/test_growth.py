"""memoryGrowth and Theil-Sen: leaks are found with the right slope; staircases and sawtooths are not.

The rule over whole traces, through the engine, is in test_growth_shapes.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuwarden.policy.rules.common import Outcome, WindowParams
from gpuwarden.policy.rules.growth import GrowthCache, MemoryGrowth, evaluate_growth
from gpuwarden.policy.rules.growth.model import (
    BUCKETS,
    JUMP_SHARE,
    MAX_POINTS,
    MIN_SPAN_SECONDS,
    evidence_spans,
)
from gpuwarden.policy.rules.growth.shape import gpu_growth, growth_window, peak_before, span_ends
from gpuwarden.policy.stats import (
    bucket_medians,
    fit_line,
    median,
    pairwise_slopes,
    r_squared,
    sen_lower_bound,
    theil_sen,
)
from gpuwarden.policy.store.series import PodId, Point, SeriesKey, SeriesStore, Window

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
# Noise of 56 MiB a reading: a quarter's slope (5 bucket medians) came out at 8.4 of 20 MiB/min, within
# its noise of the span's, and no span held while each quarter had to reach half the span's slope.
@example(rate=20.0, noise=0.09375, start=1.0, spikes=0.0, seed=10230)
def test_noisy_linear_leak_is_found_with_its_slope_and_time_to_oom(
    rate: float, noise: float, start: float, spikes: float, seed: int
) -> None:
    """Tolerance: the slope within 10% of the true rate plus what the noise explains over the span it
    was judged on; the time to full consistent with that slope and the newest reading."""
    rng = random.Random(seed)
    per_second = rate * MI / 60
    sigma = noise * per_second * WINDOW

    def used(i: int) -> float:
        spike = 2 * GI if rng.random() < spikes else 0.0
        return start * GI + per_second * i + rng.gauss(0, sigma) + spike

    out = judge(used, leak_rule(rate / 2))
    assert out.holds, out.message
    assert out.value is not None
    assert out.fit is not None
    assert out.fit >= 0.8
    # Four standard errors of a least-squares slope through 20 bucket medians of the span.
    width = out.window_seconds / BUCKETS
    per_bucket = min(width, MAX_POINTS / BUCKETS)
    standard_error = 1.25 * sigma / per_bucket**0.5 / (width * (BUCKETS * (BUCKETS**2 - 1) / 12) ** 0.5)
    assert abs(out.value - per_second) <= 0.1 * per_second + 4 * standard_error
    now_used = start * GI + per_second * (SECONDS - 1)
    assert out.seconds_to_full is not None
    assert abs(out.seconds_to_full * out.value - (CARD - now_used)) <= 4 * sigma + 2 * GI * (spikes > 0) + MI


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
    assert out.message == "GPU memory grows 212Mi/m over 30m, fit 1.00; the card (141Gi) is full in 14m"
    assert out.window_seconds == WINDOW
    assert out.unit == "bytes/s"
    assert out.threshold == pytest.approx(100 * MI / 60)


def test_a_gap_restarts_the_evidence() -> None:
    """No span that holds a gap holds; the spans after it are judged on their own, from the shortest."""
    per_second = 500 * MI / 60

    def used(i: int) -> float | None:
        return None if 900 < i < 960 else GI + per_second * i

    after_gap = [960 + int(MIN_SPAN_SECONDS) - 10, 960 + int(MIN_SPAN_SECONDS) + 30, SECONDS - 1]
    early, found, later = judge_at(used, leak_rule(100), SECONDS, after_gap)
    assert not early.holds
    assert early.value is not None
    assert found.holds
    assert found.window_seconds == MIN_SPAN_SECONDS
    assert later.holds
    assert later.window_seconds == 2 * 2 * MIN_SPAN_SECONDS  # 16m: the longest span after the gap


def test_a_young_series_holds_from_the_shortest_span_on() -> None:
    per_second = 500 * MI / 60
    young = judge_at(lambda i: GI + per_second * i, leak_rule(100), 400, [200, 250, 399])
    assert [o.holds for o in young] == [False, True, True]
    assert {o.window_seconds for o in young[1:]} == {MIN_SPAN_SECONDS}


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
    assert fit_line(xs, [5.0] * 20, 2.33).fit == 0.0
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
    assert ys == [1.0, 100.0, 5.0]  # an even count's lower middle reading, never a mean of two


def test_a_step_in_the_middle_of_a_bucket_rises_whole_between_two_buckets() -> None:
    times = [float(t) for t in range(12)]
    values = [0.0] * 6 + [1.0] * 6  # the step halfway through the middle bucket
    _, ys = bucket_medians(times, values, 0.0, 12.0, 3)
    assert ys == [0.0, 0.0, 1.0]


@settings(max_examples=30, deadline=None)
@given(
    window=st.sampled_from([60.0, 300.0, 1800.0]),
    per_bucket=st.integers(1, 30),  # readings per bucket: dt = window / 20 / per_bucket
    offset=st.floats(0.0, 1.0),  # where the series starts, as a share of a bucket
    explicit=st.sampled_from([None, 5.0]),
)
@example(window=60.0, per_bucket=3, offset=0.0, explicit=None)  # dt 1 s, buckets of 3 s
@example(window=1800.0, per_bucket=9, offset=0.2, explicit=None)  # dt 10 s: a window 19 s before t0
def test_a_young_series_holds_only_on_spans_it_covers_but_one_interval(
    window: float, per_bucket: int, offset: float, explicit: float | None
) -> None:
    """A leak from the first reading at ``t0``, sampled every ``dt``: the rule never holds on a
    span that starts before ``t0 - dt``, and holds once the whole window starts at ``t0`` or later.

    A span's leading edge may be uncovered by one sampling interval, never by
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
            judged_from = growth_window(out.window_seconds, t, key.gpu)[0]
            assert judged_from >= t0 - dt - 1e-6, (judged_from - t0, dt)
            held = True
        if start >= t0 and (explicit is None or explicit >= dt):
            assert out.holds, (start - t0, dt)
        if start >= t0 + width:
            break
        k += 1
    assert held or (explicit is not None and explicit < dt)


def test_spans_double_from_four_minutes_up_to_the_window() -> None:
    assert evidence_spans(1800) == (240, 480, 960, 1800)
    assert evidence_spans(600) == (240, 600)
    assert evidence_spans(300) == (300,)
    assert evidence_spans(60) == (60,)
    assert evidence_spans(6 * 3600)[-2:] == (7680, 6 * 3600)


def test_sen_lower_bound_is_a_rank_below_the_median() -> None:
    xs = [float(i) for i in range(20)]
    assert sen_lower_bound(pairwise_slopes(xs, [2.0 * x for x in xs]), 20, 2.33) == pytest.approx(2.0)
    rng = random.Random(5)
    ys = [x + rng.gauss(0, 3) for x in xs]
    slopes = pairwise_slopes(xs, ys)
    line = fit_line(xs, ys, 2.33)
    # n = 20: (190 - 2.33 * sqrt(20 * 19 * 45 / 18)) / 2 = 59.1, the 59th smallest slope.
    assert line.lower == slopes[58] < line.slope
    assert sen_lower_bound(slopes, 20, 1.0) > line.lower  # less confidence, a higher bound
    assert sen_lower_bound(pairwise_slopes(xs[:3], ys[:3]), 3, 2.33) == -math.inf  # too few points


def test_a_staircase_rises_in_jumps_and_a_leak_does_not() -> None:
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    stairs, ramp = SeriesKey("ns", "pod", "GPU-s"), SeriesKey("ns", "pod", "GPU-r")
    rng = random.Random(2)
    for i in range(300):
        store.add(stairs, Point(T0 + i, mem_used=GI * (4 + 2 * (i // 50)) + rng.gauss(0, MI), mem_total=CARD))
        store.add(ramp, Point(T0 + i, mem_used=GI * (4 + i / 25) + rng.gauss(0, MI), mem_total=CARD))
    step, line = (gpu_growth(k.gpu, _window(store, k), T0 + 60, T0 + 300) for k in (stairs, ramp))
    assert step is not None
    assert line is not None
    assert step.jumps == pytest.approx(4 * 2 * GI, rel=0.01)  # its four steps: all of its rise
    assert step.jumps > JUMP_SHARE * step.slope * step.span_seconds
    assert line.jumps < 0.01 * line.slope * line.span_seconds
    out = evaluate_growth(leak_rule(60), POD, [(stairs, _window(store, stairs))], T0 + 300, PARAMS)
    assert not out.holds  # a straight enough line through the steps, but it rose in jumps


def test_memory_higher_before_a_span_is_seen_and_its_ends_are_medians() -> None:
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    key = SeriesKey("ns", "pod", "GPU-1")
    for i in range(1200):  # a 600 s ramp from 20Gi to 40Gi, freed, and ramping again
        store.add(key, Point(T0 + i, mem_used=20 * GI + 20 * GI * (i % 600) / 600, mem_total=CARD))
    window = _window(store, key)
    ends = span_ends(window, T0 + 900, T0 + 1139)  # 240 readings: none strided away
    assert ends is not None
    assert ends.first == pytest.approx(20 * GI + 20 * GI * 305.5 / 600, rel=1e-6)
    assert ends.slope == pytest.approx(20 * GI / 600, rel=1e-3)
    full_start, full_end = growth_window(WINDOW, T0 + 1199)
    full = gpu_growth("GPU-1", window, full_start, full_end)
    # Read off the window's buckets, or (a history too young for them) from the readings.
    assert peak_before(window, full_end - WINDOW, T0 + 900, full, full_start) > 38 * GI
    assert peak_before(window, full_end - WINDOW, T0 + 900, None, full_start) > 38 * GI
    # The rule never holds on the second tooth, however straight its 4 minutes are.
    out = evaluate_growth(leak_rule(100), POD, store.series_of("ns", "pod"), T0 + 1150, PARAMS)
    assert not out.holds


def _window(store: SeriesStore, key: SeriesKey) -> Window:
    window = store.window(key)
    assert window is not None
    return window


def test_the_pairs_cache_of_theil_sen_stays_bounded() -> None:
    from gpuwarden.policy import stats as slope_module

    for n in range(3, 300):
        theil_sen([float(i) for i in range(n)], [2.0 * i for i in range(n)])
    info = slope_module._pairs.cache_info()
    assert info.maxsize is not None
    assert info.currsize <= info.maxsize

"""The load forecast: damped trend, daily season, buckets and the empirical prediction interval."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.policy.scaling.forecast import (
    DAY_BUCKETS,
    MAX_GAP_BUCKETS,
    MIN_ERRORS,
    DampedTrend,
    LoadForecast,
    Smoothing,
)
from gpuwarden.policy.spec.model import BUCKET_SECONDS, MAX_STEPS

T0 = 1_750_000_020.0 - (1_750_000_020.0 % BUCKET_SECONDS)  # a bucket boundary


def feed(forecast: LoadForecast, values: list[float], per_bucket: int = 6, start: float = T0) -> None:
    """Each value as ``per_bucket`` samples 10 s apart in its own bucket."""
    for i, v in enumerate(values):
        for j in range(per_bucket):
            forecast.add(start + i * BUCKET_SECONDS + j * 10, v)


def test_holt_without_damping_extrapolates_a_line_exactly() -> None:
    model = DampedTrend(Smoothing(alpha=0.5, beta=0.3, phi=1.0, seasonal=False))
    for i in range(200):
        model.update(100 + 3 * i)
    assert model.path(5) == pytest.approx([100 + 3 * (199 + k) for k in range(1, 6)], rel=1e-6)


def test_damping_bounds_how_far_a_slope_is_carried() -> None:
    model = DampedTrend(Smoothing(alpha=0.5, beta=0.3, phi=0.9, seasonal=False))
    for i in range(200):
        model.update(100 + 3 * i)
    path = model.path(MAX_STEPS)
    assert all(b > a for a, b in itertools.pairwise(path))
    # The whole path stays below level + trend * phi / (1 - phi): a trend is not extrapolated forever.
    assert path[-1] < model.level + model.trend * 0.9 / 0.1


def test_buckets_are_means_and_complete_when_a_later_sample_comes() -> None:
    f = LoadForecast(Smoothing(seasonal=False))
    f.add(T0, 10.0)
    f.add(T0 + 30, 30.0)
    assert f.buckets == 0  # the first bucket is still open
    f.add(T0 + BUCKET_SECONDS, 50.0)
    assert f.buckets == 1
    assert f.model.level == 20.0
    assert f.last_bucket_end() == T0 + BUCKET_SECONDS
    f.add(T0 + 5, 1000.0)  # late: its bucket is closed, ignored
    f.add(T0 + BUCKET_SECONDS + 1, math.nan)  # not a reading
    f.add(T0 + 2 * BUCKET_SECONDS, 0.0)
    assert f.model.n == 2


def test_a_short_silence_is_bridged_and_a_long_one_starts_afresh() -> None:
    f = LoadForecast(Smoothing(seasonal=False))
    feed(f, [100.0] * 20)
    end = T0 + 20 * BUCKET_SECONDS
    f.add(end + 5 * BUCKET_SECONDS, 100.0)  # four buckets without a sample: filled with the forecast
    assert f.buckets == 25
    f.add(end + (MAX_GAP_BUCKETS + 10) * BUCKET_SECONDS, 100.0)
    assert f.buckets == 0


def test_no_interval_until_enough_errors_were_seen() -> None:
    f = LoadForecast(Smoothing(seasonal=False))
    feed(f, [100.0] * (MIN_ERRORS + 2))
    assert f.at(1).half_width is not None
    assert f.at(3).half_width is None  # three steps ahead: only MIN_ERRORS - 1 scored so far
    feed(f, [100.0] * 5, start=T0 + (MIN_ERRORS + 2) * BUCKET_SECONDS)
    assert f.at(3).half_width is not None


def test_the_interval_covers_about_eighty_percent_of_what_comes() -> None:
    """Each one-step interval, made before its bucket, against the bucket: white noise around a level."""
    rng = random.Random(5)
    f = LoadForecast(Smoothing(seasonal=False))
    hits = total = 0
    for i in range(800):
        actual = 200 + rng.gauss(0, 10)
        if i > 100:
            p = f.at(1)
            assert p.lower is not None
            assert p.upper is not None
            hits += p.lower <= actual <= p.upper
            total += 1
        feed(f, [actual], start=T0 + i * BUCKET_SECONDS)
    assert 0.7 <= hits / total <= 0.9


def test_the_interval_widens_when_the_load_stops_behaving_like_its_past() -> None:
    rng = random.Random(9)
    f = LoadForecast(Smoothing(seasonal=False))
    feed(f, [200 + rng.gauss(0, 3) for _ in range(120)])
    calm = f.at(3).half_width
    feed(f, [200 + rng.choice((0, 300)) for _ in range(5)], start=T0 + 120 * BUCKET_SECONDS)
    stormy = f.at(3).half_width
    assert calm is not None
    assert stormy is not None
    assert stormy > 3 * calm


def daily(i: int) -> float:
    """A day in minutes: 100 at night, a ramp to 600 from 07:00 to 08:00, back down at 18:00."""
    h = (i % DAY_BUCKETS) / 60
    if h < 7:
        return 100.0
    if h < 8:
        return 100 + 500 * (h - 7)
    if h < 18:
        return 600.0
    if h < 19:
        return 600 - 500 * (h - 18)
    return 100.0


def test_the_season_sees_the_morning_ramp_coming() -> None:
    """On day three, at 06:58, the seasonal forecast expects the ramp; the damped trend cannot."""
    seasonal, plain = LoadForecast(Smoothing()), LoadForecast(Smoothing(seasonal=False))
    upto = 2 * DAY_BUCKETS + 7 * 60 - 2
    values = [daily(i) for i in range(upto)]
    feed(seasonal, values, per_bucket=1)
    feed(plain, values, per_bucket=1)
    assert seasonal.seasonal
    assert not plain.seasonal
    ahead = 10  # 07:08
    assert seasonal.at(ahead).value == pytest.approx(daily(upto - 1 + ahead), abs=15)
    assert plain.at(ahead).value == pytest.approx(100, abs=5)


def test_the_season_follows_a_day_that_runs_higher_than_yesterday() -> None:
    f = LoadForecast(Smoothing())
    values = [daily(i) * (1.0 if i < DAY_BUCKETS else 1.2) for i in range(DAY_BUCKETS + 12 * 60)]
    feed(f, values, per_bucket=1)
    # Noon on day two: yesterday's flat 600 plus today's 20%.
    assert f.at(5).value == pytest.approx(720, abs=10)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(0, 2000, allow_nan=False), min_size=1, max_size=200),
    steps=st.integers(1, MAX_STEPS + 5),
)
def test_forecasts_are_finite_and_as_long_as_asked(values: list[float], steps: int) -> None:
    f = LoadForecast()
    feed(f, values, per_bucket=2)
    path = f.path(steps)
    assert len(path) == min(steps, MAX_STEPS)
    assert all(math.isfinite(v) for v in path)
    point = f.at(steps)
    assert point.value == path[-1]
    assert point.half_width is None or (math.isfinite(point.half_width) and point.half_width >= 0)

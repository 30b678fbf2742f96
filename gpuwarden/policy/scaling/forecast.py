"""Forecasting a workload's load a few minutes ahead, with a prediction interval. Pure and small.

The series is the workload's load (the summed GPU utilization of its pods, see
:mod:`gpuwarden.policy.scaling.predictive`) in **buckets** of :data:`BUCKET_SECONDS`: each
bucket is the mean of the samples that fell in it. A forecast looks ``k`` buckets
past the last complete one.

The model was chosen by measurement (``bench/forecast_scaling.py``, ``docs/benchmarks.md``):

- **Damped trend** (Holt's linear method with a damped trend, ETS(A,Ad,N) in
  innovations form): level ``l``, trend ``b``; for each bucket value ``y`` the
  one-step error ``e = y - (l + phi*b)`` moves ``l <- l + phi*b + alpha*e`` and
  ``b <- phi*b + beta*e``. The ``k``-step forecast is ``l + (phi + ... + phi^k) b``.
  Damping keeps a noisy slope from being extrapolated for long.
- **Daily season**, once a day of buckets (plus the horizon) is kept: the forecast
  is the current level plus *the change the previous day saw over the same stretch
  of the clock* (its buckets averaged over :data:`SEASON_SMOOTHING` on either side,
  so that one noisy minute yesterday is not copied), plus the damped trend of how
  today differs from yesterday: ``l + (Y(t+k-m) - Y(t-m)) + trend``, ``m`` a day in
  buckets. Without a day of history it is the damped trend alone.

The **prediction interval** is empirical and model-agnostic: every forecast path
made is kept until its buckets complete, and each step ``k`` keeps an exponentially
weighted mean of its squared errors (:class:`ErrorTracker`). The interval at
``k`` is the forecast +- :data:`Z_80` of their root: an 80% interval where errors
are roughly normal. A step with fewer than :data:`MIN_ERRORS` errors seen has no
interval (the forecast is not trusted yet), and a load that starts behaving unlike
its past widens the interval at once, since its errors grow.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass

from gpuwarden.policy.spec.model import BUCKET_SECONDS, MAX_STEPS

DAY_BUCKETS = 1440
"""A day in buckets: the season's period."""

SEASON_SMOOTHING = 5
"""Buckets either side of yesterday's point that are averaged into it."""

Z_80 = 1.2816
"""The standard normal's 90th percentile: +- this many RMSEs is an 80% interval."""

MIN_ERRORS = 10
"""A step's interval needs this many errors seen before it is given (before, the forecast is unsure)."""

ERROR_WEIGHT = 1 / 30
"""Weight of each new squared error in its step's mean: about the last half hour counts."""

MAX_GAP_BUCKETS = 30
"""A silence longer than this (half an hour) restarts the forecast: the past no longer says much."""


@dataclass(frozen=True, slots=True)
class Smoothing:
    """The damped trend's parameters (see the module doc); the defaults are what the benchmark chose."""

    alpha: float = 0.5
    """Level: how much of each error the level takes."""
    beta: float = 0.3
    """Trend: how much of each error the slope takes."""
    phi: float = 0.98
    """Damping: each step ahead keeps this share of the previous step's slope (1: Holt's linear trend)."""
    seasonal: bool = True
    """Use the daily season once a day of history is kept."""


@dataclass(frozen=True, slots=True)
class ForecastPoint:
    """The forecast for one step ahead, with its 80% interval when one is known."""

    steps: int
    value: float
    half_width: float | None
    """Half the interval's width; None while the step has seen too few errors to say."""

    @property
    def lower(self) -> float | None:
        """The interval's lower end."""
        return None if self.half_width is None else self.value - self.half_width

    @property
    def upper(self) -> float | None:
        """The interval's upper end."""
        return None if self.half_width is None else self.value + self.half_width


class DampedTrend:
    """Holt's damped trend over a series of bucket values (see the module doc)."""

    __slots__ = ("level", "n", "params", "trend")

    def __init__(self, params: Smoothing) -> None:
        self.params = params
        self.level = 0.0
        self.trend = 0.0
        self.n = 0

    def update(self, value: float) -> None:
        """Take the next bucket's value."""
        p = self.params
        if self.n == 0:
            self.level = value
        else:
            error = value - (self.level + p.phi * self.trend)
            self.level += p.phi * self.trend + p.alpha * error
            self.trend = p.phi * self.trend + p.beta * error
        self.n += 1

    def path(self, steps: int) -> list[float]:
        """Forecasts 1..``steps`` buckets ahead."""
        out = []
        damped = 0.0
        factor = 1.0
        for _ in range(steps):
            factor *= self.params.phi
            damped += factor
            out.append(self.level + damped * self.trend)
        return out


class ErrorTracker:
    """Per step ahead, the weighted mean of squared forecast errors (the interval's width)."""

    __slots__ = ("_count", "_mse", "_paths")

    def __init__(self) -> None:
        self._paths: deque[array[float]] = deque(maxlen=MAX_STEPS)
        """Recent forecast paths, newest last: the one made ``k`` buckets ago predicted this bucket at k."""
        self._mse = [0.0] * MAX_STEPS
        self._count = [0] * MAX_STEPS

    def observe(self, value: float) -> None:
        """A bucket completed with ``value``: score every kept path's forecast for it."""
        for age, path in enumerate(reversed(self._paths)):
            if age < len(path):
                error = value - path[age]
                n = self._count[age] = self._count[age] + 1
                # A plain mean until the weights would say otherwise: early errors count fully.
                weight = max(ERROR_WEIGHT, 1 / n)
                self._mse[age] += weight * (error * error - self._mse[age])

    def made(self, path: list[float]) -> None:
        """The forecast made after the latest bucket (it predicts the next buckets)."""
        self._paths.append(array("d", path))  # 8 bytes a step, not a float object's 32

    def half_width(self, steps: int) -> float | None:
        """The 80% interval's half width ``steps`` ahead; None with too few errors seen."""
        i = min(steps, MAX_STEPS) - 1
        if self._count[i] < MIN_ERRORS:
            return None
        return Z_80 * math.sqrt(self._mse[i])


class LoadForecast:
    """A load series in buckets, its model, and its errors; fed samples, asked for forecasts.

    ``add`` takes samples in time order (epoch seconds); a bucket is complete once a
    sample of a later bucket arrives. Buckets no sample fell in are filled with the
    model's own forecast (no error is scored for them); a silence over
    :data:`MAX_GAP_BUCKETS` starts afresh.
    """

    def __init__(self, params: Smoothing | None = None) -> None:
        self.params = params or Smoothing()
        self._reset()

    def _reset(self) -> None:
        self.model = DampedTrend(self.params)
        self.deviation = DampedTrend(self.params)
        """Seasonal only: today's value less the season's, smoothed (its trend is today's drift)."""
        self.errors = ErrorTracker()
        self._history: array[float] = array("d")
        """Bucket values, oldest first; the last day and a bit, for the season."""
        self._bucket: int | None = None
        self._sum = 0.0
        self._count = 0

    @property
    def buckets(self) -> int:
        """Complete buckets seen since the forecast (re)started."""
        return self.model.n

    def add(self, t: float, value: float) -> None:
        """One sample of the load at ``t``."""
        if not math.isfinite(value):
            return
        bucket = math.floor(t / BUCKET_SECONDS)
        if self._bucket is None:
            self._bucket = bucket
        elif bucket < self._bucket:
            return  # out of order: the bucket it belongs to is closed
        elif bucket > self._bucket:
            self._close()
            missing = bucket - self._bucket - 1
            if missing > MAX_GAP_BUCKETS:
                self._reset()
            else:
                for _ in range(missing):
                    self._push(self.path(1)[0], scored=False)
            self._bucket = bucket
        self._sum += value
        self._count += 1

    def _close(self) -> None:
        if self._count:
            self._push(self._sum / self._count, scored=True)
        self._sum, self._count = 0.0, 0

    def _push(self, value: float, *, scored: bool) -> None:
        if scored:
            self.errors.observe(value)
        self.model.update(value)
        history = self._history
        history.append(value)
        season = self._season_base()
        if season is not None:
            self.deviation.update(value - season)
        keep = DAY_BUCKETS + MAX_STEPS + SEASON_SMOOTHING + 1
        if len(history) > keep + 256:
            del history[: len(history) - keep]  # in batches: one memmove per 256 buckets
        self.errors.made(self.path(MAX_STEPS))

    def _yesterday(self, ahead: int) -> float | None:
        """The previous day's smoothed value ``ahead`` buckets after the current bucket's time."""
        history = self._history
        centre = len(history) - 1 - DAY_BUCKETS + ahead
        lo, hi = centre - SEASON_SMOOTHING, centre + SEASON_SMOOTHING
        if lo < 0 or hi >= len(history):
            return None
        return sum(history[lo : hi + 1]) / (hi - lo + 1)

    def _season_base(self) -> float | None:
        return self._yesterday(0) if self.params.seasonal else None

    @property
    def seasonal(self) -> bool:
        """Whether the daily season is in use (a day of history is kept, and the model uses it)."""
        return self._season_base() is not None and self.deviation.n > 0

    def path(self, steps: int) -> list[float]:
        """Point forecasts 1..``steps`` buckets past the last complete one."""
        steps = max(1, min(steps, MAX_STEPS))
        if self.model.n == 0:
            return [0.0] * steps
        base = self._season_base()
        if base is None or self.deviation.n == 0 or self._yesterday(steps) is None:
            return self.model.path(steps)
        drift = self.deviation.path(steps)
        level = self.model.level
        out = []
        for k in range(1, steps + 1):
            then = self._yesterday(k)
            assert then is not None
            # Today's level, yesterday's change over the same stretch, and today's own drift from yesterday.
            out.append(level + (then - base) + (drift[k - 1] - self.deviation.level))
        return out

    def at(self, steps: int) -> ForecastPoint:
        """The forecast ``steps`` buckets past the last complete one, with its interval."""
        steps = max(1, min(steps, MAX_STEPS))
        return ForecastPoint(steps, self.path(steps)[-1], self.errors.half_width(steps))

    def last_bucket_end(self) -> float | None:
        """When the last complete bucket ended (epoch seconds); None before one completed."""
        if self._bucket is None or self.model.n == 0:
            return None
        return self._bucket * BUCKET_SECONDS

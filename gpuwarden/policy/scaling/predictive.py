"""Forecast-driven scaling: a scaled workload's load, forecast a start-up time ahead, as a scale signal.

Pure: load samples, replica counts and ``now`` come in; a :class:`ForecastVerdict` goes out,
which :class:`~gpuwarden.policy.scaling.decider.ScaleDecider` combines with the reactive rules.

- **Load.** At each evaluation, the sum over the selected pods of each pod's mean
  utilization over the last evaluation interval, on the ceiling rule's signal
  (:func:`workload_load`): the workload's load in "replica percent", which does not
  change when the same load is split over more replicas. Per replica it is that
  sum over the target's replicas (those still starting included: by the horizon
  they serve). With ``load: requests``, the sum of the pods' rates of requests served
  (:func:`request_load`, from their own metrics), its ceiling ``requestsPerReplica``:
  the load in the unit a replica's capacity is measured in, whatever the GPUs make of it
  (a server that is GPU-bound at 40% utilization still reads its limit). Requests served,
  not sent: like utilization, it stops rising once every replica is full, which the
  reactive rules (the queue, the latency) then answer.
- **Horizon.** ``forecast.horizon``, or else the workload's observed **start-up
  time**: after a scale-up to ``n`` replicas, the time until ``n`` pods carry load
  (a mean above :data:`SERVING_PERCENT`), the median of the last
  :data:`STARTUP_SAMPLES` such times; :data:`DEFAULT_HORIZON_SECONDS` until one is seen.
- **Verdict** (:meth:`Predictor.verdict`), on the forecast at the horizon
  (:mod:`gpuwarden.policy.scaling.forecast`):

  - too little history, or an 80% interval per replica wider than ``maxUncertainty``:
    *no say*; the reactive rules decide alone;
  - per-replica forecast above the ceiling: **up**, even before any pod is saturated;
  - a floor rule, and the interval's upper end above the floor at some step up to the
    horizon: a reactive scale-down is **held back** (the load is coming back);
  - otherwise *clear*: the reactive rules decide.

  A reactive scale-up is never held back: a forecast can miss a burst, a saturated pod
  cannot be argued with.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuwarden.policy.humanize import format_count
from gpuwarden.policy.rules.activity import pod_activity
from gpuwarden.policy.rules.common import Services, WindowParams, percent, pod_end
from gpuwarden.policy.scaling.forecast import MIN_ERRORS, LoadForecast, Smoothing
from gpuwarden.policy.spec.model import BUCKET_SECONDS, MAX_STEPS, ForecastLoad, ScaleForecast
from gpuwarden.policy.store.series import SeriesKey, Window
from gpuwarden.units import format_duration

SERVING_PERCENT = 5.0
"""A pod whose mean utilization over the last interval is above this carries load (it has started)."""

DEFAULT_HORIZON_SECONDS = 180.0
"""The horizon before any start-up was observed: a model server's typical few minutes."""

STARTUP_SAMPLES = 5
"""Observed start-up times kept; the horizon is their median."""

MAX_STARTUP_SECONDS = MAX_STEPS * BUCKET_SECONDS
"""A scale-up whose pods do not all carry load within this long is not timed (the load fell, a pod failed)."""


@dataclass(frozen=True, slots=True)
class WorkloadLoad:
    """One evaluation's load sample of a scaled workload (see the module doc)."""

    total: float
    """The sum of the pods' mean utilization over the last interval, percent (100 = one busy replica);
    requests load: of the requests they served, per second."""
    serving: int
    """Pods with a mean above :data:`SERVING_PERCENT`."""
    pods: int
    """Pods with readings in the interval."""


def workload_load(
    pods: Iterable[Sequence[tuple[SeriesKey, Window]]],
    forecast: ScaleForecast,
    now: float,
    interval_seconds: float,
    params: WindowParams,
) -> WorkloadLoad | None:
    """The load of the selected pods (each given as its series) over the last interval; None without data.

    A pod is read as of its newest sample, as the rules read it; a stale pod adds nothing.
    """
    total, serving, counted = 0.0, 0, 0
    for series in pods:
        end = pod_end(series, now, params)
        if end is None:
            continue
        gpus = pod_activity(series, forecast.signal, end - interval_seconds, end)
        means = [g.mean for g in gpus if g.mean is not None]
        if not means:
            continue
        mean = sum(means) / len(means)
        total += mean
        counted += 1
        serving += mean > SERVING_PERCENT
    return WorkloadLoad(total, serving, counted) if counted else None


def request_load(
    services: Services,
    forecast: ScaleForecast,
    now: float,
    interval_seconds: float,
    params: WindowParams,
) -> WorkloadLoad | None:
    """The requests the selected pods served per second over the last :func:`request_window`, summed
    (``forecast.request_metrics``: the first a pod exports); None without data. A pod that served any
    carries load (it has started)."""
    window = request_window(interval_seconds)
    total, serving, counted = 0.0, 0, 0
    for pod in services.pods:
        found = services.store.increase(
            pod, forecast.request_metrics, window, now, params.stale_after_seconds
        )
        if found is None:
            continue
        total += found.rate
        counted += 1
        serving += found.rate > 0
    return WorkloadLoad(total, serving, counted) if counted else None


def request_window(interval_seconds: float) -> float:
    """The window a pod's request rate is read over: two evaluations, and at least a forecast bucket,
    so that it spans two scrapes whatever their jitter."""
    return max(2 * interval_seconds, BUCKET_SECONDS)


class View(enum.StrEnum):
    """What the forecast says about scaling."""

    NO_HISTORY = "NoHistory"
    UNSURE = "Unsure"
    UP = "Up"
    HOLD_DOWN = "HoldDown"
    CLEAR = "Clear"


@dataclass(frozen=True, slots=True)
class ForecastVerdict:
    """The forecast's say at one evaluation, and its figures for messages."""

    view: View
    horizon_seconds: float
    per_replica: float | None = None
    """The point forecast at the horizon, per replica (percent)."""
    half_width: float | None = None
    """Half the 80% interval at the horizon, per replica (percentage points)."""
    peak_upper: float | None = None
    """HOLD_DOWN: the highest upper end up to the horizon, per replica."""

    @property
    def has_say(self) -> bool:
        """Whether the forecast takes part in the decision (else the reactive rules decide alone)."""
        return self.view in (View.UP, View.HOLD_DOWN, View.CLEAR)

    def summary(self, forecast: ScaleForecast) -> str:
        """What it says, without figures that change at every evaluation (for the status)."""
        ahead = format_duration(self.horizon_seconds)
        if self.view is View.UP:
            if forecast.load is ForecastLoad.REQUESTS:
                rate = format_count(forecast.ceiling_percent)
                return f"forecast above requestsPerReplica ({rate}/s) in {ahead}"
            ceiling = percent(forecast.ceiling_percent)
            return f"forecast above {forecast.ceiling_rule}'s ceiling ({ceiling}) in {ahead}"
        if self.view is View.HOLD_DOWN:
            floor = percent(forecast.floor_percent or 0.0)
            return f"the forecast rises above {forecast.floor_rule}'s floor ({floor}) within {ahead}"
        if self.view is View.UNSURE:
            return "forecast unsure: the rules decide"
        if self.view is View.NO_HISTORY:
            return "forecast has too little history: the rules decide"
        return f"forecast within bounds for {ahead}"

    def detail(self, load: ForecastLoad = ForecastLoad.UTILIZATION) -> str:
        """The figures, for Events: ``103% per replica (80% interval 97-109%)``; requests load:
        ``4.2 requests/s per replica (80% interval 3.9-4.5)``."""
        if self.per_replica is None:
            return ""
        show = percent if load is ForecastLoad.UTILIZATION else format_count
        unit = "" if load is ForecastLoad.UTILIZATION else " requests/s"
        text = f"{show(max(0.0, self.per_replica))}{unit} per replica"
        if self.half_width is not None:
            lo = max(0.0, self.per_replica - self.half_width)
            text += f" (80% interval {show(lo)}-{show(max(0.0, self.per_replica + self.half_width))})"
        if self.view is View.HOLD_DOWN and self.peak_upper is not None:
            text += f", up to {show(self.peak_upper)}"
        return text


class StartupClock:
    """Times scale-ups until their pods carry load: the workload's start-up time."""

    __slots__ = ("_pending", "samples")

    def __init__(self) -> None:
        self._pending: tuple[float, int] | None = None
        self.samples: deque[float] = deque(maxlen=STARTUP_SAMPLES)

    def scaled(self, now: float, before: int, after: int) -> None:
        """The target went from ``before`` to ``after`` replicas at ``now``: time a scale-up."""
        # A newer change makes the pending one unmeasurable: its pods and the new ones mix.
        self._pending = (now, after) if after > before else None

    def observe(self, now: float, serving: int) -> None:
        """``serving`` pods carry load at ``now``."""
        if self._pending is None:
            return
        since, replicas = self._pending
        if now - since > MAX_STARTUP_SECONDS:
            self._pending = None
        elif serving >= replicas:
            self.samples.append(now - since)
            self._pending = None

    def observed(self) -> float | None:
        """The median of the recent start-up times; None before one was seen."""
        return statistics.median(self.samples) if self.samples else None


class Predictor:
    """One scaled workload's load forecast and start-up clock; asked for a verdict at each evaluation."""

    def __init__(self, smoothing: Smoothing | None = None) -> None:
        self.load = LoadForecast(smoothing)
        self.startup = StartupClock()

    def horizon_seconds(self, forecast: ScaleForecast) -> float:
        """The configured horizon, else the observed start-up time, else the default."""
        if forecast.horizon_seconds is not None:
            return forecast.horizon_seconds
        observed = self.startup.observed()
        return observed if observed is not None else DEFAULT_HORIZON_SECONDS

    def observe(self, sample: WorkloadLoad | None, now: float) -> None:
        """Take one evaluation's load sample (None: no pod had data)."""
        if sample is None:
            return
        self.load.add(now, sample.total)
        self.startup.observe(now, sample.serving)

    def verdict(self, forecast: ScaleForecast, replicas: int, now: float) -> ForecastVerdict:
        """What the forecast says for a target at ``replicas``, a horizon ahead of ``now``."""
        horizon = self.horizon_seconds(forecast)
        last = self.load.last_bucket_end()
        if replicas <= 0 or last is None or self.load.buckets < MIN_ERRORS:
            return ForecastVerdict(View.NO_HISTORY, horizon)
        steps = max(1, math.ceil((now - last + horizon) / BUCKET_SECONDS))
        path = self.load.path(steps)
        half_width = self.load.errors.half_width(steps)
        per_replica = path[-1] / replicas
        if half_width is None:
            return ForecastVerdict(View.NO_HISTORY, horizon, per_replica)
        half = half_width / replicas
        if 2 * half > forecast.widest:
            return ForecastVerdict(View.UNSURE, horizon, per_replica, half)
        if per_replica > forecast.ceiling_percent:
            return ForecastVerdict(View.UP, horizon, per_replica, half)
        if forecast.floor_percent is not None:
            peak = max(
                (value + (self.load.errors.half_width(k) or half_width)) / replicas
                for k, value in enumerate(path, start=1)
            )
            if peak >= forecast.floor_percent:
                return ForecastVerdict(View.HOLD_DOWN, horizon, per_replica, half, peak)
        return ForecastVerdict(View.CLEAR, horizon, per_replica, half)

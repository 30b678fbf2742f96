"""memoryGrowth: GPU memory growing in a straight line (a leak), and the time until the card is full.

Semantics (the window, coverage and as-of time are in :mod:`gpuwarden.policy.rules`):

- **The window** is bucket-aligned: time is cut into buckets of
  ``window / 20`` (90 s for a 30m window), aligned to multiples of that length
  since the epoch plus a fixed per-GPU phase, and the rule reads the GPU's 20
  latest *complete* buckets before the pod's as-of time. A verdict therefore
  depends only on the samples, never on when evaluations run; it changes once
  per bucket, and costs a refit only then (the evaluator memoizes trends; see
  :class:`GrowthCache`). A leak is seen at most one bucket later than with a
  window ending at the newest sample.
- **Per GPU**, each bucket is reduced to the median of its memory readings (of
  at most :data:`MAX_POINTS` evenly strided readings per window): transient
  allocations do not count, and the cost is bounded whatever the sampling
  rate. Through those points:

  - ``slope``: the Theil-Sen slope, bytes per second;
  - ``fit``: R² of that line, 0..1 (see :func:`gpuwarden.policy.slope.r_squared`):
    near 1 for a steady ramp even when noisy, low for a sawtooth
    (allocate/free) or a staircase that stopped climbing;
  - ``recent slope``: the Theil-Sen slope of the last 7 buckets (a third), so
    that growth that has stopped (a caching allocator warming up, then
    plateauing) does not count however straight it was before;
  - ``seconds to full``: ``(total - used now) / slope``, with ``used now`` the
    newest reading (as of the pod's newest sample) and ``total`` the card's memory.

- **Holds** for a GPU when it covers the window (as every rule does, see
  :func:`gpuwarden.policy.rules.covered`: a series younger than the window,
  less one sampling interval, does not), ``slope >= rate``,
  ``fit >= minFit`` and ``recent slope >= rate / 2``; for the pod when some GPU
  holds. With ``for``, it must hold at every evaluation for that long before a
  finding starts (the window already demands a long steady trend; ``for``
  guards against an evaluation that catches a lucky line).
- **Clears** when every GPU's ``slope < 0.8 x rate``, or its ``fit < minFit - 0.1``,
  or its ``recent slope < rate / 4``: the trend broke, not just wobbled.
- The pod's value is the largest slope among its GPUs that hold (else among
  all); ``fit`` and ``seconds to full`` are that GPU's.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwarden.policy.humanize import approx_duration, format_bytes
from gpuwarden.policy.model import MemoryGrowth
from gpuwarden.policy.rules import Outcome, RuleKind, WindowParams, covered, pod_end, readings, unknown
from gpuwarden.policy.series import Column, PodId, SeriesKey, Window
from gpuwarden.policy.slope import bucket_medians, fit_line, theil_sen

BUCKETS = 20
"""Bucket medians per window: 190 pairwise slopes, whatever the sampling rate."""
MIN_BUCKETS = 6
"""Fewer non-empty buckets than this: too little to judge (nothing holds or clears)."""
MAX_POINTS = 240
"""Readings per window the bucket medians look at (evenly strided): 12 per bucket."""
RECENT_BUCKETS = 7
"""The last third of the window (7 of 20 buckets) is its recent part."""
HOLD_RECENT = 0.5
"""The recent slope must be at least this share of ``rate`` for the rule to hold."""
CLEAR_RATE = 0.8
CLEAR_FIT = 0.1
CLEAR_RECENT = 0.25
UNIT = "bytes/s"


@dataclass(slots=True)
class GpuGrowth:
    """One GPU's memory trend over a window."""

    gpu: str
    slope: float
    """Bytes per second."""
    fit: float
    recent_slope: float
    used_bytes: float
    """The newest reading (in the outcome: as of the pod's newest sample, not the window's end)."""
    total_bytes: float | None
    covered: bool

    @property
    def seconds_to_full(self) -> float | None:
        """Seconds until the card is full at ``slope``; None when not growing or the total is unknown."""
        if self.total_bytes is None or self.slope <= 0:
            return None
        return max(0.0, (self.total_bytes - self.used_bytes) / self.slope)


def growth_window(window_seconds: float, end: float, gpu: str = "") -> tuple[float, float]:
    """The bucket-aligned window of a GPU's series judged as of ``end``: its latest complete buckets.

    Buckets are ``window_seconds / BUCKETS`` long, aligned to multiples of that
    length since the epoch plus a per-GPU phase (see :func:`bucket_phase`), so
    a verdict depends only on the samples, never on when evaluations happen,
    and changes once per bucket.
    """
    width = window_seconds / BUCKETS
    phase = bucket_phase(gpu) * width
    boundary = math.floor((end - phase) / width) * width + phase
    return boundary - window_seconds, boundary


def bucket_phase(gpu: str) -> float:
    """A GPU's fixed offset into a bucket, 0..1 of its length (0 for ``""``).

    Spreads refits over time: with one alignment for all, every series would
    complete a bucket at the same instant, and one evaluation in nine (at 10 s
    intervals, 90 s buckets) would refit them all. CRC-32 is stable across
    processes, unlike ``hash()``, so replays see the same buckets.
    """
    return zlib.crc32(gpu.encode()) / 2**32 if gpu else 0.0


def gpu_growth(
    gpu: str, window: Window, start: float, end: float, max_gap: float | None = None
) -> GpuGrowth | None:
    """One GPU's memory trend over ``[start, end]``, or None when there are too few readings to judge.

    ``used_bytes`` is the last reading in the window; see :func:`evaluate_growth` for the newest.
    """
    r = readings(window, Column.MEM_USED, start, end)
    times, used = r.times, r.values
    if not used:
        return None
    # Bound the cost whatever the sampling rate: every step-th reading, a dozen per bucket.
    step = -(-len(used) // MAX_POINTS)
    xs, ys = bucket_medians(times[::step], used[::step], start, end, BUCKETS)
    if len(xs) < MIN_BUCKETS:
        return None
    line = fit_line(xs, ys)
    # Centers are seconds before `end`, ascending: the recent ones are a suffix.
    recent_from = -RECENT_BUCKETS * (end - start) / BUCKETS
    k = sum(1 for x in xs if x > recent_from)
    recent = theil_sen(xs[-k:], ys[-k:])[0] if k >= 3 else 0.0
    return GpuGrowth(
        gpu,
        slope=line.slope,
        fit=line.fit,
        recent_slope=recent,
        used_bytes=used[-1],
        total_bytes=window.mem_total,
        covered=covered(r, start, end, max_gap),
    )


class GrowthCache:
    """Memo of per-GPU trends by (series, window, the window's points).

    A bucket-aligned window only changes when a bucket completes (every 90 s for
    a 30m window), so most evaluations reuse the last trend instead of refitting.
    Entries not used during one :meth:`sweep` period are dropped, so the memo
    never outlives its series by more than one evaluation.
    """

    def __init__(self) -> None:
        self._current: dict[tuple[SeriesKey, float, float], tuple[tuple[int, float, float], GpuGrowth | None]]
        self._current = {}
        self._previous: dict[
            tuple[SeriesKey, float, float], tuple[tuple[int, float, float], GpuGrowth | None]
        ]
        self._previous = {}
        self.hits = 0
        self.misses = 0

    def trend(
        self, key: SeriesKey, window: Window, start: float, end: float, max_gap: float | None
    ) -> GpuGrowth | None:
        """The GPU's trend over ``[start, end]``, computed once per distinct set of points."""
        i0, i1 = window.span(start, end)
        if i0 == i1:
            return None
        times = window.times(i0, i0 + 1)
        signature = (i1 - i0, times[0], window.times(i1 - 1, i1)[0])
        slot = (key, start, end)
        entry = self._current.get(slot) or self._previous.get(slot)
        if entry is not None and entry[0] == signature:
            self.hits += 1
            self._current[slot] = entry
            return entry[1]
        self.misses += 1
        trend = gpu_growth(key.gpu, window, start, end, max_gap)
        self._current[slot] = (signature, trend)
        return trend

    def sweep(self) -> None:
        """End a period: forget what was not used since the previous sweep."""
        self._previous = self._current
        self._current = {}

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())


def _newest_used(window: Window, end: float) -> float | None:
    i1 = window.span(-math.inf, end)[1]
    if not i1:
        return None
    value = window.values(Column.MEM_USED, i1 - 1, i1)[0]
    return value if value == value else None


def _holds(g: GpuGrowth, rule: MemoryGrowth) -> bool:
    rate = rule.rate_bytes_per_second
    return g.covered and g.slope >= rate and g.fit >= rule.min_fit and g.recent_slope >= HOLD_RECENT * rate


def _clears(g: GpuGrowth, rule: MemoryGrowth) -> bool:
    rate = rule.rate_bytes_per_second
    return (
        g.slope < CLEAR_RATE * rate
        or g.fit < rule.min_fit - CLEAR_FIT
        or g.recent_slope < CLEAR_RECENT * rate
    )


def describe(slope: float, fit: float, total_bytes: float | None, seconds_to_full: float | None) -> str:
    """``GPU memory grows 212Mi/m, fit 0.97; the card (80Gi) is full in 14m``."""
    per_minute = slope * 60
    if per_minute >= 2**10:
        text = f"GPU memory grows {format_bytes(per_minute)}/m, fit {fit:.2f}"
    elif per_minute <= -(2**10):
        text = f"GPU memory shrinks {format_bytes(-per_minute)}/m, fit {fit:.2f}"
    else:
        return f"GPU memory is flat (fit {fit:.2f})"
    if seconds_to_full is not None and total_bytes is not None:
        if seconds_to_full <= 0:
            text += f"; the card is full ({format_bytes(total_bytes)})"
        else:
            text += f"; the card ({format_bytes(total_bytes)}) is full in {approx_duration(seconds_to_full)}"
    return text


def growth_message(o: Outcome) -> str:
    """:func:`describe` of the worst GPU, and ``(on 1 of 2 GPUs)`` for a pod of several."""
    text = describe(o.value or 0.0, o.fit or 0.0, o.total_bytes, o.seconds_to_full)
    if o.gpu_count > 1 and o.gpus:
        text += f" (on {len(o.gpus)} of {o.gpu_count} GPUs)"
    return text


def evaluate_growth(
    rule: MemoryGrowth,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
    cache: GrowthCache | None = None,
) -> Outcome:
    """Judge a memoryGrowth rule for one pod (see the module doc); the finding tracker applies ``for``.

    Pass the evaluator's :class:`GrowthCache` to reuse trends between evaluations.
    """
    kind = RuleKind.MEMORY_GROWTH
    rate = rule.rate_bytes_per_second
    end = pod_end(series, now, params)
    if end is None:
        return unknown(rule.name, kind, pod, rate, UNIT)
    trends: list[GpuGrowth] = []
    for key, window in series:
        start, boundary = growth_window(rule.window_seconds, end, key.gpu)
        if cache is not None:
            trend = cache.trend(key, window, start, boundary, params.max_gap_seconds)
        else:
            trend = gpu_growth(key.gpu, window, start, boundary, params.max_gap_seconds)
        if trend is not None:
            newest = _newest_used(window, end)
            # A copy (the memoized trend stays as computed), built directly: replace() is 5x slower.
            trends.append(
                GpuGrowth(
                    trend.gpu,
                    trend.slope,
                    trend.fit,
                    trend.recent_slope,
                    trend.used_bytes if newest is None else newest,
                    window.mem_total,
                    trend.covered,
                )
            )
    if not trends:
        return unknown(rule.name, kind, pod, rate, UNIT)
    holding = [g for g in trends if _holds(g, rule)]
    named = holding or [g for g in trends if not _clears(g, rule)]
    worst = max(holding or trends, key=lambda g: g.slope)

    return Outcome(
        rule.name,
        kind,
        pod,
        worst.slope,
        rate,
        UNIT,
        holds=bool(holding),
        clears=not holding and all(_clears(g, rule) for g in trends),
        gpus=tuple(g.gpu for g in named),
        gpu_count=len(trends),
        window_seconds=rule.window_seconds,
        total_bytes=worst.total_bytes,
        fit=worst.fit,
        seconds_to_full=worst.seconds_to_full,
        describe=growth_message,
    )

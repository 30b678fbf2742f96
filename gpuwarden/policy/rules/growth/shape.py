"""One GPU's memory trend over one span: the bucket medians, the Theil-Sen line, its quarters, its
jumps and the memory before it (:class:`GpuGrowth`, :func:`gpu_growth`)."""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import sub

from gpuwarden.policy.rules.common import covered, readings
from gpuwarden.policy.rules.growth.model import (
    BUCKETS,
    CONFIDENCE_Z,
    MAX_POINTS,
    MIN_BUCKETS,
    MIN_PART_BUCKETS,
    NOISE_PAIRS,
    PARTS,
    SPLIT_SHARE,
    STEP_SIGMAS,
)
from gpuwarden.policy.stats import bucket_medians, fit_line, median, theil_sen
from gpuwarden.policy.store.series import Column, Window

_Shape = tuple[tuple[float, ...], tuple[float, ...], float, float]
"""A span's ``(parts, part margins, recent slope, jumps)``."""


@dataclass(slots=True)
class GpuGrowth:
    """One GPU's memory trend over one span.

    ``parts``, ``part_margins``, ``recent_slope`` and ``jumps`` are worked out from
    ``levels`` when first read: most trends are judged on their slope alone (not growing), and
    never need them.
    """

    gpu: str
    slope: float
    """Bytes per second."""
    lower: float
    """The slope's lower confidence bound (see :data:`CONFIDENCE_Z`)."""
    fit: float
    levels: array[float]
    """The bucket medians, oldest first; NaN for an empty bucket."""
    used_bytes: float
    """The last reading in the span."""
    total_bytes: float | None
    covered: bool
    span_seconds: float
    noise: float = 0.0
    """A bucket median's standard deviation by noise alone, bytes (see :func:`median_noise`)."""
    _shape: _Shape | None = field(default=None, compare=False, repr=False)

    @property
    def parts(self) -> tuple[float, ...]:
        """Each quarter's Theil-Sen slope, oldest first; empty when some quarter has too few buckets."""
        return self._shaped()[0]

    @property
    def part_margins(self) -> tuple[float, ...]:
        """How far each quarter's slope may fall short by noise alone: :data:`CONFIDENCE_Z` errors."""
        return self._shaped()[1]

    @property
    def recent_slope(self) -> float:
        """The last quarter's slope (of the last quarter's buckets there are, when it has too few)."""
        return self._shaped()[2]

    @property
    def jumps(self) -> float:
        """Bytes of the rise made in jumps: bucket-to-bucket rises beyond what the others' spread explains."""
        return self._shaped()[3]

    @property
    def seconds_to_full(self) -> float | None:
        """Seconds until the card is full at ``slope`` from ``used_bytes`` (None: not growing, or unknown)."""
        if self.total_bytes is None or self.slope <= 0:
            return None
        return max(0.0, (self.total_bytes - self.used_bytes) / self.slope)

    def _shaped(self) -> _Shape:
        if self._shape is None:
            self._shape = _shape(self.levels, self.span_seconds, self.noise)
        return self._shape


def _shape(levels: Sequence[float], span: float, noise: float) -> _Shape:
    """``(parts, part margins, recent slope, jumps)`` of a span's bucket medians (see :class:`GpuGrowth`)."""
    width = span / BUCKETS
    per_part = BUCKETS // PARTS
    quarters: list[tuple[list[float], list[float]]] = []
    for q in range(PARTS):
        xs = [(k + 0.5) * width for k in range(q * per_part, (q + 1) * per_part) if levels[k] == levels[k]]
        ys = [y for y in levels[q * per_part : (q + 1) * per_part] if y == y]
        quarters.append((xs, ys))
    parts: tuple[float, ...] = ()
    margins: tuple[float, ...] = ()
    if all(len(xs) >= MIN_PART_BUCKETS for xs, _ in quarters):
        parts = tuple(theil_sen(xs, ys)[0] for xs, ys in quarters)
        # A straight line's slope error through the quarter's points, the medians' noise known.
        margins = tuple(CONFIDENCE_Z * noise / math.sqrt(_spread_of(xs)) for xs, _ in quarters)
    xs, ys = quarters[-1]
    recent = parts[-1] if parts else theil_sen(xs, ys)[0] if len(xs) >= 2 else 0.0
    present = [y for y in levels if y == y]
    rises = list(map(sub, present[1:], present[:-1]))
    typical = median(rises)
    spread = 1.4826 * median([abs(rise - typical) for rise in rises])
    if noise > 0:
        # The rises' own spread counts the steps in it: a cache's five steps among 19 rises, under
        # noise, widen it until no step stands 4 of it above the typical rise. The medians' noise,
        # from the readings (median_noise), does not see the steps; a rise's is sqrt(2) of it.
        spread = min(spread, math.sqrt(2) * noise)
    return parts, margins, recent, _jumps(rises, typical, STEP_SIGMAS * spread)


def _jumps(rises: Sequence[float], typical: float, beyond: float) -> float:
    """Bytes of ``rises`` made in jumps: excesses over ``typical`` beyond ``beyond``, alone or in a pair.

    Under noise a bucket's lower median is not always on one side of a step in it: the step then
    rises in two buckets, each short of ``beyond``. Two consecutive rises count together when each
    is at least :data:`SPLIT_SHARE` of ``beyond`` over ``typical`` (noise alone rarely makes two in a
    row: consecutive rises share a median, one's excess is the other's shortfall).
    """
    excesses = [rise - typical for rise in rises]
    total = 0.0
    i = 0
    while i < len(excesses):
        one = excesses[i]
        if one > beyond:
            total += one
            i += 1
            continue
        pair = one + excesses[i + 1] if i + 1 < len(excesses) else 0.0
        if pair > beyond and min(one, excesses[i + 1]) >= SPLIT_SHARE * beyond:
            total += pair
            i += 2
            continue
        i += 1
    return total


def _spread_of(xs: Sequence[float]) -> float:
    """The sum of squared deviations of ``xs`` from their mean."""
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs)


def median_noise(values: Sequence[float], buckets: int) -> float:
    """The standard deviation of a bucket median of ``values`` (consecutive readings) by noise alone.

    From the readings themselves, not the medians: the medians' scatter about a line is a
    staircase's or a leak onset's shape as much as noise. A second difference of consecutive
    readings, ``y[i+1] - 2 y[i] + y[i-1]``, is free of the trend, even where it changes (a leak's
    onset, sparse samples), and has sqrt(6) times the readings' noise; the interquartile range of
    :data:`NOISE_PAIRS` of them, evenly spread over the span, ignores the few that hold a step or
    a transient, at a fraction of the cost of all of them. A median of ``m`` readings has about
    1.25 / sqrt(m) of their noise.
    """
    stride = max(1, len(values) // NOISE_PAIRS)
    triples = zip(values[::stride], values[1::stride], values[2::stride], strict=False)
    curvatures = sorted([a - 2 * b + c for a, b, c in triples])
    if len(curvatures) < 4:
        return 0.0
    quarter = len(curvatures) // 4
    sigma = (curvatures[-1 - quarter] - curvatures[quarter]) / 1.349 / math.sqrt(6)
    return 1.2533 * sigma / math.sqrt(max(1.0, len(values) / buckets))


@dataclass(slots=True)
class SpanEnds:
    """A span's two ends: the medians of its first and last twentieth of readings."""

    first: float
    last: float
    slope: float
    """``(last - first)`` per second between the two groups' centers."""


def growth_window(window_seconds: float, end: float, gpu: str = "") -> tuple[float, float]:
    """The bucket-aligned span of a GPU's series judged as of ``end``: its latest complete buckets.

    Buckets are ``window_seconds / BUCKETS`` long (pass a span's length for a
    span), aligned to multiples of that length since the epoch plus a per-GPU
    phase (see :func:`bucket_phase`), so a verdict depends only on the
    samples, never on when evaluations happen, and changes once per bucket.
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


def span_ends(window: Window, start: float, end: float, column: Column = Column.MEM_USED) -> SpanEnds | None:
    """The span's :class:`SpanEnds`: what it costs before it is worth a fit (two small medians).

    Each end is the median of a twentieth of the span's readings (a dozen at
    most, strided like the fit's). None with fewer than two readings.
    """
    i0, i1 = window.span(start, end)
    count = i1 - i0
    if count < 2:
        return None
    step = -(-count // MAX_POINTS)
    k = max(1, count // BUCKETS)
    first = window.values(column, i0, i0 + k)[::step]
    last = window.values(column, i1 - k, i1)[::step]
    if window.has_missing(column, i0):
        first, last = array("f", [v for v in first if v == v]), array("f", [v for v in last if v == v])
    # Between the two groups' centers: the midpoints of their first and last readings.
    times = window.times(i0, i0 + k) + window.times(i1 - k, i1)
    span = (times[-k] + times[-1] - times[0] - times[k - 1]) / 2
    if not first or not last or span <= 0:
        return None
    low, high = median(first), median(last)
    return SpanEnds(low, high, (high - low) / span)


def gpu_growth(
    gpu: str,
    window: Window,
    start: float,
    end: float,
    max_gap: float | None = None,
    column: Column = Column.MEM_USED,
) -> GpuGrowth | None:
    """One GPU's memory trend over the span ``[start, end]``, or None when there are too few readings.

    ``used_bytes`` is the last reading in the span; see :func:`evaluate_growth` for the newest.
    ``column``: which memory (the hook's host memory fills its limit, not the card: :func:`capacity`).
    """
    r = readings(window, column, start, end)
    if not r.values:
        return None
    step = -(-len(r.values) // MAX_POINTS)
    values = r.values[::step]
    xs, ys = bucket_medians(r.times[::step], values, start, end, BUCKETS)
    if len(xs) < MIN_BUCKETS:
        return None
    span = end - start
    width = span / BUCKETS
    line = fit_line(xs, ys, CONFIDENCE_Z)
    levels = array("d", [math.nan]) * BUCKETS
    for x, y in zip(xs, ys, strict=True):
        # Centers are seconds before `end`: bucket k's is (k + 0.5) * width - span.
        levels[int((x + span) / width)] = y
    return GpuGrowth(
        gpu,
        slope=line.slope,
        lower=line.lower,
        fit=line.fit,
        levels=levels,
        used_bytes=r.values[-1],
        total_bytes=capacity(window, column),
        covered=covered(r, start, end, max_gap),
        span_seconds=span,
        noise=median_noise(values, len(xs)),
    )


def peak_before(
    window: Window,
    since: float,
    start: float,
    full: GpuGrowth | None,
    full_start: float,
    column: Column = Column.MEM_USED,
) -> float:
    """The highest bucket median over ``[since, start)``; -inf when there is none.

    Read off the window-long trend ``full`` (which begins at ``full_start``) when
    there is one: its buckets that lie wholly inside. Otherwise (a history too
    young for it) computed from the readings.
    """
    if full is not None:
        width = full.span_seconds / BUCKETS
        # Buckets that begin in [since, start), as multiples of the width from full_start (with float
        # slack). The one that straddles `start` counts: its median is at most half a window bucket
        # into the span, and a brief peak just before the span is seen.
        first = math.ceil((since - full_start) / width - 1e-9)
        last = math.ceil((start - full_start) / width - 1e-9)
        inside = [v for v in full.levels[max(0, first) : max(0, last)] if v == v]
        return max(inside, default=-math.inf)
    # Half-open: the reading exactly at `start` belongs to the span. Buckets over the readings
    # there are, not the whole lookback: a young history's peak may have lasted seconds.
    r = readings(window, column, since, math.nextafter(start, -math.inf))
    if not r.values:
        return -math.inf
    step = -(-len(r.values) // MAX_POINTS)
    return max(bucket_medians(r.times[::step], r.values[::step], r.times[0], start, BUCKETS)[1])


def capacity(window: Window, column: Column) -> float | None:
    """What ``column`` fills: the card's total for GPU memory; for host memory the hooked processes'
    memory limit (the newest known, :attr:`Window.host_limit`), None without one."""
    return window.host_limit if column is Column.HOST else window.mem_total

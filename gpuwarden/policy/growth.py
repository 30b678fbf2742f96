"""memoryGrowth: GPU memory growing in a straight line (a leak), and the time until the card is full.

Semantics (coverage and the as-of time are in :mod:`gpuwarden.policy.rules`; docs/policy.md has
the same account for users):

- **Evidence spans.** A leak is decided as soon as the evidence is enough, not
  when a whole ``window`` of it has been seen: each GPU is judged over a ladder
  of trailing spans (:func:`evidence_spans`), the shortest
  :data:`MIN_SPAN_SECONDS` (4m; the window when that is shorter), each next
  one twice as long while at most the window / :data:`SPAN_RATIO`, the last
  the window itself: 4m, 8m, 16m, 30m for a 30m window. The window is the
  longest history used. A span is judged only once the GPU covers it, so a
  young history is judged on its short spans first, and so is the history
  after a gap; the long spans give a slow or noisy leak the evidence a short
  one lacks.
- **Bucket-aligned spans.** Each span is cut into 20 buckets (12 s for 4m,
  90 s for 30m), aligned to multiples of that length since the epoch plus a
  fixed per-GPU phase; a span reads the GPU's 20 latest *complete* buckets
  before the pod's as-of time. A verdict therefore depends only on the
  samples, never on when evaluations run, and changes once per bucket (the
  evaluator memoizes trends; see :class:`GrowthCache`).
- **Per span**, each bucket is reduced to the median of its memory readings
  (of at most :data:`MAX_POINTS` evenly strided readings per span): transient
  allocations do not count, and the cost is bounded whatever the sampling
  rate. Through those points (:func:`gpu_growth`):

  - ``slope``: the Theil-Sen slope, bytes per second, and ``lower``, Sen's
    one-sided 99% lower confidence bound on it
    (:func:`gpuwarden.policy.slope.sen_lower_bound`);
  - ``fit``: R² of that line, 0..1 (see :func:`gpuwarden.policy.slope.r_squared`):
    near 1 for a steady ramp even when noisy, low for a sawtooth
    (allocate/free) or a staircase that stopped climbing;
  - ``parts``: the Theil-Sen slope of each quarter of the span (5 buckets); the
    last is the ``recent slope``. A leak grows all along; a quarter with no
    allocator step in it (or one at its edge) does not grow;
  - ``jumps``: the part of the rise made in bucket-to-bucket rises beyond
    :data:`STEP_SIGMAS` robust sigmas of the others (a load, an allocator's step);
  - ``seconds to full``: ``(total - used) / slope``.

- **Memory was higher before** (:func:`peak_before`). For a span shorter than
  the window: the highest bucket median between the window's start and the
  span's start. Above the span's first end (:class:`SpanEnds`) by
  :data:`REUSE_SHARE` of its rise, memory is being reused (a sawtooth, a
  periodic pattern), not leaked, and the span cannot hold.
- **Holds** for a span when the GPU covers it, ``lower >= rate`` (the evidence
  excludes rates below ``rate``; when *urgent*, the card full within
  :data:`URGENT_SPANS` times the span at ``slope``, ``slope >= rate`` instead:
  there is no time to wait for more evidence), ``fit >= minFit``, every
  quarter grows at least :data:`HOLD_PART` of the span's slope, the jumps are
  at most :data:`JUMP_SHARE` of its rise, and memory was not higher before.
  For a GPU when some span holds (the window first, then the shorter ones,
  longest first); for the pod when some GPU does. With ``for``, it must hold
  at every evaluation for that long before a finding starts.
- **Clears** for a GPU when the trend broke, not just wobbled: over the window
  (when covered), ``slope < 0.8 x rate``, or ``fit < minFit - 0.1``, or the
  recent slope ``< rate / 4``; and over the shortest span (when shorter than
  the window), memory rose end to end at less than ``rate / 4``. With neither
  judged (a gap everywhere), the window's trend decides on whatever readings
  it has. For the pod when every GPU clears.
- **Cost.** A span shorter than the window is fitted only when its ends, and
  those of the shortest span, rose at :data:`SCREEN_RATE` of ``rate`` or
  more, and memory was not higher before. A GPU whose memory is not growing
  costs one window fit per window bucket and two small medians per evaluation.
- The pod's value is the largest slope among its GPUs that hold (else among
  all); each GPU speaks through its longest span that holds (else the window,
  else its longest fitted span); ``fit``, ``seconds to full`` (from the
  newest reading) and the evidence span (the outcome's ``window_seconds``)
  are that span's.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import sub

from gpuwarden.policy.humanize import approx_duration, format_bytes
from gpuwarden.policy.model import MemoryGrowth
from gpuwarden.policy.rules import Outcome, RuleKind, WindowParams, covered, pod_end, readings, unknown
from gpuwarden.policy.series import Column, PodId, SeriesKey, Window
from gpuwarden.policy.slope import bucket_medians, fit_line, median, pairwise_slopes
from gpuwarden.policy.units import format_duration

MIN_SPAN_SECONDS = 240.0
"""The shortest evidence span (or the window, when shorter): a leak is never decided on less."""
SPAN_RATIO = 1.5
"""Spans double from the shortest while at most the window / this; the window is the last."""
BUCKETS = 20
"""Bucket medians per span: 190 pairwise slopes, whatever the sampling rate."""
MIN_BUCKETS = 6
"""Fewer non-empty buckets than this: too little to judge (nothing holds or clears)."""
MAX_POINTS = 240
"""Readings per span the bucket medians look at (evenly strided): 12 per bucket."""
PARTS = 4
"""Quarters of a span that must each grow; the last is the recent part."""
MIN_PART_BUCKETS = 3
"""Fewer bucket medians than this in some quarter: the span cannot hold."""
HOLD_PART = 0.5
"""Each quarter's slope must be at least this share of the span's for the span to hold."""
CONFIDENCE_Z = 2.33
"""Standard deviations of the slope's lower bound: one-sided 99%."""
URGENT_SPANS = 2.0
"""The card full within this many spans at the span's slope: hold on the slope, not its bound."""
STEP_SIGMAS = 4.0
"""A bucket-to-bucket rise is a jump when this many robust sigmas above the typical rise."""
JUMP_SHARE = 0.5
"""A span whose rise is more than this share jumps (a staircase, a load) does not hold."""
REUSE_SHARE = 0.5
"""Memory before a span counts as higher when above its first end by this share of its rise."""
CLEAR_RATE = 0.8
CLEAR_FIT = 0.1
CLEAR_RECENT = 0.25
SCREEN_RATE = 0.5
"""A span shorter than the window is fitted only when it, and the shortest span, grew at this share of
``rate`` from end to end (:class:`SpanEnds`)."""
UNIT = "bytes/s"


def evidence_spans(window_seconds: float) -> tuple[float, ...]:
    """The spans a GPU is judged over, ascending; the last is the window (see the module doc)."""
    span = min(MIN_SPAN_SECONDS, window_seconds)
    spans: list[float] = []
    while span * SPAN_RATIO <= window_seconds:
        spans.append(span)
        span *= 2
    spans.append(window_seconds)
    return tuple(spans)


@dataclass(slots=True)
class GpuGrowth:
    """One GPU's memory trend over one span.

    ``parts``, ``recent_slope`` and ``jumps`` are worked out from ``levels`` when
    first read: most trends are judged on their slope alone (not growing), and
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
    _shape: tuple[tuple[float, ...], float, float] | None = field(default=None, compare=False, repr=False)

    @property
    def parts(self) -> tuple[float, ...]:
        """Each quarter's Theil-Sen slope, oldest first; empty when some quarter has too few buckets."""
        return self._shaped()[0]

    @property
    def recent_slope(self) -> float:
        """The last quarter's slope (of the last quarter's buckets there are, when it has too few)."""
        return self._shaped()[1]

    @property
    def jumps(self) -> float:
        """Bytes of the rise made in jumps: bucket-to-bucket rises beyond what the others' spread explains."""
        return self._shaped()[2]

    @property
    def seconds_to_full(self) -> float | None:
        """Seconds until the card is full at ``slope`` from ``used_bytes`` (None: not growing, or unknown)."""
        if self.total_bytes is None or self.slope <= 0:
            return None
        return max(0.0, (self.total_bytes - self.used_bytes) / self.slope)

    def _shaped(self) -> tuple[tuple[float, ...], float, float]:
        if self._shape is None:
            self._shape = _shape(self.levels, self.span_seconds)
        return self._shape


def _shape(levels: Sequence[float], span: float) -> tuple[tuple[float, ...], float, float]:
    """``(parts, recent slope, jumps)`` of a span's bucket medians (see :class:`GpuGrowth`)."""
    width = span / BUCKETS
    per_part = BUCKETS // PARTS
    quarters: list[tuple[list[float], list[float]]] = []
    for q in range(PARTS):
        xs = [(k + 0.5) * width for k in range(q * per_part, (q + 1) * per_part) if levels[k] == levels[k]]
        ys = [y for y in levels[q * per_part : (q + 1) * per_part] if y == y]
        quarters.append((xs, ys))
    parts: tuple[float, ...] = ()
    if all(len(xs) >= MIN_PART_BUCKETS for xs, _ in quarters):
        parts = tuple(_slope(xs, ys) for xs, ys in quarters)
    xs, ys = quarters[-1]
    recent = parts[-1] if parts else _slope(xs, ys) if len(xs) >= 2 else 0.0
    present = [y for y in levels if y == y]
    rises = list(map(sub, present[1:], present[:-1]))
    typical = median(rises)
    spread = 1.4826 * median([abs(rise - typical) for rise in rises])
    jumps = sum(rise - typical for rise in rises if rise > typical + STEP_SIGMAS * spread)
    return parts, recent, jumps


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The Theil-Sen slope alone (no intercept)."""
    slopes = pairwise_slopes(xs, ys)
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


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


def span_ends(window: Window, start: float, end: float) -> SpanEnds | None:
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
    first = window.values(Column.MEM_USED, i0, i0 + k)[::step]
    last = window.values(Column.MEM_USED, i1 - k, i1)[::step]
    if window.has_missing(Column.MEM_USED, i0):
        first, last = array("f", [v for v in first if v == v]), array("f", [v for v in last if v == v])
    # Between the two groups' centers: the midpoints of their first and last readings.
    times = window.times(i0, i0 + k) + window.times(i1 - k, i1)
    span = (times[-k] + times[-1] - times[0] - times[k - 1]) / 2
    if not first or not last or span <= 0:
        return None
    low, high = median(first), median(last)
    return SpanEnds(low, high, (high - low) / span)


def gpu_growth(
    gpu: str, window: Window, start: float, end: float, max_gap: float | None = None
) -> GpuGrowth | None:
    """One GPU's memory trend over the span ``[start, end]``, or None when there are too few readings.

    ``used_bytes`` is the last reading in the span; see :func:`evaluate_growth` for the newest.
    """
    r = readings(window, Column.MEM_USED, start, end)
    if not r.values:
        return None
    step = -(-len(r.values) // MAX_POINTS)
    xs, ys = bucket_medians(r.times[::step], r.values[::step], start, end, BUCKETS)
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
        total_bytes=window.mem_total,
        covered=covered(r, start, end, max_gap),
        span_seconds=span,
    )


def peak_before(
    window: Window, since: float, start: float, full: GpuGrowth | None, full_start: float
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
    r = readings(window, Column.MEM_USED, since, math.nextafter(start, -math.inf))
    if not r.values:
        return -math.inf
    step = -(-len(r.values) // MAX_POINTS)
    return max(bucket_medians(r.times[::step], r.values[::step], r.times[0], start, BUCKETS)[1])


class GrowthCache:
    """Memo of per-GPU trends by (series, span, the span's points).

    A bucket-aligned span only changes when a bucket completes (every 90 s for
    a 30m span), so most evaluations reuse the last trend instead of refitting.
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
    if not (g.covered and g.slope >= rate and g.fit >= rule.min_fit and g.parts):
        return False
    if min(g.parts) < HOLD_PART * g.slope or g.jumps > JUMP_SHARE * g.slope * g.span_seconds:
        return False
    if g.lower >= rate:
        return True
    full_in = g.seconds_to_full
    return full_in is not None and full_in <= URGENT_SPANS * g.span_seconds


def _clears(g: GpuGrowth, rule: MemoryGrowth) -> bool:
    rate = rule.rate_bytes_per_second
    return (
        g.slope < CLEAR_RATE * rate
        or g.fit < rule.min_fit - CLEAR_FIT
        or g.recent_slope < CLEAR_RECENT * rate
    )


def describe(
    slope: float, fit: float, total_bytes: float | None, seconds_to_full: float | None, span: float = 0.0
) -> str:
    """``GPU memory grows 212Mi/m over 4m, fit 0.97; the card (80Gi) is full in 14m``."""
    per_minute = slope * 60
    over = f" over {format_duration(span)}" if span > 0 else ""
    if per_minute >= 2**10:
        text = f"GPU memory grows {format_bytes(per_minute)}/m{over}, fit {fit:.2f}"
    elif per_minute <= -(2**10):
        text = f"GPU memory shrinks {format_bytes(-per_minute)}/m{over}, fit {fit:.2f}"
    else:
        return f"GPU memory is flat{over} (fit {fit:.2f})"
    if seconds_to_full is not None and total_bytes is not None:
        if seconds_to_full <= 0:
            text += f"; the card is full ({format_bytes(total_bytes)})"
        else:
            text += f"; the card ({format_bytes(total_bytes)}) is full in {approx_duration(seconds_to_full)}"
    return text


def growth_message(o: Outcome) -> str:
    """:func:`describe` of the worst GPU, and ``(on 1 of 2 GPUs)`` for a pod of several."""
    text = describe(o.value or 0.0, o.fit or 0.0, o.total_bytes, o.seconds_to_full, o.window_seconds)
    if o.gpu_count > 1 and o.gpus:
        text += f" (on {len(o.gpus)} of {o.gpu_count} GPUs)"
    return text


@dataclass(slots=True)
class _Verdict:
    """One GPU's verdict over its spans, and the span that speaks for it."""

    trend: GpuGrowth
    window: Window
    holds: bool
    clears: bool


def _judge_gpu(
    rule: MemoryGrowth,
    key: SeriesKey,
    window: Window,
    end: float,
    params: WindowParams,
    cache: GrowthCache,
) -> _Verdict | None:
    """The GPU's verdict: it holds when some span holds, and clears as the module doc says.

    The window's span first, then the shorter ones, longest first: the first
    that holds decides. Shorter spans are fitted only when their ends say they
    may hold.
    """
    rate = rule.rate_bytes_per_second
    spans = evidence_spans(rule.window_seconds)
    full_start, full_end = growth_window(rule.window_seconds, end, key.gpu)
    full = cache.trend(key, window, full_start, full_end, params.max_gap_seconds)
    judged = stands = False
    standing: GpuGrowth | None = None
    if full is not None and full.covered:
        if _holds(full, rule):
            return _Verdict(full, window, holds=True, clears=False)
        judged = True
        standing = None if _clears(full, rule) else full
    fitted: GpuGrowth | None = None
    shortest = span_ends(window, *growth_window(spans[0], end, key.gpu)) if len(spans) > 1 else None
    if shortest is not None:
        judged = True
        stands = shortest.slope >= CLEAR_RECENT * rate
    if shortest is not None and shortest.slope >= SCREEN_RATE * rate:
        for span in reversed(spans[:-1]):
            start, boundary = growth_window(span, end, key.gpu)
            ends = shortest if span == spans[0] else span_ends(window, start, boundary)
            if ends is None or ends.slope < SCREEN_RATE * rate:
                continue
            peak = peak_before(window, boundary - rule.window_seconds, start, full, full_start)
            if peak > ends.first + REUSE_SHARE * (ends.last - ends.first):
                continue  # memory was higher before: reused, not leaked
            trend = cache.trend(key, window, start, boundary, params.max_gap_seconds)
            if trend is None:
                continue
            fitted = fitted or trend
            if trend.covered and _holds(trend, rule):
                return _Verdict(trend, window, holds=True, clears=False)
    speaker = standing or full or fitted
    if speaker is None and len(spans) > 1:
        # A history too young for the window's trend: the shortest span speaks.
        start, boundary = growth_window(spans[0], end, key.gpu)
        speaker = cache.trend(key, window, start, boundary, params.max_gap_seconds)
    if speaker is None:
        return None
    clears = not (standing or stands) if judged else _clears(speaker, rule)
    return _Verdict(speaker, window, holds=False, clears=clears)


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
    memo = cache if cache is not None else GrowthCache()
    verdicts: list[_Verdict] = []
    for key, window in series:
        verdict = _judge_gpu(rule, key, window, end, params, memo)
        if verdict is not None:
            verdicts.append(verdict)
    if not verdicts:
        return unknown(rule.name, kind, pod, rate, UNIT)
    holding = [v for v in verdicts if v.holds]
    named = holding or [v for v in verdicts if not v.clears]
    top = max(holding or verdicts, key=lambda v: v.trend.slope)
    worst, total = top.trend, top.window.mem_total
    newest = _newest_used(top.window, end)
    used = worst.used_bytes if newest is None else newest
    full_in = max(0.0, (total - used) / worst.slope) if total is not None and worst.slope > 0 else None

    return Outcome(
        rule.name,
        kind,
        pod,
        worst.slope,
        rate,
        UNIT,
        holds=bool(holding),
        clears=not holding and all(v.clears for v in verdicts),
        gpus=tuple(v.trend.gpu for v in named),
        gpu_count=len(verdicts),
        window_seconds=worst.span_seconds,
        total_bytes=total,
        fit=worst.fit,
        seconds_to_full=full_in,
        describe=growth_message,
    )

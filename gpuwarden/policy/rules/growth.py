"""memoryGrowth: GPU memory growing in a straight line (a leak), and the time until the card is full.

Semantics (coverage and the as-of time are in :mod:`gpuwarden.policy.rules.common`; docs/policy.md has
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
- **Urgency** (:func:`urgent_spans`). Below the shortest span, the *urgent*
  spans: :data:`URGENT_SPAN_SECONDS` (40s) doubling while at most the shortest
  span / :data:`SPAN_RATIO`: 40s, 1m20s, 2m40s below 4m. Each decides only when,
  at its slope from its last reading, the card is full within :data:`URGENCY`
  (4) times the next longer span (5m20s, 10m40s, 16m): waiting for that span
  would leave less than 3/4 of the time to full. The evidence is then the
  strictest (:func:`_holds_urgently`): the slope's lower bound at least
  ``rate``, or (the slope at least :data:`SCREEN_RATE` of ``rate``) high enough
  that the card is full within the horizon even at the bound; the slope above
  zero beyond chance (:data:`URGENT_SIGNIFICANCE_Z`); the fit with
  the noise taken out (:func:`noise_free_fit`) at least :data:`URGENT_FIT`
  (0.9); no quarter
  significantly slower than :data:`URGENT_PART` (0.85) of the span's slope;
  at most :data:`URGENT_JUMP_SHARE` of the rise in jumps; memory not higher
  before. A load over 30 s or less, a step, a staircase, or a curved rise (a
  sine's flank) fails it; a straight rise of 40 s or more that would fill the
  card soon is, by the data, a leak until it stops. For host memory the
  capacity is the hooked processes' memory limit (:func:`capacity`); without
  one (an older hook, several containers' limits), no urgency.
- **Imminent.** A GPU memory finding whose card is full within
  :data:`IMMINENT_SECONDS` (16m) has the reason :data:`IMMINENT_REASON`, and
  keeps it while full within twice that (``Outcome.kept_reason``); a host
  memory finding whose limit is reached within it, :data:`HOST_IMMINENT_REASON`.
- **Bucket-aligned spans.** Each span is cut into 20 buckets (12 s for 4m,
  90 s for 30m), aligned to multiples of that length since the epoch plus a
  fixed per-GPU phase; a span reads the GPU's 20 latest *complete* buckets
  before the pod's as-of time. A verdict therefore depends only on the
  samples, never on when evaluations run, and changes once per bucket (the
  evaluator memoizes trends; see :class:`GrowthCache`).
- **Per span**, each bucket is reduced to the median of its memory readings
  (of at most :data:`MAX_POINTS` evenly strided readings per span; the lower
  middle one for an even count, so a step mid-bucket rises whole): transient
  allocations do not count, and the cost is bounded whatever the sampling
  rate. Through those points (:func:`gpu_growth`):

  - ``slope``: the Theil-Sen slope, bytes per second, and ``lower``, Sen's
    one-sided 99% lower confidence bound on it
    (:func:`gpuwarden.policy.stats.sen_lower_bound`);
  - ``fit``: R² of that line, 0..1 (see :func:`gpuwarden.policy.stats.r_squared`):
    near 1 for a steady ramp even when noisy, low for a sawtooth
    (allocate/free) or a staircase that stopped climbing;
  - ``parts``: the Theil-Sen slope of each quarter of the span (5 buckets); the
    last is the ``recent slope``. A leak grows all along; a quarter with no
    allocator step in it (or one at its edge) does not grow. Five medians make
    a noisy slope: ``part_margins`` say how far each may fall short by noise
    alone (:data:`CONFIDENCE_Z` standard errors, the medians' ``noise`` from
    the readings' second differences: :func:`median_noise`);
  - ``jumps``: the part of the rise made in bucket-to-bucket rises beyond
    :data:`STEP_SIGMAS` sigmas of the typical rise (a load, an allocator's step): the rises'
    robust sigma, or the medians' noise's when smaller (the rises' own counts the steps); two
    consecutive rises count as one when together beyond that and each at least half of it (a
    step split between two buckets, :func:`_jumps`);
  - ``seconds to full``: ``(total - used) / slope``.

- **Memory was higher before** (:func:`peak_before`). For a span shorter than
  the window: the highest bucket median between the window's start and the
  span's start. Above the span's first end (:class:`SpanEnds`) by
  :data:`REUSE_SHARE` of its rise, memory is being reused (a sawtooth, a
  periodic pattern), not leaked, and the span cannot hold.
- **Holds** for a span when the GPU covers it, ``lower >= rate`` (the evidence
  excludes rates below ``rate``; when *urgent*, the card full within
  :data:`URGENT_SPANS` times the span at ``slope``, ``slope >= rate`` instead:
  there is no time to wait for more evidence), ``fit >= minFit``, no
  quarter grows significantly (by more than its margin) slower than
  :data:`HOLD_PART` of the span's slope, nor the end quarters together than
  :data:`S_SHAPE` of the middle two (:func:`_s_shaped`), the jumps are
  at most :data:`JUMP_SHARE` of its rise, and memory was not higher before.
  For a GPU when some span holds (the window first, then the shorter ones,
  longest first, then the urgent ones, longest first); for the pod when some
  GPU does. With ``for``, it must hold at every evaluation for that long before
  a finding starts.
- **Clears** for a GPU when the trend broke, not just wobbled: over the window
  (when covered), ``slope < 0.8 x rate``, or ``fit < minFit - 0.1``, or the
  recent slope ``< rate / 4``; and over the shortest span (when shorter than
  the window), memory rose end to end at less than ``rate / 4``. With neither
  judged (a gap everywhere), the window's trend decides on whatever readings
  it has. For the pod when every GPU clears. A clearing whose speaking trend
  still grows says what the shortest span's ends did instead
  (:func:`change_text`): the trend would belie the clearing.
- **Cost.** A span shorter than the window is fitted only when its ends, and
  those of the shortest span, rose at :data:`SCREEN_RATE` of ``rate`` or
  more, and memory was not higher before; an urgent span only when the
  shortest span's ends rose so, and its own ends project the card full within
  its urgency. A GPU whose memory is not growing costs one window fit per
  window bucket and two small medians per evaluation.
- **Which memory** (``memory``, :class:`MemorySource`):
  ``device`` reads NVML's used memory; ``allocated``, ``reserved`` and ``host``
  the training hook's columns (:class:`~gpuwarden.policy.store.series.HookColumns`),
  and a GPU whose series has none is not judged (the outcome is unknown, never
  a silent switch to another memory). ``auto`` reads ``allocated`` on a GPU
  with an allocated reading inside the window, else ``device``. ``host`` is
  the pod's, the same on each of its GPUs' series: it is judged on the first
  hooked one only, and its time to full is to its memory limit, when the hook
  sends one (:func:`capacity`). The message
  names the memory judged and, when the speaking series' newest hook reading
  carries allocation sites, the top :data:`MESSAGE_SITES` of them.
- The pod's value is the largest slope among its GPUs that hold (else among
  all); each GPU speaks through its longest span that holds (else the window,
  else its longest fitted span); ``fit``, ``seconds to full`` (from the
  newest reading) and the evidence span (the outcome's ``window_seconds``)
  are that span's.
"""

from __future__ import annotations

import enum
import math
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import sub
from typing import Any

from gpuwarden.policy.humanize import approx_duration, format_bytes
from gpuwarden.policy.rules.common import (
    JudgeContext,
    Outcome,
    RuleKind,
    RuleType,
    WindowParams,
    covered,
    pod_end,
    readings,
    unknown,
)
from gpuwarden.policy.spec.fields import (
    SpecError,
    check_fields,
    duration,
    member,
    number,
    type_name,
    value_or,
)
from gpuwarden.policy.stats import (
    bucket_medians,
    fit_line,
    median,
    pairwise_slopes,
    sen_lower_bound,
    theil_sen,
)
from gpuwarden.policy.store.series import Column, PodId, SeriesKey, Window
from gpuwarden.units import format_duration, parse_rate
from gpuwarden.wire.node import AllocationSite

KIND = RuleKind("memoryGrowth")
"""Its kind: its key under ``spec.rules[]``."""


class MemorySource(enum.StrEnum):
    """Which memory a memoryGrowth rule watches (see the module doc)."""

    AUTO = "auto"  # allocated where the subject's samples carry the hook's allocated bytes, else device
    DEVICE = "device"  # NVML's used memory (the subject's processes' on a shared GPU)
    ALLOCATED = "allocated"  # the hook's torch.cuda.memory_allocated: live tensors
    RESERVED = "reserved"  # the hook's torch.cuda.memory_reserved: the caching allocator's pool
    HOST = "host"  # the hook's hostRssBytes: the pod's hooked processes and their workers


@dataclass(frozen=True, slots=True)
class MemoryGrowth:
    """Fires when memory grows steadily (a leak): robust slope above ``rate``, fit >= ``min_fit``."""

    name: str
    rate_bytes_per_second: float
    window_seconds: float
    min_fit: float
    for_seconds: float = 0.0
    memory: MemorySource = MemorySource.AUTO


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
"""No quarter's slope may be significantly below this share of the span's for the span to hold."""
S_SHAPE = 0.75
"""Nor may the end quarters' mean slope be significantly below this share of the middle two's."""
NOISE_PAIRS = 60
"""Second differences of readings a span's noise is estimated from (:func:`median_noise`)."""
CONFIDENCE_Z = 2.33
"""Standard deviations of the slope's lower bound: one-sided 99%."""
URGENT_SPANS = 2.0
"""The card full within this many spans at the span's slope: hold on the slope, not its bound."""
URGENT_SPAN_SECONDS = 40.0
"""The shortest urgent span (:func:`urgent_spans`): longer than a model takes to load (a load over
30 s is a 30 s ramp), so that no load fits inside one with its quarters all rising."""
URGENCY = 4.0
"""An urgent span decides only when, at its slope, the card is full within this many times the next
longer span: a finding on that span would come with less than 3/4 of the time to full ahead."""
URGENT_SIGNIFICANCE_Z = 4.0
"""An urgent span holds only when its slope is above zero at this many standard deviations (Sen's
bound on its medians, one-sided 1 - 3.2e-5): the ramp is real, not a flat card's noise. An urgent
span is judged afresh at each of its buckets, on every GPU near full, and its three lengths overlap:
~160 independent chances an hour. At :data:`CONFIDENCE_Z` alone (1% each), flat cards 0.3 to 2Gi from
full under 43Mi to 1Gi of noise paged in 3 to 44 of 1,000 40-minute runs each (their slopes 2 to 4.6
standard errors over zero); at this bound, in none of 5,000 (``bench/near_full_noise.py``). Whether
the card fills within the horizon is still asked of the 99% bound, so a real leak near full is found
as soon as before: its slope is 6 to 25 standard errors over zero on the span that decides."""
URGENT_FIT = 0.9
"""An urgent span's fit, its noise taken out (:func:`noise_free_fit`), must be at least this (and
``minFit``): a near-perfect line."""
URGENT_PART = 0.85
"""On an urgent span, no quarter may grow significantly slower than this share of the span's slope."""
URGENT_JUMP_SHARE = 0.25
"""On an urgent span, at most this share of the rise may be made in jumps."""
STEP_SIGMAS = 4.0
"""A bucket-to-bucket rise is a jump when this many sigmas above the typical rise (the rises' robust
sigma, or that of the medians' noise when smaller: :func:`_shape`)."""
SPLIT_SHARE = 0.5
"""Two consecutive rises are one jump (a step split between two buckets) when together beyond
:data:`STEP_SIGMAS` and each beyond this share of it (:func:`_jumps`)."""
JUMP_SHARE = 0.5
"""A span whose rise is more than this share jumps (a staircase, a load) does not hold."""
REUSE_SHARE = 0.5
"""Memory before a span counts as higher when above its first end by this share of its rise."""
MESSAGE_SITES = 3
"""Allocation sites a message names at most."""
SITE_FILE_CHARS = 60
"""A site's file as the message shows it: its last two path parts, at most this many characters."""
CLEAR_RATE = 0.8
CLEAR_FIT = 0.1
CLEAR_RECENT = 0.25
SCREEN_RATE = 0.5
"""A span shorter than the window is fitted only when it, and the shortest span, grew at this share of
``rate`` from end to end (:class:`SpanEnds`)."""
UNIT = "bytes/s"


def evidence_spans(window_seconds: float) -> tuple[float, ...]:
    """The spans a GPU is judged over, ascending; the last is the window (see the module doc)."""
    return _ladder(min(MIN_SPAN_SECONDS, window_seconds), window_seconds)


def urgent_spans(window_seconds: float) -> tuple[float, ...]:
    """The spans shorter than the shortest evidence span, ascending, that decide only when urgent.

    :data:`URGENT_SPAN_SECONDS` doubling while at most the shortest evidence span /
    :data:`SPAN_RATIO`: 40s, 1m20s, 2m40s below the 4m span; none for a window under 1m.
    """
    return _ladder(URGENT_SPAN_SECONDS, evidence_spans(window_seconds)[0])[:-1]


def _ladder(span: float, longest: float) -> tuple[float, ...]:
    """``span`` doubling while at most ``longest`` / :data:`SPAN_RATIO`, then ``longest``."""
    spans: list[float] = []
    while span * SPAN_RATIO <= longest:
        spans.append(span)
        span *= 2
    spans.append(longest)
    return tuple(spans)


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


_Slot = tuple[SeriesKey, Column, float, float]


class GrowthCache:
    """Memo of per-GPU trends by (series, memory column, span, the span's points).

    A bucket-aligned span only changes when a bucket completes (every 90 s for
    a 30m span), so most evaluations reuse the last trend instead of refitting.
    Entries not used during one :meth:`sweep` period are dropped, so the memo
    never outlives its series by more than one evaluation.
    """

    def __init__(self) -> None:
        self._current: dict[_Slot, tuple[tuple[int, float, float], GpuGrowth | None]]
        self._current = {}
        self._previous: dict[_Slot, tuple[tuple[int, float, float], GpuGrowth | None]]
        self._previous = {}
        self.hits = 0
        self.misses = 0

    def trend(
        self,
        key: SeriesKey,
        window: Window,
        start: float,
        end: float,
        max_gap: float | None,
        column: Column = Column.MEM_USED,
    ) -> GpuGrowth | None:
        """The GPU's trend of ``column`` over ``[start, end]``, computed once per distinct set of points."""
        i0, i1 = window.span(start, end)
        if i0 == i1:
            return None
        times = window.times(i0, i0 + 1)
        signature = (i1 - i0, times[0], window.times(i1 - 1, i1)[0])
        slot = (key, column, start, end)
        entry = self._current.get(slot) or self._previous.get(slot)
        if entry is not None and entry[0] == signature:
            self.hits += 1
            self._current[slot] = entry
            return entry[1]
        self.misses += 1
        trend = gpu_growth(key.gpu, window, start, end, max_gap, column)
        self._current[slot] = (signature, trend)
        return trend

    def sweep(self) -> None:
        """End a period: forget what was not used since the previous sweep."""
        self._previous = self._current
        self._current = {}

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())


def capacity(window: Window, column: Column) -> float | None:
    """What ``column`` fills: the card's total for GPU memory; for host memory the hooked processes'
    memory limit (the newest known, :attr:`Window.host_limit`), None without one."""
    return window.host_limit if column is Column.HOST else window.mem_total


def _newest_used(window: Window, end: float, column: Column) -> float | None:
    i1 = window.span(-math.inf, end)[1]
    if not i1:
        return None
    value = window.values(column, i1 - 1, i1)[0]
    return value if value == value else None


def _holds(g: GpuGrowth, rule: MemoryGrowth) -> bool:
    rate = rule.rate_bytes_per_second
    if not (g.covered and g.slope >= rate and g.fit >= rule.min_fit and g.parts):
        return False
    floor = HOLD_PART * g.slope
    if any(part < floor - margin for part, margin in zip(g.parts, g.part_margins, strict=True)):
        return False  # some quarter grew significantly slower than the span: a plateau, not a leak
    if _s_shaped(g.parts, g.part_margins):
        return False
    if g.jumps > JUMP_SHARE * g.slope * g.span_seconds:
        return False
    if g.lower >= rate:
        return True
    full_in = g.seconds_to_full
    return full_in is not None and full_in <= URGENT_SPANS * g.span_seconds


def _s_shaped(parts: Sequence[float], margins: Sequence[float]) -> bool:
    """Whether both end quarters together grow significantly slower than :data:`S_SHAPE` of the middle two.

    A climb that began after the span's start and ended before its end (a cache's few steps, flat on
    both sides) leaves each end quarter only a little short (within the noise each is allowed), but
    both at once; a leak's end quarters scatter about its slope like the middle ones.
    """
    first, second, third, last = parts
    m1, m2, m3, m4 = margins
    gap = (first + last) - S_SHAPE * (second + third)
    # Each quarter's margin is CONFIDENCE_Z of its errors: the gap's (twice the means'), theirs combined.
    return gap < 0 and gap * gap > m1 * m1 + m4 * m4 + S_SHAPE * S_SHAPE * (m2 * m2 + m3 * m3)


def _holds_urgently(g: GpuGrowth, rule: MemoryGrowth, next_span: float) -> bool:
    """Whether an urgent span holds: the card full within :data:`URGENCY` next spans, and a clean ramp.

    A short span is believed only on the strictest evidence (the module doc lists it): a step, a
    load or a ramp that stopped leaves some quarter flat, a staircase makes its rise in jumps.
    """
    full_in = g.seconds_to_full
    horizon = URGENCY * next_span
    if full_in is None or full_in > horizon or not (g.covered and g.parts):
        return False
    rate = rule.rate_bytes_per_second
    assert g.total_bytes is not None  # a time to full implies a card
    if g.lower < rate and (g.slope < SCREEN_RATE * rate or g.lower * horizon < g.total_bytes - g.used_bytes):
        # The question near full is whether the card fills within the horizon, not whether the rate
        # is over `rate`: the bound may answer it, at half `rate` at least (the screen's own floor).
        return False  # the evidence excludes neither rates below `rate` nor a card not full in time
    if (
        noise_free_fit(g) < max(rule.min_fit, URGENT_FIT)
        or g.jumps > URGENT_JUMP_SHARE * g.slope * g.span_seconds
        or not _rising_beyond_chance(g)
    ):
        return False
    floor = URGENT_PART * g.slope
    return all(part >= floor - margin for part, margin in zip(g.parts, g.part_margins, strict=True))


def _rising_beyond_chance(g: GpuGrowth) -> bool:
    """Whether the span's slope is above zero at :data:`URGENT_SIGNIFICANCE_Z` (Sen's bound on its medians).

    Worked out only for an urgent span that passed every cheaper test: the pairwise slopes again.
    """
    width = g.span_seconds / BUCKETS
    xs = [(k + 0.5) * width for k, y in enumerate(g.levels) if y == y]
    ys = [y for y in g.levels if y == y]
    return sen_lower_bound(pairwise_slopes(xs, ys), len(xs), URGENT_SIGNIFICANCE_Z) > 0


def noise_free_fit(g: GpuGrowth) -> float:
    """``fit`` with the bucket medians' noise taken out: the share of the trend's variance the line explains.

    An urgent span has few readings per bucket, so noise alone keeps a straight leak's R² far
    below 1 (0.7 for 104Mi/m under 43Mi of noise over 1m20s). Noise adds about ``noise²`` a point
    to the residuals' sum of squares (``n - 2`` of them free) and to the total's (``n - 1``); with
    those taken out of both, a curve, a step or a plateau still leaves its own residuals, a straight
    line under noise none. Equal to ``fit`` without noise; 0 when noise explains all the variance
    (nothing left to fit) or the line explains none of it.
    """
    present = [y for y in g.levels if y == y]
    n = len(present)
    if g.fit <= 0 or n < 3:
        return 0.0
    mean = sum(present) / n
    total = sum((y - mean) ** 2 for y in present)
    variance = g.noise * g.noise
    trend = total - (n - 1) * variance
    if trend <= 0:
        return 0.0
    residual = (1.0 - g.fit) * total - (n - 2) * variance
    return min(1.0, 1.0 - max(0.0, residual) / trend)


def _clears(g: GpuGrowth, rule: MemoryGrowth) -> bool:
    rate = rule.rate_bytes_per_second
    return (
        g.slope < CLEAR_RATE * rate
        or g.fit < rule.min_fit - CLEAR_FIT
        or g.recent_slope < CLEAR_RECENT * rate
    )


HOST_LEAK_REASON = "HostMemoryLeakSuspected"
"""The reason of a ``memory: host`` growth finding (the kind's own, GPUMemoryLeakSuspected, for the rest)."""
IMMINENT_REASON = "GPUMemoryExhaustionImminent"
"""The reason of a GPU memory growth finding whose card is full within :data:`IMMINENT_SECONDS`."""
HOST_IMMINENT_REASON = "HostMemoryExhaustionImminent"
"""The reason of a ``memory: host`` finding whose memory limit is reached within :data:`IMMINENT_SECONDS`."""
IMMINENT_SECONDS = URGENCY * MIN_SPAN_SECONDS
"""16m: the card full within the longest urgent horizon, where the shortest span's caution is not
affordable. A finding with this reason keeps it while the card is full within twice this."""

MEMORY_NOUNS = {
    MemorySource.DEVICE: "GPU memory",
    MemorySource.ALLOCATED: "allocated memory (live tensors, not the cache)",
    MemorySource.RESERVED: "reserved memory (the allocator's cache)",
    MemorySource.HOST: "host memory (the hooked processes and their workers)",
}
"""How a message names the memory it judged (``auto`` says which of the two it read)."""


def describe(
    slope: float,
    fit: float,
    total_bytes: float | None,
    seconds_to_full: float | None,
    span: float = 0.0,
    memory: MemorySource = MemorySource.DEVICE,
) -> str:
    """``GPU memory grows 212Mi/m over 4m, fit 0.97; the card (80Gi) is full in 14m``.

    ``memory`` names what was judged (:data:`MEMORY_NOUNS`); host memory fills its limit, not a card
    (``total_bytes`` is the limit then; None: no limit known).
    """
    per_minute = slope * 60
    over = f" over {format_duration(span)}" if span > 0 else ""
    noun = MEMORY_NOUNS[memory]
    if per_minute >= 2**10:
        text = f"{noun} grows {format_bytes(per_minute)}/m{over}, fit {fit:.2f}"
    elif per_minute <= -(2**10):
        return f"{noun} shrinks {format_bytes(-per_minute)}/m{over}, fit {fit:.2f}"
    else:
        return f"{noun} is flat{over} (fit {fit:.2f})"
    if memory is MemorySource.HOST:
        if seconds_to_full is None or total_bytes is None:
            return text + "; no memory limit is known, so no time to full"
        limit = format_bytes(total_bytes)
        if seconds_to_full <= 0:
            text += f"; at its memory limit ({limit})"
        else:
            text += f"; its memory limit ({limit}) is reached in {approx_duration(seconds_to_full)}"
    elif seconds_to_full is not None and total_bytes is not None:
        if seconds_to_full <= 0:
            text += f"; the card is full ({format_bytes(total_bytes)})"
        else:
            text += f"; the card ({format_bytes(total_bytes)}) is full in {approx_duration(seconds_to_full)}"
    return text


def growth_message(o: Outcome) -> str:
    """:func:`describe` of the worst GPU, ``(on 1 of 2 GPUs)`` for a pod of several, and the top sites.

    A clearing whose trend still grows says instead what changed (:func:`change_text`), when the
    shortest span was judged.
    """
    memory = MemorySource(o.signal) if o.signal else MemorySource.DEVICE
    if isinstance(o.extra, Change):
        return change_text(o.extra, memory, o.threshold)
    text = describe(o.value or 0.0, o.fit or 0.0, o.total_bytes, o.seconds_to_full, o.window_seconds, memory)
    if o.gpu_count > 1 and o.gpus and memory is not MemorySource.HOST:
        text += f" (on {len(o.gpus)} of {o.gpu_count} GPUs)"
    if isinstance(o.extra, tuple) and o.extra:
        sites = o.extra[:MESSAGE_SITES]
        gpu = [site_text(s) for s in sites if s.memory == "gpu"]
        host = [site_text(s) for s in sites if s.memory != "gpu"]
        if gpu:
            text += "; on the GPU by line: " + ", ".join(gpu)
        if host:
            text += "; top growing lines: " + ", ".join(host)
    return text


def change_text(change: Change, memory: MemorySource, rate: float) -> str:
    """``GPU memory fell from 40Gi to 20Gi over the last 4m``, ``...: no growth over the last 4m (20Gi)``."""
    noun = MEMORY_NOUNS[memory]
    over = f"over the last {format_duration(change.span_seconds)}"
    rise = change.last - change.first
    if rise < -CLEAR_RECENT * rate * change.span_seconds:
        return f"{noun} fell from {format_bytes(change.first)} to {format_bytes(change.last)} {over}"
    if rise < 2**20:
        return f"{noun}: no growth {over} ({format_bytes(change.last)})"
    return f"{noun} grew only {format_bytes(rise)} {over}, to {format_bytes(change.last)}"


def site_text(site: AllocationSite) -> str:
    """``train.py:88 +50Mi (1,200 blocks)``: the file's last two path parts, bounded in length. A GPU
    line (the allocator's history) says what it holds: ``train.py:35 holds 41.2Gi (+36.9Gi/m)``; the
    blocks no Python frame allocated, line 0, are named alone (``<no Python frames> holds 312Mi``)."""
    parts = site.file.replace("\\", "/").rsplit("/", 2)
    name = "/".join(parts[-2:])
    if len(name) > SITE_FILE_CHARS:
        name = "…" + name[-(SITE_FILE_CHARS - 1) :]
    if site.memory == "gpu":
        where = f"{name}:{site.line}" if site.line else name
        rate = site.growth_bytes_per_minute
        return f"{where} holds {format_bytes(site.size_bytes)}" + (
            f" (+{format_bytes(rate)}/m)" if rate else ""
        )
    blocks = "block" if site.count == 1 else "blocks"
    return f"{name}:{site.line} +{format_bytes(site.growth_bytes)} ({site.count:,} {blocks})"


def memory_column(rule: MemoryGrowth, window: Window, end: float) -> tuple[MemorySource, Column] | None:
    """The memory ``rule`` judges on this series as of ``end``; None when the series has none of it.

    ``auto``: allocated when the series has an allocated reading within the window, else device.
    """
    memory = rule.memory
    if memory is MemorySource.AUTO:
        if window.last_allocated >= end - rule.window_seconds:
            return MemorySource.ALLOCATED, Column.ALLOCATED
        return MemorySource.DEVICE, Column.MEM_USED
    if memory is MemorySource.DEVICE:
        return memory, Column.MEM_USED
    if not window.hooked:
        return None
    return memory, _HOOK_COLUMNS[memory]


_HOOK_COLUMNS = {
    MemorySource.ALLOCATED: Column.ALLOCATED,
    MemorySource.RESERVED: Column.RESERVED,
    MemorySource.HOST: Column.HOST,
}


@dataclass(slots=True)
class _Verdict:
    """One GPU's verdict over its spans, and the span that speaks for it."""

    trend: GpuGrowth
    window: Window
    holds: bool
    clears: bool
    memory: MemorySource = MemorySource.DEVICE
    column: Column = Column.MEM_USED
    recent: SpanEnds | None = None
    """The shortest span's ends, when judged: what a clearing says changed."""


@dataclass(frozen=True, slots=True)
class Change:
    """What memory did over the shortest span (a clearing's message): its first and last level."""

    first: float
    last: float
    span_seconds: float


def _judge_gpu(
    rule: MemoryGrowth,
    key: SeriesKey,
    window: Window,
    end: float,
    params: WindowParams,
    cache: GrowthCache,
    column: Column = Column.MEM_USED,
) -> _Verdict | None:
    """The GPU's verdict: it holds when some span holds, and clears as the module doc says.

    The window's span first, then the shorter ones, longest first: the first
    that holds decides. Shorter spans are fitted only when their ends say they
    may hold.
    """
    rate = rule.rate_bytes_per_second
    spans = evidence_spans(rule.window_seconds)
    full_start, full_end = growth_window(rule.window_seconds, end, key.gpu)
    max_gap = params.max_gap_seconds
    full = cache.trend(key, window, full_start, full_end, max_gap, column)
    judged = stands = False
    standing: GpuGrowth | None = None
    if full is not None and full.covered:
        if _holds(full, rule):
            return _Verdict(full, window, holds=True, clears=False)
        judged = True
        standing = None if _clears(full, rule) else full
    fitted: GpuGrowth | None = None
    shortest = span_ends(window, *growth_window(spans[0], end, key.gpu), column) if len(spans) > 1 else None
    if shortest is not None:
        judged = True
        stands = shortest.slope >= CLEAR_RECENT * rate
    if shortest is not None and shortest.slope >= SCREEN_RATE * rate:
        for span in reversed(spans[:-1]):
            start, boundary = growth_window(span, end, key.gpu)
            ends = shortest if span == spans[0] else span_ends(window, start, boundary, column)
            if ends is None or ends.slope < SCREEN_RATE * rate:
                continue
            peak = peak_before(window, boundary - rule.window_seconds, start, full, full_start, column)
            if peak > ends.first + REUSE_SHARE * (ends.last - ends.first):
                continue  # memory was higher before: reused, not leaked
            trend = cache.trend(key, window, start, boundary, max_gap, column)
            if trend is None:
                continue
            fitted = fitted or trend
            if trend.covered and _holds(trend, rule):
                return _Verdict(trend, window, holds=True, clears=False)
    # A card about to fill cannot wait for the shortest span: the urgent spans, screened like the others.
    screen = shortest
    if screen is None and urgent_spans(rule.window_seconds):
        screen = span_ends(window, *growth_window(spans[0], end, key.gpu), column)
    if screen is not None and screen.slope >= SCREEN_RATE * rate:
        urgent = _urgent(rule, key, window, end, params, cache, column, full, full_start, screen)
        if urgent is not None:
            return _Verdict(urgent, window, holds=True, clears=False)
    speaker = standing or full or fitted
    if speaker is None and len(spans) > 1:
        # A history too young for the window's trend: the shortest span speaks.
        start, boundary = growth_window(spans[0], end, key.gpu)
        speaker = cache.trend(key, window, start, boundary, max_gap, column)
    if speaker is None:
        return None
    clears = not (standing or stands) if judged else _clears(speaker, rule)
    return _Verdict(speaker, window, holds=False, clears=clears, recent=shortest)


def _urgent(
    rule: MemoryGrowth,
    key: SeriesKey,
    window: Window,
    end: float,
    params: WindowParams,
    cache: GrowthCache,
    column: Column,
    full: GpuGrowth | None,
    full_start: float,
    screen: SpanEnds,
) -> GpuGrowth | None:
    """The longest urgent span that holds (:func:`_holds_urgently`), or None.

    None at once unless the shortest span's ends (``screen``) project the card full within twice
    :data:`IMMINENT_SECONDS` (a leak of an urgent span's horizon that began inside the 4m span,
    at least an urgent span ago, does); a span is fitted only when its ends rose at
    :data:`SCREEN_RATE` of ``rate``, project the card full within :data:`URGENCY` next spans, and
    memory was not higher before.
    """
    total = capacity(window, column)
    if total is None or total - screen.last > 2 * IMMINENT_SECONDS * screen.slope:
        return None  # no capacity known (host memory without a limit), or not full soon: nothing is urgent
    rate = rule.rate_bytes_per_second
    spans = urgent_spans(rule.window_seconds)
    nexts = (*spans[1:], evidence_spans(rule.window_seconds)[0])
    for span, next_span in reversed(list(zip(spans, nexts, strict=True))):
        start, boundary = growth_window(span, end, key.gpu)
        ends = span_ends(window, start, boundary, column)
        if ends is None or ends.slope < SCREEN_RATE * rate:
            continue
        if total - ends.last > URGENCY * next_span * ends.slope:
            continue  # the card is not full soon enough for a short span to decide
        peak = peak_before(window, boundary - rule.window_seconds, start, full, full_start, column)
        if peak > ends.first + REUSE_SHARE * (ends.last - ends.first):
            continue
        trend = cache.trend(key, window, start, boundary, params.max_gap_seconds, column)
        if trend is not None and _holds_urgently(trend, rule, next_span):
            return trend
    return None


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
    kind = KIND
    rate = rule.rate_bytes_per_second
    end = pod_end(series, now, params)
    if end is None:
        return unknown(rule.name, kind, pod, rate, UNIT)
    memo = cache if cache is not None else GrowthCache()
    if rule.memory is MemorySource.HOST:
        # The pod's host memory is on each of its hooked GPUs' series alike: judge it once.
        series = [next(((k, w) for k, w in series if w.hooked), series[0])]
    verdicts: list[_Verdict] = []
    for key, window in series:
        source = memory_column(rule, window, end)
        if source is None:
            continue
        verdict = _judge_gpu(rule, key, window, end, params, memo, source[1])
        if verdict is not None:
            verdict.memory, verdict.column = source
            verdicts.append(verdict)
    if not verdicts:
        return unknown(rule.name, kind, pod, rate, UNIT)
    holding = [v for v in verdicts if v.holds]
    named = holding or [v for v in verdicts if not v.clears]
    top = max(holding or verdicts, key=lambda v: v.trend.slope)
    worst = top.trend
    total = capacity(top.window, top.column)
    newest = _newest_used(top.window, end, top.column)
    used = worst.used_bytes if newest is None else newest
    full_in = max(0.0, (total - used) / worst.slope) if total is not None and worst.slope > 0 else None
    clears = not holding and all(v.clears for v in verdicts)
    imminent = full_in is not None and full_in <= IMMINENT_SECONDS and not clears
    host = top.memory is MemorySource.HOST
    soon = HOST_IMMINENT_REASON if host else IMMINENT_REASON
    extra: object = top.window.sites or None
    if clears and top.recent is not None and worst.slope >= CLEAR_RECENT * rate:
        # A clearing whose speaking trend still grows says what changed instead: the trend would belie it.
        extra = Change(top.recent.first, top.recent.last, evidence_spans(rule.window_seconds)[0])
    return Outcome(
        rule.name,
        kind,
        pod,
        worst.slope,
        rate,
        UNIT,
        holds=bool(holding),
        clears=clears,
        gpus=tuple(v.trend.gpu for v in named),
        gpu_count=len(verdicts),
        window_seconds=worst.span_seconds,
        total_bytes=total,
        fit=worst.fit,
        seconds_to_full=full_in,
        signal=top.memory.value,
        # Host memory is not the GPU's: an alert on GPUMemoryLeakSuspected must not page for it.
        reason=soon if imminent else HOST_LEAK_REASON if host else None,
        kept_reason=soon if full_in is not None and full_in <= 2 * IMMINENT_SECONDS else None,
        extra=extra,
        describe=growth_message,
    )


# --- the kind ----------------------------------------------------------------------------------------

DEFAULTS: Mapping[str, Any] = {"window": "30m", "minFit": 0.8, "for": "0s", "memory": "auto"}

MIN_WINDOW = 60.0
"""The engine fits a line through 20 bucket medians (window/20 each): under a minute, that is noise."""


def parse_memory_growth(name: str, obj: Mapping[str, Any], path: str) -> MemoryGrowth:
    """A memoryGrowth rule's body (``path`` is its own)."""
    check_fields(obj, path, ("rate", "window", "minFit", "for", "memory"), ("rate",))
    raw = obj["rate"]
    if not isinstance(raw, str):
        raise SpecError(
            f"{path}.rate", f"must be a quantity per time unit such as 100Mi/m, not {type_name(raw)}"
        )
    try:
        rate = parse_rate(raw)
    except ValueError as exc:
        raise SpecError(f"{path}.rate", str(exc)) from None
    return MemoryGrowth(
        name=name,
        rate_bytes_per_second=rate,
        window_seconds=duration(obj, "window", path, DEFAULTS["window"], minimum=MIN_WINDOW),
        min_fit=number(obj, "minFit", path, DEFAULTS["minFit"], 0, 1),
        for_seconds=duration(obj, "for", path, DEFAULTS["for"]),
        memory=member(MemorySource, value_or(obj, "memory", DEFAULTS["memory"]), f"{path}.memory"),
    )


def _judge(rule: MemoryGrowth, c: JudgeContext, memo: GrowthCache | None) -> Outcome:
    return evaluate_growth(rule, c.pod, c.series, c.now, c.params, memo)


RULE_TYPE = RuleType(
    kind=KIND,
    model=MemoryGrowth,
    parse=parse_memory_growth,
    defaults=DEFAULTS,
    evaluate=_judge,
    # growth_window: the window plus one bucket.
    reach=lambda rule: rule.window_seconds * (1 + 1 / BUCKETS),
    window=lambda rule: ("window", rule.window_seconds),
    reason="GPUMemoryLeakSuspected",
    meaning="steady growth like this usually means a leak, heading for out-of-memory",
    per_gpu=True,
    colour="darkmagenta",
    utilization=False,
    hold=lambda rule: rule.for_seconds,
    memo=GrowthCache,
)

"""memoryGrowth's spec, its constants, its evidence spans and its reasons: what the other parts of
the kind read."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpuwarden.policy.rules.common import RuleKind

KIND = RuleKind("memoryGrowth")
"""Its kind: its key under ``spec.rules[]``."""


class MemorySource(enum.StrEnum):
    """Which memory a memoryGrowth rule watches (see docs/policy.md, "memoryGrowth")."""

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
    snapshot_before_seconds: float = 960.0  # 16m: IMMINENT_SECONDS, which the spans below define
    """A hooked process under this rule's finding is asked for an allocator snapshot once its card is
    full within this long (:func:`~gpuwarden.policy.rules.growth.snapshot.snapshot_due`); 16m, the
    imminent horizon (:data:`IMMINENT_SECONDS`), by default."""


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
    """The spans a GPU is judged over, ascending; the last is the window (docs/policy.md, "memoryGrowth")."""
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


HOST_LEAK_REASON = "HostMemoryLeakSuspected"
"""The reason of a ``memory: host`` growth finding (the kind's own, GPUMemoryLeakSuspected, for the rest)."""
IMMINENT_REASON = "GPUMemoryExhaustionImminent"
"""The reason of a GPU memory growth finding whose card is full within :data:`IMMINENT_SECONDS`."""
HOST_IMMINENT_REASON = "HostMemoryExhaustionImminent"
"""The reason of a ``memory: host`` finding whose memory limit is reached within :data:`IMMINENT_SECONDS`."""
IMMINENT_SECONDS = URGENCY * MIN_SPAN_SECONDS
"""16m: the card full within the longest urgent horizon, where the shortest span's caution is not
affordable. A finding with this reason keeps it while the card is full within twice this."""


@dataclass(frozen=True, slots=True)
class Change:
    """What memory did over the shortest span (a clearing's message): its first and last level."""

    first: float
    last: float
    span_seconds: float

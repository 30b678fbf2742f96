"""Judging memoryGrowth: which memory, which spans, whether a GPU holds or clears, and the pod's
outcome (:func:`evaluate_growth`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwarden.policy.rules.common import Outcome, WindowParams, pod_end, unknown
from gpuwarden.policy.rules.growth.cache import GrowthCache
from gpuwarden.policy.rules.growth.model import (
    BUCKETS,
    CLEAR_FIT,
    CLEAR_RATE,
    CLEAR_RECENT,
    HOLD_PART,
    HOST_IMMINENT_REASON,
    HOST_LEAK_REASON,
    IMMINENT_REASON,
    IMMINENT_SECONDS,
    JUMP_SHARE,
    KIND,
    REUSE_SHARE,
    S_SHAPE,
    SCREEN_RATE,
    UNIT,
    URGENCY,
    URGENT_FIT,
    URGENT_JUMP_SHARE,
    URGENT_PART,
    URGENT_SIGNIFICANCE_Z,
    URGENT_SPANS,
    Change,
    MemoryGrowth,
    MemorySource,
    evidence_spans,
    urgent_spans,
)
from gpuwarden.policy.rules.growth.shape import (
    GpuGrowth,
    SpanEnds,
    capacity,
    growth_window,
    peak_before,
    span_ends,
)
from gpuwarden.policy.rules.growth.text import growth_message
from gpuwarden.policy.stats import pairwise_slopes, sen_lower_bound
from gpuwarden.policy.store.series import Column, PodId, SeriesKey, Window


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

    A short span is believed only on the strictest evidence (docs/policy.md, "Urgency", lists it): a step, a
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


def _judge_gpu(
    rule: MemoryGrowth,
    key: SeriesKey,
    window: Window,
    end: float,
    params: WindowParams,
    cache: GrowthCache,
    column: Column = Column.MEM_USED,
) -> _Verdict | None:
    """The GPU's verdict: it holds when some span holds, and clears as docs/policy.md says.

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
    """Judge a memoryGrowth rule for one pod (docs/policy.md, "memoryGrowth"); the tracker applies ``for``.

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

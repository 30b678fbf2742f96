"""memoryGrowth: GPU memory growing in a straight line (a leak), and the time until the card is full.

Semantics (the window, coverage and as-of time are in :mod:`gpuwarden.policy.rules`):

- **Per GPU**, over ``[end - window, end]``: the window is cut into
  :data:`BUCKETS` equal spans and each span reduced to the median of its
  memory readings (so transient allocations do not count, and the cost is
  bounded whatever the sampling rate). Through those points:

  - ``slope``: the Theil-Sen slope, bytes per second;
  - ``fit``: R² of that line, 0..1 (see :func:`gpuwarden.policy.slope.r_squared`):
    near 1 for a steady ramp even when noisy, low for a sawtooth
    (allocate/free) or a staircase that stopped climbing;
  - ``recent slope``: the Theil-Sen slope of the last third of the buckets, so
    that growth that has stopped (a caching allocator warming up, then
    plateauing) does not count however straight it was before;
  - ``seconds to full``: ``(total - used now) / slope``, with ``used now`` the
    newest reading and ``total`` the card's memory.

- **Holds** for a GPU when it covers the window, ``slope >= rate``,
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

from collections.abc import Sequence
from dataclasses import dataclass

from gpuwarden.policy.humanize import approx_duration, format_bytes
from gpuwarden.policy.model import MemoryGrowth
from gpuwarden.policy.rules import Outcome, RuleKind, WindowParams, covered, pod_end, readings, unknown
from gpuwarden.policy.series import Column, PodId, SeriesKey, Window
from gpuwarden.policy.slope import bucket_medians, fit_line, theil_sen

BUCKETS = 30
"""Bucket medians per window: 435 pairwise slopes, whatever the sampling rate."""
MIN_BUCKETS = 6
"""Fewer non-empty buckets than this: too little to judge (nothing holds or clears)."""
RECENT_BUCKETS = BUCKETS // 3
HOLD_RECENT = 0.5
"""The recent slope must be at least this share of ``rate`` for the rule to hold."""
CLEAR_RATE = 0.8
CLEAR_FIT = 0.1
CLEAR_RECENT = 0.25
UNIT = "bytes/s"


@dataclass(frozen=True, slots=True)
class GpuGrowth:
    """One GPU's memory trend over a window."""

    gpu: str
    slope: float
    """Bytes per second."""
    fit: float
    recent_slope: float
    used_bytes: float
    """The newest reading."""
    total_bytes: float | None
    covered: bool

    @property
    def seconds_to_full(self) -> float | None:
        """Seconds until the card is full at ``slope``; None when not growing or the total is unknown."""
        if self.total_bytes is None or self.slope <= 0:
            return None
        return max(0.0, (self.total_bytes - self.used_bytes) / self.slope)


def gpu_growth(
    gpu: str, window: Window, start: float, end: float, max_gap: float | None = None
) -> GpuGrowth | None:
    """One GPU's memory trend over ``[start, end]``, or None when there are too few readings to judge."""
    times, used = readings(window, Column.MEM_USED, start, end)
    if not used:
        return None
    xs, ys = bucket_medians(times, used, start, end, BUCKETS)
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
        covered=covered(times, start, end, max_gap),
    )


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


def describe(g: GpuGrowth) -> str:
    """``GPU memory grows 212Mi/m, fit 0.97; the card is full in 14m``."""
    text = f"GPU memory grows {format_bytes(g.slope * 60)}/m, fit {g.fit:.2f}"
    eta = g.seconds_to_full
    if eta is not None and g.total_bytes is not None:
        if eta <= 0:
            text += f"; the card is full ({format_bytes(g.total_bytes)})"
        else:
            text += f"; the card ({format_bytes(g.total_bytes)}) is full in {approx_duration(eta)}"
    return text


def evaluate_growth(
    rule: MemoryGrowth,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
) -> Outcome:
    """Judge a memoryGrowth rule for one pod (see the module doc); the finding tracker applies ``for``."""
    kind = RuleKind.MEMORY_GROWTH
    rate = rule.rate_bytes_per_second
    end = pod_end(series, now)
    if end is None or now - end > params.stale_after_seconds:
        return unknown(rule.name, kind, pod, rate, UNIT)
    start = end - rule.window_seconds
    trends = [
        g
        for key, window in series
        if (g := gpu_growth(key.gpu, window, start, end, params.max_gap_seconds)) is not None
    ]
    if not trends:
        return unknown(rule.name, kind, pod, rate, UNIT)
    holding = [g for g in trends if _holds(g, rule)]
    named = holding or [g for g in trends if not _clears(g, rule)]
    worst = max(holding or trends, key=lambda g: g.slope)
    message = describe(worst)
    if len(trends) > 1 and named:
        message += f" (on {len(named)} of {len(trends)} GPUs)"
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
        message=message,
        fit=worst.fit,
        seconds_to_full=worst.seconds_to_full,
    )

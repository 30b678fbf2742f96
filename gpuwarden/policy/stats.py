"""Robust straight lines: Theil-Sen slope, its fit, and the bucketing that bounds their cost.

Theil-Sen takes the median of the slopes between every pair of points: up to
29% of the points can be arbitrary outliers and the slope barely moves. It
costs n²/2 slopes, so callers first reduce a window to a few dozen bucket
medians (:func:`bucket_medians`): each bucket summarises all of its readings
(nothing is skipped, so nothing aliases with a periodic pattern), and a
bucket's median shrugs off transient allocations.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter, le, sub, truediv
from typing import Any


@dataclass(slots=True)
class LineFit:
    """``y ≈ intercept + slope * x``, with ``fit`` the R² of that line, clipped to 0..1.

    ``lower`` is a one-sided lower confidence bound on the slope (see :func:`sen_lower_bound`).
    """

    slope: float
    intercept: float
    fit: float
    lower: float


def pairwise_slopes(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """The slopes between every pair of points, ascending.

    ``xs`` must be strictly ascending, at least two of them.
    """
    n = len(xs)
    xl, yl = list(xs), list(ys)
    # Each x against its predecessor, C-level (a generator over pairwise() cost a fifth of a fit).
    if n < 2 or any(map(le, xl[1:], xl[:-1])):
        raise ValueError("theil_sen needs at least two strictly ascending x values")
    if n < 3:
        return [(yl[1] - yl[0]) / (xl[1] - xl[0])]
    # Every pair at once, C-level: a cached itemgetter picks each pair's later and earlier
    # points, ~20 ns a pair.
    later, earlier = _pairs(n)
    slopes = list(map(truediv, map(sub, later(yl), earlier(yl)), map(sub, later(xl), earlier(xl))))
    slopes.sort()
    return slopes


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Theil-Sen slope (median of pairwise slopes) and intercept (median of ``y - slope * x``).

    ``xs`` must be strictly ascending, at least two of them. Center them near
    zero (e.g. seconds before the window's end) to keep the intercept precise.
    """
    slope = _median_sorted(pairwise_slopes(xs, ys))
    return slope, _intercept(xs, ys, slope)


def _intercept(xs: Sequence[float], ys: Sequence[float], slope: float) -> float:
    return median([y - slope * x for x, y in zip(xs, ys, strict=True)])


def sen_lower_bound(slopes: Sequence[float], n: int, z: float) -> float:
    """Sen's one-sided lower confidence bound on the Theil-Sen slope of ``n`` points.

    ``slopes`` are the ``n (n - 1) / 2`` pairwise slopes, ascending. Under
    independent residuals the number of pairwise slopes below the true slope
    has the variance of Kendall's S, ``n (n - 1) (2n + 5) / 18``; the bound is
    the slope ``z`` of its standard deviations below the median rank (Sen
    1968). -inf when ``n`` is too small for that confidence.
    """
    rank = int((len(slopes) - z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)) / 2)
    return slopes[rank - 1] if rank >= 1 else -math.inf


# Bounded: the engine asks for a few sizes only (bucket counts up to BUCKETS, quarters of them), but
# an entry for n points holds n(n-1) indexes, and a caller with ever new sizes must not grow it for good.
@lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[itemgetter[Any], itemgetter[Any]]:
    """For ``n >= 3`` points: getters of each pair's later and earlier point, lag 1 first, then lag 2, …."""
    pairs = [(i + lag, i) for lag in range(1, n) for i in range(n - lag)]
    return itemgetter(*(j for j, _ in pairs)), itemgetter(*(i for _, i in pairs))


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence (the mean of the two middle values for an even count)."""
    return _median_sorted(sorted(values))


def _median_sorted(ordered: Sequence[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def r_squared(xs: Sequence[float], ys: Sequence[float], slope: float, intercept: float) -> float:
    """Share of the variance of ``ys`` the line explains, clipped to 0..1 (0 for constant ``ys``).

    Computed against the given (robust) line rather than the least-squares one,
    so it can only be lower: a staircase that stopped or a sawtooth leaves large
    residuals around any straight line and scores low; a noisy but steady
    ramp scores near 1.
    """
    mean = sum(ys) / len(ys)
    total = sum((y - mean) ** 2 for y in ys)
    if total <= 0:
        return 0.0
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return min(1.0, max(0.0, 1.0 - residual / total))


def fit_line(xs: Sequence[float], ys: Sequence[float], z: float) -> LineFit:
    """Theil-Sen line through the points, its R² (see :func:`r_squared`) and its slope's lower bound.

    ``z`` sets the bound's confidence in standard deviations (see :func:`sen_lower_bound`).
    """
    slopes = pairwise_slopes(xs, ys)
    slope = _median_sorted(slopes)
    intercept = _intercept(xs, ys, slope)
    return LineFit(slope, intercept, r_squared(xs, ys, slope, intercept), sen_lower_bound(slopes, len(xs), z))


def bucket_medians(
    times: Sequence[float], values: Sequence[float], start: float, end: float, buckets: int
) -> tuple[list[float], list[float]]:
    """Split ``[start, end]`` into ``buckets`` equal spans; return non-empty spans' centers and medians.

    A median here is the lower middle value for an even count, always one of the readings: the
    mean of the two middle ones turns a step in the middle of a bucket into two half rises, and
    steps that do so every few buckets into what looks like a line (the jump measure then takes
    half a step for the typical rise). ``times`` must be ascending and ``values`` free of NaN.
    Centers are relative to ``end`` (negative seconds), ready for :func:`theil_sen`.
    """
    width = (end - start) / buckets
    xs: list[float] = []
    ys: list[float] = []
    lo = bisect_left(times, start)
    for k in range(buckets):
        hi = len(times) if k == buckets - 1 else bisect_left(times, start + (k + 1) * width, lo)
        if hi > lo:
            xs.append(start + (k + 0.5) * width - end)
            # The lower median, inline: it runs per bucket of every refit.
            ordered = sorted(values[lo:hi])
            ys.append(ordered[(hi - lo - 1) // 2])
        lo = hi
    return xs, ys

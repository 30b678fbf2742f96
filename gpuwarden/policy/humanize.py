"""Numbers as people read them in findings' messages: ``212Mi``, ``1.5Gi``, about ``14m``, ``12:03:04Z``,
``3.4s``."""

from __future__ import annotations

import math
from datetime import UTC, datetime

_BINARY = (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def format_bytes(n: float) -> str:
    """A size with a Kubernetes binary suffix and at most three significant digits: ``212Mi``, ``1.5Gi``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for suffix, size in _BINARY:
        if n >= size:
            return f"{sign}{_significant(n / size)}{suffix}"
    return f"{sign}{n:.0f}"


def _significant(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}".removesuffix(".0")
    return f"{x:.2f}".rstrip("0").removesuffix(".")


def approx_duration(seconds: float) -> str:
    """A projected duration, to its two largest units: ``45s``, ``14m``, ``1h5m``, ``2d3h``.

    For estimates; a policy's own durations read exactly through
    :func:`gpuwarden.units.format_duration`.
    """
    if not math.isfinite(seconds):
        return "never"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    parts = []
    for suffix, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, s = divmod(s, size)
        if count:
            parts.append(f"{count}{suffix}")
    return "".join(parts[:2])


def time_of_day(epoch: float) -> str:
    """When something happened, for a message: UTC to the second, ``12:03:04Z``.

    Absolute, not "4m ago": a message that does not change with time is written once.
    """
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%SZ")


def format_latency(seconds: float) -> str:
    """A latency for a message, to three significant digits: ``850ms``, ``3.4s``, ``12.5s``."""
    if seconds < 1:
        return f"{_significant(seconds * 1000)}ms"
    return f"{_significant(seconds)}s"


def format_count(n: float) -> str:
    """A count or a mean of counts, to three significant digits: ``12``, ``7.5``, ``0.25``."""
    return _significant(n)

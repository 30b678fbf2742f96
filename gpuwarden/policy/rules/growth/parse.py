"""Reading a memoryGrowth rule's body (the CRD's defaults, its bounds, its messages)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwarden.policy.rules.growth.model import MemoryGrowth, MemorySource
from gpuwarden.policy.spec.fields import (
    SpecError,
    check_fields,
    duration,
    member,
    number,
    type_name,
    value_or,
)
from gpuwarden.units import parse_rate

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

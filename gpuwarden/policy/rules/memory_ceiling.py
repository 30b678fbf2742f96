"""memoryCeiling: GPU memory used stayed above a limit for the whole ``for`` window.

Semantics (the window, coverage and as-of time are in :mod:`gpuwarden.policy.rules.common`):

- **Per GPU.** The GPU's value is the *lowest* memory used over
  ``[end - for, end]``: the level it stayed above for the whole window. With
  ``percent`` it is a share of the card's total memory (as last reported; a GPU
  that never reported its total cannot be judged), with ``bytes`` a size.
- **Holds** when some GPU covers the window and its value is above the limit;
  each GPU is judged on its own readings, so one GPU's gap does not hide
  another's full card. The pod's value is its worst GPU's; the finding names
  the GPUs over the limit.
- **Clears** when every GPU's value is at or below the limit minus
  ``hysteresis`` (percentage points of the card with ``percent``; per cent of
  ``bytes`` with ``bytes``): memory dipped clearly below the limit within the window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.humanize import format_bytes
from gpuwarden.policy.rules.common import (
    Outcome,
    RuleKind,
    RuleType,
    WindowParams,
    covered,
    on_series,
    percent,
    pod_end,
    readings,
    unknown,
)
from gpuwarden.policy.spec.fields import SpecError
from gpuwarden.policy.spec.schema import Body, Bytes, Check, Duration, Number
from gpuwarden.policy.store.series import Column, PodId, SeriesKey, Window
from gpuwarden.units import format_duration

KIND = RuleKind("memoryCeiling")
"""Its kind: its key under ``spec.rules[]``."""


@dataclass(frozen=True, slots=True)
class MemoryCeiling:
    """Fires when GPU memory used stays above a share of the card or an absolute size."""

    name: str
    for_seconds: float
    percent: float | None = None
    bytes: int | None = None
    hysteresis: float = 2.0
    """Percent of the card (or of ``bytes``) below the threshold needed to clear."""


@dataclass(slots=True)
class GpuMemoryLevel:
    """The memory a GPU stayed above over a window."""

    gpu: str
    low_bytes: float
    total_bytes: float | None
    value: float
    """In the rule's unit: percent of the card, or bytes."""
    covered: bool


def _limits(rule: MemoryCeiling) -> tuple[float, float, str]:
    """The rule's threshold, clear line and unit."""
    if rule.percent is not None:
        return rule.percent, rule.percent - rule.hysteresis, "percent"
    if rule.bytes is None:
        raise ValueError(f"memoryCeiling {rule.name!r} has neither percent nor bytes")
    return float(rule.bytes), rule.bytes * (1 - rule.hysteresis / 100), "bytes"


def memory_message(o: Outcome) -> str:
    """``GPU memory stayed above 95% of the card (76Gi of 80Gi) for 1m, limit 90%`` (sizes with ``bytes``)."""
    low = format_bytes(o.level_bytes or 0.0)
    if o.unit == "percent":
        level = f"{percent(o.value or 0.0)} of the card ({low} of {format_bytes(o.total_bytes or 0.0)})"
        limit = percent(o.threshold)
    else:
        level, limit = low, format_bytes(o.threshold)
    on = f" on {len(o.gpus)} of {o.gpu_count} GPUs" if o.gpu_count > 1 and o.gpus else ""
    return f"GPU memory stayed above {level} for {format_duration(o.window_seconds)}{on}, limit {limit}"


def evaluate_memory_ceiling(
    rule: MemoryCeiling,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
) -> Outcome:
    """Judge a memoryCeiling rule for one pod (see the module doc)."""
    kind = KIND
    threshold, clear_line, unit = _limits(rule)
    end = pod_end(series, now, params)
    if end is None:
        return unknown(rule.name, kind, pod, threshold, unit)
    start = end - rule.for_seconds
    levels: list[GpuMemoryLevel] = []
    for key, window in series:
        r = readings(window, Column.MEM_USED, start, end)
        if not r.values:
            continue
        total = window.mem_total
        low = min(r.values)
        if unit == "percent":
            if not total:
                continue
            value = 100.0 * low / total
        else:
            value = low
        levels.append(
            GpuMemoryLevel(key.gpu, low, total, value, covered(r, start, end, params.max_gap_seconds))
        )
    if not levels:
        return unknown(rule.name, kind, pod, threshold, unit)

    over = [g for g in levels if g.covered and g.value > threshold]
    holds = bool(over)
    clears = all(g.value <= clear_line for g in levels)
    named = over if holds else [g for g in levels if g.value > clear_line]
    worst = max(over or levels, key=lambda g: g.value)

    return Outcome(
        rule.name,
        kind,
        pod,
        worst.value,
        threshold,
        unit,
        holds=holds,
        clears=clears,
        gpus=tuple(g.gpu for g in named),
        gpu_count=len(levels),
        window_seconds=rule.for_seconds,
        level_bytes=worst.low_bytes,
        total_bytes=worst.total_bytes,
        describe=memory_message,
    )


# --- the kind ----------------------------------------------------------------------------------------

PERCENT = Number(
    "percent", "The threshold as a percentage (0-100) of the GPU's total memory.", minimum=0, maximum=100
)
BYTES = Bytes(
    "bytes",
    "the threshold as an absolute size, a whole number of bytes or a Kubernetes quantity such as"
    " 120Gi, 80G or 1.5Ti.",
)
FOR = Duration(
    "for",
    "How long memory must stay above the limit (a duration such as 1m, at least evaluationInterval):"
    " the lowest reading in the trailing window must be above it, and the GPU's samples must cover the"
    " window without gaps.",
    default="1m",
    window=True,
)
HYSTERESIS = Number(
    "hysteresis",
    "How far below the threshold memory must fall before an active violation clears: percentage"
    " points of the GPU's memory with percent, percent of the bytes threshold with bytes.",
    minimum=0,
    maximum=50,
    default=2,
)
BODY = Body(
    "Fires when the memory used on one of the pod's GPUs stays above a share of that GPU's total"
    " memory (percent) or an absolute size (bytes) for the whole `for` window: close to out-of-memory."
    " Each GPU is judged on its own. Set exactly one of percent and bytes.",
    (PERCENT, BYTES, FOR, HYSTERESIS),
    (
        Check(
            "has(self.percent) != has(self.bytes)", "memoryCeiling must set exactly one of percent or bytes"
        ),
    ),
)


def parse_memory_ceiling(name: str, obj: Mapping[str, Any], path: str) -> MemoryCeiling:
    """A memoryCeiling rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    has_percent, has_bytes = obj.get("percent") is not None, obj.get("bytes") is not None
    if has_percent == has_bytes:  # the body's Check
        found = "both" if has_percent else "neither"
        raise SpecError(path, f"memoryCeiling must set exactly one of percent or bytes; found {found}")
    return MemoryCeiling(
        name=name,
        for_seconds=FOR.read(obj, path),
        percent=PERCENT.get(obj, path),
        bytes=BYTES.get(obj, path),
        hysteresis=HYSTERESIS.read(obj, path),
    )


RULE_TYPE = RuleType(
    kind=KIND,
    model=MemoryCeiling,
    parse=parse_memory_ceiling,
    body=BODY,
    evaluate=on_series(evaluate_memory_ceiling),
    reach=lambda rule: rule.for_seconds,
    window=lambda rule: rule.for_seconds,
    reason="GPUMemoryNearLimit",
    meaning="it is close to running out of GPU memory",
    per_gpu=True,
    colour="tab:orange",
    utilization=False,
)

"""utilizationFloor and utilizationCeiling: a pod's mean GPU activity over the rule's ``for`` window.

Semantics (the window, coverage and as-of time are in :mod:`gpuwarden.policy.rules.common`):

- **Signal.** ``smActive`` or ``gpuUtil`` as the rule says; ``auto`` uses a GPU's
  smActive readings when it has any in the window, else its gpuUtil readings.
  (gpuUtil reads near 100 under a trickle of tiny kernels; SM activity is the
  share of SM cycles doing work.) What a reading is made of depends on the
  subject, and the message says it: smActive is the device's GPM SM activity;
  gpuUtil is the device counter (utilization.gpu) for a subject alone on its GPU,
  and on a shared GPU the sum of the subject's per-process SM utilization, 0 for
  a process NVML's per-process reading leaves out (it ran no kernel). GPM
  cannot be split per process, so on a shared GPU ``auto`` judges per-process
  SM utilization and ``smActive`` has nothing to judge.
- **Noise floor** (floor only). A reading at or below ``noiseFloor`` counts as 0.
- **Value.** Per GPU, the mean of its readings over ``[end - for, end]``; for the
  pod, the mean of its GPUs' means (the same as averaging the GPUs at each
  timestamp, since one node snapshot samples them together). A pod holding 8
  GPUs and using one reads 12.5%.
- **"For" is the window.** The rule holds when every GPU covers the window and
  the mean is below (floor) / above (ceiling) ``percent``. Brief spikes lift the
  mean only a little, so an idle GPU with brief spikes still trips the floor;
  it is spared only when its activity lifts the mean over the window.
- **Power** (floor only). With ``powerThresholdWatts``, a GPU whose mean power
  draw over the window is at least the threshold counts as busy: the floor does
  not hold for its pod, and an active finding clears.
- **Clearing.** A floor finding clears once the mean is at or above
  ``percent + hysteresis`` (or a GPU is busy by power); a ceiling finding once it
  is at or below ``percent - hysteresis``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.rules.activity import UNIT, signal_name, trailing_activity
from gpuwarden.policy.rules.common import (
    Outcome,
    RuleKind,
    RuleType,
    WindowParams,
    percent,
    unknown,
)
from gpuwarden.policy.rules.throttling import judged_with_throttling
from gpuwarden.policy.spec.model import Signal
from gpuwarden.policy.spec.schema import Body, Choice, Duration, Number
from gpuwarden.policy.store.series import PodId, SeriesKey, Window
from gpuwarden.units import format_duration

FLOOR_KIND = RuleKind("utilizationFloor")
"""The floor's kind: its key under ``spec.rules[]``."""
CEILING_KIND = RuleKind("utilizationCeiling")
"""The ceiling's kind."""


@dataclass(frozen=True, slots=True)
class UtilizationFloor:
    """Fires when a pod's GPUs stay below ``percent`` for ``for_seconds`` (idle or wasted GPUs)."""

    name: str
    percent: float
    for_seconds: float
    signal: Signal = Signal.AUTO
    noise_floor: float = 0.0
    """Readings at or below this count as 0 (monitoring chatter)."""
    power_threshold_watts: float | None = None
    """If set, a GPU drawing at least this much power is treated as busy and never idle."""
    hysteresis: float = 5.0
    """Percentage points past the threshold the value must go before a finding clears."""


@dataclass(frozen=True, slots=True)
class UtilizationCeiling:
    """Fires when a pod's GPUs stay above ``percent`` for ``for_seconds`` (saturation)."""

    name: str
    percent: float
    for_seconds: float
    signal: Signal = Signal.AUTO
    hysteresis: float = 5.0


def _mean_over(o: Outcome) -> str:
    across = f" across {o.gpu_count} GPUs" if o.gpu_count > 1 else ""
    return f"mean {o.signal} {percent(o.value or 0.0)} over {format_duration(o.window_seconds)}{across}"


def floor_message(o: Outcome) -> str:
    """``mean SM activity (GPM) 3% over 5m, floor 20%`` (``; busy by power (310 W)`` when it is)."""
    text = f"{_mean_over(o)}, floor {percent(o.threshold)}"
    if o.busy_watts is not None:
        text += f"; busy by power ({o.busy_watts:.0f} W)"
    return text


def ceiling_message(o: Outcome) -> str:
    """``mean per-process SM utilization 97% over 2m, ceiling 95%``."""
    return f"{_mean_over(o)}, ceiling {percent(o.threshold)}"


def evaluate_floor(
    rule: UtilizationFloor,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
) -> Outcome:
    """Judge a utilizationFloor rule for one pod (see the module doc)."""
    kind = FLOOR_KIND
    gpus = trailing_activity(
        series,
        rule.signal,
        rule.for_seconds,
        now,
        params,
        noise_floor=rule.noise_floor,
        with_power=rule.power_threshold_watts is not None,
    )
    means = [g.mean for g in gpus if g.mean is not None]
    if not means:
        return unknown(rule.name, kind, pod, rule.percent, UNIT)
    value = sum(means) / len(means)
    busy = [
        g
        for g in gpus
        if rule.power_threshold_watts is not None
        and g.power_w is not None
        and g.power_w >= rule.power_threshold_watts
    ]
    complete = all(g.covered for g in gpus)
    holds = complete and value < rule.percent and not busy
    clears = not holds and (value >= rule.percent + rule.hysteresis or bool(busy))

    return Outcome(
        rule.name,
        kind,
        pod,
        value,
        rule.percent,
        UNIT,
        holds=holds,
        clears=clears,
        gpus=tuple(g.gpu for g in gpus),
        gpu_count=len(gpus),
        window_seconds=rule.for_seconds,
        signal=signal_name(gpus),
        busy_watts=max(g.power_w or 0.0 for g in busy) if busy else None,
        describe=floor_message,
    )


def evaluate_ceiling(
    rule: UtilizationCeiling,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
) -> Outcome:
    """Judge a utilizationCeiling rule for one pod (see the module doc)."""
    kind = CEILING_KIND
    gpus = trailing_activity(series, rule.signal, rule.for_seconds, now, params)
    means = [g.mean for g in gpus if g.mean is not None]
    if not means:
        return unknown(rule.name, kind, pod, rule.percent, UNIT)
    value = sum(means) / len(means)
    holds = all(g.covered for g in gpus) and value > rule.percent
    clears = not holds and value <= rule.percent - rule.hysteresis
    return Outcome(
        rule.name,
        kind,
        pod,
        value,
        rule.percent,
        UNIT,
        holds=holds,
        clears=clears,
        gpus=tuple(g.gpu for g in gpus),
        gpu_count=len(gpus),
        window_seconds=rule.for_seconds,
        signal=signal_name(gpus),
        describe=ceiling_message,
    )


# --- the two kinds ------------------------------------------------------------------------------------


_SIGNAL = Choice(
    "signal",
    "Which utilization reading to use. smActive: the fraction of time SMs had work (GPM, Hopper and"
    " newer). gpuUtil: NVML's utilization.gpu, the fraction of time any kernel ran. auto: smActive"
    " where the GPU reports it, gpuUtil elsewhere. On a GPU shared by several pods, gpuUtil is the"
    " pod's own per-process SM utilization and smActive has no value (it cannot be split per pod).",
    choices=Signal,
    default=Signal.AUTO,
)


def _percent(side: str) -> Number:
    return Number(
        "percent",
        f"The threshold in percent (0-100); the rule holds while the pod's mean utilization over the"
        f" window is {side} it.",
        minimum=0,
        maximum=100,
        required=True,
    )


FLOOR_PERCENT = _percent("below")
FLOOR_FOR = Duration(
    "for",
    "The trailing window the utilization is averaged over (a duration such as 5m, at least"
    " evaluationInterval). Every GPU's samples must cover it without gaps before the rule can fire:"
    " missing samples never count as idle.",
    default="5m",
    window=True,
)
NOISE_FLOOR = Number(
    "noiseFloor",
    "Readings at or below this percentage count as 0, so monitoring chatter (health probes, periodic"
    " tiny kernels) does not mask an idle GPU.",
    minimum=0,
    maximum=100,
    default=0,
)
POWER_THRESHOLD = Number(
    "powerThresholdWatts",
    "Optional: a GPU whose mean power draw over the window is at least this many watts counts as"
    " busy whatever its utilization reading (catches work the counters miss); the rule does not hold"
    " for its pod, and an active violation clears.",
    minimum=0,
)
FLOOR_HYSTERESIS = Number(
    "hysteresis",
    "Percentage points the mean utilization must rise above percent before an active violation"
    " clears (it clears at percent + hysteresis or more), so a value hovering at the threshold does"
    " not flap.",
    minimum=0,
    maximum=50,
    default=5,
)
FLOOR_BODY = Body(
    "Fires when a pod's GPU utilization, averaged over the trailing `for` window and over the pod's"
    " GPUs, is below percent, with every GPU's samples covering the window: GPUs held but barely"
    " used.",
    (FLOOR_PERCENT, FLOOR_FOR, _SIGNAL, NOISE_FLOOR, POWER_THRESHOLD, FLOOR_HYSTERESIS),
)

CEILING_PERCENT = _percent("above")
CEILING_FOR = Duration(
    "for",
    "The trailing window the utilization is averaged over (a duration such as 2m, at least"
    " evaluationInterval). Every GPU's samples must cover it without gaps before the rule can fire.",
    default="2m",
    window=True,
)
CEILING_HYSTERESIS = Number(
    "hysteresis",
    "Percentage points the mean utilization must fall below percent before an active violation"
    " clears (it clears at percent - hysteresis or less), so a value hovering at the threshold does"
    " not flap.",
    minimum=0,
    maximum=50,
    default=5,
)
CEILING_BODY = Body(
    "Fires when a pod's GPU utilization, averaged over the trailing `for` window and over the pod's"
    " GPUs, is above percent, with every GPU's samples covering the window: saturated, a candidate for"
    " scaling out.",
    (CEILING_PERCENT, CEILING_FOR, _SIGNAL, CEILING_HYSTERESIS),
)


def parse_floor(name: str, obj: Mapping[str, Any], path: str) -> UtilizationFloor:
    """A utilizationFloor rule's body (``path`` is its own)."""
    FLOOR_BODY.check(obj, path)
    return UtilizationFloor(
        name=name,
        percent=FLOOR_PERCENT.read(obj, path),
        for_seconds=FLOOR_FOR.read(obj, path),
        signal=_SIGNAL.read(obj, path),
        noise_floor=NOISE_FLOOR.read(obj, path),
        power_threshold_watts=POWER_THRESHOLD.get(obj, path),
        hysteresis=FLOOR_HYSTERESIS.read(obj, path),
    )


def parse_ceiling(name: str, obj: Mapping[str, Any], path: str) -> UtilizationCeiling:
    """A utilizationCeiling rule's body (``path`` is its own)."""
    CEILING_BODY.check(obj, path)
    return UtilizationCeiling(
        name=name,
        percent=CEILING_PERCENT.read(obj, path),
        for_seconds=CEILING_FOR.read(obj, path),
        signal=_SIGNAL.read(obj, path),
        hysteresis=CEILING_HYSTERESIS.read(obj, path),
    )


FLOOR_TYPE = RuleType(
    kind=FLOOR_KIND,
    model=UtilizationFloor,
    parse=parse_floor,
    body=FLOOR_BODY,
    evaluate=judged_with_throttling(evaluate_floor, idle=True),
    reach=lambda rule: rule.for_seconds,
    window=lambda rule: rule.for_seconds,
    reason="GPUUnderutilized",
    meaning="its GPUs sit mostly idle: release them, share them or scale in",
    per_gpu=False,
    colour="tab:purple",
    utilization=True,
    forecast_floor=lambda rule: rule.percent,
    idle="pod",
)

CEILING_TYPE = RuleType(
    kind=CEILING_KIND,
    model=UtilizationCeiling,
    parse=parse_ceiling,
    body=CEILING_BODY,
    evaluate=judged_with_throttling(evaluate_ceiling, idle=False),
    reach=lambda rule: rule.for_seconds,
    window=lambda rule: rule.for_seconds,
    reason="GPUSaturated",
    meaning="its GPUs are fully busy: it may need more replicas",
    per_gpu=False,
    colour="tab:red",
    utilization=True,
    forecast_ceiling=lambda rule: (rule.percent, rule.signal),
)

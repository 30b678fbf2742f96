"""Throttling beside utilization verdicts, and the throttling classes gpuHealth counts.

**Throttling beside utilization** (:func:`throttling_note`): a GPU read by its device-wide
utilization (not a shared GPU's per-process readings: see :func:`with_throttling`) and held down by thermal,
power or hardware slowdown reasons for at least :data:`THROTTLED_SHARE` of a utilization
rule's window is not idle: its utilization measures the throttling, not the workload. So a
utilizationFloor does not hold for its pod, and an active finding clears, with the reason in
the message (``…; throttled 80% of the window (thermal): not idle``), as a GPU busy by power
does; a utilizationCeiling still holds (the GPU is saturated either way) and says so
(``…; throttled 80% of the window (thermal)``): more replicas may not help a GPU that is hot.

Its own module because the utilization kinds and gpuHealth share it, and kinds do not import kinds.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from gpuwarden.policy.rules.common import Judge, JudgeContext, Outcome, WindowParams, pod_end
from gpuwarden.policy.store.health import HealthStore
from gpuwarden.policy.store.series import PodId, SeriesKey, UtilizationSource, Window
from gpuwarden.wire.node import ClockEventReason


class Throttling(enum.StrEnum):
    """A class of clock event reasons a gpuHealth rule can count (:data:`THROTTLING_REASONS`)."""

    THERMAL = "thermal"  # swThermalSlowdown, hwThermalSlowdown
    POWER = "power"  # swPowerCap, hwPowerBrakeSlowdown
    HW_SLOWDOWN = "hwSlowdown"


THROTTLING_REASONS: Mapping[Throttling, frozenset[ClockEventReason]] = {
    Throttling.THERMAL: frozenset(
        {ClockEventReason.SW_THERMAL_SLOWDOWN, ClockEventReason.HW_THERMAL_SLOWDOWN}
    ),
    Throttling.POWER: frozenset({ClockEventReason.SW_POWER_CAP, ClockEventReason.HW_POWER_BRAKE_SLOWDOWN}),
    Throttling.HW_SLOWDOWN: frozenset({ClockEventReason.HW_SLOWDOWN}),
}
"""Which clock event reasons each throttling class stands for."""

ANY_THROTTLING = frozenset().union(*THROTTLING_REASONS.values())
"""Every reason that holds the clocks down for heat, power or the hardware's protection (not idling,
application clocks, sync boost or display settings)."""

THROTTLED_SHARE = 0.5
"""The share of a utilization rule's window a GPU must be throttled for to count as throttled."""

_CLASS_WORDS = {
    Throttling.THERMAL: "thermal",
    Throttling.POWER: "power",
    Throttling.HW_SLOWDOWN: "hardware slowdown",
}


def reasons_of(classes: Iterable[Throttling]) -> frozenset[ClockEventReason]:
    """The clock event reasons of some throttling classes."""
    return frozenset().union(*(THROTTLING_REASONS[c] for c in classes))


def throttling_words(reasons: Iterable[ClockEventReason]) -> str:
    """The classes some reasons belong to, in words: ``thermal, power``."""
    held = set(reasons)
    return ", ".join(_CLASS_WORDS[c] for c, rs in THROTTLING_REASONS.items() if held & rs)


def throttling_note(
    health: HealthStore | None, pod: PodId, gpus: Sequence[str], start: float, end: float
) -> tuple[str, bool]:
    """The note for a utilization outcome of ``pod`` over ``[start, end]``, and whether a GPU was throttled.

    ``gpus`` are the series' GPU ids (MIG device UUIDs included), each read from the record of
    the node that reported the pod on it: another node's word on that UUID counts for nothing.
    Empty note when none was throttled for :data:`THROTTLED_SHARE` of the window.
    """
    if health is None:
        return "", False
    worst = 0.0
    held: set[ClockEventReason] = set()
    for gpu in gpus:
        record = health.gpu_of(pod.namespace, pod.name, gpu)
        if record is None:
            continue
        share, reasons = record.throttled_share(ANY_THROTTLING, start, end)
        if share >= THROTTLED_SHARE:
            worst = max(worst, share)
            held |= reasons
    if not held:
        return "", False
    return f"throttled {round(worst * 100)}% of the window ({throttling_words(held)})", True


def with_throttling(
    outcome: Outcome,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
    health: HealthStore | None,
    *,
    idle: bool,
) -> Outcome:
    """A utilization rule's outcome, with throttling as a reason beside it (see the module doc);
    ``idle``: whether its outcome says the GPUs are idle (a floor's), which throttling belies."""
    if health is None or outcome.value is None or not outcome.gpus:
        return outcome
    end = pod_end(series, now, params)
    if end is None:
        return outcome
    # Only a device-wide reading measures the throttling. A process's own share of SM time on a
    # shared GPU does not drop when the clocks do, and a process that ran no kernel is idle
    # however the GPU is held down (its clocks are the other processes' doing: an H200 at full
    # load sits at its power cap).
    device_read = {key.gpu for key, window in series if window.util_source is UtilizationSource.DEVICE}
    gpus = [gpu for gpu in outcome.gpus if gpu in device_read]
    note, throttled = throttling_note(health, outcome.pod, gpus, end - outcome.window_seconds, end)
    if not throttled:
        return outcome
    outcome.note = note
    if idle:
        # Its utilization measures the throttling, not the workload: not idle (as busy by power).
        outcome.note += ": not idle"
        outcome.holds = False
        outcome.clears = True
    return outcome


_R = TypeVar("_R")


def judged_with_throttling(
    evaluate: Callable[[_R, PodId, Sequence[tuple[SeriesKey, Window]], float, WindowParams], Outcome],
    *,
    idle: bool,
) -> Judge[_R, None]:
    """A utilization rule's evaluator, as a :data:`~gpuwarden.policy.rules.common.Judge`, with the
    GPUs' throttling noted beside its verdict (``idle``: see :func:`with_throttling`)."""

    def judge(rule: _R, c: JudgeContext, memo: None) -> Outcome:
        outcome = evaluate(rule, c.pod, c.series, c.now, c.params)
        return with_throttling(outcome, c.series, c.now, c.params, c.health, idle=idle)

    return judge

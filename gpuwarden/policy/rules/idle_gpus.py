"""idleGpus: some of a pod's GPUs stay idle while another works: it holds more GPUs than its work uses.

The waste a pooled utilization floor misses: a pod holding 8 GPUs with 3 idle and 5 busy reads
62.5% on average, far above any floor. The usual causes are a request larger than the job's
parallelism (a tensor-parallel size below the GPU count, a script that uses ``cuda:0`` only) and a
rank that stopped while the others wait for it.

Semantics (the window, coverage and as-of time are in :mod:`gpuwarden.policy.rules.common`; the
readings are utilization's, :func:`~gpuwarden.policy.rules.activity.trailing_activity`):

- **Per GPU**, the mean of its readings over ``[end - for, end]``, on the rule's ``signal``.
- **Idle**: a GPU whose mean is below ``percent``. **In use**: one whose mean is at least
  ``percent + hysteresis``.
- **Holds** when every GPU of the pod covers the window, some GPU is idle, and some other is in
  use. A pod with one GPU never holds (a utilizationFloor rule is for that), nor one whose GPUs
  are all idle: nothing of its work runs on the GPUs it holds, which is the floor's finding too.
- **Clears** when no GPU's mean is below ``percent + hysteresis``. In between (a GPU inside the
  margin, or every GPU idle) nothing changes: an active finding stays while the pod still leaves
  GPUs idle.
- **Value**: the least used GPU's mean; the finding names the idle GPUs (the status the first),
  none once no GPU is idle (a GPU inside the margin keeps an active finding but is not named).
- **Throttling**: as for utilizationFloor, an idle GPU throttled for half the window is not idle
  (:func:`~gpuwarden.policy.rules.throttling.with_throttling`).
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

KIND = RuleKind("idleGpus")
"""Its kind: its key under ``spec.rules[]``."""


@dataclass(frozen=True, slots=True)
class IdleGpus:
    """Fires when some of a pod's GPUs stay below ``percent`` while another is in use."""

    name: str
    for_seconds: float
    percent: float = 5.0
    """A GPU whose mean utilization over the window is below this is idle."""
    signal: Signal = Signal.AUTO
    hysteresis: float = 5.0
    """Percentage points above ``percent``: a GPU at least this far above it is in use, and the
    finding clears once every GPU is."""


def idle_message(o: Outcome) -> str:
    """``3 of 8 GPUs idle: mean SM activity (GPM) below 5% over 10m (lowest 0.4%), while the busiest
    averaged 97%``; ``no GPU idle: ...`` once none is."""
    window = format_duration(o.window_seconds)
    lowest = percent(o.value or 0.0)
    if not o.gpus:
        least = f"the least used averaged {lowest} {o.signal} over {window}"
        return f"no GPU idle: {least}, idle below {percent(o.threshold)}"
    busiest = o.extra if isinstance(o.extra, float) else 0.0
    return (
        f"{len(o.gpus)} of {o.gpu_count} GPUs idle: mean {o.signal} below {percent(o.threshold)} "
        f"over {window} (lowest {lowest}), while the busiest averaged {percent(busiest)}"
    )


def evaluate_idle_gpus(
    rule: IdleGpus,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
) -> Outcome:
    """Judge an idleGpus rule for one pod (see the module doc)."""
    gpus = trailing_activity(series, rule.signal, rule.for_seconds, now, params)
    read = sorted((g for g in gpus if g.mean is not None), key=lambda g: g.mean or 0.0)
    if not read:
        return unknown(rule.name, KIND, pod, rule.percent, UNIT)
    in_use = rule.percent + rule.hysteresis
    lowest = read[0].mean or 0.0
    busiest = read[-1].mean or 0.0
    idle = [g for g in read if (g.mean or 0.0) < rule.percent]
    holds = bool(idle) and busiest >= in_use and all(g.covered for g in gpus)
    clears = lowest >= in_use
    return Outcome(
        rule.name,
        KIND,
        pod,
        lowest,
        rule.percent,
        UNIT,
        holds=holds,
        clears=clears,
        gpus=tuple(g.gpu for g in idle),
        gpu_count=len(gpus),
        window_seconds=rule.for_seconds,
        signal=signal_name(idle or read[:1]),
        extra=busiest,
        describe=idle_message,
    )


# --- the kind ----------------------------------------------------------------------------------------

PERCENT = Number(
    "percent",
    "A GPU whose mean utilization over the window is below this percentage (0-100) is idle.",
    minimum=0,
    maximum=100,
    default=5,
)
FOR = Duration(
    "for",
    "The trailing window each GPU's utilization is averaged over (a duration such as 10m, at least"
    " evaluationInterval). Every GPU's samples must cover it without gaps before the rule can fire.",
    default="10m",
    window=True,
)
SIGNAL = Choice(
    "signal",
    "Which utilization reading to use, as for utilizationFloor: smActive (GPM), gpuUtil (NVML's"
    " utilization.gpu; on a shared GPU the pod's own per-process SM utilization), or auto (smActive"
    " where the GPU reports it, gpuUtil elsewhere).",
    choices=Signal,
    default=Signal.AUTO,
)
HYSTERESIS = Number(
    "hysteresis",
    "Percentage points above percent: a GPU at least this far above it is in use, and an active"
    " violation clears once every GPU is (at percent + hysteresis or more).",
    minimum=0,
    maximum=50,
    default=5,
)
BODY = Body(
    "Fires when some of a pod's GPUs stay idle (mean utilization over the trailing `for` window below"
    " percent) while another is in use (at least percent + hysteresis), with every GPU's samples"
    " covering the window: the pod holds more GPUs than its work uses. A pod with one GPU, or whose"
    " GPUs are all idle, never fires (that is utilizationFloor's finding).",
    (PERCENT, FOR, SIGNAL, HYSTERESIS),
)


def parse_idle_gpus(name: str, obj: Mapping[str, Any], path: str) -> IdleGpus:
    """An idleGpus rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    return IdleGpus(
        name=name,
        for_seconds=FOR.read(obj, path),
        percent=PERCENT.read(obj, path),
        signal=SIGNAL.read(obj, path),
        hysteresis=HYSTERESIS.read(obj, path),
    )


RULE_TYPE = RuleType(
    kind=KIND,
    model=IdleGpus,
    parse=parse_idle_gpus,
    body=BODY,
    evaluate=judged_with_throttling(evaluate_idle_gpus, idle=True),
    reach=lambda rule: rule.for_seconds,
    window=lambda rule: rule.for_seconds,
    reason="GPUIdleInPod",
    meaning="it holds GPUs its work does not use: request fewer, or spread the work over all of them",
    per_gpu=True,
    colour="tab:pink",
    utilization=True,
    idle="some",
)

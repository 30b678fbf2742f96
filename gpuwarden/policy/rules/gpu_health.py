"""gpuHealth: a pod's GPUs lost, failing or held down, judged from the health store.

**A GPU's problems** (:func:`gpu_problems`), as of ``now``, for one set of settings (a rule's,
or the operator's node view):

- *lost*: off the bus, for as long as it is;
- *XID*: one of the counted codes within the last ``hold`` seconds (each XID is an event; NVML
  never says one is over, so it counts for ``hold`` after it, and a GPU that keeps failing
  keeps raising them);
- *memory*: a rise of the uncorrected ECC count within the last ``hold``, or a memory repair
  (row remapping, page retirement) that failed or waits for a GPU reset, while reported;
- *throttling* (rules only): one of the counted clock event reasons, without a break for at
  least ``for``.

A GPU the agents have not reported for ``stale_after`` seconds has nothing to judge.

**gpuHealth** (:func:`evaluate_health`) holds while one of the pod's GPUs (those it was on in
the last ``stale_after`` seconds) has a problem, and clears as soon as none has; the finding's
value is the number of problems, its message the first problem GPU's, in words (XIDs with
their meaning and the recommended action, :mod:`gpuwarden.policy.xids`). Throttling beside
utilization verdicts is :mod:`gpuwarden.policy.rules.throttling`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.humanize import approx_duration, time_of_day
from gpuwarden.policy.rules.common import JudgeContext, Outcome, RuleKind, RuleType, WindowParams, unknown
from gpuwarden.policy.rules.throttling import Throttling, reasons_of, throttling_words
from gpuwarden.policy.spec.fields import SpecError, as_list, type_name
from gpuwarden.policy.spec.schema import Body, Boolean, Check, Choice, Duration, Integer, ListOf
from gpuwarden.policy.store.health import GpuRecord, HealthStore
from gpuwarden.policy.store.series import PodId
from gpuwarden.policy.xids import CRITICAL_XIDS, describe_xid
from gpuwarden.wire.node import ClockEventReason

KIND = RuleKind("gpuHealth")
"""Its kind: its key under ``spec.rules[]``."""


@dataclass(frozen=True, slots=True)
class GpuHealthRule:
    """Fires while one of a pod's GPUs is broken: lost, a counted XID, memory errors, or long throttling."""

    name: str
    xids: tuple[int, ...] = CRITICAL_XIDS
    """XID codes that count; each keeps the finding up for ``clear_after_seconds``."""
    gpu_lost: bool = True
    """A GPU off the bus counts, for as long as it is."""
    memory_errors: bool = True
    """A new uncorrected ECC error counts for ``clear_after_seconds``; a failed or pending memory repair
    (row remapping, page retirement) for as long as the GPU reports it."""
    throttling: tuple[Throttling, ...] = ()
    """Clock event classes that count once they held without a break for ``for_seconds``."""
    for_seconds: float = 300.0
    clear_after_seconds: float = 600.0


__all__ = [
    "KIND",
    "RULE_TYPE",
    "GpuHealthRule",
    "Problem",
    "evaluate_health",
    "gpu_problems",
    "parse_gpu_health",
]


UNIT = "problems"


@dataclass(frozen=True, slots=True)
class Problem:
    """Something wrong with one GPU; ``reason`` is a CamelCase word for a Node condition."""

    gpu: GpuRecord
    reason: str
    text: str


def gpu_name(record: GpuRecord) -> str:
    """``GPU 3 (GPU-8f3c…)``."""
    return f"GPU {record.index} ({record.uuid})"


def gpu_problems(
    record: GpuRecord,
    now: float,
    *,
    xids: Iterable[int],
    gpu_lost: bool = True,
    memory_errors: bool = True,
    hold: float,
    throttling: frozenset[ClockEventReason] = frozenset(),
    throttling_for: float = 0.0,
) -> list[Problem]:
    """What is wrong with one GPU as of ``now`` (see the module doc), most serious first."""
    out: list[Problem] = []
    if gpu_lost and record.lost_since is not None:
        out.append(Problem(record, "GPULost", f"off the bus since {time_of_day(record.lost_since)}"))
    seen = record.xids_since(now - hold, xids)
    if seen:
        t, code = seen[-1]
        more = f" (and {len(seen) - 1} more)" if len(seen) > 1 else ""
        out.append(Problem(record, "GPUXidError", f"{describe_xid(code)} at {time_of_day(t)}{more}"))
    if memory_errors:
        errors = record.ecc_since(now - hold)
        if errors:
            count = sum(n for _, n in errors)
            text = (
                f"{count} uncorrected ECC error{'s' if count != 1 else ''} since {time_of_day(errors[0][0])}"
            )
            out.append(Problem(record, "GPUMemoryError", text))
        if record.memory_repair is not None:
            out.append(Problem(record, "GPUMemoryError", f"{record.memory_repair} (reset the GPU)"))
    if throttling:
        lasted, held = record.throttled_for(throttling)
        if held and lasted >= throttling_for:
            what = throttling_words(held)
            out.append(Problem(record, "GPUThrottled", f"throttled ({what}) for {approx_duration(lasted)}"))
    return out


def health_message(o: Outcome) -> str:
    """The problem GPUs' problems, as :func:`evaluate_health` put them in :attr:`Outcome.detail`."""
    return o.detail or ("no problem" if o.value == 0 else "")


def evaluate_health(
    rule: GpuHealthRule, pod: PodId, health: HealthStore | None, now: float, params: WindowParams
) -> Outcome:
    """Judge a gpuHealth rule for one pod (see the module doc)."""
    kind = KIND
    if health is None:
        return unknown(rule.name, kind, pod, 0.0, UNIT)
    fresh = [
        r
        for r in health.gpus_of(pod.namespace, pod.name, since=now - params.stale_after_seconds)
        if r.fresh(now, params.stale_after_seconds)
    ]
    if not fresh:
        return unknown(rule.name, kind, pod, 0.0, UNIT)
    throttling = reasons_of(rule.throttling)
    by_gpu = [
        (record, problems)
        for record in fresh
        if (
            problems := gpu_problems(
                record,
                now,
                xids=rule.xids,
                gpu_lost=rule.gpu_lost,
                memory_errors=rule.memory_errors,
                hold=rule.clear_after_seconds,
                throttling=throttling,
                throttling_for=rule.for_seconds,
            )
        )
    ]
    count = sum(len(p) for _, p in by_gpu)
    text = ""
    if by_gpu:
        record, problems = by_gpu[0]
        text = f"{gpu_name(record)}: " + "; ".join(p.text for p in problems)
        if len(by_gpu) > 1:
            text += f"; and {len(by_gpu) - 1} more GPU{'s' if len(by_gpu) > 2 else ''}"
    return Outcome(
        rule.name,
        kind,
        pod,
        float(count),
        0.0,
        UNIT,
        holds=count > 0,
        clears=count == 0,
        gpus=tuple(r.uuid for r, _ in by_gpu),
        gpu_count=len(fresh),
        detail=text,
        describe=health_message,
    )


# --- the kind ----------------------------------------------------------------------------------------

# NVML reports an XID as an unsigned 32-bit number.
XID = Integer("", "One XID code.", minimum=1, maximum=2**32 - 1)
XIDS = ListOf(
    "xids",
    "The XID codes that count (the NVIDIA driver's error codes, e.g. 79: the GPU has fallen off the"
    " bus). Each keeps the violation active for clearAfter. Left out: those after which the GPU needs"
    f" a reset or the node a reboot, {', '.join(map(str, CRITICAL_XIDS))}; [] counts none.",
    item=XID,
    max_items=64,
)
GPU_LOST = Boolean(
    "gpuLost", "A GPU off the bus (NVML cannot reach it) counts, for as long as it is.", default=True
)
MEMORY_ERRORS = Boolean(
    "memoryErrors",
    "A new uncorrected (double-bit) ECC error counts for clearAfter; a memory repair that failed or"
    " waits for a GPU reset (row remapping, page retirement) counts for as long as the GPU reports it.",
    default=True,
)
THROTTLE = Choice("", "One class of clock event reasons.", choices=Throttling)
THROTTLING = ListOf(
    "throttling",
    "Clock throttling that counts once it lasted for `for` without a break: thermal (software or"
    " hardware thermal slowdown), power (power cap, power brake), hwSlowdown (the hardware's own"
    " slowdown). Left out: none, throttling alone is not a fault (utilization rules say when it"
    " explains a low figure).",
    item=THROTTLE,
    max_items=len(Throttling),
)
FOR = Duration(
    "for",
    "How long throttling must last without a break before it counts (a duration such as 5m). Lost"
    " GPUs, XIDs and memory errors count at once.",
    default="5m",
)
CLEAR_AFTER = Duration(
    "clearAfter",
    "How long an XID or a new ECC error keeps the violation active after it (a duration, at least 1s,"
    " such as 10m): NVML never says that one is over, and a GPU that keeps failing keeps raising them.",
    default="10m",
    minimum="1s",
)
BODY = Body(
    "Fires while one of the pod's GPUs is broken: off the bus (gpuLost), an XID of the listed codes"
    " (xids), uncorrected memory errors (memoryErrors), or, when listed, throttling that lasts"
    " (throttling, for). The message names the GPU and says what happened, with the XID's meaning and"
    " the recommended action. gpuHealth: {} counts the defaults.",
    (XIDS, GPU_LOST, MEMORY_ERRORS, THROTTLING, FOR, CLEAR_AFTER),
    (
        Check(
            "!has(self.xids) || size(self.xids) > 0 || !has(self.gpuLost) || self.gpuLost"
            " || !has(self.memoryErrors) || self.memoryErrors"
            " || (has(self.throttling) && size(self.throttling) > 0)",
            "gpuHealth counts nothing: set xids, gpuLost, memoryErrors or throttling",
        ),
    ),
)


def _xids(raw: Any, path: str) -> tuple[int, ...]:
    """xids: whole numbers in the item's range, no duplicates."""
    lo, hi = XID.bounds
    codes: list[int] = []
    for i, code in enumerate(as_list(raw, f"{path}.xids", max_items=XIDS.max_items)):
        item_path = f"{path}.xids[{i}]"
        if isinstance(code, float) and code.is_integer():
            code = int(code)  # JSON has one number type (as fields.integer says)
        if isinstance(code, bool) or not isinstance(code, int):
            raise SpecError(item_path, f"must be an XID code (a whole number), not {type_name(code)}")
        if not lo <= code <= hi:
            raise SpecError(item_path, f"{code} is out of range; must be between {lo} and {hi}")
        if code in codes:
            raise SpecError(item_path, f"duplicate XID {code}")
        codes.append(code)
    return tuple(codes)


def parse_gpu_health(name: str, obj: Mapping[str, Any], path: str) -> GpuHealthRule:
    """A gpuHealth rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    raw_xids = obj.get("xids")
    # Absent: the critical ones (the CRD has no list default; its description names them).
    xids = CRITICAL_XIDS if raw_xids is None else _xids(raw_xids, path)
    raw_throttling = obj.get("throttling")
    throttling: list[Throttling] = []
    items = (
        []
        if raw_throttling is None
        else as_list(raw_throttling, f"{path}.throttling", max_items=THROTTLING.max_items)
    )
    for i, item in enumerate(items):
        value = THROTTLE.check(item, f"{path}.throttling[{i}]")
        if value in throttling:
            raise SpecError(f"{path}.throttling[{i}]", f'duplicate entry "{value}"')
        throttling.append(value)
    rule = GpuHealthRule(
        name=name,
        xids=xids,
        gpu_lost=GPU_LOST.read(obj, path),
        memory_errors=MEMORY_ERRORS.read(obj, path),
        throttling=tuple(throttling),
        for_seconds=FOR.read(obj, path),
        clear_after_seconds=CLEAR_AFTER.read(obj, path),
    )
    if not (rule.xids or rule.gpu_lost or rule.memory_errors or rule.throttling):  # the body's Check
        raise SpecError(path, "gpuHealth counts nothing: set xids, gpuLost, memoryErrors or throttling")
    return rule


def _judge(rule: GpuHealthRule, c: JudgeContext, memo: None) -> Outcome:
    return evaluate_health(rule, c.pod, c.health, c.now, c.params)


RULE_TYPE = RuleType(
    kind=KIND,
    model=GpuHealthRule,
    parse=parse_gpu_health,
    body=BODY,
    evaluate=_judge,
    reach=lambda rule: max(rule.for_seconds, rule.clear_after_seconds),
    # No window of samples: it judges states and events as they are reported.
    window=None,
    reason="GPUUnhealthy",
    meaning="its GPU is failing: its work may have crashed or be wrong; move it elsewhere",
    per_gpu=True,
    colour="black",
    utilization=False,
)

"""A policy's ``status``, built from its latest verdict; pure, so it is tested without a cluster.

Conditions follow the Kubernetes API conventions: a list keyed by ``type``, each
with ``status``, a one-word CamelCase ``reason``, a ``message``,
``observedGeneration``, and a ``lastTransitionTime`` that moves only when
``status`` moves. Conditions of types this module does not own are kept as they
are. ``violations`` lists at most :data:`MAX_VIOLATIONS` active findings, newest
first. Messages are those last announced (Events), not the latest readings, so
the status changes when something happens, not at every evaluation.

:func:`findings_from_status` reads violations back after a restart, so that the
engine resumes ongoing findings instead of announcing them again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.kubetime import format_time, parse_epoch
from gpuwarden.operator.reclaim import RECLAIM_ACTIVE
from gpuwarden.operator.scaling import SCALING_ACTIVE
from gpuwarden.operator.scrape import AVAILABLE
from gpuwarden.policy import Evaluation, Finding, FindingKey, PolicySpec, rule_kind, rule_type
from gpuwarden.units import format_duration

__all__ = [
    "MAX_VIOLATIONS",
    "PolicyVerdict",
    "build_status",
    "findings_from_status",
]

MAX_VIOLATIONS = 20
"""As many violations as the CRD's ``status.violations`` admits (maxItems)."""

MAX_MESSAGE = 1024
"""The CRD's maxLength of a violation's message."""

READY = "Ready"
VIOLATING = "Violating"
OWNED_CONDITIONS = (READY, VIOLATING)


@dataclass(frozen=True, slots=True)
class PolicyVerdict:
    """What the operator concluded about a policy at one evaluation (or why it could not evaluate)."""

    generation: int | None
    interval_seconds: float = 0.0
    spec_error: str | None = None
    """Why the spec cannot be evaluated (``Ready=False``, ``InvalidSpec``)."""
    evaluation: Evaluation | None = None
    messages: Mapping[FindingKey, str] = field(default_factory=dict)
    """The announced message of each active finding (falls back to the finding's own)."""
    warnings: tuple[str, ...] = ()
    """What in a valid spec is most likely a mistake (:func:`~gpuwarden.policy.spec_warnings`): said in
    ``Ready``'s message, which stays ``True``."""
    problem: tuple[str, str] | None = None
    """``(reason, message)`` of a problem that makes the policy not Ready although it evaluates
    (e.g. the scaler's ``ScaleTargetNotFound``)."""
    scale: Mapping[str, Any] | None = None
    """``status.scale`` from the scaler; None keeps what the status has."""
    scale_condition: tuple[str, str, str] | None = None
    """``(status, reason, message)`` of the scaler's ``ScalingActive`` condition; None keeps what is there."""
    scaling: bool = True
    """Whether the spec has ``actions.scale``; False removes ``ScalingActive`` and ``status.scale``."""
    reclaim: Mapping[str, Any] | None = None
    """``status.reclaim`` from the reclaimer; None keeps what the status has."""
    reclaim_condition: tuple[str, str, str] | None = None
    """``(status, reason, message)`` of ``ReclaimActive``; None keeps what is there."""
    reclaiming: bool = True
    """Whether the spec has ``actions.reclaim``; False removes ``ReclaimActive`` and ``status.reclaim``."""
    service_metrics: tuple[str, str, str] | None = None
    """``(status, reason, message)`` of ``ServiceMetricsAvailable``
    (:func:`~gpuwarden.operator.scrape.availability`) when the spec has ``serviceMetrics``; None
    removes the condition."""


def build_status(verdict: PolicyVerdict, previous: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """The status fields this operator owns, given the current ``previous`` status (for transition times)."""
    previous = previous or {}
    if verdict.spec_error is not None:
        ready = ("False", "InvalidSpec", verdict.spec_error)
        violating = ("Unknown", "NotEvaluated", "The spec is invalid, so no pod is evaluated.")
        matched, violating_pods, violations = 0, 0, []
    else:
        evaluation = verdict.evaluation
        matched = len(evaluation.matched_pods) if evaluation else 0
        violating_pods = len(evaluation.violating_pods) if evaluation else 0
        violations = _violations(evaluation.active if evaluation else (), verdict.messages)
        if verdict.problem is not None:
            ready = ("False", *verdict.problem)
        else:
            every = format_duration(verdict.interval_seconds)
            message = f"The policy is valid and evaluated every {every}."
            if verdict.warnings:
                message += f" Warning: {'; '.join(verdict.warnings)}."
            ready = ("True", "Evaluating", message)
        if evaluation is None:
            violating = ("Unknown", "NotEvaluated", "The policy has not been evaluated yet.")
        elif violating_pods:
            violating = (
                "True",
                "ViolationsActive",
                f"{violating_pods} of {matched} selected pods violate a rule.",
            )
        else:
            violating = ("False", "NoViolations", f"None of the {matched} selected pods violates a rule.")
    wanted = {READY: ready, VIOLATING: violating}
    if verdict.scale_condition is not None:
        wanted[SCALING_ACTIVE] = verdict.scale_condition
    if verdict.reclaim_condition is not None:
        wanted[RECLAIM_ACTIVE] = verdict.reclaim_condition
    if verdict.service_metrics is not None:
        wanted[AVAILABLE] = verdict.service_metrics
    drop = [] if verdict.scaling else [SCALING_ACTIVE]
    if not verdict.reclaiming:
        drop.append(RECLAIM_ACTIVE)
    if verdict.service_metrics is None and verdict.spec_error is None:
        drop.append(AVAILABLE)  # no serviceMetrics (any more); an invalid spec keeps what was said
    conditions = _conditions(
        previous.get("conditions"), wanted, generation=verdict.generation, now=now, drop=drop
    )
    status: dict[str, Any] = {
        "matchedPods": matched,
        "violatingPods": violating_pods,
        "violations": violations,
        "conditions": conditions,
    }
    if verdict.generation is not None:
        status["observedGeneration"] = verdict.generation
    scale = verdict.scale if verdict.scale is not None else previous.get("scale")
    if not verdict.scaling:
        if scale is not None:
            status["scale"] = None  # a merge patch's null removes it
    elif scale is not None:
        status["scale"] = dict(scale)
    reclaim = verdict.reclaim if verdict.reclaim is not None else previous.get("reclaim")
    if not verdict.reclaiming:
        if reclaim is not None:
            status["reclaim"] = None
    elif reclaim is not None:
        status["reclaim"] = dict(reclaim)
    return status


def owned_part(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys of a status that :func:`build_status` writes (to tell whether a write changes anything)."""
    status = status or {}
    keys = (
        "observedGeneration",
        "matchedPods",
        "violatingPods",
        "violations",
        "conditions",
        "scale",
        "reclaim",
    )
    return {k: status[k] for k in keys if k in status}


def _violations(active: Sequence[Finding], messages: Mapping[FindingKey, str]) -> list[dict[str, Any]]:
    out = []
    for f in active[:MAX_VIOLATIONS]:
        item: dict[str, Any] = {
            "pod": f.pod,
            "rule": f.rule,
            "reason": f.reason,
            "message": _clip(messages.get(f.key) or f.message, MAX_MESSAGE),
            "since": format_time(f.started_at),
        }
        if rule_type(f.kind).per_gpu and f.gpus:
            item["gpu"] = f.gpus[0]
        out.append(item)
    return out


def _conditions(
    previous: Any,
    wanted: Mapping[str, tuple[str, str, str]],
    *,
    generation: int | None,
    now: float,
    drop: Iterable[str] = (),
) -> list[dict[str, Any]]:
    old = {c.get("type"): c for c in previous if isinstance(c, Mapping)} if isinstance(previous, list) else {}
    out: list[dict[str, Any]] = []
    for ctype, (cstatus, reason, message) in wanted.items():
        before = old.get(ctype)
        since = before.get("lastTransitionTime") if before and before.get("status") == cstatus else None
        condition: dict[str, Any] = {
            "type": ctype,
            "status": cstatus,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since or format_time(now),
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        out.append(condition)
    # Conditions others own (e.g. a scaler's) stay as they were, after ours; ``drop`` goes (the list
    # replaces the stored one in a merge patch).
    gone = set(drop)
    out.extend(dict(c) for t, c in old.items() if t not in wanted and t not in gone)
    return out


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def findings_from_status(
    status: Mapping[str, Any] | None, spec: PolicySpec, *, policy: str, namespace: str
) -> list[Finding]:
    """Active findings as a previous run (or the other replica) left them in ``status.violations``.

    Violations of rules no longer in the spec are skipped (nothing to resume).
    Values are unknown (NaN) until the next evaluation reads them again.
    """
    rules = {r.name: r for r in spec.rules}
    items = (status or {}).get("violations")
    found: list[Finding] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping):
            continue
        rule = rules.get(str(item.get("rule", "")))
        pod = item.get("pod")
        since = parse_epoch(str(item.get("since", "")))
        if rule is None or not isinstance(pod, str) or since is None:
            continue
        kind = rule_kind(rule)
        gpu = item.get("gpu")
        found.append(
            Finding(
                policy=policy,
                rule=rule.name,
                kind=kind,
                reason=rule_type(kind).reason,
                namespace=namespace,
                pod=pod,
                gpus=(str(gpu),) if gpu else (),
                value=math.nan,
                threshold=math.nan,
                unit="",
                started_at=since,
                message=str(item.get("message", "")),
            )
        )
    return found


def messages_of(findings: Iterable[Finding]) -> dict[FindingKey, str]:
    """Each finding's own message, keyed (for findings restored with the message they were announced with)."""
    return {f.key: f.message for f in findings}

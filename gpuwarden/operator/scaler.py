"""Scaler: acts on a policy's scale decisions, after each evaluation of the policy.

Per call of :meth:`Scaler.reconcile`, in order:

1. read the target's ``/scale`` (current replicas);
2. ask the policy's :class:`~gpuwarden.policy.scaling.ScaleDecider` (pure) for the desired replicas
   and publish them as ``gpuwarden_policy_desired_replicas{namespace,policy}``;
3. unless ``dryRun``, refuse to act when another policy (not in dryRun) scales the same workload
   (``PolicyConflict``, for every such policy alike) or an HPA does (``HPAConflict``; KEDA's
   ScaledObjects are HPAs too): the condition says so and an Event is posted once per conflict;
4. act: ``PATCH`` the ``/scale`` subresource (guarded by its resourceVersion) and post an Event on
   the target and on the policy; in dryRun, post "would scale" Events instead and change nothing.

What the status writer needs comes back as a :class:`ScaleOutcome`: ``status.scale``
and the ``ScalingActive`` condition (type, status, reason, message; the writer stamps
``lastTransitionTime`` and ``observedGeneration``). The Scaler holds no clock: ``now``
(epoch seconds) is passed in, and cooldowns and windows are measured on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Gauge

from gpuwarden.operator.scaleapi import (
    EventSink,
    NotFound,
    NotScalable,
    ObjectRef,
    Scale,
    ScaleApi,
    ScaleApiError,
    ScaleConflict,
    group_of,
)
from gpuwarden.operator.status import parse_rfc3339, rfc3339
from gpuwarden.policy.model import ScaleAction, ScaleTargetRef
from gpuwarden.policy.scaling import (
    ActiveFinding,
    Blocker,
    Direction,
    ScaleDecider,
    ScaleDecision,
    findings_by_pod,
)

CONDITION_TYPE = "ScalingActive"

DESIRED_REPLICAS_METRIC = "gpuwarden_policy_desired_replicas"


class PolicyKey(NamedTuple):
    """A policy's namespace and name."""

    namespace: str
    name: str


class _TargetKey(NamedTuple):
    namespace: str
    group: str
    kind: str
    name: str


def _target_key(namespace: str, ref: ScaleTargetRef) -> _TargetKey:
    # Versions of one group serve the same object: apps/v1 and apps/v1beta2 Deployments collide.
    return _TargetKey(namespace, group_of(ref.api_version), ref.kind, ref.name)


@dataclass(frozen=True, slots=True)
class Condition:
    """A status condition without its timestamps (the status writer adds them)."""

    type: str
    status: str
    reason: str
    message: str

    def as_dict(self) -> dict[str, str]:
        """The condition as the CRD stores it (without lastTransitionTime/observedGeneration)."""
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message}


@dataclass(frozen=True, slots=True)
class ScaleStatus:
    """``status.scale``; ``None`` means unknown now (the target could not be read)."""

    current_replicas: int | None
    desired_replicas: int | None
    last_scale_time: str | None
    """RFC 3339, when the policy last changed (or in dryRun would have changed) the replicas."""
    last_scale_reason: str | None

    def as_dict(self) -> dict[str, Any]:
        """camelCase, as in the CRD; None values stay, so that a merge patch clears stale ones."""
        return {
            "currentReplicas": self.current_replicas,
            "desiredReplicas": self.desired_replicas,
            "lastScaleTime": self.last_scale_time,
            "lastScaleReason": self.last_scale_reason,
        }


@dataclass(frozen=True, slots=True)
class ScaleOutcome:
    """What one reconcile saw, decided and did."""

    status: ScaleStatus
    condition: Condition
    decision: ScaleDecision | None
    """None when the target could not be read."""
    applied: bool = False
    """The target's replicas were changed by this call."""


@dataclass(slots=True)
class _PolicyScaling:
    """What the Scaler keeps per policy."""

    ref: ObjectRef
    action: ScaleAction
    decider: ScaleDecider = field(default_factory=ScaleDecider)
    last_scale_time: float | None = None
    last_scale_reason: str | None = None
    problem: str | None = None
    """The reason of the problem of the last reconcile, so that a lasting problem is announced once."""


def desired_replicas_gauge(registry: CollectorRegistry) -> Gauge:
    """``gpuwarden_policy_desired_replicas{namespace,policy}`` on ``registry`` (for HPA/KEDA users)."""
    return Gauge(
        DESIRED_REPLICAS_METRIC,
        "Replicas the policy wants its scale target to have (also in dryRun): feed it to an HPA or KEDA.",
        ["namespace", "policy"],
        registry=registry,
    )


class Scaler:
    """Scales the targets of every policy with ``spec.actions.scale``; one per operator.

    Call :meth:`claim` for each policy as soon as it is known (before any evaluation, e.g.
    from an index or the resume handler): conflicts between policies are then found
    whichever evaluates first. :meth:`forget` when a policy goes away or drops its
    scale action; :meth:`restore` after a restart, from the policy's ``status.scale``.
    """

    def __init__(self, api: ScaleApi, events: EventSink, *, desired_replicas: Gauge | None = None) -> None:
        self._api = api
        self._events = events
        self._gauge = desired_replicas
        self._policies: dict[PolicyKey, _PolicyScaling] = {}

    # --- bookkeeping ------------------------------------------------------------------------------

    def claim(self, policy: ObjectRef, action: ScaleAction) -> None:
        """Record (or update) that ``policy`` scales ``action.target_ref``; a new target starts afresh."""
        key = PolicyKey(policy.namespace, policy.name)
        known = self._policies.get(key)
        if known is None or known.action.target_ref != action.target_ref:
            self._policies[key] = _PolicyScaling(policy, action)
        else:
            known.ref, known.action = policy, action

    def forget(self, policy: PolicyKey) -> None:
        """The policy is gone or no longer scales: drop its state and its metric series."""
        if self._policies.pop(policy, None) is not None and self._gauge is not None:
            with contextlib.suppress(KeyError):  # never published: nothing to remove
                self._gauge.remove(policy.namespace, policy.name)

    def restore(self, policy: ObjectRef, action: ScaleAction, scale_status: Mapping[str, Any]) -> None:
        """Seed a policy's state from its ``status.scale`` after a restart: its cooldowns run on."""
        self.claim(policy, action)
        state = self._policies[PolicyKey(policy.namespace, policy.name)]
        when = parse_rfc3339(str(scale_status.get("lastScaleTime") or ""))
        if when is None:
            return  # never scaled, or unreadable: nothing to carry on
        state.last_scale_time = when
        state.decider.restore(when)
        reason = scale_status.get("lastScaleReason")
        state.last_scale_reason = reason if isinstance(reason, str) else None

    # --- the reconcile ----------------------------------------------------------------------------

    async def reconcile(
        self,
        policy: ObjectRef,
        action: ScaleAction,
        findings: Iterable[ActiveFinding],
        matched_pods: int,
        now: float,
    ) -> ScaleOutcome:
        """Decide and act for ``policy`` after an evaluation whose active findings are ``findings``."""
        self.claim(policy, action)
        key = PolicyKey(policy.namespace, policy.name)
        state = self._policies[key]
        target = action.target_ref
        what = f"{target.kind} {target.name}"
        try:
            scale = await self._api.get_scale(policy.namespace, target)
        except NotFound:
            return await self._problem(state, None, None, "ScaleTargetNotFound", f"{what} not found")
        except NotScalable as exc:
            return await self._problem(state, None, None, "ScaleTargetNotScalable", f"{what}: {exc}")
        except ScaleApiError as exc:
            return await self._problem(state, None, None, "FailedGetScale", f"reading {what}/scale: {exc}")

        decision = state.decider.decide(action, scale.replicas, findings_by_pod(findings), matched_pods, now)
        if self._gauge is not None:
            self._gauge.labels(policy.namespace, policy.name).set(decision.desired)

        if not action.dry_run:
            if rivals := self._rivals(key):
                names = ", ".join(sorted([policy.name, *rivals]))
                return await self._problem(
                    state,
                    scale,
                    decision,
                    "PolicyConflict",
                    f"not scaling {what}: policies {names} all target it; one policy may scale a workload",
                )
            try:
                hpas = [h.name for h in await self._api.list_hpas(policy.namespace) if h.targets(target)]
            except ScaleApiError as exc:
                # Unable to rule out an HPA: not acting is the side that never fights one.
                return await self._problem(
                    state, scale, decision, "FailedListHPAs", f"not scaling {what}: cannot list HPAs: {exc}"
                )
            if hpas:
                return await self._problem(
                    state,
                    scale,
                    decision,
                    "HPAConflict",
                    f"not scaling {what}: HorizontalPodAutoscaler {', '.join(sorted(hpas))} also scales it "
                    "(to feed this policy's decisions to it, set dryRun: true; see docs/scaling.md)",
                )

        if decision.blocked_by is Blocker.SCALED_TO_ZERO:
            return self._outcome(state, scale, decision, "False", "ScaledToZero", decision.reason)
        if not decision.changes:
            return self._outcome(state, scale, decision, *self._quiet(action), decision.reason)
        if action.dry_run:
            return await self._announce(state, scale, decision, now, applied=False)
        try:
            await self._api.patch_scale(scale, decision.desired)
        except ScaleConflict:
            # Replicas moved under us (a person, a rollout): decide again from the new value next time.
            return self._outcome(
                state, scale, decision, "True", "Active", f"{what} changed while scaling; deciding again"
            )
        except ScaleApiError as exc:
            return await self._problem(
                state,
                scale,
                decision,
                "FailedUpdateScale",
                f"failed to scale {what} {decision.current}→{decision.desired}: {exc}",
            )
        return await self._announce(state, scale, decision, now, applied=True)

    # --- helpers ----------------------------------------------------------------------------------

    def _rivals(self, key: PolicyKey) -> list[str]:
        """Other acting (not dryRun) policies with the same target as ``key`` (when it acts too)."""
        mine = self._policies[key]
        target = _target_key(key.namespace, mine.action.target_ref)
        return [
            other.name
            for other, state in self._policies.items()
            if other != key
            and not state.action.dry_run
            and _target_key(other.namespace, state.action.target_ref) == target
        ]

    @staticmethod
    def _quiet(action: ScaleAction) -> tuple[str, str]:
        """Condition status and reason when nothing stops the policy (and nothing changes now)."""
        return ("False", "DryRun") if action.dry_run else ("True", "Active")

    async def _announce(
        self, state: _PolicyScaling, scale: Scale, decision: ScaleDecision, now: float, *, applied: bool
    ) -> ScaleOutcome:
        """Record a change (made, or in dryRun only announced) and post its Events."""
        state.decider.record_scale(decision, now)
        name = scale.target.name
        change = f"{name} {decision.current}→{decision.desired}: {decision.reason}"
        up = decision.direction is Direction.UP
        if applied:
            message, reason = f"scaled {change}", "ScaledUp" if up else "ScaledDown"
        else:
            message, reason = f"would scale {change} (dryRun)", "WouldScaleUp" if up else "WouldScaleDown"
        state.last_scale_time, state.last_scale_reason = now, message
        await self._events.post(state.ref, "Normal", reason, message)
        await self._events.post(scale.target, "Normal", reason, f"policy {state.ref.name}: {message}")
        status, condition_reason = self._quiet(state.action)
        return self._outcome(state, scale, decision, status, condition_reason, message, applied=applied)

    async def _problem(
        self,
        state: _PolicyScaling,
        scale: Scale | None,
        decision: ScaleDecision | None,
        reason: str,
        message: str,
    ) -> ScaleOutcome:
        """ScalingActive=False for ``reason``; a Warning Event on the policy (and target) when it is new."""
        if state.problem != reason:
            await self._events.post(state.ref, "Warning", reason, message)
            if scale is not None:
                on_target = f"policy {state.ref.name}: {message}"
                await self._events.post(scale.target, "Warning", reason, on_target)
        if scale is None and self._gauge is not None:
            # Without a target there is no decision; a stale value must not keep driving an HPA.
            with contextlib.suppress(KeyError):
                self._gauge.remove(state.ref.namespace, state.ref.name)
        return self._outcome(state, scale, decision, "False", reason, message, problem=True)

    @staticmethod
    def _outcome(
        state: _PolicyScaling,
        scale: Scale | None,
        decision: ScaleDecision | None,
        status: str,
        reason: str,
        message: str,
        *,
        applied: bool = False,
        problem: bool = False,
    ) -> ScaleOutcome:
        """The outcome to report; remembers whether it is a problem (announced once until it clears)."""
        state.problem = reason if problem else None
        replicas = decision.desired if applied and decision is not None else None
        return ScaleOutcome(
            status=ScaleStatus(
                current_replicas=replicas if replicas is not None else (scale.replicas if scale else None),
                desired_replicas=decision.desired if decision is not None else None,
                last_scale_time=None if state.last_scale_time is None else rfc3339(state.last_scale_time),
                last_scale_reason=state.last_scale_reason,
            ),
            condition=Condition(CONDITION_TYPE, status, reason, message),
            decision=decision,
            applied=applied,
        )

"""WorkloadScaler: scales a policy's workload through its /scale subresource, after each evaluation.

Built by the composition root over the operator's API client and its Event poster, and handed to
each policy's evaluation loop, which calls :meth:`WorkloadScaler.scale`. Per call, in order:

1. look the namespace's policies up in the operator's index (:mod:`.claims`, passed in):
   this one's uid (for its Events) and, after a restart, its ``status.scale.lastScaleTime``
   (so cooldowns run on); and the others that scale the same workload;
2. read the target's ``/scale`` (current replicas);
3. take a :func:`~gpuwarden.policy.scaling.decider.scale_step` (pure) with the policy's
   :class:`~gpuwarden.policy.scaling.decider.ScaleDecider`: the desired replicas, published as
   ``gpuwarden_policy_desired_replicas{namespace,policy}``, and whether to hold, announce or apply;
4. unless ``dryRun``, refuse to act when another policy (not in dryRun) scales the same
   workload (``PolicyConflict``: every such policy stops, whichever evaluates first,
   because each sees the others' specs, not what their evaluations decided; a rival seen
   in the index is confirmed by listing the policies, since an index may still hold a policy
   deleted while this replica stood by) or an HPA does
   (``HPAConflict``; KEDA's ScaledObjects are HPAs too); the condition says so and an
   Event is posted once per conflict;
5. act: ``PATCH`` the ``/scale`` subresource (guarded by its resourceVersion) and post an
   Event on the target and on the policy; in dryRun, post "would scale" Events instead; then
   settle the step with whether the change was made (the step decides what that records).

What the status writer needs comes back as a :class:`ScaleOutcome`: ``status.scale``
and the ``ScalingActive`` condition. The WorkloadScaler holds no clock of its own: ``now``
(epoch seconds) is passed in, and cooldowns and windows are measured on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.kubetime import format_time, parse_epoch
from gpuwarden.operator.kube import EventSink
from gpuwarden.operator.resources import ObjectRef, PolicyKey
from gpuwarden.operator.scaling.api import (
    NotFound,
    NotScalable,
    Scale,
    ScaleApi,
    ScaleApiError,
    ScaleConflict,
    group_of,
)
from gpuwarden.operator.scaling.claims import PolicyClaim, policy_claim
from gpuwarden.operator.scaling.seam import SCALING_ACTIVE, ScaleResult
from gpuwarden.policy import (
    ActiveFinding,
    Blocker,
    Direction,
    Evaluation,
    PolicySpec,
    ScaleAction,
    ScaleDecider,
    ScaleDecision,
    ScaleStep,
    ScaleTargetRef,
    StepKind,
    WorkloadLoad,
    scale_step,
)

__all__ = [
    "Condition",
    "ScaleOutcome",
    "ScaleStatus",
    "WorkloadScaler",
]

STALE_INTERVALS = 3
STALE_MIN_SECONDS = 60.0
"""A policy not reconciled for this many of its evaluation intervals (and at least this long) is gone
(deleted, or evaluated by the other replica now): its state and metric series go. One that drops its
scale action goes at its next evaluation (:meth:`WorkloadScaler.scale` is called without one)."""

NOT_READY_REASONS = frozenset({"ScaleTargetNotFound", "ScaleTargetNotScalable"})
"""Problems in the policy itself (its targetRef), which make it ``Ready=False``; the rest are passing."""


@dataclass(frozen=True, slots=True)
class Condition:
    """A status condition without its timestamps (the status writer adds them)."""

    type: str
    status: str
    reason: str
    message: str


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

    def result(self) -> ScaleResult:
        """The outcome in the operator's terms: ``status.scale``, the condition, and whether Ready suffers."""
        c = self.condition
        problem = (c.reason, c.message) if c.reason in NOT_READY_REASONS else None
        return ScaleResult(
            status=self.status.as_dict(), problem=problem, condition=(c.status, c.reason, c.message)
        )


DECISION_REASONS = ("ScaledUp", "ScaledDown", "WouldScaleUp", "WouldScaleDown")
"""The reasons of a scale change's Events, by which :meth:`WorkloadScaler.decisions` counts them."""


@dataclass(slots=True)
class _PolicyScaling:
    """What the WorkloadScaler keeps per policy."""

    target: ScaleTargetRef
    decider: ScaleDecider = field(default_factory=ScaleDecider)
    restored: bool = False
    """Whether ``status.scale`` was read back (once, at the first reconcile)."""
    last_scale_time: float | None = None
    last_scale_reason: str | None = None
    problem: str | None = None
    """The reason of the problem of the last reconcile, so that a lasting problem is announced once."""
    desired: int | None = None
    seen_at: float = 0.0
    """``now`` of the last reconcile."""
    expires_after: float = 0.0
    """Seconds after ``seen_at`` when this policy counts as gone."""


class WorkloadScaler:
    """Scales the targets of every policy with ``spec.actions.scale``; one per operator."""

    def __init__(self, api: ScaleApi, events: EventSink, *, observe_only: bool = False) -> None:
        self._api = api
        self._events = events
        self._observe_only = observe_only
        """``--observe-only``: the operator may not read or write a /scale; each scaling policy is told."""
        self._policies: dict[PolicyKey, _PolicyScaling] = {}
        self._decisions: dict[tuple[str, str, str], int] = {}

    # --- the operator's seam ----------------------------------------------------------------------

    async def scale(
        self,
        policy: PolicyKey,
        spec: PolicySpec,
        evaluation: Evaluation,
        now: float,
        policies: Iterable[PolicyClaim],
    ) -> ScaleResult | None:
        """After an evaluation of ``policy``: decide and act on ``spec.actions.scale`` (None: none set).

        ``policies`` are the namespace's, this one included, from the operator's index.
        """
        action = spec.actions.scale
        if action is None:
            self._policies.pop(policy, None)
            return None
        outcome = await self.reconcile(
            policy,
            action,
            evaluation.active,
            len(evaluation.matched_pods),
            now,
            policies,
            expires_after=max(STALE_MIN_SECONDS, STALE_INTERVALS * spec.evaluation_interval_seconds),
            load=evaluation.load,
        )
        return outcome.result()

    def desired_replicas(self, now: float) -> dict[PolicyKey, int]:
        """The desired replicas of every policy reconciled recently (for the metric)."""
        return {
            key: s.desired
            for key, s in self._policies.items()
            if s.desired is not None and now - s.seen_at <= s.expires_after
        }

    def decisions(self) -> dict[tuple[str, str, str], int]:
        """Changes made (``ScaledUp``, ``ScaledDown``) and, in dryRun, announced (``WouldScaleUp``,
        ``WouldScaleDown``) by (namespace, policy, reason), since this process started (for the metric).

        Every reason of a policy reads 0 from its first reconcile on, so that its first change shows
        as an increase; a policy's counts stay after it goes (a counter that vanished and came back
        from 0 would read as a reset).
        """
        return dict(self._decisions)

    # --- the reconcile ----------------------------------------------------------------------------

    async def reconcile(
        self,
        policy: PolicyKey,
        action: ScaleAction,
        findings: Iterable[ActiveFinding],
        matched_pods: int,
        now: float,
        policies: Iterable[PolicyClaim],
        *,
        expires_after: float = 600.0,
        load: WorkloadLoad | None = None,
    ) -> ScaleOutcome:
        """Decide and act for ``policy`` after an evaluation whose active findings are ``findings``.

        ``policies`` are the namespace's as the operator's index has them, this one included;
        ``load`` is the evaluation's load sample, for ``actions.scale.forecast``.
        """
        self._expire(now)
        state = self._policies.get(policy)
        if state is None or state.target != action.target_ref:
            # A new target starts afresh: the old one's wishes and cooldowns say nothing about it.
            state = self._policies[policy] = _PolicyScaling(action.target_ref)
            for reason in DECISION_REASONS:
                self._decisions.setdefault((policy.namespace, policy.name, reason), 0)
        state.seen_at, state.expires_after = now, expires_after
        me = policy.object_ref()
        target = action.target_ref
        what = f"{target.kind} {target.name}"

        claims = list(policies)
        mine = next((c for c in claims if c.name == policy.name), None)
        if mine is not None:
            me = policy.object_ref(mine.uid)
            if not state.restored:
                self._restore(state, mine.scale_status)
        state.restored = True

        if self._observe_only:
            message = f"not reading or scaling {what}: the operator runs observe-only (--observe-only)"
            return await self._problem(state, me, None, None, "ObserveOnly", message)
        try:
            scale = await self._api.get_scale(policy.namespace, target)
        except NotFound:
            return await self._problem(state, me, None, None, "ScaleTargetNotFound", f"{what} not found")
        except NotScalable as exc:
            return await self._problem(state, me, None, None, "ScaleTargetNotScalable", f"{what}: {exc}")
        except ScaleApiError as exc:
            return await self._problem(
                state, me, None, None, "FailedGetScale", f"reading {what}/scale: {exc}"
            )

        step = scale_step(state.decider, action, scale.replicas, findings, matched_pods, now, load)
        decision = step.decision
        state.desired = decision.wanted

        if not action.dry_run:
            try:
                rivals = await self._confirmed_rivals(policy, action, claims)
            except ScaleApiError as exc:
                message = f"not scaling {what}: cannot list policies to confirm a conflict: {exc}"
                return await self._problem(state, me, scale, decision, "FailedListPolicies", message)
            if rivals:
                names = ", ".join(sorted([policy.name, *rivals]))
                message = (
                    f"not scaling {what}: policies {names} all target it; one policy may scale a workload"
                )
                return await self._problem(state, me, scale, decision, "PolicyConflict", message)
            try:
                hpas = [h.name for h in await self._api.list_hpas(policy.namespace) if h.targets(target)]
            except ScaleApiError as exc:
                # Unable to rule out an HPA: not acting is the side that never fights one.
                message = f"not scaling {what}: cannot list HPAs: {exc}"
                return await self._problem(state, me, scale, decision, "FailedListHPAs", message)
            if hpas:
                message = (
                    f"not scaling {what}: HorizontalPodAutoscaler {', '.join(sorted(hpas))} also scales it "
                    "(to feed this policy's decisions to it, set dryRun: true; see docs/scaling.md)"
                )
                return await self._problem(state, me, scale, decision, "HPAConflict", message)

        if decision.blocked_by is Blocker.SCALED_TO_ZERO:
            return _outcome(state, scale, decision, "False", "ScaledToZero", decision.reason)
        if step.kind is StepKind.HOLD:
            # The steady reason: a status rewritten at every evaluation for a ticking "for 3m10s" is noise.
            return _outcome(state, scale, decision, *_quiet(action), decision.steady_reason)
        if step.kind is StepKind.ANNOUNCE:
            return await self._announce(state, me, scale, step, action, made=False)
        try:
            await self._api.patch_scale(scale, decision.desired)
        except ScaleConflict:
            # Replicas moved under us (a person, a rollout): decide again from the new value next time.
            step.settle(made=False)
            return _outcome(
                state, scale, decision, "True", "Active", f"{what} changed while scaling; deciding again"
            )
        except ScaleApiError as exc:
            step.settle(made=False)
            message = f"failed to scale {what} {decision.current}→{decision.desired}: {exc}"
            return await self._problem(state, me, scale, decision, "FailedUpdateScale", message)
        return await self._announce(state, me, scale, step, action, made=True)

    # --- helpers ----------------------------------------------------------------------------------

    async def _confirmed_rivals(
        self, policy: PolicyKey, action: ScaleAction, indexed: Iterable[PolicyClaim]
    ) -> list[str]:
        """The rivals the index shows, as a list of the namespace's policies confirms them.

        Kopf drops an index entry only on a DELETED event it sees, so a policy deleted while this
        replica stood by (peering) stays in its index; it must not stop the others for good. The
        list is made only when the index shows a rival, which is rare and lasts until fixed.
        """
        if not _rivals(policy, action, indexed):
            return []
        listed = [policy_claim(item) for item in await self._api.list_policies(policy.namespace)]
        return _rivals(policy, action, listed)

    @staticmethod
    def _restore(state: _PolicyScaling, scale_status: Mapping[str, Any]) -> None:
        """Carry on from ``status.scale`` after a restart or a failover: cooldowns run on."""
        when = parse_epoch(scale_status.get("lastScaleTime"))
        if when is None:
            return  # never scaled, or unreadable: nothing to carry on
        state.last_scale_time = when
        state.decider.restore(when)
        reason = scale_status.get("lastScaleReason")
        state.last_scale_reason = reason if isinstance(reason, str) else None

    def _expire(self, now: float) -> None:
        for key in [k for k, s in self._policies.items() if now - s.seen_at > s.expires_after]:
            del self._policies[key]

    async def _announce(
        self,
        state: _PolicyScaling,
        me: ObjectRef,
        scale: Scale,
        step: ScaleStep,
        action: ScaleAction,
        *,
        made: bool,
    ) -> ScaleOutcome:
        """Settle a step whose change was made (or, in dryRun, only announced) and post its Events."""
        step.settle(made=made)
        decision, now = step.decision, step.now
        change = f"{scale.target.name} {decision.current}→{decision.desired}: {decision.reason}"
        up = decision.direction is Direction.UP
        if made:
            message, reason = f"scaled {change}", "ScaledUp" if up else "ScaledDown"
        else:
            message, reason = f"would scale {change} (dryRun)", "WouldScaleUp" if up else "WouldScaleDown"
        state.last_scale_time, state.last_scale_reason = now, message
        counted = (me.namespace, me.name, reason)
        self._decisions[counted] = self._decisions.get(counted, 0) + 1
        await self._events.post(me, "Normal", reason, message)
        await self._events.post(scale.target, "Normal", reason, f"policy {me.name}: {message}")
        return _outcome(state, scale, decision, *_quiet(action), message, applied=made)

    async def _problem(
        self,
        state: _PolicyScaling,
        me: ObjectRef,
        scale: Scale | None,
        decision: ScaleDecision | None,
        reason: str,
        message: str,
    ) -> ScaleOutcome:
        """ScalingActive=False for ``reason``; a Warning Event on the policy (and target) when it is new."""
        if state.problem != reason:
            await self._events.post(me, "Warning", reason, message)
            if scale is not None:
                await self._events.post(scale.target, "Warning", reason, f"policy {me.name}: {message}")
        if scale is None:
            state.desired = None  # without a target there is no decision; no stale value may drive an HPA
        return _outcome(state, scale, decision, "False", reason, message, problem=True)


def _rivals(policy: PolicyKey, action: ScaleAction, claims: Iterable[PolicyClaim]) -> list[str]:
    """Other acting (not dryRun) policies with the same target (versions of one group are one object)."""

    def key(ref: ScaleTargetRef) -> tuple[str, str, str]:
        return group_of(ref.api_version), ref.kind, ref.name

    return [
        c.name
        for c in claims
        if c.name != policy.name
        and c.action is not None
        and not c.action.dry_run
        and key(c.action.target_ref) == key(action.target_ref)
    ]


def _quiet(action: ScaleAction) -> tuple[str, str]:
    """Condition status and reason when nothing stops the policy."""
    return ("False", "DryRun") if action.dry_run else ("True", "Active")


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
    current = scale.replicas if scale is not None else None
    if applied and decision is not None:
        current = decision.desired
    return ScaleOutcome(
        status=ScaleStatus(
            current_replicas=current,
            desired_replicas=decision.wanted if decision is not None else None,
            last_scale_time=None if state.last_scale_time is None else format_time(state.last_scale_time),
            last_scale_reason=state.last_scale_reason,
        ),
        condition=Condition(SCALING_ACTIVE, status, reason, message),
        decision=decision,
        applied=applied,
    )

"""Reclaimer: acts on ``spec.actions.reclaim`` after each evaluation of a policy (docs/reclaim.md).

Per call, in order:

1. resolve each selected pod's workload: the highest owner in its chain of controllers that the
   action fits (ScaleToZero: a Deployment, StatefulSet or LeaderWorkerSet; Suspend: a Job, JobSet
   or RayCluster; Annotate: the top owner), through :class:`~.api.ReclaimApi` (cached per pod);
2. the idle workloads (:func:`~gpuwarden.policy.idle_workloads`, pure): every selected pod of it has
   an active finding of a reclaim rule, and none worked in the last interval;
3. leave out those that opted out (``gpuwarden.dev/reclaim: "false"`` on the workload or its
   namespace), are reclaimed already, already at zero or suspended, or are scaled by an HPA (KEDA's
   ScaledObjects make HPAs; as for ``actions.scale``, gpuwarden does not fight one);
4. plan (:class:`~gpuwarden.policy.ReclaimPlanner`, pure): warn the newly idle (a Warning Event on
   the workload, its pods and the policy, naming the action and when), cancel those no longer idle,
   and act on those due, unless the policy's or the cluster's circuit breaker is open;
5. act: one merge patch per workload (:func:`~.marks.reclaim_patch`: the change and its record),
   on the Kueue Workload that admits a Job instead when there is one (Kueue would undo a Job's
   ``suspend``; deactivating its Workload is the way Kueue's maintainers point to). In dryRun, a
   ``WouldReclaim`` Event instead.

The condition ``ReclaimActive`` and ``status.reclaim`` come back as a :class:`ReclaimResult`. No
clock of its own: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.kubetime import format_time
from gpuwarden.operator.kube import EventSink, JsonObject
from gpuwarden.operator.reclaim.api import Owner, ReclaimApi, ReclaimApiError, ReclaimConflict
from gpuwarden.operator.reclaim.marks import fits, kind_of, opted_out, reclaim_patch, reclaimed
from gpuwarden.operator.resources import ObjectRef, PodRecord, PolicyKey
from gpuwarden.policy import (
    CircuitBreaker,
    Evaluation,
    Idle,
    PodId,
    PolicySpec,
    ReclaimAction,
    ReclaimMethod,
    ReclaimPlanner,
    ReclaimStep,
    ReclaimStepKind,
    WorkloadRef,
    idle_workloads,
)
from gpuwarden.units import format_duration

__all__ = ["RECLAIMER_FIELD_MANAGER", "RECLAIM_ACTIVE", "ReclaimResult", "Reclaimer"]

RECLAIM_ACTIVE = "ReclaimActive"
STALE_INTERVALS = 3
STALE_MIN_SECONDS = 60.0
"""A policy not seen for this many of its evaluation intervals (and at least this long) is forgotten."""
RECLAIMER_FIELD_MANAGER = "gpuwarden-reclaimer"

_VERB = {
    ReclaimMethod.SCALE_TO_ZERO: "scale {w} to zero",
    ReclaimMethod.SUSPEND: "suspend {w}",
    ReclaimMethod.ANNOTATE: "mark {w} reclaimable",
}


@dataclass(frozen=True, slots=True)
class ReclaimResult:
    """What the reclaimer reports into the policy's status."""

    status: Mapping[str, Any]
    """``status.reclaim``: pendingWorkloads, lastReclaimTime, lastReclaimMessage."""
    condition: tuple[str, str, str]
    """``(status, reason, message)`` of ``ReclaimActive``."""


@dataclass(slots=True)
class _PolicyReclaim:
    planner: ReclaimPlanner
    breaker: CircuitBreaker
    targets: dict[WorkloadRef, Owner] = field(default_factory=dict)
    last_time: float | None = None
    last_message: str | None = None
    said: set[tuple[WorkloadRef, str]] = field(default_factory=set)
    """(workload, reason) of the problems announced, so that a lasting one is said once."""
    breaker_said: bool = False
    seen_at: float = 0.0
    expires_after: float = 0.0


class Reclaimer:
    """Reclaims the idle workloads of every policy with ``spec.actions.reclaim``; one per operator."""

    def __init__(
        self,
        api: ReclaimApi,
        events: EventSink,
        *,
        max_per_hour: int = 20,
        enabled: bool = False,
        observe_only: bool = False,
    ) -> None:
        self._api = api
        self._events = events
        self._cluster = CircuitBreaker(max_per_hour)
        """Reclaims by every policy together (``--reclaim-max-per-hour``)."""
        self._enabled = enabled
        """``--reclaim``: the chart granted the reads and writes; without it no policy reclaims."""
        self._observe_only = observe_only
        self._policies: dict[PolicyKey, _PolicyReclaim] = {}

    async def reclaim(
        self,
        policy: PolicyKey,
        spec: PolicySpec,
        evaluation: Evaluation,
        now: float,
        pods: Iterable[PodRecord],
        active: Iterable[PodId],
        uid: str = "",
    ) -> ReclaimResult | None:
        """After an evaluation of ``policy``; ``active``: the selected pods that worked in the last
        interval (:func:`~gpuwarden.policy.recently_active`). None: the policy has no reclaim."""
        action = spec.actions.reclaim
        if action is None:
            self._policies.pop(policy, None)
            return None
        for gone in [k for k, s in self._policies.items() if now - s.seen_at > s.expires_after]:
            del self._policies[gone]  # deleted, or evaluated by another replica now
        state = self._policies.get(policy)
        if state is None:
            state = self._policies[policy] = _PolicyReclaim(
                ReclaimPlanner(action.grace_seconds), CircuitBreaker(action.max_per_hour)
            )
        state.planner.grace_seconds, state.breaker.limit = action.grace_seconds, action.max_per_hour
        state.seen_at = now
        state.expires_after = max(STALE_MIN_SECONDS, STALE_INTERVALS * spec.evaluation_interval_seconds)
        me = policy.object_ref(uid)
        if self._observe_only:
            message = "not reclaiming: the operator runs observe-only (--observe-only)"
            return self._result(state, ("False", "ObserveOnly", message))
        if not self._enabled:
            # Without --reclaim the chart grants none of the reads either: nothing to announce from.
            message = (
                "not reclaiming: the operator runs without --reclaim (the chart's operator.reclaim.enabled)"
            )
            return self._result(state, ("False", "NotEnabled", message))
        dry_run = action.dry_run

        matched = set(evaluation.matched_pods)
        records = [r for r in pods if r.view.id in matched]
        try:
            pods_of, owners = await self._workloads(policy.namespace, records, action.method)
        except ReclaimApiError as exc:
            return self._result(state, ("False", "FailedGetOwners", f"reading the pods' owners: {exc}"))
        # The owners of workloads still warned stay known, for their cancellation once their pods are gone.
        state.targets = {w: o for w, o in state.targets.items() if w in state.planner.pending()} | owners
        state.said = {key for key in state.said if key[0] in owners}
        idle = idle_workloads(action, evaluation.active, pods_of, active)
        try:
            idle, objects = await self._eligible(policy, me, state, action, idle, owners)
        except ReclaimApiError as exc:
            return self._result(state, ("False", "FailedCheck", f"not reclaiming: {exc}"))

        held = None
        for step in state.planner.plan(idle, now):
            if step.kind is ReclaimStepKind.WARN:
                await self._warn(policy, me, action, step, owners[step.workload], records, dry_run)
            elif step.kind is ReclaimStepKind.CANCEL:
                await self._cancel(policy, me, action, step, state.targets.get(step.workload))
            else:
                stopped = await self._due(
                    policy, me, state, action, step, objects[step.workload], now, dry_run
                )
                held = held or stopped
                if held is not None and not state.breaker_said:
                    state.breaker_said = True
                    await self._events.post(me, "Warning", "ReclaimBreakerOpen", held)
        if held is not None:
            return self._result(state, ("False", "BreakerOpen", held))
        state.breaker_said = False
        pending = len(state.planner.pending())
        waiting = f"{pending} workload(s) warned, in their grace period" if pending else "none warned"
        if dry_run:
            message = f"dryRun: reclaims are announced, not made; {waiting}"
            return self._result(state, ("False", "DryRun", message))
        return self._result(state, ("True", "Active", waiting))

    # --- steps --------------------------------------------------------------------------------------

    async def _workloads(
        self, namespace: str, records: Sequence[PodRecord], method: ReclaimMethod
    ) -> tuple[dict[WorkloadRef, list[str]], dict[WorkloadRef, Owner]]:
        pods_of: dict[WorkloadRef, list[str]] = {}
        owners: dict[WorkloadRef, Owner] = {}
        for record in records:
            chain = await self._api.chain(namespace, record.view.name, record.uid)
            if method is ReclaimMethod.ANNOTATE:  # the highest owner reclaim knows how to act on
                fitting = [o for o in chain if (k := kind_of(o.api_version, o.kind)) and k.field]
            else:
                fitting = [o for o in chain if fits(method, o.api_version, o.kind)]
            top = fitting[-1] if fitting else chain[-1]
            ref = WorkloadRef(top.api_version, top.kind, top.name)
            pods_of.setdefault(ref, []).append(record.view.name)
            owners[ref] = top
        return pods_of, owners

    async def _eligible(
        self,
        policy: PolicyKey,
        me: ObjectRef,
        state: _PolicyReclaim,
        action: ReclaimAction,
        idle: Mapping[WorkloadRef, Idle],
        owners: Mapping[WorkloadRef, Owner],
    ) -> tuple[dict[WorkloadRef, Idle], dict[WorkloadRef, JsonObject]]:
        """The idle workloads reclaim may act on, each with the object to patch."""
        if not idle:
            return {}, {}
        if opted_out(await self._api.namespace(policy.namespace)):
            return {}, {}
        kept: dict[WorkloadRef, Idle] = {}
        objects: dict[WorkloadRef, JsonObject] = {}
        for workload, found in idle.items():
            owner = owners[workload]
            obj = await self._api.read(owner)
            if obj is None or opted_out(obj) or reclaimed(obj):
                continue
            if not fits(action.method, owner.api_version, owner.kind):
                await self._say(
                    state,
                    me,
                    owner,
                    "ReclaimNotApplicable",
                    f"not reclaiming {workload}: {action.method} does not apply to a {owner.kind}",
                )
                continue
            spec = obj.get("spec") or {}
            if action.method is ReclaimMethod.SCALE_TO_ZERO:
                if spec.get("replicas", 1) == 0:
                    continue
                hpas = await self._api.hpa_targets(
                    policy.namespace, owner.api_version, owner.kind, owner.name
                )
                if hpas:
                    message = (
                        f"not reclaiming {workload}: HorizontalPodAutoscaler {', '.join(hpas)} scales it"
                        " (gpuwarden does not fight an HPA or KEDA)"
                    )
                    await self._say(state, me, owner, "HPAConflict", message)
                    continue
            elif action.method is ReclaimMethod.SUSPEND:
                queued = await self._api.kueue_workload(owner)
                if queued is not None:
                    if (
                        opted_out(queued)
                        or reclaimed(queued)
                        or (queued.get("spec") or {}).get("active") is False
                    ):
                        continue
                    obj = queued
                elif spec.get("suspend") is True:
                    continue
            kept[workload], objects[workload] = found, obj
        return kept, objects

    async def _warn(
        self,
        policy: PolicyKey,
        me: ObjectRef,
        action: ReclaimAction,
        step: ReclaimStep,
        owner: Owner,
        records: Sequence[PodRecord],
        dry_run: bool,
    ) -> None:
        assert step.idle is not None
        verb = _VERB[action.method].format(w=step.workload)
        when = f"at {format_time(step.due_at)} (in {format_duration(action.grace_seconds)})"
        message = (
            f"will {verb} {when} unless its GPUs work: {step.idle.reason}"
            f"{' (dryRun: announced, not done)' if dry_run else ''}; opt out with the annotation"
            ' gpuwarden.dev/reclaim: "false"'
        )
        await self._events.post(owner.ref(), "Warning", "ReclaimPending", f"policy {policy.name}: {message}")
        await self._events.post(me, "Warning", "ReclaimPending", message)
        for record in records:
            if record.view.name in step.idle.pods:
                await self._events.post(
                    record.object_ref(), "Warning", "ReclaimPending", f"policy {policy.name}: {message}"
                )

    async def _cancel(
        self, policy: PolicyKey, me: ObjectRef, action: ReclaimAction, step: ReclaimStep, owner: Owner | None
    ) -> None:
        verb = _VERB[action.method].format(w=step.workload)
        message = f"not going to {verb}: it is no longer idle (its GPUs worked, or it opted out)"
        if owner is not None:
            await self._events.post(
                owner.ref(), "Normal", "ReclaimCancelled", f"policy {policy.name}: {message}"
            )
        await self._events.post(me, "Normal", "ReclaimCancelled", message)

    async def _due(
        self,
        policy: PolicyKey,
        me: ObjectRef,
        state: _PolicyReclaim,
        action: ReclaimAction,
        step: ReclaimStep,
        obj: JsonObject,
        now: float,
        dry_run: bool,
    ) -> str | None:
        """Act on a due workload; the breaker's message when it holds the reclaim back."""
        assert step.idle is not None
        if not state.breaker.allows(now):
            again = state.breaker.closes_at(now) or now
            return (
                f"circuit breaker open: {state.breaker.count(now)} reclaims by this policy in the last hour"
                f" (maxPerHour {action.max_per_hour}); {step.workload} and any other due wait until"
                f" {format_time(again)}"
            )
        if not dry_run and not self._cluster.allows(now):
            again = self._cluster.closes_at(now) or now
            return (
                f"circuit breaker open: {self._cluster.count(now)} reclaims in the cluster in the last hour"
                f" (the operator's --reclaim-max-per-hour {self._cluster.limit}); {step.workload} waits until"
                f" {format_time(again)}"
            )
        owner = state.targets[step.workload]
        idle_for = format_duration(max(0.0, now - step.idle.since))
        reason = f"{step.idle.reason} for {idle_for}"
        body, words = reclaim_patch(action.method, obj, by=f"{policy.name}: {reason}", at=format_time(now))
        where = "" if obj.get("kind") == owner.kind else f" (its Kueue Workload {obj['metadata']['name']})"
        undo = f"gpuwarden restore {owner.kind.lower()}/{owner.name} -n {policy.namespace}"
        if dry_run:
            message = f"would have {words} {step.workload}{where}: {reason} (dryRun)"
            kind = "WouldReclaim"
        else:
            try:
                await self._api.patch(obj, body, RECLAIMER_FIELD_MANAGER)
            except ReclaimConflict:
                return None  # changed meanwhile (a person scaled it): decided again next evaluation
            except ReclaimApiError as exc:
                await self._say(state, me, owner, "FailedReclaim", f"reclaiming {step.workload}: {exc}")
                return None
            self._cluster.record(now)
            message = f"{words} {step.workload}{where}: {reason}; undo: {undo}"
            kind = "Reclaimed"
        state.breaker.record(now)
        state.planner.finish(step.workload)
        state.last_time, state.last_message = now, message
        await self._events.post(owner.ref(), "Normal", kind, f"policy {policy.name}: {message}")
        await self._events.post(me, "Normal", kind, message)
        return None

    async def _say(
        self, state: _PolicyReclaim, me: ObjectRef, owner: Owner, reason: str, message: str
    ) -> None:
        """A Warning on the policy and the workload, once per (workload, reason)."""
        key = (WorkloadRef(owner.api_version, owner.kind, owner.name), reason)
        if key in state.said:
            return
        state.said.add(key)
        await self._events.post(me, "Warning", reason, message)
        await self._events.post(owner.ref(), "Warning", reason, message)

    @staticmethod
    def _result(state: _PolicyReclaim, condition: tuple[str, str, str]) -> ReclaimResult:
        return ReclaimResult(
            status={
                "pendingWorkloads": len(state.planner.pending()),
                "lastReclaimTime": None if state.last_time is None else format_time(state.last_time),
                "lastReclaimMessage": state.last_message,
            },
            condition=condition,
        )

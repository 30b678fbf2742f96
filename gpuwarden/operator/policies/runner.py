"""One policy's evaluation loop, run by its Kopf daemon: spec → rules → Events, scaling, status.

Every round:

1. **Spec.** When ``metadata.generation`` moved (or at the first round), parse
   the spec. An invalid one makes ``Ready=False`` (``InvalidSpec``) and nothing
   is evaluated until it is fixed; the findings so far are kept. At the first
   valid parse the findings in ``status.violations`` (a previous run's, or the
   other replica's) are restored, so ongoing violations are not announced again.
2. **Evaluate** the selected pods against the series store (the engine). Sharded mode
   (docs/scaling-out.md): the pods on other replicas' nodes by the verdicts those replicas
   sent (:mod:`gpuwarden.operator.sharding.board`); and a replica that does not own the policy only judges the
   pods on its own nodes and sends the owner its verdicts (:meth:`PolicyRunner.judge_for_owner`),
   steps 3 to 5 being the owner's alone.
3. **Announce** starts, re-notifications and ends as Events (:mod:`.announce`).
4. **Scale**, through the :class:`Scaler` seam (which answers None without ``actions.scale``;
   the status then loses ``ScalingActive`` and ``status.scale``); then **reclaim** idle workloads
   through the :class:`~gpuwarden.operator.reclaim.Reclaimer` (likewise for ``actions.reclaim``).
5. **Status**: built (:mod:`.status`) and patched only when it differs from
   what was last written, so a quiet policy writes nothing.

Then wait (:class:`~gpuwarden.operator.pacing.Pacing`): an interval after the
previous round started, as soon as readings arrived.

A runner is given what it uses (:class:`RunnerParts`, one for every policy, built by the composition
root): the records it reads and keeps its policy's pacing and retention in, the API client, the clock,
the metrics, the Event sink, this replica's shard (not sharded: a shard of one, which acts on every
policy and owns every node), the verdicts received and the sender of its own, the scaler, the reclaimer.

Status is patched here through the API rather than through Kopf's ``patch``
kwarg: a daemon's ``patch`` is applied only when the daemon function returns,
and this one runs for as long as the policy exists.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.operator.kube import ApiError, EventSink, KubeApi, object_ref
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.pacing import Pacing
from gpuwarden.operator.policies.announce import Announcer, announce
from gpuwarden.operator.policies.status import PolicyVerdict, build_status, findings_from_status, owned_part
from gpuwarden.operator.reclaim import Reclaimer, ReclaimResult
from gpuwarden.operator.resources import FIELD_MANAGER, GROUP, PLURAL, VERSION, PodRecord, PolicyKey
from gpuwarden.operator.scaling import PolicyClaim, Scaler, ScaleResult
from gpuwarden.operator.scrape import availability
from gpuwarden.operator.sharding import Leadership, VerdictBoard, VerdictSender, pod_verdicts
from gpuwarden.operator.state import OperatorState
from gpuwarden.operator.suspicion import HookAsks, PodPlace
from gpuwarden.policy import (
    Evaluation,
    Outcome,
    PodId,
    PolicyEvaluator,
    PolicySpec,
    ServiceScrape,
    SpecError,
    parse_spec,
    recently_active,
    rule_kind,
    service_metric_names,
    snapshot_before,
    spec_warnings,
)
from gpuwarden.wire.verdicts import SCHEMA_VERSION as VERDICT_SCHEMA_VERSION
from gpuwarden.wire.verdicts import VerdictReport

__all__ = ["PolicyRunner", "RunnerParts"]

EXISTENCE_CHECK_S = 300.0
"""How often a daemon confirms that its policy object still exists. No finalizer holds a policy (see
handlers.py), so its DELETED event ends the daemon; should a watch that is re-listed lose that event,
this ends it within five minutes (a 404 on the status write, sooner)."""


@dataclass(frozen=True, eq=False)
class RunnerParts:
    """What every policy's runner is given (by the composition root)."""

    records: OperatorState
    """The series, health and scrapes judged; the pod index; the policies' pacing and retention."""
    api: KubeApi
    """Reads the policy (does it still exist?) and writes its status."""
    clock: Callable[[], float]
    metrics: OperatorMetrics
    events: EventSink
    shard: Leadership
    """Which policies this replica acts on and which nodes' pods it judges (not sharded: all)."""
    board: VerdictBoard
    """Sharded mode, on a policy's owner: the verdicts the other shards sent."""
    sender: VerdictSender
    """Sharded mode, on the others: sends the policy's owner this replica's verdicts."""
    asks: HookAsks | None = None
    """What the hooks of pods under a memoryGrowth finding are asked, through their nodes' agents."""
    scaler: Scaler | None = None
    reclaimer: Reclaimer | None = None


class PolicyRunner:
    """The evaluation loop of one policy (one per running daemon)."""

    def __init__(self, parts: RunnerParts, key: PolicyKey) -> None:
        self.parts = parts
        self.records = parts.records
        self.key = key
        self.scaler = parts.scaler
        self.reclaimer = parts.reclaimer
        self.log = logging.getLogger(f"{__name__}.{key}")
        self.generation: int | None = None
        self.parsed = False
        self.spec: PolicySpec | None = None
        self.spec_error: str | None = None
        self.evaluator: PolicyEvaluator | None = None
        self.announcer: Announcer | None = None
        self.evaluation: Evaluation | None = None
        self.scale_result: ScaleResult | None = None
        self.reclaim_result: ReclaimResult | None = None
        self.written: dict[str, Any] | None = None
        """The status fields last written (or found, at start)."""
        self._judge: tuple[int | None, PolicyEvaluator | None] | None = None
        """Sharded mode, not the owner: the generation judged by, and its evaluator (None: invalid)."""

    async def run(
        self,
        *,
        body: Mapping[str, Any],
        pods: Mapping[str, Iterable[PodRecord]],
        policies: Mapping[str, Iterable[PolicyClaim]],
    ) -> None:
        """Evaluate until the policy is deleted (:meth:`OperatorState.end_policy`), or until cancelled
        (Kopf cancels the daemon on pause or exit).

        ``pods`` and ``policies`` are the operator's indexes, by namespace (live: Kopf keeps them).
        """
        parts, records = self.parts, self.records
        pacing = records.open_policy(self.key, str((body.get("metadata") or {}).get("uid", "")))
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            due = loop.time()
            while not pacing.ended:
                if loop.time() - checked >= EXISTENCE_CHECK_S:
                    checked = loop.time()
                    if not await self._exists(pacing.uid):
                        break
                started = loop.time()
                try:
                    with parts.metrics.evaluation_seconds.time():
                        await self.round(
                            body=body,
                            pods=pods.get(self.key.namespace, ()),
                            pacing=pacing,
                            policies=policies.get(self.key.namespace, ()),
                        )
                except Exception:
                    # One failed round (a bug in a rule) must not stop the policy for Kopf's retry backoff.
                    self.log.exception("Evaluation failed; it is retried at the next interval.")
                parts.metrics.evaluation_delay.observe(max(0.0, loop.time() - due))
                due = await pacing.wait_next(started)
        finally:
            records.close_policy(self.key, pacing)
            if not records.runs_policy(
                self.key.namespace, self.key.name
            ):  # a namesake created since keeps its own
                parts.board.forget(self.key.namespace, self.key.name)
                parts.metrics.set_findings(self.key.namespace, self.key.name, ())

    async def _exists(self, uid: str) -> bool:
        """Whether the policy object ``uid`` still exists (an unanswered API: assumed so)."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{self.key.namespace}/{PLURAL}/{self.key.name}"
        try:
            live = await self.parts.api.get(path)
        except ApiError as exc:
            return exc.status != 404
        return not uid or (live.get("metadata") or {}).get("uid") == uid

    async def round(
        self,
        *,
        body: Mapping[str, Any],
        pods: Iterable[PodRecord],
        pacing: Pacing,
        policies: Iterable[PolicyClaim] = (),
    ) -> None:
        """One evaluation round; a bad spec or a failed write is logged and retried next round.

        ``policies``: the namespace's (this one included), for the scaler's conflict check.
        """
        parts, records = self.parts, self.records
        now = parts.clock()
        meta = body.get("metadata") or {}
        if not parts.shard.acts_on_policy(self.key.namespace, self.key.name):
            self._stand_aside()
            await self.judge_for_owner(meta.get("generation"), body.get("spec") or {}, pods, pacing, now)
            return
        status = body.get("status") or {}
        self.sync_spec(meta.get("generation"), body.get("spec") or {}, status, now)
        pacing.interval = self.spec.evaluation_interval_seconds if self.spec else pacing.interval
        if self.spec_error is None and self.evaluator is not None and self.announcer is not None:
            pod_records = list(pods)
            evaluation = self.evaluator.evaluate(
                (r.view for r in pod_records),
                records.store,
                now,
                records.health,
                elsewhere=self._judged_elsewhere(pod_records, now),
                services=records.services,
            )
            self.evaluation = evaluation
            assert self.spec is not None
            specs = self.announcer.plan(
                evaluation, events=self.spec.actions.events, claim_of=records.health.claim_of
            )
            if specs:
                refs = {r.view.name: r.object_ref() for r in pod_records}
                for spec in await announce(specs, policy=object_ref(body), pods=refs, sink=parts.events):
                    parts.metrics.events.labels(spec.type, spec.reason).inc()
            parts.metrics.set_findings(self.key.namespace, self.key.name, evaluation.active)
            if parts.asks is not None and (before := snapshot_before(self.spec.rules)):
                parts.asks.observe(str(self.key), evaluation.active, self._place_of(pod_records), before)
            if self.scaler is not None:
                # Also without actions.scale: the scaler then forgets the policy and answers None, so a
                # removed action takes its last result (a problem, the condition) with it.
                self.scale_result = await self._scale(evaluation, now, policies)
            if self.reclaimer is not None:
                self.reclaim_result = await self._reclaim(
                    evaluation, now, pod_records, str(meta.get("uid", ""))
                )
        await self.write_status(status, now, pacing)

    def _place_of(self, pod_records: list[PodRecord]) -> Callable[[str], PodPlace | None]:
        """Where a pod of this policy's namespace runs, by name, and its Event reference."""
        records: dict[str, PodRecord] = {}

        def place_of(name: str) -> PodPlace | None:
            if not records:
                records.update((r.view.name, r) for r in pod_records)
            record = records.get(name)
            nodes = self.records.pod_nodes.get((self.key.namespace, name)) if record is not None else None
            return PodPlace(next(iter(nodes)), record.object_ref()) if record is not None and nodes else None

        return place_of

    def _judged_here(self, record: PodRecord) -> bool:
        """Whether this replica holds the pod's readings (sharded mode: its node is ours)."""
        nodes = self.records.pod_nodes.get((record.view.namespace, record.view.name))
        return not nodes or any(self.parts.shard.owns_node(n) for n in nodes)

    def _judged_elsewhere(
        self, records: Iterable[PodRecord], now: float
    ) -> dict[PodId, list[Outcome]] | None:
        """On the policy's owner: the pods on other shards' nodes (not sharded: none), with the outcomes
        their shards sent (none: nothing to judge them by this time)."""
        if self.spec is None:
            return None
        received = self.parts.board.outcomes(
            self.key.namespace,
            self.key.name,
            kinds={r.name: rule_kind(r) for r in self.spec.rules},
            generation=self.generation,
            interval=self.spec.evaluation_interval_seconds,
            now=now,
        )
        return {r.view.id: received.get(r.view.id, []) for r in records if not self._judged_here(r)}

    async def judge_for_owner(
        self,
        generation: int | None,
        spec: Mapping[str, Any],
        pods: Iterable[PodRecord],
        pacing: Pacing,
        now: float,
    ) -> None:
        """Sharded mode, another replica owns the policy: judge the pods on our nodes and send the
        owner the verdicts (it alone announces, scales and writes the status)."""
        parts, records = self.parts, self.records
        url = parts.shard.verdicts_to(self.key.namespace, self.key.name)
        if url is None:
            return  # ours, not settled yet (nothing to send), or an owner that takes nothing
        judge = self._evaluator_for(generation, spec)
        if judge is None:
            return
        pacing.interval = judge.spec.evaluation_interval_seconds
        judged = judge.judge(
            (r.view for r in pods if self._judged_here(r)),
            records.store,
            now,
            records.health,
            services=records.services,
        )
        if not judged:
            return  # none of the policy's pods is ours
        report = VerdictReport(
            schema_version=VERDICT_SCHEMA_VERSION,
            shard=parts.shard.identity,
            at=now,
            namespace=self.key.namespace,
            policy=self.key.name,
            generation=generation,
            pods=pod_verdicts(judged),
        )
        await parts.sender.send(url, report)

    def _evaluator_for(self, generation: int | None, spec: Mapping[str, Any]) -> PolicyEvaluator | None:
        """The evaluator that judges for the owner, by the spec of ``generation`` (None: invalid)."""
        if self._judge is not None and self._judge[0] == generation:
            return self._judge[1]
        try:
            parsed = parse_spec(spec)
        except SpecError:
            self._judge = (generation, None)  # the owner says so in the status
            return None
        previous = self._judge[1] if self._judge else None
        if previous is None:
            previous = PolicyEvaluator(str(self.key), parsed, namespace=self.key.namespace)
        else:
            previous.update_spec(parsed)
        self._judge = (generation, previous)
        return previous

    def _stand_aside(self) -> None:
        """Sharded mode, another replica owns the policy: forget it here, so that owning it again
        starts as a takeover does (findings restored from its status, not announced again)."""
        if not self.parsed:
            return
        self.log.info("Another replica owns this policy now; this one sends it its verdicts.")
        self.parts.metrics.set_findings(self.key.namespace, self.key.name, ())
        self.records.set_horizon(self.key, None)
        self.generation = self.spec = self.spec_error = self.evaluator = self.announcer = None
        self.evaluation = self.scale_result = self.reclaim_result = self.written = None
        self.parsed = False

    def sync_spec(
        self, generation: int | None, spec: Mapping[str, Any], status: Mapping[str, Any], now: float
    ) -> None:
        """Re-read the spec when its generation moved; restore findings at the first valid parse."""
        if self.parsed and generation == self.generation:
            return
        self.parsed = True
        self.generation = generation
        try:
            parsed = parse_spec(spec)
        except SpecError as exc:
            if self.spec_error != str(exc):
                self.log.warning("Invalid spec (generation %s): %s", generation, exc)
            self.spec_error = str(exc)
            return
        self.spec_error = None
        self.spec = parsed
        if self.evaluator is None or self.announcer is None:
            self.evaluator = PolicyEvaluator(str(self.key), parsed, namespace=self.key.namespace)
            self.announcer = Announcer(self.key.name)
            restored = findings_from_status(
                status, parsed, policy=str(self.key), namespace=self.key.namespace
            )
            if restored:
                self.evaluator.restore(restored, now)
                self.announcer.restore(restored, now)
                self.log.info("Resumed %d ongoing violation(s) from status.", len(restored))
        else:
            self.evaluator.update_spec(parsed)
        self.records.set_horizon(self.key, self.evaluator.horizon_seconds())

    async def _scale(
        self, evaluation: Evaluation, now: float, policies: Iterable[PolicyClaim]
    ) -> ScaleResult | None:
        assert self.scaler is not None
        assert self.spec is not None
        try:
            return await self.scaler.scale(self.key, self.spec, evaluation, now, policies)
        except Exception:
            self.log.exception("The scaler failed; scaling is retried at the next evaluation.")
            return self.scale_result

    async def _reclaim(
        self, evaluation: Evaluation, now: float, records: list[PodRecord], uid: str
    ) -> ReclaimResult | None:
        assert self.reclaimer is not None
        assert self.spec is not None
        active: set[PodId] = set()
        if (action := self.spec.actions.reclaim) is not None:
            store = self.records.store
            series = {pod: store.series_of(*pod) for pod in evaluation.matched_pods}
            active = recently_active(
                series, action, self.spec.rules, now, self.spec.evaluation_interval_seconds
            )
        try:
            return await self.reclaimer.reclaim(self.key, self.spec, evaluation, now, records, active, uid)
        except Exception:
            self.log.exception("The reclaimer failed; it is retried at the next evaluation.")
            return self.reclaim_result

    def verdict(self) -> PolicyVerdict:
        """What this round concluded, for the status."""
        return PolicyVerdict(
            generation=self.generation,
            interval_seconds=self.spec.evaluation_interval_seconds if self.spec else 0.0,
            spec_error=self.spec_error,
            warnings=spec_warnings(self.spec) if self.spec else (),
            evaluation=self.evaluation,
            messages=self.announcer.messages() if self.announcer else {},
            problem=self.scale_result.problem if self.scale_result else None,
            scale=self.scale_result.status if self.scale_result else None,
            scale_condition=self.scale_result.condition if self.scale_result else None,
            scaling=self.spec is None or self.spec.actions.scale is not None,
            reclaim=self.reclaim_result.status if self.reclaim_result else None,
            reclaim_condition=self.reclaim_result.condition if self.reclaim_result else None,
            reclaiming=self.spec is None or self.spec.actions.reclaim is not None,
            service_metrics=self._service_metrics(),
        )

    def _service_metrics(self) -> tuple[str, str, str] | None:
        """``ServiceMetricsAvailable`` over the selected pods, while the rules read the pods' own metrics."""
        if self.spec is None or self.evaluation is None or not service_metric_names(self.spec):
            return None
        services = self.records.services

        def latest(pod: PodId) -> ServiceScrape | None:
            kept = services.scrapes(pod)
            return kept[-1] if kept else None

        return availability(latest, self.evaluation.matched_pods)

    async def write_status(self, live: Mapping[str, Any], now: float, pacing: Pacing) -> None:
        """Patch the status subresource if what this round concluded differs from what was written."""
        if self.written is None:
            self.written = owned_part(live)
        new = build_status(self.verdict(), self.written, now)
        if new == self.written:
            return
        try:
            await self.parts.api.patch_status(
                GROUP, VERSION, PLURAL, self.key.namespace, self.key.name, new, manager=FIELD_MANAGER
            )
        except ApiError as exc:
            if exc.status == 404:
                # Deleted. Its DELETED event ends the daemon; this ends it should that event be missed
                # (no finalizer holds the policy until the operator has seen it go).
                pacing.end()
                return
            self.log.warning("Cannot write the status (retried at the next evaluation): %s", exc)
            return
        self.parts.metrics.status_writes.inc()
        # What the server holds now: a merge patch's null removes the field.
        self.written = {k: v for k, v in new.items() if v is not None}

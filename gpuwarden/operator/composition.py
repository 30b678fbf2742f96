"""The operator's composition root: :func:`build_operator` builds every part, each given what it uses.

One place says what the operator is made of, built in dependency order (nothing is plugged in
afterwards): the records (:class:`~gpuwarden.operator.state.OperatorState`); the clock (one, epoch
seconds, read by the admission, the evaluation loops, the pruning, the Events, the node view, the
peering verdict, the Leases and the verdict exchange) and, for spans that a step of the system's
clock must not bend, the monotonic clock (the rate limiter's buckets, sharded mode's view); the API
client; the metrics; the TokenReview authenticator of the agents' tokens; the Event poster every
Event goes through (the scaler's included); this replica's shard: leadership (peering), which is
sharded mode's one shard of one, or in sharded mode membership with its ring and the verdict
endpoint the other shards post to; the verdicts received and the sender of this replica's; the
accounting book (GPU time per workload, on ``/metrics``); the asks to the hooks of pods under a
leak finding (:mod:`.suspicion`); the admission of the agents' reports
(:mod:`.admission`) and the ingest endpoint that holds it; the scaler; the reclaimer; with
``--node-health`` the node view; the policies' runners' parts; and the
:class:`~gpuwarden.operator.lifecycle.Lifecycle` that start and stop the servers and background tasks.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gpuwarden.operator.accounting import AccountingBook, OwnerResolver
from gpuwarden.operator.admission import ReportAdmission
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints import NodeRateLimiter, ReportBook, ReportIngest, make_ingest_app
from gpuwarden.operator.kube import EventPoster, KubeApi, TokenAuthenticator
from gpuwarden.operator.lifecycle import Lifecycle, prune
from gpuwarden.operator.memory import GlibcHeap, keep_memory
from gpuwarden.operator.metrics import (
    DesiredReplicasCollector,
    OperatorMetrics,
    ScaleDecisionsCollector,
    store_gauges,
)
from gpuwarden.operator.nodehealth import NodeHealthMonitor
from gpuwarden.operator.policies import PolicyRunner, RunnerParts
from gpuwarden.operator.reclaim import KubeReclaimApi, Reclaimer
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.scaling import KubeScaleApi, WorkloadScaler
from gpuwarden.operator.sharding import Leadership, Sharding, VerdictBoard, VerdictIngest, VerdictSender
from gpuwarden.operator.state import OperatorState
from gpuwarden.operator.suspicion import HookAsks
from gpuwarden.wire.verdicts import VerdictReport

__all__ = ["Operator", "build_operator"]


@dataclass(eq=False)
class Operator:
    """The operator as :func:`build_operator` wired it; one per process, in ``memo.operator``."""

    state: OperatorState
    """The records: the Kopf handlers bind its indexes, forget deleted pods, end and wake policies."""
    ingest: ReportIngest
    """``POST /v1/reports``: the agents' reports, let in by its admission."""
    parts: RunnerParts
    """What each policy's runner is given."""
    lifecycle: Lifecycle
    """The servers and background tasks (the node view's among them), started and stopped together."""

    def runner(self, key: PolicyKey) -> PolicyRunner:
        """The evaluation loop of the policy ``key`` (one per running daemon)."""
        return PolicyRunner(self.parts, key)

    def forget_pod(self, namespace: str, name: str) -> None:
        """A pod was deleted: drop its records and its per-pod GPU gauges."""
        self.state.forget_pod(namespace, name)
        self.parts.metrics.latest.forget_pod(namespace, name)
        if self.parts.asks is not None:
            self.parts.asks.forget_pod(namespace, name)


def build_operator(
    config: OperatorConfig,
    *,
    api: KubeApi | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> Operator:
    """The operator for ``config``, wired: ``api`` (default: from the environment), ``clock`` (epoch
    seconds; the one wall clock of the whole operator), ``monotonic`` (seconds that only move on)."""
    api = api or KubeApi()
    metrics = OperatorMetrics()
    records = OperatorState()
    book = ReportBook()

    async def review(token: str) -> dict[str, Any]:
        return await api.create_token_review(token, [config.token_audience])

    authenticator = TokenAuthenticator(
        review,
        audience=config.token_audience,
        username=config.agent_service_account.username,
        review_rate=config.token_review_rate,
        # A GPU pod runs on the node, or its agent reported lately.
        known_node=lambda node: node in book or node in records.service_pods,
    )
    events = EventPoster(api, instance=config.identity, dropped=metrics.events_dropped, clock=clock)
    board = VerdictBoard()
    sender = VerdictSender(
        config.peer_token_file,
        metrics,
        tls=ssl.create_default_context(cafile=config.peer_ca_file),
        server_name=config.peer_server_name,
    )

    # The one place the mode is chosen: not sharded is a shard of one (Leadership), which owns every
    # node and policy and takes no verdicts.
    shard: Leadership
    if config.shards:
        shard = Sharding(config, api, clock=clock, monotonic=monotonic)

        def arrived(report: VerdictReport) -> None:
            # Another shard's verdicts on a policy owned here: its daemon may evaluate.
            records.schedule.nudge_policy_data(report.namespace, report.policy)

        verdicts = VerdictIngest(
            authenticator=TokenAuthenticator(
                review,
                audience=config.token_audience,
                username=config.operator_service_account.username,
                pod_bound=False,
            ),
            board=board,
            metrics=metrics,
            acting=shard.acting,
            received=arrived,
            known=records.runs_policy,
            max_body_bytes=config.max_body_bytes,
            clock=clock,
        )
        verdict_route = verdicts.handle
    else:
        shard = Leadership(config, api, clock=clock)
        verdict_route = None
    accounting = AccountingBook(
        config.accounting,
        OwnerResolver(
            api,
            group_label=config.accounting.group_label,
            follow_owners=config.accounting.follow_owners,
        ),
        clock,
    )
    metrics.registry.register(accounting)
    asks = HookAsks(events, clock)
    ingest = ReportIngest(
        authenticator=authenticator,
        limiter=NodeRateLimiter(config.node_rate, config.node_burst, clock=monotonic),
        book=book,
        metrics=metrics,
        admission=ReportAdmission(
            config, records, latest=metrics.latest, accounting=accounting, asks=asks, clock=clock
        ),
        acting=shard.acting,
        route=shard.route,
        max_body_bytes=config.max_body_bytes,
        clock=clock,
    )
    scaler = WorkloadScaler(KubeScaleApi(api), events, observe_only=config.observe_only)
    metrics.registry.register(DesiredReplicasCollector(scaler.desired_replicas, clock))
    metrics.registry.register(ScaleDecisionsCollector(scaler.decisions))
    reclaimer = Reclaimer(
        KubeReclaimApi(api),
        events,
        max_per_hour=config.reclaim_max_per_hour,
        enabled=config.reclaim,
        observe_only=config.observe_only,
    )
    tasks: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
        "gpuwarden pruning": lambda: prune(records, clock),
        "gpuwarden memory": lambda: keep_memory(GlibcHeap.open()),
        "gpuwarden accounting": accounting.run,
    }
    if config.node_health:
        node_health = NodeHealthMonitor(
            config,
            api,
            records.health,
            metrics,
            events,
            pods=lambda: records.pods,  # Kopf's index, bound at startup
            acting=lambda: shard.active,
            clock=clock,
        )
        tasks["gpuwarden node health"] = node_health.run

    def gauges() -> dict[str, float]:
        return {
            **store_gauges(records.store),
            "gpuwarden_operator_active": shard.active,
            "gpuwarden_operator_tokenreviews": authenticator.reviews,
            "gpuwarden_operator_policies": len(records.schedule),
            "gpuwarden_operator_retention_seconds": records.store.retention_seconds,
            "gpuwarden_operator_service_scrape_bytes": records.services.nbytes,
            "gpuwarden_operator_service_scrapes_dropped": records.services.dropped,
            "gpuwarden_operator_shard_members": shard.members(),
        }

    metrics.watch_pods(clock=clock)
    metrics.watch_state(gauges)
    lifecycle = Lifecycle(
        config,
        api=api,
        metrics=metrics,
        authenticator=authenticator,
        events=events,
        shard=shard,
        sender=sender,
        ingest_app=make_ingest_app(ingest, verdict_route),
        tasks=tasks,
    )
    parts = RunnerParts(
        records=records,
        api=api,
        clock=clock,
        metrics=metrics,
        events=events,
        shard=shard,
        board=board,
        sender=sender,
        asks=asks,
        scaler=scaler,
        reclaimer=reclaimer,
    )
    return Operator(state=records, ingest=ingest, parts=parts, lifecycle=lifecycle)

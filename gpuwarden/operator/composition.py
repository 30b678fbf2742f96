"""The operator's composition root: :func:`build_operator` builds its state and every collaborator.

One place says what the operator is made of, so that the state only keeps records and each
collaborator is handed what it needs: the clock (one, epoch seconds, read by the ingest, the
evaluation loops, the pruning, the Events, the node view, the peering verdict, the Leases and the
verdict exchange) and, for spans that a step of the system's clock must not bend, the monotonic
clock (the rate limiter's buckets, sharded mode's view); the API client; the metrics;
leadership (peering), or in sharded mode membership with its ring; the TokenReview authenticator
of the agents' tokens; the per-node rate limiter; the ingest endpoint's core, which stores through
the state; the accounting book (GPU time per workload, fed by the ingest, on ``/metrics``); the
Event poster every Event goes through (the scaler's included); the scaler; the reclaimer; with
``--node-health`` the node view; in sharded mode the verdict exchange (the sender to the policies'
owners, the endpoint the other shards post to); and the :class:`~gpuwarden.operator.services.Services`
that start and stop the servers and background tasks.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.operator.accounting import AccountingBook, OwnerResolver
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints import NodeRateLimiter, ReportIngest
from gpuwarden.operator.kube import EventPoster, KubeApi, TokenAuthenticator
from gpuwarden.operator.metrics import DesiredReplicasCollector, OperatorMetrics, ScaleDecisionsCollector
from gpuwarden.operator.nodehealth import NodeHealthMonitor
from gpuwarden.operator.policies import PolicyRunner
from gpuwarden.operator.reclaim import KubeReclaimApi, Reclaimer
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.scaling import KubeScaleApi, WorkloadScaler
from gpuwarden.operator.services import Services
from gpuwarden.operator.sharding import Leadership, Sharding, VerdictIngest, VerdictSender
from gpuwarden.operator.state import OperatorState

__all__ = ["Operator", "build_operator"]


@dataclass(eq=False)
class Operator:
    """The operator as :func:`build_operator` wired it; one per process, in ``memo.operator``."""

    state: OperatorState
    scaler: WorkloadScaler
    """Acts on ``actions.scale`` after each evaluation; its Events go through ``state.events``."""
    services: Services
    """The servers and background tasks (the node view's among them), started and stopped together."""
    reclaimer: Reclaimer | None = None
    """Acts on ``actions.reclaim`` after each evaluation."""

    def runner(self, key: PolicyKey) -> PolicyRunner:
        """The evaluation loop of the policy ``key`` (one per running daemon)."""
        return PolicyRunner(self.state, key, scaler=self.scaler, reclaimer=self.reclaimer)


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
    # Not sharded is a shard of one (Leadership), which owns every node and policy.
    leadership = (
        Sharding(config, api, clock=clock, monotonic=monotonic)
        if config.shards
        else Leadership(config, api, clock=clock)
    )

    async def review(token: str) -> dict[str, Any]:
        return await api.create_token_review(token, [config.token_audience])

    state = OperatorState(
        config=config,
        api=api,
        metrics=metrics,
        events=EventPoster(api, instance=config.identity, dropped=metrics.events_dropped, clock=clock),
        leadership=leadership,
        verdict_sender=VerdictSender(
            config.peer_token_file,
            metrics,
            tls=ssl.create_default_context(cafile=config.peer_ca_file),
            server_name=config.peer_server_name,
        ),
        authenticator=TokenAuthenticator(
            review,
            audience=config.token_audience,
            username=config.agent_service_account.username,
            review_rate=config.token_review_rate,
        ),
        limiter=NodeRateLimiter(config.node_rate, config.node_burst, clock=monotonic),
        clock=clock,
    )
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
    state.accounting = accounting
    state.authenticator.known_node = state.knows_node
    state.ingest = ReportIngest(
        authenticator=state.authenticator,
        limiter=state.limiter,
        book=state.book,
        metrics=metrics,
        accept=state.accept,
        acting=leadership.acting,
        max_body_bytes=config.max_body_bytes,
        clock=clock,
        route=leadership.route,
        plan=state.scrape_plan,
    )
    if config.shards:
        state.verdict_ingest = VerdictIngest(
            authenticator=TokenAuthenticator(
                review,
                audience=config.token_audience,
                username=config.operator_service_account.username,
                pod_bound=False,
            ),
            board=state.verdicts,
            metrics=metrics,
            acting=leadership.acting,
            received=state.verdicts_arrived,
            known=state.runs_policy,
            max_body_bytes=config.max_body_bytes,
            clock=clock,
        )
    scaler = WorkloadScaler(KubeScaleApi(api), state.events, observe_only=config.observe_only)
    metrics.registry.register(DesiredReplicasCollector(scaler.desired_replicas, clock))
    metrics.registry.register(ScaleDecisionsCollector(scaler.decisions))
    node_health = None
    if config.node_health:
        node_health = NodeHealthMonitor(
            config,
            api,
            state.health,
            metrics,
            state.events,
            pods=lambda: state.pods,  # Kopf's index, bound at startup
            acting=lambda: state.leadership.active,
            clock=clock,
        )
    metrics.watch_pods(clock=clock)
    metrics.watch_state(state.gauges)
    reclaimer = Reclaimer(
        KubeReclaimApi(api),
        state.events,
        max_per_hour=config.reclaim_max_per_hour,
        enabled=config.reclaim,
        observe_only=config.observe_only,
    )
    return Operator(
        state=state,
        scaler=scaler,
        services=Services(state, node_health=node_health),
        reclaimer=reclaimer,
    )

"""The operator's composition root: :func:`build_operator` builds its state and every collaborator.

One place says what the operator is made of, so that the state only keeps records and each
collaborator is handed what it needs: the API client; the metrics; leadership (peering), or in
sharded mode membership with its ring; the TokenReview authenticator of the agents' tokens; the
per-node rate limiter; the ingest endpoint's core, which stores through the state; and in sharded
mode the verdict exchange (the sender to the policies' owners, the endpoint the other shards post to). The
scaling component plugs in at startup (:func:`gpuwarden.operator.scaler.attach_scaler`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.ingest import ReportIngest
from gpuwarden.operator.kubeapi import KubeApi
from gpuwarden.operator.leadership import Leadership
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.posting import EventPoster
from gpuwarden.operator.ratelimit import NodeRateLimiter
from gpuwarden.operator.sharding import Sharding
from gpuwarden.operator.state import OperatorState
from gpuwarden.operator.tokenreview import TokenAuthenticator
from gpuwarden.operator.verdictexchange import VerdictIngest, VerdictSender

__all__ = ["build_operator"]


def build_operator(
    config: OperatorConfig, *, api: KubeApi | None = None, clock: Callable[[], float] = time.time
) -> OperatorState:
    """The operator's state for ``config``, wired: ``api`` (default: from the environment), ``clock``
    (epoch seconds; the ingest's, which bounds the reports' timestamps)."""
    api = api or KubeApi()
    metrics = OperatorMetrics()
    sharding = Sharding(config, api) if config.shards else None

    async def review(token: str) -> dict[str, Any]:
        return await api.create_token_review(token, [config.token_audience])

    state = OperatorState(
        config=config,
        api=api,
        metrics=metrics,
        events=EventPoster(api, instance=config.identity, dropped=metrics.events_dropped),
        leadership=sharding or Leadership(config, api),
        sharding=sharding,
        authenticator=TokenAuthenticator(
            review, audience=config.token_audience, username=config.agent_service_account.username
        ),
        limiter=NodeRateLimiter(config.node_rate, config.node_burst, clock=time.monotonic),
    )
    leadership = state.leadership
    state.ingest = ReportIngest(
        authenticator=state.authenticator,
        limiter=state.limiter,
        book=state.book,
        metrics=metrics,
        accept=state.accept,
        acting=sharding.acting if sharding else lambda: leadership.active,
        max_body_bytes=config.max_body_bytes,
        clock=clock,
        route=sharding.route if sharding else None,
    )
    if sharding is not None:
        state.verdict_sender = VerdictSender(config.peer_token_file, metrics)
        state.verdict_ingest = VerdictIngest(
            authenticator=TokenAuthenticator(
                review,
                audience=config.token_audience,
                username=config.operator_service_account.username,
                pod_bound=False,
            ),
            board=state.verdicts,
            metrics=metrics,
            acting=sharding.acting,
            received=state.verdicts_arrived,
            known=state.runs_policy,
            max_body_bytes=config.max_body_bytes,
        )
    metrics.watch_pods()
    metrics.watch_state(state.gauges)
    return state

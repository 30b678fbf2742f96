"""Sharded mode's loop: renew this replica's Lease, list the group's, and act on what the ring gives us.

Replaces the peering verdict (:class:`~.leadership.Leadership`, whose loop and pod label it
reuses) with ``--shards``: every replica whose Lease is live acts, each on its share. Every
:data:`~.membership.POLL_SECONDS` it lists the group's Leases into a
:class:`~.membership.ShardView`, and every :data:`~.membership.RENEW_SECONDS` renews its own
(carrying ``--advertise-url``). It labels its pod ``gpuwarden.dev/ingest-active=true`` while it
acts, so the ingest Service spreads the agents over every live replica; one that does not own
a node answers 421 with the owner (:meth:`route`). On exit it deletes its Lease, so its share
moves within a poll. See docs/scaling-out.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints import Elsewhere
from gpuwarden.operator.kube import ApiError, KubeApi
from gpuwarden.operator.resources import FIELD_MANAGER
from gpuwarden.operator.sharding.exchange import verdicts_url
from gpuwarden.operator.sharding.leadership import Leadership
from gpuwarden.operator.sharding.membership import (
    GROUP_LABEL,
    POLL_SECONDS,
    RENEW_SECONDS,
    Member,
    ShardView,
    lease_body,
    lease_name,
    live_members,
)
from gpuwarden.operator.sharding.ring import ring_key

__all__ = ["Sharding"]

logger = logging.getLogger(__name__)


class Sharding(Leadership):
    """This replica's membership and share (``--shards``); ``active`` while it is a live member."""

    def __init__(
        self,
        config: OperatorConfig,
        api: KubeApi,
        *,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        super().__init__(config, api, clock=clock, poll_seconds=poll_seconds)
        assert config.pod_namespace is not None  # OperatorConfig.from_args insists
        self.namespace = config.pod_namespace
        self.group = config.peering
        self.me = Member(config.identity, config.advertise_url)
        self.view = ShardView(config.identity)
        self.monotonic = monotonic
        """Elapsed seconds, for the view's freshness and settling: unlike the Leases' wall time
        (``clock``), a step of the system's clock must not make a stale view look fresh."""
        self._renewed_at: float | None = None

    # -- what the rest of the operator asks --

    def acting(self) -> bool:
        """Whether this replica acts now (a fresh view that counts it in): else ingest answers 503."""
        return self.view.acting(self.monotonic())

    def route(self, node: str) -> Elsewhere | None:
        """None when ``node``'s reports are ours; else the owner, for the 421."""
        now = self.monotonic()
        if self.view.owns(node, now):
            return None
        owner = self.view.owner(node)
        # No owner known (a view of nobody): the caller has answered 503 already through acting().
        return Elsewhere(owner.identity, owner.url) if owner is not None else Elsewhere("")

    def owns_node(self, node: str) -> bool:
        """Whether ``node``'s reports are taken here (its pods are judged here)."""
        return self.view.owns(node, self.monotonic())

    def acts_on_policy(self, namespace: str, name: str) -> bool:
        """Whether this replica evaluates, announces, scales and writes the status of a policy."""
        return self.view.settled_owner(ring_key(namespace, name), self.monotonic())

    def verdicts_to(self, namespace: str, name: str) -> str | None:
        """Where the policy's owner in the current ring takes this replica's verdicts on it; None while
        it is ours, not settled yet, or owned by a replica that advertises no URL."""
        owner = self.view.owner(ring_key(namespace, name))
        if owner is None or owner.identity == self.me.identity or owner.url is None:
            return None
        return verdicts_url(owner.url)

    def members(self) -> int:
        """Live replicas in this replica's view of the shard group."""
        return len(self.view.members)

    # -- the loop (Leadership.run calls _follow every poll) --

    async def _follow(self) -> None:
        now = self.monotonic()
        try:
            if self._renewed_at is None or now - self._renewed_at >= RENEW_SECONDS:
                body = lease_body(self.group, self.me, datetime.fromtimestamp(self.clock(), UTC))
                await self.api.renew_lease(self.namespace, body, manager=FIELD_MANAGER)
                self._renewed_at = now
            leases = await self.api.list_leases(self.namespace, f"{GROUP_LABEL}={self.group}")
            members = live_members(leases, datetime.fromtimestamp(self.clock(), UTC))
            if self.view.update(members, self.monotonic()):
                logger.info("Shards: %d live replica(s): %s.", len(members), ", ".join(sorted(members)))
        finally:
            # Also when the API failed: a view going stale stops this replica acting.
            await self._set_active(self.acting())

    async def step_down(self) -> None:
        """On shutdown: hand the share over at once (delete the Lease), then Leadership's step down."""
        self.view = ShardView(self.config.identity)
        try:
            await self.api.delete_lease(self.namespace, lease_name(self.group, self.config.identity))
        except ApiError as exc:
            logger.warning("Cannot delete this replica's Lease on exit (it expires on its own): %s", exc)
        await super().step_down()

"""Which replica acts: Kopf's peering verdict, mirrored for what Kopf does not pause by itself.

Kopf pauses a replica while a live peer with a higher (or the same) priority is
in the peering object: its watches stop and its daemons (our evaluations) are
stopped, so only the acting replica evaluates, posts Events and writes status.
The ingest endpoint and this replica's pod label are ours, not Kopf's, and Kopf
offers no hook for its pause. So this module reads the same peering object(s)
and applies Kopf's rule (:func:`peering_paused`, the logic of
``kopf._core.engines.peering.process_peering_event``): the acting replica
labels its own pod ``gpuwarden.dev/ingest-active=true`` (the ingest Service
selects on it) and accepts reports; a paused one removes the label and answers
503, so agents keep their reports and retry.

A missing peering object pauses, as in Kopf (``--peering`` makes peering
mandatory). The two verdicts can disagree for at most one poll interval after a
change: either way reports are buffered by the agents or land on a replica that
is about to evaluate them.

Not sharded is sharded mode's one shard of one (as kube-state-metrics has it): the acting replica
owns every node and every policy. So :class:`Leadership` answers what the rest of the operator asks
a shard (:meth:`~Leadership.route`, :meth:`~Leadership.owns_node`, ...), and
:class:`~.shard.Sharding` answers the same by its share of the ring: no part asks which mode it runs in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuwarden.kubetime import parse_time
from gpuwarden.operator.config import INGEST_ACTIVE_LABEL, OperatorConfig
from gpuwarden.operator.endpoints import Elsewhere
from gpuwarden.operator.kube import ApiError, KubeApi
from gpuwarden.operator.resources import FIELD_MANAGER

__all__ = ["Leadership", "peering_paused"]

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0
"""How often the peering object is read; Kopf's own keep-alives come every ~50 s, changes are rarer."""


def peering_paused(peers: Mapping[str, Any], *, identity: str, priority: int, now: datetime) -> bool:
    """Kopf's rule: paused while another live peer has a higher or the same priority.

    ``peers`` is the peering object's ``status``: identity -> {priority, lifetime, lastseen}.
    A peer is live until ``lastseen + lifetime``; one without ``lastseen`` counts as seen now.
    """
    for peer_id, info in peers.items():
        if peer_id == identity or not isinstance(info, Mapping):
            continue
        lastseen = parse_time(info["lastseen"]) if info.get("lastseen") is not None else now
        if lastseen is None:
            continue
        try:
            lifetime = timedelta(seconds=int(info.get("lifetime", 60)))
            their_priority = int(info.get("priority", 0))
        except (TypeError, ValueError):
            continue
        if lastseen + lifetime <= now:
            continue  # dead: Kopf ignores it (and cleans it up)
        if their_priority >= priority:
            return True
    return False


class Leadership:
    """Follows the peering verdict; labels this replica's pod while it acts; a shard of one."""

    def __init__(
        self,
        config: OperatorConfig,
        api: KubeApi,
        *,
        clock: Callable[[], float],
        on_change: Callable[[bool], Awaitable[None] | None] | None = None,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.config = config
        self.identity = config.identity
        self.api = api
        self.clock = clock
        """Wall time, epoch seconds (the operator's one clock): held against the peers' ``lastseen``."""
        self.active = False
        """Whether this replica acts (and accepts reports)."""
        self.labelled: bool | None = None
        """The label state last written to our pod (None: not known yet)."""
        self.poll_seconds = poll_seconds
        self._on_change = on_change

    # -- what the rest of the operator asks a shard (a shard of one: everything is ours) --

    def acting(self) -> bool:
        """Whether this replica acts now: else ingest answers 503."""
        return self.active

    def route(self, node: str) -> Elsewhere | None:
        """None when ``node``'s reports are ours (always, here); else the owner, for the 421."""
        return None

    def owns_node(self, node: str) -> bool:
        """Whether ``node``'s reports are taken here (its pods are judged here)."""
        return True

    def acts_on_policy(self, namespace: str, name: str) -> bool:
        """Whether this replica evaluates, announces, scales and writes the status of a policy."""
        return True

    def verdicts_to(self, namespace: str, name: str) -> str | None:
        """Where to send this replica's verdicts on a policy it does not act on; None: nowhere (here,
        it acts on all)."""
        return None

    def members(self) -> int:
        """Live replicas in this replica's view of the shard group (0: not sharded)."""
        return 0

    def _peering_paths(self) -> list[str]:
        name = self.config.peering
        if self.config.clusterwide:
            return [f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"]
        return [f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/{name}" for ns in self.config.namespaces]

    async def decide(self) -> bool:
        """Read the peering object(s) now; True when this replica acts."""
        now = datetime.fromtimestamp(self.clock(), UTC)
        for path in self._peering_paths():
            try:
                obj = await self.api.get(path)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                return False  # no peering object: Kopf pauses too
            peers = obj.get("status") or {}
            if peering_paused(peers, identity=self.config.identity, priority=self.config.priority, now=now):
                return False
        return True

    async def run(self) -> None:
        """Poll forever (cancel to stop); reconcile the label after every verdict."""
        failing: dict[str, bool] = {}
        while True:
            for what, step in (
                ("follow the peering", self._follow),
                ("label this pod", self._reconcile_label),
            ):
                try:
                    await step()
                except ApiError as exc:
                    # Said once per outage, not every poll; the verdict stays as it was meanwhile.
                    if not failing.get(what):
                        logger.warning("Cannot %s (retrying every %gs): %s", what, self.poll_seconds, exc)
                    failing[what] = True
                else:
                    if failing.pop(what, False):
                        logger.info("Can %s again.", what)
            await asyncio.sleep(self.poll_seconds)

    async def _follow(self) -> None:
        await self._set_active(await self.decide())

    async def _set_active(self, active: bool) -> None:
        if active == self.active:
            return
        self.active = active
        logger.info("This replica %s.", "acts: it evaluates and ingests" if active else "stands by")
        if self._on_change is not None:
            result = self._on_change(active)
            if result is not None:
                await result

    async def _reconcile_label(self) -> None:
        if self.labelled == self.active or not (self.config.pod_name and self.config.pod_namespace):
            return
        value = "true" if self.active else None
        await self.api.patch_pod_labels(
            self.config.pod_namespace,
            self.config.pod_name,
            {INGEST_ACTIVE_LABEL: value},
            manager=FIELD_MANAGER,
        )
        self.labelled = self.active

    async def step_down(self) -> None:
        """On shutdown: stop accepting and remove the label (best effort)."""
        self.active = False
        self.labelled = None
        try:
            await self._reconcile_label()
        except ApiError as exc:
            logger.warning("Cannot remove this pod's %s label on exit: %s", INGEST_ACTIVE_LABEL, exc)

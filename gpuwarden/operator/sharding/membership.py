"""Sharded mode's membership: the live replicas, read from their Leases; what this replica may act on.

Pure (Lease objects and a clock in, verdicts out); :mod:`.shard` renews and lists the
Leases. Each replica holds one ``coordination.k8s.io/v1`` Lease, labelled with its group
(the peering name); a Lease is live until ``renewTime + leaseDurationSeconds``. See
docs/scaling-out.md for why the timings below keep two replicas from acting on one policy.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuwarden.kubetime import format_micro_time, parse_time
from gpuwarden.operator.sharding.ring import Ring

__all__ = [
    "GROUP_LABEL",
    "LEASE_SECONDS",
    "POLL_SECONDS",
    "RENEW_SECONDS",
    "SETTLE_SECONDS",
    "STALE_SECONDS",
    "URL_ANNOTATION",
    "Member",
    "ShardView",
    "lease_body",
    "lease_name",
    "live_members",
]

GROUP_LABEL = "gpuwarden.dev/shard-group"
"""On every replica's Lease: the group (the peering name), what the replicas list by."""
URL_ANNOTATION = "gpuwarden.dev/ingest-url"
"""On a replica's Lease: where agents reach it directly (``--advertise-url``)."""
LEASE_SECONDS = 15
"""A Lease not renewed for this long is dead: a killed replica's share moves after it."""
RENEW_SECONDS = 5.0
"""How often a replica renews its Lease: three chances within a lease duration."""
POLL_SECONDS = 2.0
"""How often a replica lists the group's Leases."""
STALE_SECONDS = 2 * POLL_SECONDS
"""A view older than this (listings failing) acts on nothing."""
SETTLE_SECONDS = 3 * POLL_SECONDS
"""A policy just gained is acted on only after this long: the old owner has seen the change or gone stale."""


@dataclass(frozen=True, slots=True)
class Member:
    """A live replica: its identity and where agents reach it (None: not advertised)."""

    identity: str
    url: str | None = None


def lease_name(group: str, identity: str) -> str:
    """A DNS-1123 name for ``identity``'s Lease in ``group`` (a hash suffix keeps sanitised names apart)."""
    clean = re.sub(r"[^a-z0-9-]+", "-", identity.lower()).strip("-")
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return f"{group}-shard-{clean}"[:244].rstrip("-") + f"-{digest}"


def lease_body(group: str, member: Member, now: datetime) -> dict[str, Any]:
    """This replica's Lease, renewed at ``now`` (the whole object: created, or replaced by a merge patch)."""
    annotations = {URL_ANNOTATION: member.url} if member.url else {}
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(group, member.identity),
            "labels": {GROUP_LABEL: group},
            "annotations": annotations,
        },
        "spec": {
            "holderIdentity": member.identity,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": format_micro_time(now.timestamp()),
        },
    }


def live_members(leases: Iterable[Mapping[str, Any]], now: datetime) -> dict[str, Member]:
    """The replicas whose Leases are live at ``now``, by identity; malformed Leases count as dead."""
    members: dict[str, Member] = {}
    for lease in leases:
        spec = lease.get("spec") or {}
        identity = spec.get("holderIdentity")
        renewed = parse_time(spec.get("renewTime"))
        duration = spec.get("leaseDurationSeconds")
        if not isinstance(identity, str) or not identity or renewed is None:
            continue
        if not isinstance(duration, int) or isinstance(duration, bool) or duration <= 0:
            continue
        if renewed.timestamp() + duration <= now.timestamp():
            continue
        annotations = (lease.get("metadata") or {}).get("annotations") or {}
        url = annotations.get(URL_ANNOTATION)
        members[identity] = Member(identity, url if isinstance(url, str) and url else None)
    return members


class ShardView:
    """What this replica knows of the group, and what it may act on; times are seconds on one clock."""

    def __init__(
        self,
        identity: str,
        *,
        stale_seconds: float = STALE_SECONDS,
        settle_seconds: float = SETTLE_SECONDS,
    ) -> None:
        self.identity = identity
        self.stale_seconds = stale_seconds
        self.settle_seconds = settle_seconds
        self.members: dict[str, Member] = {}
        self.ring = Ring(())
        self.listed_at: float | None = None
        """When the group was last listed (None: never)."""
        self._history: list[tuple[float, Ring]] = []
        """The rings since the view was last fresh, oldest first, each with when it was first seen."""
        self._same_listings = 0
        """Consecutive listings that found the ring of the one before."""
        self.steady = False
        """Whether two consecutive listings found the same ring (since start, or a long silence)."""

    def update(self, members: Mapping[str, Member], now: float) -> bool:
        """A listing at ``now`` found ``members`` live; True when the ring changed."""
        if self.listed_at is None or now - self.listed_at > LEASE_SECONDS:
            # At start, or after longer than a Lease lives without a listing (peers may have come and
            # gone unseen): check the ring again. Not after a slow poll or two: a loaded API server
            # must not keep a replica from ever acting.
            self._same_listings = 0
            self.steady = False
        if not self.fresh(now):
            self._history.clear()  # a stale replica stopped acting: what it gains now, it settles again
        self.listed_at = now
        self.members = dict(members)
        ring = Ring(members)
        changed = ring != self.ring
        # A first listing may miss a peer that renewed its Lease just after it: acting on it would
        # take that peer's nodes for a poll. Two listings alike and the peer would have shown up.
        self._same_listings = 1 if changed or not self._same_listings else self._same_listings + 1
        self.steady = self.steady or self._same_listings >= 2
        if changed or not self._history:
            self.ring = ring
            self._history.append((now, ring))
        # Only the newest ring at least `settle` old matters: ownership through it is settled.
        while len(self._history) > 1 and self._history[1][0] <= now - self.settle_seconds:
            self._history.pop(0)
        return changed

    def fresh(self, now: float) -> bool:
        """Whether the last listing is recent enough to act on."""
        return self.listed_at is not None and now - self.listed_at <= self.stale_seconds

    def acting(self, now: float) -> bool:
        """Whether this replica may act at all: a fresh, steady view that counts it in (its Lease renews).

        Steady once two consecutive listings found the same ring (at start, and after a lease
        duration without a listing); a later change does not unsettle it (see docs/scaling-out.md).
        """
        return self.fresh(now) and self.steady and self.identity in self.members

    def owner(self, key: str) -> Member | None:
        """The member owning ``key`` in the current ring (None: no member)."""
        identity = self.ring.owner(key)
        return None if identity is None else self.members.get(identity)

    def owns(self, key: str, now: float) -> bool:
        """Whether this replica owns ``key`` now (a node: its reports are taken here)."""
        return self.acting(now) and self.ring.owner(key) == self.identity

    def settled_owner(self, key: str, now: float) -> bool:
        """Whether this replica owns ``key`` and has for :attr:`settle_seconds` (a policy: act on it)."""
        if not self.owns(key, now):
            return False
        since = None
        for seen, ring in reversed(self._history):
            if ring.owner(key) != self.identity:
                break
            since = seen
        return since is not None and now - since >= self.settle_seconds

"""The ring of sharded mode: which live replica owns a key (a node name, a policy's ``namespace/name``).

Rendezvous (highest random weight) hashing: the owner of a key is the member with the
highest ``blake2b(member NUL key)``. Every replica computes it the same from the same
member list, so nothing is stored or agreed on besides the list itself (:mod:`.membership`).
When a member leaves only its keys move, each to its next-highest member; when one joins
only the keys it now wins move, all to it. See docs/scaling-out.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["Ring", "ring_key"]


def _weight(member: bytes, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(member + b"\0" + key, digest_size=8).digest(), "big")


def ring_key(namespace: str, name: str) -> str:
    """The ring key of a policy (nodes are keyed by their name; names hold no ``/``)."""
    return f"{namespace}/{name}"


class Ring:
    """The owners of keys among a fixed set of members (build a new ring when the set changes)."""

    def __init__(self, members: Iterable[str]) -> None:
        self.members: tuple[str, ...] = tuple(sorted(set(members)))
        self._encoded = [(m, m.encode()) for m in self.members]
        # Owners are asked once per report: R hashes each time would be most of a lookup's cost.
        self._owners: dict[str, str | None] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and other.members == self.members

    def __hash__(self) -> int:
        return hash(self.members)

    def __repr__(self) -> str:
        return f"Ring({list(self.members)!r})"

    def owner(self, key: str) -> str | None:
        """The member owning ``key``; None when the ring is empty."""
        try:
            return self._owners[key]
        except KeyError:
            pass
        encoded = key.encode()
        best: str | None = None
        best_weight = -1
        for member, raw in self._encoded:
            weight = _weight(raw, encoded)
            if weight > best_weight:
                best, best_weight = member, weight
        if len(self._owners) >= 1 << 17:
            self._owners.clear()  # bounded: keys that come and go (policies, node names) never pile up
        self._owners[key] = best
        return best

"""Per-node token buckets: how many reports a node may send before it is told to back off (429).

A bucket holds up to ``burst`` tokens and refills at ``rate`` a second; each
accepted report takes one. A refused one learns how long until a token is
there (the ``Retry-After``). Buckets that have refilled completely carry no
information and are dropped when the map grows past ``max_nodes``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["NodeRateLimiter"]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class NodeRateLimiter:
    """Token buckets keyed by node name."""

    def __init__(
        self, rate: float, burst: float, *, clock: Callable[[], float], max_nodes: int = 50_000
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.max_nodes = max_nodes
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, node: str) -> float:
        """Take a token for ``node``: 0.0 when allowed, else the seconds until one will be there."""
        now = self._clock()
        bucket = self._buckets.get(node)
        if bucket is None:
            if len(self._buckets) >= self.max_nodes:
                self._drop_full(now)
            bucket = self._buckets[node] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    @staticmethod
    def retry_after(wait: float) -> str:
        """A ``Retry-After`` header value (whole seconds, at least 1) for a wait."""
        return str(max(1, math.ceil(wait)))

    def _drop_full(self, now: float) -> None:
        refill = self.burst / self.rate
        for node in [n for n, b in self._buckets.items() if now - b.updated >= refill]:
            del self._buckets[node]

    def __len__(self) -> int:
        return len(self._buckets)

"""Per-node token buckets: how many reports a node may send before it is told to back off (429).

A bucket holds up to ``burst`` tokens and refills at ``rate`` a second; each
accepted report takes one. A refused one learns how long until a token is
there (the ``Retry-After``). Buckets are keyed by the node the agent's token is
bound to (never by a name the report claims), so there are as many as nodes run
an agent; the map is an LRU bounded by ``max_nodes`` all the same: past it, the
bucket heard from least recently goes (a node silent that long has refilled).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["NodeRateLimiter"]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class NodeRateLimiter:
    """Token buckets keyed by node name, at most ``max_nodes`` of them."""

    def __init__(
        self, rate: float, burst: float, *, clock: Callable[[], float], max_nodes: int = 50_000
    ) -> None:
        if rate <= 0 or burst < 1 or max_nodes < 1:
            raise ValueError("rate must be > 0, burst >= 1 and max_nodes >= 1")
        self.rate = rate
        self.burst = burst
        self.max_nodes = max_nodes
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def acquire(self, node: str) -> float:
        """Take a token for ``node``: 0.0 when allowed, else the seconds until one will be there."""
        now = self._clock()
        bucket = self._buckets.get(node)
        if bucket is None:
            bucket = self._buckets[node] = _Bucket(self.burst, now)
            if len(self._buckets) > self.max_nodes:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(node)
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

    def __len__(self) -> int:
        return len(self._buckets)

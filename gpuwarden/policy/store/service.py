"""What the selected pods' own Prometheus metrics said: one bounded history of scrapes per pod.

The node agents scrape the pods on their nodes (the operator's scrape plan names the pods, the port
and the metric names the policies' service rules read), compact each scrape to what the rules need
(:class:`ServiceScrape`: histograms and counters summed over their label sets, gauges one value per
label set) and send it in their next report; the operator's intake records it here. The service rule
kinds (those whose record reads a ``metric``: :data:`gpuwarden.policy.rules.RULE_TYPES`) read it.

Pure bookkeeping, like :mod:`gpuwarden.policy.store.series`: it never reads a clock (``prune`` is told
``now``) and never does I/O. A pod keeps the scrapes of the last ``retention_seconds`` (the longest
window a policy reads, plus margin: the engine's horizon), never more than ``max_scrapes`` and never
more than ``max_pod_bytes`` (its oldest go first); all pods together never more than ``max_bytes``
(past it, the pods holding more than an equal share lose their oldest down to that share, so a pod
within it keeps all). Bytes are :func:`scrape_bytes`, an estimate of a scrape's memory. Scrapes
dropped for these bounds are counted (:attr:`ServiceStore.dropped`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuwarden.policy.store.series import PodId
from gpuwarden.units import format_duration

__all__ = [
    "MAX_BYTES",
    "MAX_POD_BYTES",
    "MAX_SCRAPES",
    "STALE_INTERVALS",
    "Histogram",
    "Increase",
    "ServiceScrape",
    "ServiceStore",
    "histogram_quantile",
    "scrape_bytes",
]

MAX_SCRAPES = 512
"""The most scrapes a pod keeps, whatever the retention: a 1-hour window scraped every 10 s is 360."""
MAX_POD_BYTES = 4 * 2**20
"""The most bytes a pod's scrapes keep (:func:`scrape_bytes`): 512 scrapes of a latency histogram of 30
buckets, two counters and a gauge take about 1.6 MiB."""
MAX_BYTES = 256 * 2**20
"""The most bytes all pods' scrapes keep together."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram at one scrape, summed over its label sets."""

    bounds: tuple[float, ...]
    """Ascending upper bounds (``le``), the last ``math.inf``."""
    counts: tuple[float, ...]
    """Cumulative counts, one per bound: ``counts[-1]`` is the histogram's ``_count``."""
    sum: float


@dataclass(frozen=True, slots=True)
class ServiceScrape:
    """One scrape of one pod, compacted to the metric names asked for."""

    at: float
    """Unix seconds: when the agent scraped."""
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    """By base name (without ``_bucket``), summed over label sets."""
    counters: Mapping[str, float] = field(default_factory=dict)
    """By name as exposed (with ``_total`` where the server writes it), summed over label sets."""
    gauges: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """By name: one value per label set (at most 16)."""
    error: str | None = None
    """Why the scrape failed (``Timeout``, ``TooLarge``, ``NotPrometheus``, ``HTTPStatus``,
    ``Unreachable``, ``NoPort``); the maps are then empty."""


@dataclass(frozen=True, slots=True)
class Increase:
    """What a histogram or a counter gained over a window, counter resets handled as ``rate()`` does."""

    name: str
    """The name read (the first of the names asked for that the pod exports)."""
    seconds: float
    """From the window's first scrape to its last: the span the increase was observed over."""
    histogram: Histogram | None = None
    """A histogram's: the window's observations, cumulative per bound (its ``counts[-1]``: how many)."""
    value: float = 0.0
    """A counter's."""
    covered: bool = True
    """Whether the pod was scraped since before the window began (or exactly at its start): the
    increase then speaks for the whole window, not for a pod that began inside it."""

    @property
    def rate(self) -> float:
        """Per second over :attr:`seconds` (a histogram's: observations per second)."""
        total = self.value if self.histogram is None else self.histogram.counts[-1]
        return total / self.seconds


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """The ``q``-quantile (0..1) of a histogram's observations, as Prometheus's ``histogram_quantile``
    computes it: linear interpolation inside the bucket the rank falls in (the first bucket from 0,
    or from its bound when that is at or below 0); a rank in the ``+Inf`` bucket answers the highest
    finite bound. None when it has no observation, or no finite bound to answer with."""
    n = len(h.bounds)
    if n < 2 or h.bounds[-1] != math.inf or h.counts[-1] <= 0:
        return None
    rank = q * h.counts[-1]
    # The first bucket (of the finite ones) whose cumulative count reaches the rank.
    b = next((i for i in range(n - 1) if h.counts[i] >= rank), n - 1)
    if b == n - 1:
        return h.bounds[n - 2]
    if b == 0 and h.bounds[0] <= 0:
        return h.bounds[0]
    start = 0.0 if b == 0 else h.bounds[b - 1]
    below = 0.0 if b == 0 else h.counts[b - 1]
    count = h.counts[b] - below
    if count <= 0:
        return h.bounds[b]
    return start + (h.bounds[b] - start) * ((rank - below) / count)


def scrape_bytes(scrape: ServiceScrape) -> int:
    """An estimate of a scrape's memory in the store: about 32 bytes a number (a float and its
    tuple slot), 200 an entry (its name, the maps' slots, a histogram's object), 300 the scrape."""
    size = 300
    for h in scrape.histograms.values():
        size += 200 + 64 * len(h.bounds)
    size += 200 * len(scrape.counters)
    for values in scrape.gauges.values():
        size += 200 + 32 * len(values)
    return size


STALE_INTERVALS = 3.0
"""A pod's newest scrape is stale once older than this many of its scrape intervals (or the caller's
``stale_after``, whichever is longer): a pod scraped every minute is not stale after 30 s."""


class ServiceStore:
    """Each pod's recent scrapes, oldest first, and the queries the service rules make of them.

    Queries are as of ``now``: they read the pod's newest scrape at or before ``now`` (the *end*),
    which must be *fresh* (no older than ``stale_after``, nor than :data:`STALE_INTERVALS` of the
    pod's scrape interval) and must have succeeded; else there is nothing to judge (None). A window
    of length ``w`` holds the scrapes in ``[end - w, end]``.
    """

    def __init__(
        self,
        retention_seconds: float,
        max_scrapes: int = MAX_SCRAPES,
        *,
        max_pod_bytes: int = MAX_POD_BYTES,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        if retention_seconds <= 0 or max_scrapes < 2 or not 0 < max_pod_bytes <= max_bytes:
            raise ValueError(
                "retention_seconds must be > 0, max_scrapes >= 2 and 0 < max_pod_bytes <= max_bytes"
            )
        self.retention_seconds = retention_seconds
        """Scrapes older than this before ``now`` go at the next :meth:`prune`; the owner raises it
        to the longest window its policies read (as it does the series store's)."""
        self.max_scrapes = max_scrapes
        self.max_pod_bytes = max_pod_bytes
        self.max_bytes = max_bytes
        self.nbytes = 0
        """The kept scrapes' :func:`scrape_bytes`, over all pods."""
        self.dropped = 0
        """Scrapes dropped before their retention for a bound (a pod's count or bytes, or all bytes)."""
        self._pods: dict[PodId, list[ServiceScrape]] = {}
        self._bytes: dict[PodId, int] = {}

    def record(self, pod: PodId, scrape: ServiceScrape) -> None:
        """Keep one scrape of ``pod``; one not newer than the pod's newest is ignored (a report
        repeated or overtaken: the counters must be read in the order they were scraped)."""
        scrapes = self._pods.get(pod)
        if scrapes is None:
            scrapes = self._pods[pod] = []
            self._bytes[pod] = 0
        elif scrapes and scrape.at <= scrapes[-1].at:
            return
        size = scrape_bytes(scrape)
        scrapes.append(scrape)
        self._bytes[pod] += size
        self.nbytes += size
        if len(scrapes) > self.max_scrapes:
            # In batches, so that each record is amortised O(1).
            self._drop(pod, max(1, len(scrapes) - self.max_scrapes + self.max_scrapes // 8))
        if self._bytes[pod] > self.max_pod_bytes:
            self._drop_to(pod, self.max_pod_bytes - self.max_pod_bytes // 8)
        if self.nbytes > self.max_bytes:
            # In one pass, to 7/8 of the bound: the pods above an equal share of that lose their oldest.
            share = (self.max_bytes - self.max_bytes // 8) // len(self._pods)
            for each in [p for p, n in self._bytes.items() if n > share]:
                self._drop_to(each, share)

    def _drop_to(self, pod: PodId, nbytes: int) -> None:
        """Drop ``pod``'s oldest scrapes until it keeps at most ``nbytes`` (its newest always stays)."""
        scrapes, held, n = self._pods[pod], self._bytes[pod], 0
        while held > nbytes and n < len(scrapes) - 1:
            held -= scrape_bytes(scrapes[n])
            n += 1
        self._drop(pod, n)

    def _drop(self, pod: PodId, n: int) -> None:
        """Drop ``pod``'s ``n`` oldest scrapes before their time (counted)."""
        self.dropped += n
        self._remove(pod, n)

    def _remove(self, pod: PodId, n: int) -> None:
        scrapes = self._pods[pod]
        freed = sum(map(scrape_bytes, scrapes[:n]))
        del scrapes[:n]
        self._bytes[pod] -= freed
        self.nbytes -= freed

    def forget_pod(self, pod: PodId) -> None:
        """Drop everything of a pod (it was deleted)."""
        if self._pods.pop(pod, None) is not None:
            self.nbytes -= self._bytes.pop(pod)

    def prune(self, now: float) -> None:
        """Drop scrapes older than ``now - retention_seconds``, and pods left with none."""
        cutoff = now - self.retention_seconds
        for pod in list(self._pods):
            scrapes = self._pods[pod]
            keep = bisect_left(scrapes, cutoff, key=_at)
            if keep == len(scrapes):
                self.forget_pod(pod)
            elif keep:
                self._remove(pod, keep)

    def pods(self) -> list[PodId]:
        """The pods with any scrape kept."""
        return list(self._pods)

    def scrapes(self, pod: PodId) -> tuple[ServiceScrape, ...]:
        """A pod's kept scrapes, oldest first (none: an empty tuple)."""
        return tuple(self._pods.get(pod, ()))

    def __len__(self) -> int:
        """How many scrapes are kept, over all pods."""
        return sum(map(len, self._pods.values()))

    # -- queries --

    def _upto(self, pod: PodId, now: float) -> tuple[list[ServiceScrape], int]:
        """The pod's scrapes, and how many of them are at or before ``now``."""
        scrapes = self._pods.get(pod, [])
        return scrapes, bisect_right(scrapes, now, key=_at)

    def newest(self, pod: PodId, now: float) -> ServiceScrape | None:
        """The pod's newest scrape at or before ``now``, failed or not, fresh or not."""
        scrapes, n = self._upto(pod, now)
        return scrapes[n - 1] if n else None

    def current(self, pod: PodId, now: float, stale_after: float) -> ServiceScrape | None:
        """The pod's newest scrape at or before ``now`` if it is fresh and succeeded (see the class)."""
        return self._usable(pod, now, stale_after)[0]

    def unjudged(self, pod: PodId, now: float, stale_after: float) -> str:
        """Why there is no :meth:`current` scrape to judge, in words; empty when there is one."""
        return self._usable(pod, now, stale_after)[1]

    def _usable(self, pod: PodId, now: float, stale_after: float) -> tuple[ServiceScrape | None, str]:
        scrapes, n = self._upto(pod, now)
        if not n:
            return None, "no scrape of its metrics yet"
        end = scrapes[n - 1]
        if end.error is not None:
            return None, f"its newest scrape failed ({end.error})"
        recent = [s.at for s in scrapes[max(0, n - 9) : n]]
        interval = (
            statistics.median_low(b - a for a, b in itertools.pairwise(recent)) if len(recent) > 1 else 0.0
        )
        if now - end.at > max(stale_after, STALE_INTERVALS * interval):
            return None, f"its newest scrape is {format_duration(round(now - end.at))} old"
        return end, ""

    def gauge(
        self, pod: PodId, names: Sequence[str], now: float, stale_after: float
    ) -> tuple[str, tuple[float, ...]] | None:
        """The first of ``names`` the pod's current scrape has, and its values (one per label set)."""
        end = self.current(pod, now, stale_after)
        if end is None:
            return None
        name = next((n for n in names if n in end.gauges), None)
        return None if name is None else (name, end.gauges[name])

    def increase(
        self, pod: PodId, names: Sequence[str], window: float, now: float, stale_after: float
    ) -> Increase | None:
        """What the first of ``names`` the pod's current scrape has (a histogram, else a counter)
        gained over the window ending at that scrape; None with fewer than two scrapes of it there.

        A fall in a counter (or in any of a histogram's buckets, or its bounds changing) is a reset,
        the process restarted: the value after it counts from zero, as ``rate()`` reads it. Failed
        scrapes in between are skipped. Unlike Prometheus's ``increase``, nothing is extrapolated to
        the window's edges: a quantile is the same either way (every bucket would be scaled alike).
        """
        end = self.current(pod, now, stale_after)
        if end is None:
            return None
        name = next((n for n in names if n in end.histograms or n in end.counters), None)
        if name is None:
            return None
        scrapes, n = self._upto(pod, now)
        start = end.at - window
        first = bisect_left(scrapes, start, 0, n, key=_at)
        covered = first > 0 or scrapes[first].at == start
        if name in end.histograms:
            found = _histogram_increase(name, [h for s in scrapes[first:n] if (h := _hist(s, name))])
        else:
            found = _counter_increase(
                name, [(s.at, c) for s in scrapes[first:n] if (c := s.counters.get(name)) is not None]
            )
        return found if found is None or covered else replace(found, covered=False)


def _at(scrape: ServiceScrape) -> float:
    return scrape.at


def _hist(scrape: ServiceScrape, name: str) -> tuple[float, Histogram] | None:
    h = scrape.histograms.get(name)
    return None if h is None else (scrape.at, h)


def _histogram_increase(name: str, seen: Sequence[tuple[float, Histogram]]) -> Increase | None:
    if len(seen) < 2:
        return None
    (t0, prev), rest = seen[0], seen[1:]
    gained = [0.0] * len(prev.counts)
    total = 0.0
    for _, h in rest:
        if h.bounds != prev.bounds:
            # A new bucket layout (the server was reconfigured): what came before cannot be added.
            gained = list(h.counts)
            total = h.sum
        elif any(c < p for c, p in zip(h.counts, prev.counts, strict=True)):
            gained = [g + c for g, c in zip(gained, h.counts, strict=True)]
            total += h.sum
        else:
            gained = [g + c - p for g, c, p in zip(gained, h.counts, prev.counts, strict=True)]
            total += h.sum - prev.sum
        prev = h
    return Increase(name, seen[-1][0] - t0, histogram=Histogram(prev.bounds, tuple(gained), total))


def _counter_increase(name: str, seen: Sequence[tuple[float, float]]) -> Increase | None:
    if len(seen) < 2:
        return None
    gained = 0.0
    for (_, p), (_, c) in itertools.pairwise(seen):
        gained += c if c < p else c - p
    return Increase(name, seen[-1][0] - seen[0][0], value=gained)

"""What the selected pods' own Prometheus metrics said: one bounded history of scrapes per pod.

The node agents scrape the pods on their nodes (the operator's scrape plan names the pods, the port
and the metric names the policies' service rules read), compact each scrape to what the rules need
(:class:`ServiceScrape`: histograms and counters summed over their label sets, gauges one value per
label set) and send it in their next report; the operator's intake records it here. The service rule
kinds (``requestLatency``, ``requestQueue``, ``kvCacheUsage``) read it.

Pure bookkeeping, like :mod:`gpuwarden.policy.store.series`: it never reads a clock (``prune`` is told
``now``) and never does I/O. A pod keeps the scrapes of the last ``retention_seconds`` (the longest
window a policy reads, plus margin: the engine's horizon) and never more than ``max_scrapes``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwarden.policy.store.series import PodId

__all__ = ["MAX_SCRAPES", "Histogram", "ServiceScrape", "ServiceStore"]

MAX_SCRAPES = 512
"""The most scrapes a pod keeps, whatever the retention: a 1-hour window scraped every 10 s is 360."""


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


class ServiceStore:
    """Each pod's recent scrapes, oldest first."""

    def __init__(self, retention_seconds: float, max_scrapes: int = MAX_SCRAPES) -> None:
        if retention_seconds <= 0 or max_scrapes < 2:
            raise ValueError("retention_seconds must be > 0 and max_scrapes >= 2")
        self.retention_seconds = retention_seconds
        """Scrapes older than this before ``now`` go at the next :meth:`prune`; the owner raises it
        to the longest window its policies read (as it does the series store's)."""
        self.max_scrapes = max_scrapes
        self._pods: dict[PodId, deque[ServiceScrape]] = {}

    def record(self, pod: PodId, scrape: ServiceScrape) -> None:
        """Keep one scrape of ``pod``; one not newer than the pod's newest is ignored (a report
        repeated or overtaken: the counters must be read in the order they were scraped)."""
        scrapes = self._pods.get(pod)
        if scrapes is None:
            scrapes = self._pods[pod] = deque(maxlen=self.max_scrapes)
        elif scrapes and scrape.at <= scrapes[-1].at:
            return
        scrapes.append(scrape)

    def forget_pod(self, pod: PodId) -> None:
        """Drop everything of a pod (it was deleted)."""
        self._pods.pop(pod, None)

    def prune(self, now: float) -> None:
        """Drop scrapes older than ``now - retention_seconds``, and pods left with none."""
        cutoff = now - self.retention_seconds
        for pod in [p for p, scrapes in self._pods.items() if self._drop_before(scrapes, cutoff)]:
            del self._pods[pod]

    @staticmethod
    def _drop_before(scrapes: deque[ServiceScrape], cutoff: float) -> bool:
        """Drop the scrapes before ``cutoff``; whether none is left."""
        while scrapes and scrapes[0].at < cutoff:
            scrapes.popleft()
        return not scrapes

    def pods(self) -> list[PodId]:
        """The pods with any scrape kept."""
        return list(self._pods)

    def scrapes(self, pod: PodId) -> tuple[ServiceScrape, ...]:
        """A pod's kept scrapes, oldest first (none: an empty tuple)."""
        return tuple(self._pods.get(pod, ()))

    def __len__(self) -> int:
        """How many scrapes are kept, over all pods."""
        return sum(map(len, self._pods.values()))

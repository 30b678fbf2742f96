"""Local mode's service scrapes: what the service rules (those that read the pods' own metrics) judge,
without an agent or an operator.

- ``demo``: the scenario's served replicas (:meth:`gpuwarden.sim.scenario.Scenario.service_metrics`,
  the model's own figures, no HTTP) become :class:`~gpuwarden.policy.ServiceScrape` values with
  :func:`scrape_of_replica`, for the scenario's pods.
- ``watch --service-metrics URL``: :class:`ServiceWatcher` GETs each URL at the policies' pace, with
  the agent's bounded fetch and its compaction (:mod:`gpuwarden.agent.scrape`: in time, in size,
  prometheus_client's parser, only the names the rules read), and records each scrape, or why it
  failed, for a subject of its own, :func:`service_subject` (``service/<host:port>``, namespace ``""``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Sequence
from urllib.parse import urlsplit

import aiohttp

# The package, not its names: ``compact`` and ``fetch`` are also its (protected) modules' names.
from gpuwarden.agent import scrape
from gpuwarden.local.policies import LocalPolicy
from gpuwarden.policy import PROCESS_NAMESPACE, Histogram, PodId, ServiceScrape, service_metric_names
from gpuwarden.sim.replica import ReplicaMetrics

log = logging.getLogger(__name__)

__all__ = ["ServiceWatcher", "scrape_interval", "scrape_of_replica", "service_subject", "wanted_names"]

Record = Callable[[PodId, ServiceScrape], None]
"""Where a scrape goes: the session's service store."""


def wanted_names(policies: Sequence[LocalPolicy]) -> frozenset[str]:
    """The metric names the policies' service rules read (none: nothing to scrape)."""
    return frozenset(name for p in policies for name in service_metric_names(p.spec))


def scrape_interval(policies: Sequence[LocalPolicy]) -> float:
    """How often to scrape: the shortest ``serviceMetrics.interval`` (else ``evaluationInterval``) of the
    policies with service rules."""
    intervals = [
        (p.spec.service_metrics.interval_seconds if p.spec.service_metrics else None)
        or p.spec.evaluation_interval_seconds
        for p in policies
        if service_metric_names(p.spec)
    ]
    return min(intervals, default=10.0)


def scrape_of_replica(metrics: ReplicaMetrics, at: float, names: Collection[str]) -> ServiceScrape:
    """A simulated replica's metrics as an agent would have compacted them, at ``at`` (unix seconds)."""
    return ServiceScrape(
        at=at,
        histograms={
            name: Histogram(h.bounds, h.counts, h.sum)
            for name, h in metrics.histograms.items()
            if name in names
        },
        counters={name: value for name, value in metrics.counters.items() if name in names},
        gauges={name: (value,) for name, value in metrics.gauges.items() if name in names},
    )


def service_subject(url: str) -> PodId:
    """The subject a scraped URL's findings are about: ``service/<host:port>`` in namespace ``""``."""
    parts = urlsplit(url)
    return PodId(PROCESS_NAMESPACE, f"service/{parts.netloc or url}")


class ServiceWatcher:
    """Scrapes ``urls`` every ``interval`` seconds (``clock`` stamps them), each scrape to ``record``.

    Each URL is fetched with the agent's bounds (``timeout``, at most half the interval; 1 MiB), one
    at a time per URL, all URLs at once; a failure is recorded as the scrape's ``error`` (the reason
    the operator's condition would count) and logged once per change of reason.
    """

    def __init__(
        self,
        urls: Sequence[str],
        names: Collection[str],
        record: Record,
        *,
        interval: float,
        clock: Callable[[], float],
        timeout: float = scrape.DEFAULT_TIMEOUT,
    ) -> None:
        self.urls = list(urls)
        self.names = frozenset(names)
        self.interval = interval
        self.timeout = min(timeout, interval / 2)
        self._record = record
        self._clock = clock
        self._last_error: dict[str, str | None] = {}

    async def run(self) -> None:
        """Scrape until cancelled."""
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._loop(session, url) for url in self.urls))

    async def scrape_once(self, session: aiohttp.ClientSession, url: str) -> ServiceScrape:
        """One scrape of ``url``, recorded, and returned."""
        at = self._clock()
        try:
            page = await scrape.fetch(session, url, seconds=self.timeout, max_bytes=scrape.DEFAULT_MAX_BYTES)
            compacted = scrape.compact(page.text, page.content_type, self.names)
        except scrape.ScrapeFailed as exc:
            result = ServiceScrape(at=at, error=exc.reason.value)
            if self._last_error.get(url) != exc.reason.value:
                log.warning("scraping %s: %s", url, exc)
        else:
            result = ServiceScrape(
                at=at,
                histograms={
                    h.name: Histogram((*h.bounds, math.inf), (*h.counts, h.count), h.sum)
                    for h in compacted.histograms
                },
                counters={c.name: c.value for c in compacted.counters},
                gauges={g.name: tuple(g.values) for g in compacted.gauges},
            )
        self._last_error[url] = result.error
        self._record(service_subject(url), result)
        return result

    async def _loop(self, session: aiohttp.ClientSession, url: str) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            await self.scrape_once(session, url)
            next_at += self.interval
            # A scrape that overran its turn starts the next at once, never a burst to catch up.
            next_at = max(next_at, loop.time())
            await asyncio.sleep(next_at - loop.time())

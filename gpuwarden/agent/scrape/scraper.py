"""The scrape loop: the operator's plan in, compacted scrapes out, never in the way of the agent's other work.

- **Which pods.** The plan comes with every answer to a report (:meth:`Scraper.accept_plan`). A
  target is scraped only when the agent's own pod list has a pod of that uid, namespace and name on
  this node with that IP: the plan names pods, the agent does not become a way to reach an arbitrary
  address. Any other target is ignored and counted (``unlisted``: no such pod here; ``address``:
  another IP), once per change.
- **When.** Each target at its interval, the first one at once. A failed one backs off: its interval
  doubles with each failure in a row, up to :data:`MAX_BACKOFF` times (and 5 minutes at most); one
  success resets it. Every attempt's outcome is sent (a failure with its reason), so the operator's
  condition stays current.
- **Bounded.** At most ``concurrency`` scrapes at once; each must finish within its timeout
  (``--scrape-timeout``, 2 s, and at most half the target's interval) and ``max_bytes``
  (:func:`~gpuwarden.agent.scrape.fetch.fetch`); the page is parsed in a worker thread, so a large
  page does not hold the event loop that samples the GPUs, serves /metrics and the hook socket, and
  posts the reports. A hung endpoint holds one slot for one timeout, nothing else.
- **Out.** The newest scrape of each pod waits in :meth:`Scraper.drain`, which the agent calls as it
  takes each snapshot: the scrapes ride on that snapshot (``Snapshot.services``), buffered and
  replayed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from gpuwarden.agent.scrape.compact import ScrapeFailed, compact
from gpuwarden.agent.scrape.fetch import DEFAULT_MAX_BYTES, fetch
from gpuwarden.wire.scrape import (
    PlanError,
    ScrapeFailure,
    ScrapePlan,
    ScrapeTarget,
    ServiceSample,
    parse_plan,
)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_TIMEOUT",
    "MAX_BACKOFF",
    "REFUSALS",
    "RESULTS",
    "ListedPod",
    "ScrapeEvents",
    "Scraper",
]

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 4
"""Scrapes in flight at once (``--scrape-concurrency``)."""
DEFAULT_TIMEOUT = 2.0
"""Seconds a scrape may take at most (``--scrape-timeout``), and never more than half its interval."""
MAX_BACKOFF = 16
"""A failing target's interval grows up to this many times its own."""
MAX_BACKOFF_SECONDS = 300.0

RESULTS = ("ok", "timeout", "too_large", "not_prometheus", "http_status", "unreachable")
"""``gpuwarden_agent_service_scrapes_total{result}``: ``ok``, or the failure's reason in snake case."""
_RESULT = {
    ScrapeFailure.TIMEOUT: "timeout",
    ScrapeFailure.TOO_LARGE: "too_large",
    ScrapeFailure.NOT_PROMETHEUS: "not_prometheus",
    ScrapeFailure.HTTP_STATUS: "http_status",
    ScrapeFailure.UNREACHABLE: "unreachable",
}
REFUSALS = ("unlisted", "address", "invalid_plan")
"""Why a plan's target (or a whole plan) is not scraped
(``gpuwarden_agent_service_targets_refused_total{reason}``)."""


@dataclass(frozen=True, slots=True)
class ListedPod:
    """A pod as the agent's own pod list has it on this node."""

    namespace: str
    name: str
    ips: frozenset[str]


class ScrapeEvents(Protocol):
    """What the scraper counts (:class:`gpuwarden.agent.metrics.ScrapeMetrics`)."""

    def scraped(self, result: str, seconds: float) -> None:
        """One scrape ended with ``result`` (one of :data:`RESULTS`) after ``seconds``."""

    def refused(self, reason: str) -> None:
        """A target (or a plan) was refused for ``reason`` (one of :data:`REFUSALS`)."""

    def targets(self, count: int) -> None:
        """The plan now has ``count`` targets to scrape."""


@dataclass(slots=True)
class _Target:
    target: ScrapeTarget
    due: float
    failures: int = 0
    task: asyncio.Task[None] | None = None


@dataclass(slots=True)
class _Plan:
    targets: dict[str, _Target] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    """Refused targets by uid, with the reason last counted (each change is counted once)."""


class Scraper:
    """Scrapes the pods of the operator's plan (see the module doc); :meth:`run` is its loop.

    ``lookup``: the agent's pod list, by pod uid (None: no such pod on this node). ``clock``:
    wall time for the scrapes' ``at``. ``session_factory`` builds the HTTP session at :meth:`run`.
    """

    def __init__(
        self,
        lookup: Callable[[str], ListedPod | None],
        events: ScrapeEvents,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.time,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
    ) -> None:
        if concurrency < 1 or timeout <= 0 or max_bytes < 1:
            raise ValueError("concurrency, timeout and max_bytes must be positive")
        self._lookup = lookup
        self._events = events
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._clock = clock
        self._session_factory = session_factory or _session
        self._slots = asyncio.Semaphore(concurrency)
        self._plan = _Plan()
        self._pending: dict[str, ServiceSample] = {}
        self._changed = asyncio.Event()

    @property
    def targets(self) -> list[ScrapeTarget]:
        """The targets being scraped (those of the plan the agent's pod list agrees with)."""
        return [t.target for t in self._plan.targets.values()]

    def accept_plan(self, value: Any) -> None:
        """Take the ``scrape`` value of an answer (None: the operator sent none, so nothing is scraped)."""
        if value is None:
            if not self._plan.targets and not self._plan.refused:
                return  # nothing planned, nothing to stop: the answer to most reports
            plan = ScrapePlan()
        else:
            try:
                plan = parse_plan(value)
            except PlanError as exc:
                log.warning("the operator sent an invalid scrape plan, keeping the last one: %s", exc)
                self._events.refused("invalid_plan")
                return
        self.set_plan(plan)

    def set_plan(self, plan: ScrapePlan) -> None:
        """Scrape ``plan``'s targets from now on, those the pod list agrees with (see the module doc)."""
        now = asyncio.get_running_loop().time()
        old = self._plan
        new = _Plan()
        for target in plan.targets:
            reason = self._refusal(target)
            if reason is not None:
                if old.refused.get(target.uid) != reason:
                    log.info(
                        "not scraping %s/%s at %s: %s",
                        target.namespace,
                        target.name,
                        target.ip,
                        "no such pod on this node" if reason == "unlisted" else "not that pod's IP",
                    )
                    self._events.refused(reason)
                new.refused[target.uid] = reason
                continue
            kept = old.targets.get(target.uid)
            if kept is not None and kept.target == target:
                new.targets[target.uid] = kept
            elif kept is not None and _same_endpoint(kept.target, target):
                # Another interval or other names: keep the pace and the backoff, and the scrape in flight.
                kept.target = target
                new.targets[target.uid] = kept
            else:
                new.targets[target.uid] = _Target(target, due=now)
        self._plan = new
        for uid in [uid for uid in self._pending if uid not in new.targets]:
            del self._pending[uid]
        self._events.targets(len(new.targets))
        self._changed.set()

    def _refusal(self, target: ScrapeTarget) -> str | None:
        listed = self._lookup(target.uid)
        if listed is None or (listed.namespace, listed.name) != (target.namespace, target.name):
            return "unlisted"
        return None if target.ip in listed.ips else "address"

    def drain(self) -> list[ServiceSample]:
        """The scrapes finished since the last call, the newest per pod, oldest first."""
        out = sorted(self._pending.values(), key=lambda s: s.at)
        self._pending.clear()
        return out

    async def run(self) -> None:
        """Start each target's scrape when it is due, until cancelled."""
        loop = asyncio.get_running_loop()
        session = self._session_factory()
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                now = loop.time()
                wait = 1.0
                for entry in self._plan.targets.values():
                    if entry.task is not None:
                        continue
                    if entry.due <= now:
                        entry.task = loop.create_task(self._scrape(session, entry))
                        tasks.add(entry.task)
                        entry.task.add_done_callback(tasks.discard)
                    else:
                        wait = min(wait, entry.due - now)
                self._changed.clear()
                # A new plan (or a scrape that ended) starts the next look at once.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, wait))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()

    async def _scrape(self, session: aiohttp.ClientSession, entry: _Target) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with self._slots:
                target = entry.target
                started = loop.time()
                sample = await self._sample(session, target)
                result = "ok" if sample.error is None else _RESULT[sample.error]
                self._events.scraped(result, loop.time() - started)
            entry.failures = 0 if sample.error is None else entry.failures + 1
            entry.due = started + _delay(target.interval_seconds, entry.failures)
            if self._plan.targets.get(target.uid) is entry:
                self._pending[target.uid] = sample
        finally:
            entry.task = None
            self._changed.set()

    async def _sample(self, session: aiohttp.ClientSession, target: ScrapeTarget) -> ServiceSample:
        at = self._clock()
        timeout = min(self._timeout, target.interval_seconds / 2)
        try:
            page = await fetch(session, target.url(), seconds=timeout, max_bytes=self._max_bytes)
            # In a thread: a page near the cap takes the parser a few hundred milliseconds.
            found = await asyncio.to_thread(compact, page.text, page.content_type, target.metrics)
        except ScrapeFailed as failed:
            log.debug("scraping %s/%s: %s", target.namespace, target.name, failed)
            return ServiceSample(
                namespace=target.namespace, name=target.name, uid=target.uid, at=at, error=failed.reason
            )
        return ServiceSample(
            namespace=target.namespace,
            name=target.name,
            uid=target.uid,
            at=at,
            histograms=found.histograms,
            counters=found.counters,
            gauges=found.gauges,
        )


def _delay(interval: float, failures: int) -> float:
    """The interval, doubled per failure in a row after the first, within the backoff's bounds."""
    if failures <= 1:
        return interval
    factor = min(MAX_BACKOFF, 1 << (failures - 1))
    return min(interval * factor, max(interval, MAX_BACKOFF_SECONDS))


def _same_endpoint(a: ScrapeTarget, b: ScrapeTarget) -> bool:
    return (a.ip, a.port, a.path, a.scheme) == (b.ip, b.port, b.path, b.scheme)


def _session() -> aiohttp.ClientSession:
    # A pod's certificate names no IP we could check it against: https encrypts, it does not authenticate
    # (as Prometheus' pod scrapes with insecure_skip_verify). No decompression: fetch() asks for none.
    connector = aiohttp.TCPConnector(ssl=False, limit=0)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False)

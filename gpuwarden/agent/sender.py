"""Deliver snapshots to the operator as NodeReports, surviving the operator's absences.

:meth:`ReportSender.submit` never blocks: it files the snapshot in a bounded buffer
(oldest dropped first, and counted), and wakes :meth:`ReportSender.run`, which posts
everything buffered, oldest first, split into reports of at most
:data:`~gpuwarden.wire.node.MAX_SNAPSHOTS_PER_REPORT` snapshots and of at most the
operator's body limit. A snapshot leaves the buffer only when the operator answered
2xx for it, or refused it as malformed (4xx). :meth:`ReportSender.flush` delivers
what is left at shutdown.

When a round of sending starts: as soon as a snapshot is submitted, unless the last round
started less than ``interval`` ago; then when that interval is over. A round sends
everything buffered when it starts, so what was submitted while a report was in flight,
while a retry was backing off, or while the interval ran goes out together: at most one
round per ``interval``, each as early as that allows. (A backlog larger than one report
goes out as several reports back to back, within the one round.) With 1 Hz sampling and
the default interval (:data:`DEFAULT_REPORT_INTERVAL`, half a second) every snapshot leaves the
moment it is taken, in a report of its own; sampling faster than the interval batches.

What happens on each answer:

- 2xx: delivered; readings the operator refused to store (``refused`` in the answer: a
  timestamp out of its clock's bounds, a pod the API places on another node) are counted
  by reason and logged, since retrying cannot help: this node's clock, or its pods, are off;
  the answer goes to ``on_answer``, which hands its scrape plan (``scrape``; absent from an older
  operator's) to :meth:`gpuwarden.agent.scrape.Scraper.accept_plan` and its ``hookAsks`` to
  :meth:`gpuwarden.agent.hookrelay.HookRelay.accept`;
- 401, 403: retried; the token is re-read for every attempt (the kubelet rotates it);
- 408, 429, 5xx, connection errors, timeouts: retried with capped exponential backoff
  and full jitter, honouring ``Retry-After``;
- 413: the report is halved and the halves sent in order; later reports stay that small;
- 421 (the operator is sharded and another replica owns this node): sent again at once, same
  ``seq``, to the ``url`` the answer names (never from https:// to http://: the token would go out
  in clear; its certificate is checked for ``server_name`` like the Service's); later reports go
  there too, until a POST there fails (connection, timeout, 401/403, 429, 5xx, a 421 without a
  URL), when they go back to ``url``,
  which redirects again (docs/scaling-out.md). At most :data:`MAX_REDIRECTS` in a row: two
  replicas that disagree for a moment cost a backoff, not a loop;
- any other 4xx: the report itself is bad and retrying cannot help: dropped, counted, logged.

A retry resends the same ``seq`` with the same snapshots (or, if the buffer overflowed
meanwhile, a suffix of them), so the operator can drop duplicates after a lost answer.
Snapshots are buffered as JSON: about 5 kB each for 8 GPUs, a seventh of the models.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from gpuwarden.agent.account import bearer
from gpuwarden.agent.metrics import SenderMetrics
from gpuwarden.wire.node import MAX_SNAPSHOTS_PER_REPORT, REFUSALS, SCHEMA_VERSION, Snapshot

log = logging.getLogger(__name__)

DEFAULT_REPORT_INTERVAL = 0.5
"""The least time between two rounds of sending (``--report-interval``).

Below the default 1 s sampling period with room to spare, so that a snapshot taken late in
its tick (a slow read, a busy loop) still goes out at once rather than waiting out the
interval that the one before it opened; above it, a fast sampler's snapshots are batched,
at most two reports a second per node (the operator allows 20 by default).
"""

DEFAULT_BUFFER_LIMIT = 900
"""15 minutes at 1 Hz: about 4.5 MB of JSON for 8 GPUs, inside the agent's memory budget."""

DEFAULT_MAX_REPORT_BYTES = 1024 * 1024
"""The operator's default ``--max-body-bytes`` (1Mi): larger bodies would only earn a 413."""

_ENVELOPE_BYTES = 1024  # room for everything in a body but the snapshots

MAX_REDIRECTS = 3
"""421s followed in a row before the report backs off like any failed POST."""


@dataclass
class _Report:
    """A report being delivered: its ``seq`` is fixed at creation, so retries are recognisable."""

    seq: int
    parts: deque[bytes] = field(default_factory=deque)
    more: bool = False
    """Whether snapshots were left behind when it was built: a backlog, to send right after."""


@dataclass(frozen=True)
class _Outcome:
    delivered: bool = False
    retry: bool = False
    retry_after: float | None = None
    split: bool = False
    redirected: bool = False


class ReportSender:
    """Buffers snapshots and posts them to the operator's ingestion endpoint.

    ``url``: the endpoint (e.g. ``https://gpuwarden-operator.gpuwarden.svc:8443/v1/reports``).
    ``node``: this node's name, as the report's ``node``.
    ``token_path``: the projected ServiceAccount token, re-read for every POST; None sends none.
    ``registry``: where the ``gpuwarden_agent_report*`` metrics go (:class:`~.metrics.SenderMetrics`).
    ``interval``: the least time between the starts of two rounds of sending (see the module's doc).
    ``buffer_limit``: snapshots kept while the operator is away; ``max_report_bytes``: the
    operator's ``--max-body-bytes``.
    ``tls``: how an https:// ``url`` (and an owner's) is verified (default: the system's trust store);
    ``server_name``: the name its certificate must carry (default: the URL's host). A sharded operator
    names its replicas by pod IP, so the chart sets the ingest Service's name here.
    ``session_factory``: builds the HTTP session on first delivery.
    ``rng``: the jitter's random source, for tests.
    ``on_answer``: called with each 2xx answer, decoded (an empty dict when it is no JSON object).
    """

    def __init__(
        self,
        url: str,
        node: str,
        token_path: str | os.PathLike[str] | None,
        *,
        registry: CollectorRegistry,
        interval: float = DEFAULT_REPORT_INTERVAL,
        buffer_limit: int = DEFAULT_BUFFER_LIMIT,
        max_report_bytes: int = DEFAULT_MAX_REPORT_BYTES,
        timeout: float = 10.0,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
        agent_id: str | None = None,
        rng: random.Random | None = None,
        on_answer: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if interval <= 0 or buffer_limit < 1 or backoff_base <= 0 or backoff_cap < backoff_base:
            raise ValueError(
                "interval, buffer_limit and backoff must be positive, backoff_cap >= backoff_base"
            )
        if max_report_bytes <= _ENVELOPE_BYTES:
            raise ValueError(f"max_report_bytes must be more than {_ENVELOPE_BYTES}")
        self.url = url
        self.node = node
        self.agent_id = agent_id or uuid.uuid4().hex
        self.buffer_limit = buffer_limit
        self._token_path = Path(token_path) if token_path is not None else None
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._server_name = server_name
        self._session_factory = session_factory or aiohttp.ClientSession
        self._rng = rng or random.Random()
        self._on_answer = on_answer
        self._pending: deque[bytes] = deque()
        self._inflight: _Report | None = None
        self._next_seq = 0
        self._max_batch = MAX_SNAPSHOTS_PER_REPORT
        self._max_bytes = max_report_bytes - _ENVELOPE_BYTES
        self._failures = 0  # consecutive failed POSTs: drives the backoff and the logging
        self._refusing = False  # whether the last delivered report had readings refused
        self._session: aiohttp.ClientSession | None = None
        self.owner_url: str | None = None
        """Where reports go while a sharded operator named this node's owner (else ``url``)."""
        self._redirects = 0  # 421s followed in a row
        # One delivery at a time: run's rounds and flush share the report in flight.
        self._lock = asyncio.Lock()
        self._running = False
        # Set by submit, cleared when a round starts: snapshots wait for run. (An Event binds
        # to a loop only when awaited, so submit still works without one.)
        self._wake = asyncio.Event()

        self._metrics = SenderMetrics(registry, buffer_limit=buffer_limit)

    @property
    def buffered(self) -> int:
        """Snapshots not yet delivered, including those of the report in flight."""
        return len(self._pending) + (len(self._inflight.parts) if self._inflight else 0)

    def submit(self, snapshot: Snapshot) -> None:
        """Queue a snapshot for the next report; never blocks. Over the limit, the oldest goes."""
        self._pending.append(snapshot.model_dump_json(by_alias=True, exclude_none=True).encode())
        excess = self.buffered - self.buffer_limit
        for _ in range(max(0, excess)):
            # The report in flight holds the oldest snapshots; a retry sends what is left of it.
            if self._inflight is not None and self._inflight.parts:
                self._inflight.parts.popleft()
            else:
                self._pending.popleft()
        if excess > 0:
            self._metrics.dropped.labels("buffer_full").inc(excess)
        self._metrics.buffered.set(self.buffered)
        self._wake.set()

    async def run(self) -> None:
        """Send each submitted snapshot at once, at most one round per ``interval``, until cancelled."""
        loop = asyncio.get_running_loop()
        self._running = True
        last_round: float | None = None
        try:
            while True:
                await self._wake.wait()
                if last_round is not None:
                    # Too soon after the last round: what arrives meanwhile waits and goes with this one.
                    await asyncio.sleep(max(0.0, last_round + self._interval - loop.time()))
                # Cleared before the round takes its snapshots: a submit from now on needs another round.
                self._wake.clear()
                async with self._lock:
                    if not self.buffered:
                        continue  # flush delivered it meanwhile: no round, so no interval to wait out
                    last_round = loop.time()
                    await self._deliver(drain=False)
        finally:
            self._running = False
            await self._close_session()

    async def flush(self) -> None:
        """Return once everything submitted so far is delivered (or dropped), retrying as :meth:`run` does.

        Alongside :meth:`run`, it waits for the round in progress and then sends what is
        left; at shutdown, after cancelling :meth:`run`, bound it with a timeout.
        """
        async with self._lock:
            try:
                await self._deliver(drain=True)
            finally:
                if not self._running:
                    await self._close_session()

    async def _deliver(self, *, drain: bool) -> None:
        """Send reports until the buffer is empty or, unless draining, only this round's arrivals are left.

        What arrived during the round set ``_wake``: it is the next round's.
        """
        if self._session is None:
            self._session = self._session_factory()
        while (report := self._next_report()) is not None:
            outcome = await self._post(self._session, report)
            if outcome.retry:
                await asyncio.sleep(self._backoff(outcome.retry_after))
                continue
            if outcome.split or outcome.redirected:
                continue
            self._inflight = None
            self._metrics.buffered.set(self.buffered)
            if outcome.delivered and not report.more and not drain:
                return

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _next_report(self) -> _Report | None:
        if self._inflight is not None and not self._inflight.parts:
            self._inflight = None  # all of it was pushed out of the buffer while it waited
        if self._inflight is None and self._pending:
            self._inflight = self._take_report()
        return self._inflight

    def _take_report(self) -> _Report:
        """The oldest pending snapshots, as many as fit the count and byte limits (at least one)."""
        report = _Report(self._next_seq)
        self._next_seq += 1
        size = 0
        while self._pending and len(report.parts) < self._max_batch:
            size += len(self._pending[0]) + 1  # and its comma
            if report.parts and size > self._max_bytes:
                break
            report.parts.append(self._pending.popleft())
        report.more = bool(self._pending)
        return report

    def _body(self, report: _Report) -> bytes:
        # The envelope is written around the buffered snapshot JSON rather than re-serialising
        # every snapshot through NodeReport; the tests check it against parse_report.
        envelope = json.dumps(
            {"schemaVersion": SCHEMA_VERSION, "node": self.node, "agentId": self.agent_id, "seq": report.seq},
            separators=(",", ":"),
        )
        return b"".join((envelope[:-1].encode(), b',"snapshots":[', b",".join(report.parts), b"]}"))

    async def _post(self, session: aiohttp.ClientSession, report: _Report) -> _Outcome:
        headers = {"Content-Type": "application/json"}
        if self._token_path is not None:
            try:
                headers["Authorization"] = bearer(self._token_path)
            except OSError as exc:
                return self._failed("token", f"cannot read the token {self._token_path}: {exc}")
        body = self._body(report)
        url = self.owner_url or self.url
        try:
            async with session.post(
                url,
                data=body,
                headers=headers,
                timeout=self._timeout,
                allow_redirects=False,
                ssl=self._tls,
                server_hostname=self._server_name,
            ) as response:
                status = response.status
                text = await response.text(errors="replace")
                retry_after = _retry_after(response.headers.get("Retry-After"))
        except TimeoutError:
            return self._failed("timeout", f"no answer from {url} within {self._timeout.total} s")
        except aiohttp.ClientConnectorCertificateError as exc:
            problem = exc.certificate_error
            return self._failed("tls", f"{url}: the operator's certificate is not trusted: {problem}")
        except aiohttp.ClientError as exc:
            return self._failed("connection", f"{url}: {type(exc).__name__}: {exc}")
        return self._answer(report, status, text, retry_after)

    def _answer(self, report: _Report, status: int, text: str, retry_after: float | None) -> _Outcome:
        size = len(report.parts)
        if 200 <= status < 300:
            if self._failures:
                log.info("operator reachable again after %d failed attempts", self._failures)
            self._failures = 0
            self._redirects = 0
            self._metrics.sent.inc()
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            answer = answer if isinstance(answer, dict) else {}
            self._count_refused(report, answer)
            if self._on_answer is not None:
                self._on_answer(answer)
            return _Outcome(delivered=True)
        text = text[:500]  # for the log: an error page can be long
        if status in (401, 403):
            return self._failed("unauthorized", f"HTTP {status}: {text}")
        if status == 429:
            return self._failed("throttled", f"HTTP 429: {text}", retry_after)
        if status == 408 or status >= 500:
            return self._failed("server_error", f"HTTP {status}: {text}", retry_after)
        if status == 421:
            return self._redirect(text)
        if status == 413 and size > 1:
            self._metrics.errors.labels("too_large").inc()
            self._max_batch = max(1, size // 2)
            log.warning(
                "operator refused a report of %d snapshots as too large; sending at most %d from now on",
                size,
                self._max_batch,
            )
            # the second half goes back to the front of the queue, in order, for a report of its own
            while len(report.parts) > self._max_batch:
                self._pending.appendleft(report.parts.pop())
            report.more = True
            return _Outcome(split=True)
        if 400 <= status < 500:
            self._metrics.errors.labels("rejected").inc()
            self._metrics.dropped.labels("rejected").inc(size)
            log.error(
                "operator rejected report seq=%d (%d snapshots) with HTTP %d, dropping it: %s",
                report.seq,
                size,
                status,
                text,
            )
            return _Outcome()
        return self._failed("unexpected_status", f"HTTP {status} from {self.url}: {text}")

    def _redirect(self, text: str) -> _Outcome:
        """A sharded operator's replica does not own this node: follow its hint to the owner."""
        try:
            hint = json.loads(text)
            url = hint.get("url")
        except (ValueError, AttributeError):
            url = None
        self._redirects += 1
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return self._failed("misdirected", f"HTTP 421 without the owner's URL: {text}")
        if self.url.startswith("https://") and not url.startswith("https://"):
            # The token would leave in clear, on the word of an answer.
            return self._failed("misdirected", f"HTTP 421 to a plain-HTTP URL from an https:// one: {url}")
        if self._redirects > MAX_REDIRECTS:
            self._redirects = 0
            return self._failed("misdirected", f"HTTP 421 {MAX_REDIRECTS + 1} times in a row: {text}")
        self._metrics.errors.labels("misdirected").inc()
        if url != self.owner_url:
            log.info("operator replica %s owns this node; reporting to %s", hint.get("owner"), url)
        self.owner_url = url
        return _Outcome(redirected=True)

    def _count_refused(self, report: _Report, answer: dict[str, Any]) -> None:
        refused = answer.get("refused")
        if not isinstance(refused, dict):
            refused = {}
        counts = {k: v for k, v in refused.items() if k in REFUSALS and isinstance(v, int) and v > 0}
        for reason, count in counts.items():
            self._metrics.refused.labels(reason).inc(count)
        if counts and not self._refusing:
            # The first of a streak is news (a clock off by more than the operator's skew, a pod
            # the API places elsewhere); the next ones are the same news.
            log.warning("operator refused readings of report seq=%d: %s", report.seq, counts)
        self._refusing = bool(counts)

    def _failed(self, reason: str, message: str, retry_after: float | None = None) -> _Outcome:
        self._metrics.errors.labels(reason).inc()
        if self.owner_url is not None:
            # The owner failed us (gone, or no longer the owner): the Service names the next one.
            log.info("report to the owner %s failed (%s); back to %s", self.owner_url, reason, self.url)
            self.owner_url = None
        self._failures += 1
        # The first failure of a streak is news; the next ones are the same news.
        level = logging.WARNING if self._failures == 1 else logging.DEBUG
        log.log(level, "report not delivered (%s), %d snapshots buffered: %s", reason, self.buffered, message)
        return _Outcome(retry=True, retry_after=retry_after)

    def _backoff(self, retry_after: float | None) -> float:
        """Full jitter over a capped exponential; the server's Retry-After wins, within the cap."""
        if retry_after is not None:
            return min(retry_after, self._backoff_cap)
        ceiling = min(self._backoff_cap, self._backoff_base * 2 ** min(self._failures - 1, 30))
        return self._rng.uniform(0, ceiling)


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds; the HTTP-date form is not used by our operator and is ignored."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None

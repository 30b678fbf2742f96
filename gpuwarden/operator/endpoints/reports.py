"""``POST /v1/reports``: node reports from agents, checked, limited, and fed into the series store.

In order, each request is answered with the first that applies:

====  =======================  ===================================================
503   ``Standby``              this replica does not act (peering); the agent retries
401   ``Unauthenticated``      no bearer token, or TokenReview does not accept it for our audience
403   ``Forbidden``            a valid token of another ServiceAccount, or one bound to no pod
503   ``AuthUnavailable``      TokenReview could not be made; the agent retries
421   ``NotOwner``             sharded mode: another replica owns the token's node; the body names it
                               (``owner``) and where to send the report (``url``, when advertised)
429   ``RateLimited``          the token's node sent more than ``--node-rate`` a second (``Retry-After``)
413   ``TooLarge``             Content-Length above ``--max-body-bytes``
415   ``UnsupportedEncoding``  a Content-Encoding other than gzip or deflate
413   ``TooLarge``             more bytes arrive than that, or the body decodes to more
400   ``InvalidReport``        a gzip/deflate body that does not decode, or has bytes after its stream;
                               not JSON, not the schema,
                               or another schemaVersion (the message names the field)
403   ``Forbidden``            the report names another node than the one the token's pod runs on
200                            ``{"accepted": N, "duplicate": false, "refused": {...}, "scrape": {...},
                               "hookAsks": [...]}``
====  =======================  ===================================================

The identity is the node the token is bound to: the rate limit and the duplicate
book are keyed by it, so names a report claims cost nothing. What of a report is
stored is the admission's to say (:class:`~gpuwarden.operator.admission.ReportAdmission`,
the endpoint's collaborator, which these rules document). ``refused`` counts
what of an accepted report was not stored (readings; XIDs and pods on the health
path), by reason: ``future`` (more than
:data:`~gpuwarden.operator.admission.MAX_FUTURE_SKEW` ahead of the
operator's clock: snapshots and XIDs alike), ``past`` (older than the longest
retention), ``foreignPod`` (the pod runs on another node), ``unknownPod`` (no
such GPU pod is watched), ``tooManyGpus`` and ``tooManyPods`` (past a bound of
docs/operator.md, "Bounds"); empty when all were.
``duplicate: true`` answers a seq the same agent had stored lately (:class:`ReportBook`).
``scrape`` is the node's scrape plan (:class:`~gpuwarden.wire.scrape.ScrapePlan`: the pods of that
node whose own metrics its agent is to read), in every 200, duplicates included; absent when there
is nothing to scrape, which the agent reads as an empty plan (as it reads an older operator's answer).
``hookAsks`` is what the hooks of the node's pods under a ``memoryGrowth`` finding are asked
(:mod:`gpuwarden.operator.suspicion`), in every 200 while any waits; absent when none does.

Error bodies are JSON ``{"reason": ..., "message": ...}``. A request is
independent of every other: one bad report never costs a good one; an
unexpected error is a 500 for that request only, counted, and its seq is not
recorded (so the agent's retry is taken, not answered as a duplicate). A large
body is parsed and stored only after the other large ones before it and a turn
of the event loop, so small reports are served in between.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from gpuwarden.operator.admission import ReportAdmission
from gpuwarden.operator.endpoints.http import Refusal, authenticate, error_response, read_body, standby
from gpuwarden.operator.endpoints.ratelimit import NodeRateLimiter
from gpuwarden.operator.kube import TokenAuthenticator
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.wire.fast import decode_report
from gpuwarden.wire.node import NodeReport, ReportError

__all__ = [
    "INGEST",
    "REPORTS_PATH",
    "VERDICTS_PATH",
    "Elsewhere",
    "ReportBook",
    "ReportIngest",
    "make_ingest_app",
]

logger = logging.getLogger(__name__)

REPORTS_PATH = "/v1/reports"
VERDICTS_PATH = "/v1/verdicts"
"""Sharded mode: the other replicas' verdicts (:mod:`gpuwarden.operator.sharding.exchange`)."""

LARGE_BODY = 64 * 1024
"""Bodies above this (a replay; a live report of 8 GPUs is about 5 kB) are parsed one at a time."""


SEQ_WINDOW = 64
"""Seqs remembered per agent: a retry comes within seconds, and an agent sends one report a second."""
AGENTS_PER_NODE = 4
"""Agent processes remembered per node (a restart starts a new one; the old one's last retries may follow)."""


class ReportBook:
    """The seqs stored lately per node and agent: a report whose (agent, seq) is among them is a duplicate
    (a retry).

    A bounded set, not a high-water mark: a seq pushed far ahead (the node's token can forge one
    for its agent's id) takes one place of :data:`SEQ_WINDOW` and holds no later report back.
    Keyed by the node the token is bound to, then by agent, each an LRU: at most ``max_nodes``
    nodes (the one heard from least recently is forgotten first: its next report is simply
    stored), :data:`AGENTS_PER_NODE` agents a node, :data:`SEQ_WINDOW` seqs an agent. A retry of
    a report that fell out of the window is stored again, which costs nothing: a series keeps only
    points newer than its latest.
    """

    def __init__(self, max_nodes: int = 50_000) -> None:
        self.max_nodes = max_nodes
        self._nodes: OrderedDict[str, OrderedDict[str, dict[int, None]]] = OrderedDict()

    def is_duplicate(self, node: str, report: NodeReport) -> bool:
        """Whether ``report``'s agent already had this seq stored for ``node`` lately."""
        agents = self._nodes.get(node)
        seqs = agents.get(report.agent_id) if agents is not None else None
        return seqs is not None and report.seq in seqs

    def record(self, node: str, report: NodeReport) -> None:
        """Remember ``report`` as stored: call it only once its readings are in the store."""
        agents = self._nodes.get(node)
        if agents is None:
            agents = self._nodes[node] = OrderedDict()
            if len(self._nodes) > self.max_nodes:
                self._nodes.popitem(last=False)
        else:
            self._nodes.move_to_end(node)
        seqs = agents.get(report.agent_id)
        if seqs is None:
            # A dict keeps insertion order: the oldest seq is the first to go.
            seqs = agents[report.agent_id] = {}
            if len(agents) > AGENTS_PER_NODE:
                agents.popitem(last=False)
        else:
            agents.move_to_end(report.agent_id)
        seqs[report.seq] = None
        if len(seqs) > SEQ_WINDOW:
            del seqs[next(iter(seqs))]

    def __contains__(self, node: object) -> bool:
        """Whether ``node``'s agents stored a report lately (it is among the nodes remembered)."""
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """Sharded mode: the replica that owns a node, and where its agent should send the reports."""

    owner: str
    url: str | None = None


@dataclass(slots=True)
class ReportIngest:
    """The endpoint's collaborators; :meth:`handle` is the request handler."""

    authenticator: TokenAuthenticator
    limiter: NodeRateLimiter
    book: ReportBook
    metrics: OperatorMetrics
    admission: ReportAdmission
    """Stores what of an authenticated report may be stored and says what it refused; plans the node's
    scrapes."""
    acting: Callable[[], bool]
    """Whether this replica acts (else 503)."""
    route: Callable[[str], Elsewhere | None]
    """None when the token's node is ours, else its owner (a 421): sharded mode's share; one shard of
    one owns every node."""
    max_body_bytes: int
    clock: Callable[[], float] = time.time
    """The operator's clock, which snapshots' timestamps are held against."""
    _large: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def handle(self, request: web.Request) -> web.Response:
        """Answer one POST /v1/reports."""
        self.metrics.reports.inc()
        try:
            return await self._handle(request)
        except Refusal as refusal:
            self.metrics.rejected.labels(refusal.metric).inc()
            return refusal.response()
        except Exception:
            logger.exception("Unexpected error while handling a report; the agent will retry it.")
            self.metrics.rejected.labels("internal").inc()
            return error_response(500, "InternalError", "the operator failed on this report; see its log")

    async def _handle(self, request: web.Request) -> web.Response:
        if not self.acting():
            raise standby()

        node = await self._authenticate(request)
        if (elsewhere := self.route(node)) is not None:
            hint = {"owner": elsewhere.owner} | ({"url": elsewhere.url} if elsewhere.url else {})
            message = f"node {node} reports to replica {elsewhere.owner}"
            raise Refusal(421, "NotOwner", message, "not_owner", hint=hint)
        wait = self.limiter.acquire(node)
        if wait > 0:
            message = f"node {node} sends more than {self.limiter.rate:g} reports a second"
            raise Refusal(429, "RateLimited", message, "rate_limited", self.limiter.retry_after(wait))

        body = await read_body(request, self.max_body_bytes)
        if len(body) > LARGE_BODY:
            async with self._large:
                response = self._ingest(node, body)
                # Still holding the lock: the next large body waits for the small ones that came meanwhile.
                await asyncio.sleep(0)
            return response
        return self._ingest(node, body)

    async def _authenticate(self, request: web.Request) -> str:
        """The node the request's token is bound to (its pod's), or a refusal."""
        return (await authenticate(request, self.authenticator)).node

    def _ingest(self, node: str, body: bytes) -> web.Response:
        try:
            report = decode_report(body)
        except ReportError as exc:
            raise Refusal(400, "InvalidReport", str(exc), "invalid") from None
        if report.node != node:
            message = f"the token belongs to a pod on node {node}, not {report.node}"
            raise Refusal(403, "Forbidden", message, "forbidden")
        if self.book.is_duplicate(node, report):
            self.metrics.duplicates.inc()
            return self._answer(node, 0, {}, duplicate=True)
        intake = self.admission.accept(report, node, self.clock())
        self.book.record(node, report)
        self.metrics.points.inc(intake.stored)
        for reason, count in intake.refused.items():
            self.metrics.refused.labels(reason).inc(count)
        return self._answer(node, intake.stored, intake.refused)

    def _answer(
        self, node: str, accepted: int, refused: dict[str, int], *, duplicate: bool = False
    ) -> web.Response:
        # Written out rather than through json_response(): this answers every report, and the plan
        # comes as JSON already.
        text = json.dumps(refused) if refused else "{}"
        body = f'{{"accepted": {accepted}, "duplicate": {"true" if duplicate else "false"}, "refused": {text}'
        scrape = self.admission.plan(node)
        if scrape is not None:
            body += f', "scrape": {scrape}'
        asks = self.admission.hook_asks(node)
        if asks is not None:
            body += f', "hookAsks": {asks}'
        return web.Response(text=body + "}", content_type="application/json")


INGEST = web.AppKey("ingest", ReportIngest)


def make_ingest_app(
    ingest: ReportIngest, verdicts: Callable[[web.Request], Awaitable[web.Response]] | None = None
) -> web.Application:
    """The ingest server's app: POST /v1/reports, and in sharded mode POST /v1/verdicts (``verdicts``:
    :meth:`~gpuwarden.operator.sharding.exchange.VerdictIngest.handle`)."""
    # client_max_size guards aiohttp's own readers; ours enforces the limit while streaming. We decode
    # Content-Encoding ourselves, bounded: aiohttp's decoder inflates before any limit applies, and
    # fails again on a corrupt body it drains after a refusal, as an unhandled error.
    app = web.Application(client_max_size=ingest.max_body_bytes + 1, handler_args={"auto_decompress": False})
    app[INGEST] = ingest
    app.router.add_post(REPORTS_PATH, ingest.handle)
    if verdicts is not None:
        app.router.add_post(VERDICTS_PATH, verdicts)
    return app

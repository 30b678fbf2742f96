"""``POST /v1/reports``: node reports from agents, checked, limited, and fed into the series store.

In order, each request is answered with the first that applies:

====  ====================  =====================================================
503   ``Standby``           this replica does not act (peering); the agent retries
401   ``Unauthenticated``   no bearer token, or TokenReview does not accept it for our audience
403   ``Forbidden``         a valid token of another ServiceAccount, or bound to another node
503   ``AuthUnavailable``   TokenReview could not be made; the agent retries
413   ``TooLarge``          Content-Length, or the bytes actually read, above ``--max-body-bytes``
400   ``InvalidReport``     not JSON, not the schema, or another schemaVersion (message: the field)
429   ``RateLimited``       the node sent more than ``--node-rate`` a second (``Retry-After``)
200                         accepted (``duplicate: true`` when the same agent sent that seq before)
====  ====================  =====================================================

Error bodies are JSON ``{"reason": ..., "message": ...}``. A request is
independent of every other: one bad report never costs a good one, and an
unexpected error is a 500 for that request only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gpuwarden.nodereport import NodeReport, ReportError, parse_report
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.ratelimit import NodeRateLimiter
from gpuwarden.operator.tokenreview import TokenAuthenticator, Verdict

__all__ = ["INGEST", "ReportBook", "ReportIngest", "make_ingest_app"]

logger = logging.getLogger(__name__)

REPORTS_PATH = "/v1/reports"


class ReportBook:
    """The newest (agent, seq) per node: a report not newer than that is a duplicate (a retry)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int]] = {}

    def admit(self, report: NodeReport) -> bool:
        """Record ``report``; False when its agent already sent this seq or a later one."""
        last = self._last.get(report.node)
        if last is not None and last[0] == report.agent_id and report.seq <= last[1]:
            return False
        # A new agent_id on a node is a restarted agent: its seqs start again.
        self._last[report.node] = (report.agent_id, report.seq)
        return True

    def __len__(self) -> int:
        return len(self._last)


@dataclass(slots=True)
class ReportIngest:
    """The endpoint's collaborators; :meth:`handle` is the request handler."""

    authenticator: TokenAuthenticator
    limiter: NodeRateLimiter
    book: ReportBook
    metrics: OperatorMetrics
    accept: Callable[[NodeReport], int]
    """Stores an admitted report's points; returns how many were kept."""
    acting: Callable[[], bool]
    """Whether this replica acts (else 503)."""
    max_body_bytes: int

    async def handle(self, request: web.Request) -> web.Response:
        """Answer one POST /v1/reports."""
        self.metrics.reports.inc()
        try:
            return await self._handle(request)
        except _Refusal as refusal:
            self.metrics.rejected.labels(refusal.metric).inc()
            return refusal.response()
        except Exception:
            logger.exception("Unexpected error while handling a report; it is dropped.")
            self.metrics.rejected.labels("internal").inc()
            return _error(500, "InternalError", "the operator failed on this report; see its log")

    async def _handle(self, request: web.Request) -> web.Response:
        if not self.acting():
            raise _Refusal(503, "Standby", "this replica stands by; retry", "standby", retry_after="1")

        token = _bearer(request.headers.get("Authorization", ""))
        if token is None:
            raise _Refusal(401, "Unauthenticated", "a bearer token is required", "unauthenticated")
        try:
            review = await self.authenticator.authenticate(token)
        except Exception as exc:
            logger.warning("TokenReview failed: %s", exc)
            raise _Refusal(
                503, "AuthUnavailable", "cannot review the token now; retry", "unavailable", "1"
            ) from None
        if review.verdict is Verdict.UNAUTHENTICATED:
            raise _Refusal(401, "Unauthenticated", review.message, "unauthenticated")
        if review.verdict is Verdict.FORBIDDEN:
            raise _Refusal(403, "Forbidden", review.message, "forbidden")

        body = await self._read_body(request)
        try:
            report = parse_report(body)
        except ReportError as exc:
            raise _Refusal(400, "InvalidReport", str(exc), "invalid") from None
        if review.node is not None and review.node != report.node:
            message = f"the token belongs to a pod on node {review.node}, not {report.node}"
            raise _Refusal(403, "Forbidden", message, "forbidden")

        wait = self.limiter.acquire(report.node)
        if wait > 0:
            message = f"node {report.node} sends more than {self.limiter.rate:g} reports a second"
            raise _Refusal(429, "RateLimited", message, "rate_limited", self.limiter.retry_after(wait))

        if not self.book.admit(report):
            self.metrics.duplicates.inc()
            return web.json_response({"accepted": 0, "duplicate": True})
        kept = self.accept(report)
        self.metrics.points.inc(kept)
        # What json_response() would send for {"accepted": kept, "duplicate": False}, without
        # json.dumps: this answers every report.
        return web.Response(
            text=f'{{"accepted": {kept}, "duplicate": false}}', content_type="application/json"
        )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise _Refusal(
                413, "TooLarge", f"the body is {declared} bytes; at most {limit} are accepted", "too_large"
            )
        # Content-Length may be absent (chunked) or lie: count what actually arrives.
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.read(min(limit + 1 - size, 1 << 16) or 1):
            size += len(chunk)
            if size > limit:
                raise _Refusal(413, "TooLarge", f"the body exceeds {limit} bytes", "too_large")
            chunks.append(chunk)
        return b"".join(chunks)


class _Refusal(Exception):
    def __init__(
        self, status: int, reason: str, message: str, metric: str, retry_after: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.metric = metric
        self.retry_after = retry_after

    def response(self) -> web.Response:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        if self.status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": 'Bearer realm="gpuwarden"'}
        return _error(self.status, self.reason, self.message, headers)


def _error(status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"reason": reason, "message": message}
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )


def _bearer(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


INGEST = web.AppKey("ingest", ReportIngest)


def make_ingest_app(ingest: ReportIngest) -> web.Application:
    """The ingest server's app: POST /v1/reports, and nothing else."""
    # client_max_size guards aiohttp's own readers; ours enforces the limit while streaming.
    app = web.Application(client_max_size=ingest.max_body_bytes + 1)
    app[INGEST] = ingest
    app.router.add_post(REPORTS_PATH, ingest.handle)
    return app

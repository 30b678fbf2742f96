"""Sharded mode's verdict traffic: ``POST /v1/verdicts`` between replicas, both ends.

A replica that does not own a policy sends its owner, once per evaluation interval, its
verdicts on the policy's pods whose readings it holds (:mod:`gpuwarden.wire.verdicts`), at the
owner's advertised ingest URL with ``/v1/verdicts`` for ``/v1/reports``, gzip-compressed,
with its ServiceAccount token (``--peer-token-file``, re-read for every POST: the kubelet
rotates it), over TLS where the owner advertises https:// (its certificate checked against
``--peer-ca-file`` for ``--peer-server-name``). The owner reviews the token as the ingest does
(TokenReview, cached) and takes only the operator's own ServiceAccount
(``--operator-service-account``); the verdicts go on its :class:`~.board.VerdictBoard` and wake
the policy's daemon.

Answers: 503 ``Standby`` (this replica does not act), 401/403/503 as for reports (the messages say
verdicts), 413/415 for the body, 400 ``InvalidVerdicts`` (the message names the field; ``at`` more
than :data:`~gpuwarden.operator.admission.MAX_FUTURE_SKEW` ahead of this replica's clock
too), 404 ``UnknownPolicy`` (no daemon of that policy runs here: nothing would ever read its
verdicts, so none are kept), else 200 ``{"taken": N, "refused": M}`` (pods whose verdict was newer
than the one held; pods new to a policy that holds :data:`~gpuwarden.wire.verdicts.MAX_PODS`
already). Refusals are counted by reason (``gpuwarden_operator_verdicts_refused``). A failed send is
not retried: the next interval sends a newer one.
"""

from __future__ import annotations

import gzip
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from gpuwarden.operator.admission import MAX_FUTURE_SKEW
from gpuwarden.operator.endpoints import (
    REPORTS_PATH,
    VERDICTS_PATH,
    Refusal,
    authenticate,
    read_body,
    standby,
)
from gpuwarden.operator.kube import TokenAuthenticator
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.sharding.board import VerdictBoard
from gpuwarden.wire.verdicts import (
    VERDICT_REFUSALS,
    VerdictError,
    VerdictReport,
    dump_verdicts,
    parse_verdicts,
)

__all__ = ["SEND_TIMEOUT", "VERDICTS_PATH", "VerdictIngest", "VerdictSender", "verdicts_url"]

logger = logging.getLogger(__name__)

SEND_TIMEOUT = 2.0
"""Seconds a send may take: a round waits for it, and the next interval sends a newer one anyway."""


def verdicts_url(advertised: str) -> str:
    """Where a replica advertised at ``advertised`` (its ``/v1/reports`` URL) takes verdicts."""
    base = advertised.removesuffix(REPORTS_PATH) if advertised.endswith(REPORTS_PATH) else advertised
    return base.rstrip("/") + VERDICTS_PATH


@dataclass(slots=True)
class VerdictIngest:
    """The ``/v1/verdicts`` endpoint's collaborators; :meth:`handle` is the request handler."""

    authenticator: TokenAuthenticator
    """Reviews the peers' tokens: the operator's own ServiceAccount only, no pod binding needed."""
    board: VerdictBoard
    metrics: OperatorMetrics
    acting: Callable[[], bool]
    received: Callable[[VerdictReport], None]
    """Called with each report taken (wakes the policy's daemon)."""
    max_body_bytes: int
    clock: Callable[[], float] = time.time
    known: Callable[[str, str], bool] = lambda namespace, name: True
    """Whether a policy (namespace, name) has a daemon here: verdicts on any other are refused."""

    async def handle(self, request: web.Request) -> web.Response:
        """Answer one POST /v1/verdicts."""
        try:
            response = await self._handle(request)
        except Refusal as refusal:
            self.metrics.verdicts_received.labels("refused").inc()
            if refusal.metric in VERDICT_REFUSALS:
                self.metrics.verdicts_refused.labels(refusal.metric).inc()
            return refusal.response()
        except Exception:
            logger.exception("Unexpected error while taking verdicts.")
            self.metrics.verdicts_received.labels("refused").inc()
            return web.Response(
                status=500,
                text=json.dumps({"reason": "InternalError", "message": "see the operator's log"}),
                content_type="application/json",
            )
        self.metrics.verdicts_received.labels("ok").inc()
        return response

    async def _handle(self, request: web.Request) -> web.Response:
        if not self.acting():
            raise standby()
        await authenticate(request, self.authenticator, what="verdicts")
        body = await read_body(request, self.max_body_bytes)
        try:
            report = parse_verdicts(body)
        except VerdictError as exc:
            raise Refusal(400, "InvalidVerdicts", str(exc), "invalid") from None
        now = self.clock()
        if report.at > now + MAX_FUTURE_SKEW:
            ahead = (
                f"at: {report.at - now:.0f} s ahead of this replica's clock (at most {MAX_FUTURE_SKEW:g} s)"
            )
            raise Refusal(400, "InvalidVerdicts", ahead, "future")
        if not self.known(report.namespace, report.policy):
            message = (
                f"no policy {report.namespace}/{report.policy} is evaluated here; its verdicts are not kept"
            )
            raise Refusal(404, "UnknownPolicy", message, "unknownPolicy")
        taken, refused = self.board.receive(report, now)
        if refused:
            self.metrics.verdicts_refused.labels("tooManyPods").inc(refused)
        self.received(report)
        return web.json_response({"taken": taken, "refused": refused})


class VerdictSender:
    """Posts verdict reports to policies' owners; one per operator, its session opened at first use."""

    def __init__(
        self,
        token_path: str | None,
        metrics: OperatorMetrics,
        *,
        timeout: float = SEND_TIMEOUT,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] = aiohttp.ClientSession,
    ) -> None:
        self._token_path = Path(token_path) if token_path else None
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._server_name = server_name
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._failing: set[str] = set()
        """Owners whose last send failed (logged once until one succeeds)."""

    async def send(self, url: str, report: VerdictReport) -> bool:
        """POST ``report`` to ``url``; whether the owner took it (failures are counted and logged)."""
        body = gzip.compress(dump_verdicts(report), compresslevel=1)
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        try:
            if self._token_path is not None:
                headers["Authorization"] = f"Bearer {self._token_path.read_text().strip()}"
            if self._session is None:
                self._session = self._session_factory()
            async with self._session.post(
                url,
                data=body,
                headers=headers,
                timeout=self._timeout,
                ssl=self._tls,
                server_hostname=self._server_name,
            ) as rsp:
                answer = await rsp.text()
                problem = None if rsp.status == 200 else f"HTTP {rsp.status}: {answer[:200]}"
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            self._metrics.verdicts_sent.labels("ok").inc()
            self._metrics.verdict_bytes_sent.inc(len(body))
            self._failing.discard(url)
            return True
        self._metrics.verdicts_sent.labels("failed").inc()
        if url not in self._failing:
            self._failing.add(url)
            logger.warning("Cannot send verdicts to %s (the next interval sends newer): %s", url, problem)
        return False

    async def close(self) -> None:
        """Close the session (at exit)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

"""What the operator's POST routes share: refusals and their JSON answers, the bearer token's review,
and the body read bounded and decoded (gzip, deflate) while it streams.

Used by ``POST /v1/reports`` (:mod:`.reports`) and ``POST /v1/verdicts``
(:mod:`gpuwarden.operator.sharding.exchange`).
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

from aiohttp import web

from gpuwarden.operator.kube import Review, ReviewLimited, TokenAuthenticator, Verdict

__all__ = ["Refusal", "authenticate", "bearer", "error_response", "read_body", "standby"]

logger = logging.getLogger(__name__)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, decoded (gzip, deflate), refused as soon as it exceeds ``limit`` bytes."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Refusal(
            413, "TooLarge", f"the body is {declared} bytes; at most {limit} are accepted", "too_large"
        )
    decoder = _decoder(request.headers.get("Content-Encoding", ""))
    # Content-Length may be absent (chunked) or lie, and a compressed body inflates: count what
    # actually arrives, and what it decodes to, inflating no more than the limit allows.
    chunks: list[bytes] = []
    received = size = 0
    content = request.content
    while chunk := await content.read(1 << 16):
        received += len(chunk)
        if decoder is not None:
            try:
                chunk = decoder.decompress(chunk, limit + 1 - size)
            except zlib.error:
                raise _undecodable(request) from None
        size += len(chunk)
        if size > limit or received > limit:
            raise Refusal(413, "TooLarge", f"the body exceeds {limit} bytes", "too_large")
        chunks.append(chunk)
        if content.at_eof():
            break  # all of it came (a report's body mostly comes whole): no read for the empty chunk
    if decoder is not None and not decoder.eof:
        raise _undecodable(request)
    if decoder is not None and decoder.unused_data:
        # Bytes after the compressed stream: what sent them is no encoder we know (a second gzip
        # member included, which no agent writes): refused, not silently dropped.
        encoding = request.headers.get("Content-Encoding", "")
        message = f"the body has {len(decoder.unused_data)} bytes after its {encoding} stream"
        raise Refusal(400, "InvalidReport", message, "invalid")
    return b"".join(chunks)


def _decoder(encoding: str) -> Any:
    """A bounded decompressor for a Content-Encoding (None for identity), or a 415."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj(zlib.MAX_WBITS)
    raise Refusal(
        415, "UnsupportedEncoding", f"Content-Encoding {encoding} is not one of gzip, deflate", "invalid"
    )


def _undecodable(request: web.Request) -> Refusal:
    encoding = request.headers.get("Content-Encoding", "")
    return Refusal(
        400, "InvalidReport", f"the body does not decode as Content-Encoding {encoding}", "invalid"
    )


class Refusal(Exception):
    """A request answered with an error: status, reason, message, and the metric's reason."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        metric: str,
        retry_after: str | None = None,
        hint: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.metric = metric
        self.retry_after = retry_after
        self.hint = hint
        self.close = close
        """Answered with ``Connection: close``: the client's retry opens a new connection."""

    def response(self) -> web.Response:
        """The error answer (JSON ``reason``, ``message`` and any hint)."""
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        if self.status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": 'Bearer realm="gpuwarden"'}
        response = error_response(self.status, self.reason, self.message, headers, self.hint)
        if self.close:
            response.force_close()  # aiohttp closes after the answer, and says so: Connection: close
        return response


def standby() -> Refusal:
    """The answer of a replica that does not act: 503, retry in a second, and the connection closed.

    Closed because a keep-alive connection stays with the replica it reached: through the ingest
    Service that is a pod the connection tracking keeps, even after it stops acting and drops out
    of the Service. Only a new connection is routed to the replica that acts now.
    """
    return Refusal(503, "Standby", "this replica stands by; retry", "standby", retry_after="1", close=True)


def error_response(
    status: int,
    reason: str,
    message: str,
    headers: dict[str, str] | None = None,
    hint: dict[str, str] | None = None,
) -> web.Response:
    """An error answer: JSON ``{"reason", "message"}`` and any hint."""
    body: dict[str, Any] = {"reason": reason, "message": message} | (hint or {})
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )


async def authenticate(
    request: web.Request, authenticator: TokenAuthenticator, *, what: str = "reports"
) -> Review:
    """The accepted review of the request's bearer token, or a :class:`Refusal` saying why not
    (401 none or invalid, 403 another ServiceAccount or audience, 503 the API cannot review now);
    ``what`` the endpoint takes, as its messages name it."""
    token = bearer(request.headers.get("Authorization", ""))
    if token is None:
        raise Refusal(401, "Unauthenticated", "a bearer token is required", "unauthenticated")
    try:
        review = await authenticator.authenticate(token)
    except ReviewLimited as exc:  # counted by the authenticator; a log line each would flood the log
        raise Refusal(503, "AuthUnavailable", str(exc), "unavailable", "1") from None
    except Exception as exc:
        logger.warning("TokenReview failed: %s", exc)
        raise Refusal(
            503, "AuthUnavailable", "cannot review the token now; retry", "unavailable", "1"
        ) from None
    if review.verdict is Verdict.UNAUTHENTICATED:
        raise Refusal(401, "Unauthenticated", review.message, "unauthenticated")
    if review.verdict is Verdict.FORBIDDEN:
        # The review speaks of reports, the agents' endpoint: another endpoint's caller is told its own.
        raise Refusal(403, "Forbidden", review.message.replace("post reports", f"post {what}"), "forbidden")
    return review


def bearer(header: str) -> str | None:
    """The token of an ``Authorization: Bearer`` header; None when there is none."""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None

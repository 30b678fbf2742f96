"""Instant PromQL queries to a Prometheus, or to what fronts one (Mimir, Cortex, Thanos, an auth proxy).

:class:`PrometheusEndpoint` says where it is and how to get in: a bearer token or basic auth, a CA
or no verification, and headers of the user's (``X-Scope-OrgID`` names a Mimir/Cortex tenant).
:class:`PrometheusClient` asks it; what goes wrong before Prometheus answers (unreachable, refused,
not a Prometheus) is a :class:`PrometheusError` with one line for the user. An answer with
``"status": "error"`` (a query Prometheus refuses) is returned as it is: the caller knows the query.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import aiohttp

from gpuwarden.clients.http import failure, tls_context

__all__ = ["PrometheusClient", "PrometheusEndpoint", "PrometheusError"]


@dataclass(frozen=True, slots=True)
class PrometheusEndpoint:
    """A Prometheus's base URL (``/api/v1/query`` is appended) and the credentials it wants."""

    url: str
    token: str | None = field(default=None, repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    insecure: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)

    def request_headers(self) -> dict[str, str]:
        """The user's headers, and ``Authorization`` from the token or the username and password."""
        headers = dict(self.headers)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        elif self.username is not None:
            basic = base64.b64encode(f"{self.username}:{self.password or ''}".encode()).decode()
            headers["Authorization"] = f"Basic {basic}"
        return headers


class PrometheusError(Exception):
    """Prometheus gave no answer to read; ``status`` is the HTTP status (0: none came)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class PrometheusClient:
    """One connection pool to one :class:`PrometheusEndpoint`; use it as an async context manager."""

    def __init__(self, endpoint: PrometheusEndpoint, *, timeout: float = 30.0) -> None:
        self.endpoint = endpoint
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        e = self.endpoint
        tls = tls_context(ca_file=e.ca_file, insecure=e.insecure) if e.url.startswith("https:") else False
        self._session = aiohttp.ClientSession(
            headers=e.request_headers(), timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=tls)
        )
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def query(self, promql: str) -> Mapping[str, Any]:
        """Prometheus's JSON answer to the instant query ``promql``."""
        assert self._session is not None, "use the client as an async context manager"
        url = self.endpoint.url.rstrip("/")
        try:
            async with self._session.get(url + "/api/v1/query", params={"query": promql}) as rsp:
                text = await rsp.text()
                status, reason = rsp.status, rsp.reason or ""
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise PrometheusError(f"Prometheus at {url}: {failure(exc)}") from None
        if status in (401, 403):
            said = _first_line(text)
            why = f" ({said})" if said else ""
            raise PrometheusError(f"Prometheus at {url} refused the request: {status} {reason}{why}", status)
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "status" not in answer:
            raise PrometheusError(
                f"Prometheus at {url}: {status} {reason}, not a Prometheus answer (is that its base URL?)",
                status,
            )
        return answer


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""

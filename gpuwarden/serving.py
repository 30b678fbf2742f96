"""HTTP servers that no client can exhaust: idle and slow connections timed out, connections capped.

Every server of the operator (ingest and verdicts, metrics and health) and of the agent and local
mode (``/metrics``, health) listens through :func:`serve`:

- a connection that sends no complete request for ``idle_timeout`` seconds is closed, whether it
  never sent anything, stopped half-way through its headers, or sits idle between keep-alive
  requests (aiohttp's keep-alive timer, which runs from the connection's start);
- a request whose body and handling take longer than ``request_timeout`` gets 408 and is closed
  (after at most :data:`LINGERING_TIME` more);
- the connections open at once are capped by a :class:`ConnectionLimiter`, shared by every server
  of the process and kept below its file-descriptor limit (raised at start to the hard limit by
  :func:`raise_fd_limit`), so that the process's own clients (Kopf's API connections, the
  TokenReviews) always find a descriptor (the listen backlog, which is also how many connections
  asyncio accepts in one go, is kept within the reserve). At the cap a new connection does not wait and is not
  refused: the connection heard from least recently is closed to make room, which is an idle one
  (a flood of idle connections evicts itself, not the agents that are sending);
- ``accept()`` running out of descriptors anyway (the limit shared with everything else) is what
  asyncio survives (it logs and retries after a second);
  :meth:`ConnectionLimiter.count_accept_errors` counts it.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "REQUEST_TIMEOUT",
    "ConnectionCollector",
    "ConnectionLimiter",
    "connection_cap",
    "raise_fd_limit",
    "serve",
]

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 30.0
"""Seconds a connection may go without a complete request. Longer than aiohttp's client keep-alive
(15 s, what the agent's sender uses), so a client never reuses a connection the server is closing."""

REQUEST_TIMEOUT = 30.0
"""Seconds a request's body and handling may take (a report is at most a few MiB; a TokenReview
that takes longer than this has failed anyway)."""

LINGERING_TIME = 2.0
"""Seconds the rest of an unread body is read (and dropped) after an early answer (413, 408), so the
client reads the answer instead of a reset; aiohttp's default, 10 s, would let a slow sender keep
its connection that much longer."""

DEFAULT_MAX_CONNECTIONS = 20_000
"""Connections open at once when the descriptors allow more: one kept-alive connection per node
of a 10,000-node fleet, twice over; each costs ~10 KiB (docs/benchmarks.md)."""

FD_RESERVE = 1024
"""Descriptors kept out of the connection cap for everything else (API clients, files, the
listening sockets), or a quarter of the limit when that is smaller."""

ACCEPT_OUT_OF_RESOURCE = "socket.accept() out of system resource"
"""The message asyncio gives its exception handler when ``accept()`` fails for want of descriptors
(or memory); the listener pauses for a second and then accepts again."""


def raise_fd_limit() -> int:
    """Raise this process's soft file-descriptor limit to its hard limit where it can; the soft
    limit then in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("Could not raise the file-descriptor limit from %d to %d: %s", soft, want, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(fd_limit: int, requested: int = 0) -> int:
    """The connections that may be open at once under ``fd_limit`` descriptors: ``requested``
    (default :data:`DEFAULT_MAX_CONNECTIONS`), but never more than the limit less its reserve."""
    room = max(1, fd_limit - min(FD_RESERVE, fd_limit // 4))
    return min(requested or DEFAULT_MAX_CONNECTIONS, room)


class ConnectionLimiter:
    """At most ``limit`` connections open at once over every server sharing it; at the cap, each new
    connection closes the one heard from least recently."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self.evicted = 0
        """Connections closed to make room for newer ones."""
        self.accept_errors = 0
        """``accept()`` failures for want of descriptors (:meth:`count_accept_errors`)."""
        self._open: OrderedDict[_Tracked, asyncio.BaseTransport] = OrderedDict()
        """Least recently heard from first."""

    def __len__(self) -> int:
        return len(self._open)

    def _opened(self, conn: _Tracked, transport: asyncio.BaseTransport) -> None:
        while len(self._open) >= self.limit:
            _, oldest = self._open.popitem(last=False)
            # abort(), not close(): the descriptor must be free now, not after a flush that an idle
            # peer may never let finish.
            _abort(oldest)
            self.evicted += 1
        self._open[conn] = transport

    def count_accept_errors(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count every ``accept()`` on ``loop`` that fails for want of descriptors, then hand the
        error on to the loop's handler as before (which logs it)."""
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == ACCEPT_OUT_OF_RESOURCE:
                self.accept_errors += 1
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def _heard(self, conn: _Tracked) -> None:
        if conn in self._open:
            self._open.move_to_end(conn)

    def _closed(self, conn: _Tracked) -> None:
        self._open.pop(conn, None)


def _abort(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.Transport | asyncio.WriteTransport):
        transport.abort()
    else:
        transport.close()


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, seen by the limiter: opened, heard from, closed."""

    def __init__(self, inner: Any, limiter: ConnectionLimiter) -> None:
        self._inner = inner
        self._limiter = limiter

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._limiter._opened(self, transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._limiter._heard(self)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._limiter._closed(self)
        self._inner.connection_lost(exc)


class _LimitedSite(web.TCPSite):
    """A TCP site whose connections go through a :class:`ConnectionLimiter`."""

    def __init__(
        self, runner: web.AppRunner, host: str | None, port: int, limiter: ConnectionLimiter, **kw: Any
    ):
        super().__init__(runner, host, port, **kw)
        self._limiter = limiter

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None  # set up by runner.setup()
        limiter = self._limiter
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Tracked(server(), limiter),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


def _deadline(seconds: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def deadline(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            async with asyncio.timeout(seconds):
                return await handler(request)
        except TimeoutError:
            return web.json_response(
                {"reason": "RequestTimeout", "message": f"the request took longer than {seconds:g}s"},
                status=408,
                headers={"Connection": "close"},
            )

    return deadline


async def serve(
    app: web.Application,
    host: str | None,
    port: int,
    *,
    limiter: ConnectionLimiter,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    request_timeout: float = REQUEST_TIMEOUT,
    ssl_context: ssl.SSLContext | None = None,
    backlog: int = 1024,
) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` with the limits above; the runner (``cleanup()`` stops it).

    ``OSError`` (the port is taken) propagates after the runner is cleaned up.
    """
    # asyncio accepts up to `backlog` connections in one go before the limiter sees any, and an evicted
    # one's descriptor is freed a turn of the loop later: twice that must fit beyond the cap, with
    # room left for the API clients, so the backlog is at most a quarter of the reserve.
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        backlog = max(16, min(backlog, (soft - limiter.limit) // 4))
    app.middlewares.insert(0, _deadline(request_timeout))
    # Access logs at 2,000 requests a second would drown everything else.
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=idle_timeout,
        lingering_time=LINGERING_TIME,
    )
    await runner.setup()
    try:
        await _LimitedSite(runner, host, port, limiter, ssl_context=ssl_context, backlog=backlog).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


class ConnectionCollector(Collector):
    """``<prefix>_connections_open``, ``_connections_limit``, ``_connections_evicted_total`` and
    ``_accept_errors_total`` of a :class:`ConnectionLimiter`, read at scrape time."""

    def __init__(self, limiter: ConnectionLimiter, prefix: str) -> None:
        self._limiter = limiter
        self._prefix = prefix

    def collect(self) -> Iterable[Metric]:
        """The four series."""
        p, limiter = self._prefix, self._limiter
        yield GaugeMetricFamily(f"{p}_connections_open", "HTTP connections open now.", value=len(limiter))
        yield GaugeMetricFamily(
            f"{p}_connections_limit", "HTTP connections that may be open at once.", value=limiter.limit
        )
        yield CounterMetricFamily(
            f"{p}_connections_evicted",
            "HTTP connections closed to make room for a new one (the least recently heard from).",
            value=limiter.evicted,
        )
        yield CounterMetricFamily(
            f"{p}_accept_errors",
            "accept() calls that failed for want of file descriptors (the listener retried a second later).",
            value=limiter.accept_errors,
        )

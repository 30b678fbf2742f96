"""The agent's HTTP server: ``/metrics``, ``/healthz`` and ``/readyz`` (fresh samples: :func:`stale_after`).

:func:`build_app` returns the aiohttp application and :func:`listen` serves it, with the limits
of :mod:`gpuwarden.serving` (idle connections closed after 30 s, at most
:data:`MAX_CONNECTIONS` at once); the agent's long-running work
(sampling, attribution refresh, report sending) rides on it as background tasks in
``app.cleanup_ctx`` (:func:`background_task`), so that starting and stopping the app
starts and stops everything, in order.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from gpuwarden.agent.snapshots import SnapshotRing
from gpuwarden.serving import ConnectionCollector, ConnectionLimiter, connection_cap, raise_fd_limit, serve

log = logging.getLogger(__name__)

REGISTRY = web.AppKey("registry", CollectorRegistry)
RING = web.AppKey("ring", SnapshotRing)
STALE_AFTER = web.AppKey("stale_after", float)

CleanupContext = Callable[[web.Application], AsyncIterator[None]]

MAX_CONNECTIONS = 256
"""Connections the agent's server holds open at once: Prometheus, the kubelet's probes and a few
people; a local flood of idle connections evicts itself
(:class:`~gpuwarden.serving.ConnectionLimiter`)."""


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


STALE_SAMPLES = 5
"""Sample intervals without a new snapshot after which the agent is unready (:func:`stale_after`)."""
STALE_FLOOR_S = 10.0
"""...and never sooner: a slow NVML call or a busy node's pause must not flap readiness."""


def stale_after(sample_interval: float) -> float:
    """Seconds without a new snapshot after which ``/readyz`` fails: the sampler is stalled (an NVML
    call that hangs) or failing (every read raises). A pod that reports nothing fresh is not ready,
    whatever its web server says."""
    return max(STALE_SAMPLES * sample_interval, STALE_FLOOR_S)


async def _readyz(request: web.Request) -> web.Response:
    age = request.app[RING].age()
    if age is None:
        return web.Response(status=503, text="no sample taken yet\n")
    limit = request.app[STALE_AFTER]
    if age > limit:
        text = f"no new sample for {age:.0f} s (unready after {limit:g} s): sampling is stalled or failing\n"
        return web.Response(status=503, text=text)
    return web.Response(text="ok\n")


def build_app(
    registry: CollectorRegistry,
    ring: SnapshotRing,
    *,
    stale_after: float = math.inf,
    background: Iterable[CleanupContext] = (),
) -> web.Application:
    """The agent's app: /metrics from ``registry``; /readyz while ``ring``'s newest snapshot is at
    most ``stale_after`` seconds old (infinite: once it holds one, for local mode, which nothing probes).

    ``background`` contexts start (in order) when the app starts and stop (in reverse)
    when it is cleaned up.
    """
    app = web.Application()
    app[REGISTRY] = registry
    app[RING] = ring
    app[STALE_AFTER] = stale_after
    # prometheus_client's handler, as the operator's and the simulated server's: the format the scraper
    # asks for, gzipped when it accepts that. The collectors only read the latest snapshot: cheap
    # enough for the event loop.
    app.router.add_get("/metrics", make_aiohttp_handler(registry))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.cleanup_ctx.extend(background)
    return app


def background_task(
    name: str,
    work: Callable[[], Coroutine[Any, Any, None]],
    *,
    on_exit: Callable[[str, BaseException | None], None] | None = None,
) -> CleanupContext:
    """A cleanup context that runs ``work()`` as a task for the app's lifetime.

    ``on_exit(name, error)`` is called if the task ends on its own (it should run until
    cancelled), with its exception or ``None``; the agent uses it to shut down rather than
    run on without, say, its sampling loop.
    """

    async def context(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(work(), name=name)

        def finished(done: asyncio.Task[None]) -> None:
            if done.cancelled():
                return
            error = done.exception()  # retrieved here, so asyncio does not warn about it later
            if error is not None:
                log.error("background task %s failed", name, exc_info=error)
            else:
                log.error("background task %s ended on its own", name)
            if on_exit is not None:
                on_exit(name, error)

        task.add_done_callback(finished)
        yield
        task.remove_done_callback(finished)
        task.cancel()
        # A task that already failed was reported by `finished`; only wait for the rest to stop.
        await asyncio.gather(task, return_exceptions=True)

    return context


async def listen(app: web.Application, host: str | None, port: int) -> tuple[web.AppRunner, list[str]]:
    """Serve ``app`` (:func:`build_app`) on ``host:port``; the runner and the addresses it listens on.

    The file-descriptor limit is raised first, and ``<app's registry>`` gains the connection
    metrics (``gpuwarden_agent_connections_*``). ``OSError`` (the port is taken) propagates after
    the runner is cleaned up.
    """
    limiter = ConnectionLimiter(connection_cap(raise_fd_limit(), MAX_CONNECTIONS))
    app[REGISTRY].register(ConnectionCollector(limiter, "gpuwarden_agent"))
    runner = await serve(app, host, port, limiter=limiter)
    return runner, [address_text(a) for a in runner.addresses]


def address_text(address: object) -> str:
    """A socket address as ``host:port`` (``[host]:port`` for IPv6)."""
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return str(address)

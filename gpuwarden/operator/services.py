"""The operator's own servers and background tasks, run inside Kopf's event loop.

Started by a ``@kopf.on.startup`` handler and stopped by ``@kopf.on.cleanup``:
the ingest server (``POST /v1/reports``), the metrics server (``/metrics``,
``/healthz``, ``/readyz``), the leadership loop (peering verdict → pod label), the
Event poster, the pruning of the series and health stores and the heap trim after it
(:func:`return_freed_memory`), and with ``--node-health`` the node view of GPU health
(:mod:`.nodehealth`). The servers go through :mod:`gpuwarden.serving` (timeouts, one connection
cap for both under the file-descriptor limit raised here).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import ssl
from collections.abc import Iterable, Mapping

from aiohttp import web

from gpuwarden.operator.config import Address
from gpuwarden.operator.ingest import make_ingest_app
from gpuwarden.operator.metrics import make_metrics_app
from gpuwarden.operator.nodehealth import NodeHealthMonitor
from gpuwarden.operator.resources import PodRecord
from gpuwarden.operator.state import PRUNE_SECONDS, OperatorState
from gpuwarden.operator.tokenreview import ReviewCollector
from gpuwarden.serving import ConnectionCollector, ConnectionLimiter, connection_cap, raise_fd_limit, serve

__all__ = ["Services", "return_freed_memory", "trim_heap"]

logger = logging.getLogger(__name__)

DRAIN_SECONDS = 5.0
"""At exit, how long queued Events get to be posted (within the pod's termination grace period)."""


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there
    is no glibc. Large buffers (the series' columns) are freed and reallocated as readings come
    and go; glibc keeps the freed pages mapped unless asked, so resident memory creeps up while
    what Python holds stays flat (docs/benchmarks.md, the soak)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


async def return_freed_memory(every: float = PRUNE_SECONDS) -> None:
    """Forever, every ``every`` seconds, :func:`trim_heap` (after the stores' pruning has freed)."""
    while True:
        await asyncio.sleep(every)
        if not trim_heap():
            return


class Services:
    """Servers and tasks the operator runs besides Kopf's own."""

    def __init__(
        self, state: OperatorState, *, pods: Mapping[str, Iterable[PodRecord]] | None = None
    ) -> None:
        self.state = state
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        """Cancelled at exit, last started first; the Event poster is apart: it is drained first."""
        self._posting: asyncio.Task[None] | None = None
        fds = raise_fd_limit()
        self.connections = ConnectionLimiter(connection_cap(fds, state.config.max_connections))
        """Shared by the ingest and the metrics servers."""
        state.metrics.registry.register(ConnectionCollector(self.connections, "gpuwarden_operator"))
        state.metrics.registry.register(ReviewCollector(state.authenticator, "gpuwarden_operator"))
        logger.info("File-descriptor limit %d: at most %d connections at once.", fds, self.connections.limit)
        self.node_health: NodeHealthMonitor | None = None
        if state.config.node_health:
            self.node_health = NodeHealthMonitor(
                state.config,
                state.api,
                state.health,
                state.metrics,
                state.events,
                pods={} if pods is None else pods,  # an Index: empty (falsy) this early, filled later
                acting=lambda: state.leadership.active,
            )

    async def start(self) -> None:
        """Listen on the ingest and metrics addresses; follow the peering verdict; post Events;
        prune the stores; judge node health."""
        config = self.state.config
        self.connections.count_accept_errors(asyncio.get_running_loop())
        tls = None
        if config.tls_cert_file and config.tls_key_file:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        verdicts = self.state.verdict_ingest.handle if self.state.verdict_ingest else None
        await self._serve(make_ingest_app(self.state.ingest, verdicts), config.ingest, tls, "ingest")
        await self._serve(
            make_metrics_app(self.state.metrics, lambda: self.state.started), config.metrics, None, "metrics"
        )
        self._tasks.append(asyncio.create_task(self.state.leadership.run(), name="gpuwarden leadership"))
        self._tasks.append(asyncio.create_task(self.state.prune(), name="gpuwarden pruning"))
        self._tasks.append(asyncio.create_task(return_freed_memory(), name="gpuwarden heap trim"))
        if self.node_health is not None:
            self._tasks.append(asyncio.create_task(self.node_health.run(), name="gpuwarden node health"))
        self._posting = asyncio.create_task(self.state.events.run(), name="gpuwarden events")
        self.state.started = True

    async def _serve(
        self, app: web.Application, address: Address, tls: ssl.SSLContext | None, what: str
    ) -> None:
        runner = await serve(
            app,
            address.host,
            address.port,
            limiter=self.connections,
            idle_timeout=self.state.config.idle_timeout,
            ssl_context=tls,
        )
        self._runners.append(runner)
        logger.info("Serving %s on %s%s.", what, address, " (TLS)" if tls else "")

    async def stop(self) -> None:
        """Stand down (remove the pod label), post queued Events, stop the servers, close the API client."""
        self.state.started = False
        for task in reversed(self._tasks):
            await _cancel(task)
        self._tasks.clear()
        await self.state.leadership.step_down()
        if self._posting is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_SECONDS):
                    await self.state.events.drain()
            await _cancel(self._posting)
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self.state.verdict_sender is not None:
            await self.state.verdict_sender.close()
        await self.state.api.close()


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""The operator's own servers and background tasks, run inside Kopf's event loop.

Built by the composition root, started by a ``@kopf.on.startup`` handler and stopped by
``@kopf.on.cleanup`` (one :class:`contextlib.AsyncExitStack`):
the ingest server (``POST /v1/reports``), the metrics server (``/metrics``,
``/healthz``, ``/readyz``), the leadership loop (peering verdict, or sharded mode's membership →
pod label), the Event poster, and the tasks the composition root names: the pruning of the records
(:func:`prune`), the memory's upkeep (:func:`.memory.keep_memory`), the accounting, and with
``--node-health`` the node view of GPU health (:mod:`.nodehealth`). The servers go through
:mod:`gpuwarden.serving` (timeouts, one connection cap for both under the file-descriptor limit
raised here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from aiohttp import web

from gpuwarden.operator.config import Address, OperatorConfig
from gpuwarden.operator.kube import EventPoster, KubeApi, ReviewCollector, TokenAuthenticator
from gpuwarden.operator.metrics import OperatorMetrics, make_metrics_app
from gpuwarden.operator.sharding import Leadership, VerdictSender
from gpuwarden.operator.state import PRUNE_SECONDS, OperatorState
from gpuwarden.serving import ConnectionCollector, ConnectionLimiter, connection_cap, raise_fd_limit, serve

__all__ = ["Lifecycle", "prune"]

logger = logging.getLogger(__name__)

DRAIN_SECONDS = 5.0
"""At exit, how long queued Events get to be posted (within the pod's termination grace period)."""


async def prune(records: OperatorState, clock: Callable[[], float]) -> None:
    """Forever, every :data:`PRUNE_SECONDS`: age out what stopped receiving readings
    (:meth:`OperatorState.prune`)."""
    while True:
        await asyncio.sleep(PRUNE_SECONDS)
        records.prune(clock())


class Lifecycle:
    """Servers and tasks the operator runs besides Kopf's own; built by the composition root.

    ``ingest_app``: the ingest server's routes; ``shard``: the leadership loop (peering, or sharded
    mode's membership), stepped down at exit; ``sender``: sharded mode's verdict sender, closed at
    exit; ``tasks``: the background work to run, by task name (cancelled at exit).
    """

    def __init__(
        self,
        config: OperatorConfig,
        *,
        api: KubeApi,
        metrics: OperatorMetrics,
        authenticator: TokenAuthenticator,
        events: EventPoster,
        shard: Leadership,
        sender: VerdictSender,
        ingest_app: web.Application,
        tasks: Mapping[str, Callable[[], Coroutine[Any, Any, None]]],
    ) -> None:
        self.config = config
        self.api = api
        self.metrics = metrics
        self.events = events
        self.shard = shard
        self.sender = sender
        self.ingest_app = ingest_app
        self.tasks = tasks
        self.started = False
        """True once the servers listen (``/readyz``)."""
        self._stack = contextlib.AsyncExitStack()
        """What :meth:`start` started, undone last started first by :meth:`stop`."""
        fds = raise_fd_limit()
        self.connections = ConnectionLimiter(connection_cap(fds, config.max_connections))
        """Shared by the ingest and the metrics servers."""
        metrics.registry.register(ConnectionCollector(self.connections, "gpuwarden_operator"))
        metrics.registry.register(ReviewCollector(authenticator, "gpuwarden_operator"))
        logger.info("File-descriptor limit %d: at most %d connections at once.", fds, self.connections.limit)

    async def start(self) -> None:
        """Listen on the ingest and metrics addresses; follow the peering verdict (or the shard group);
        post Events; run the tasks. What started before a failure is stopped again."""
        config = self.config
        self.connections.count_accept_errors(asyncio.get_running_loop())
        tls = None
        if config.tls_cert_file and config.tls_key_file:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        async with contextlib.AsyncExitStack() as stack:
            # Undone in reverse: the API client closes last, after the sender, the servers, the
            # Events' drain (which needs the client) and the step down (which removes the pod label).
            stack.push_async_callback(self.api.close)
            stack.push_async_callback(self.sender.close)
            await self._serve(stack, self.ingest_app, config.ingest, tls, "ingest")
            await self._serve(
                stack, make_metrics_app(self.metrics, lambda: self.started), config.metrics, None, "metrics"
            )
            posting = asyncio.create_task(self.events.run(), name="gpuwarden events")
            stack.push_async_callback(_drain_then_cancel, self.events, posting)
            stack.push_async_callback(self.shard.step_down)
            self._task(stack, self.shard.run(), "gpuwarden leadership")
            for name, work in self.tasks.items():
                self._task(stack, work(), name)
            if tls is not None and config.tls_cert_file and config.tls_key_file:
                reload = reload_certificate(tls, config.tls_cert_file, config.tls_key_file)
                self._task(stack, reload, "gpuwarden certificate reload")
            stack.callback(setattr, self, "started", False)
            self.started = True
            self._stack = stack.pop_all()

    @staticmethod
    def _task(stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
        stack.push_async_callback(_cancel, asyncio.create_task(work, name=name))

    async def _serve(
        self,
        stack: contextlib.AsyncExitStack,
        app: web.Application,
        address: Address,
        tls: ssl.SSLContext | None,
        what: str,
    ) -> None:
        runner = await serve(
            app,
            address.host,
            address.port,
            limiter=self.connections,
            idle_timeout=self.config.idle_timeout,
            ssl_context=tls,
        )
        stack.push_async_callback(runner.cleanup)
        logger.info("Serving %s on %s%s.", what, address, " (TLS)" if tls else "")

    async def stop(self) -> None:
        """Stand down (remove the pod label), post queued Events, stop the servers, close the API client."""
        await self._stack.aclose()


CERTIFICATE_CHECK_SECONDS = 60.0
"""How often the serving certificate's files are checked for a renewal."""


async def reload_certificate(
    tls: ssl.SSLContext, cert_file: str, key_file: str, *, every: float = CERTIFICATE_CHECK_SECONDS
) -> None:
    """Load the certificate again whenever its files change: cert-manager renews it in place (the
    Secret's volume swaps in new files), and new handshakes then get the new one. A pair that does
    not load (caught halfway through a swap) is tried again at the next check."""
    seen = _modified(cert_file, key_file)
    while True:
        await asyncio.sleep(every)
        now = _modified(cert_file, key_file)
        if now == seen:
            continue
        try:
            tls.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            logger.warning("The renewed certificate %s does not load yet: %s", cert_file, exc)
            continue
        seen = now
        logger.info("Serving the renewed certificate %s.", cert_file)


def _modified(*paths: str) -> tuple[float, ...]:
    times = []
    for path in paths:
        try:
            times.append(os.stat(path).st_mtime)
        except OSError:
            times.append(-1.0)
    return tuple(times)


async def _drain_then_cancel(events: EventPoster, posting: asyncio.Task[None]) -> None:
    """Give the queued Events :data:`DRAIN_SECONDS` to be posted, then stop the poster."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            await events.drain()
    await _cancel(posting)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

"""The operator's own servers and background task, run inside Kopf's event loop.

Started by a ``@kopf.on.startup`` handler and stopped by ``@kopf.on.cleanup``:
the ingest server (``POST /v1/reports``), the metrics server (``/metrics``,
``/healthz``, ``/readyz``), the leadership loop (peering verdict → pod label), and with
``--node-health`` the node view of GPU health (:mod:`.nodehealth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterable, Mapping

from aiohttp import web

from gpuwarden.operator.config import Address
from gpuwarden.operator.ingest import make_ingest_app
from gpuwarden.operator.metrics import make_metrics_app
from gpuwarden.operator.nodehealth import NodeHealthMonitor
from gpuwarden.operator.state import OperatorState, PodRecord

__all__ = ["Services"]

logger = logging.getLogger(__name__)


class Services:
    """Servers and tasks the operator runs besides Kopf's own."""

    def __init__(
        self, state: OperatorState, *, pods: Mapping[str, Iterable[PodRecord]] | None = None
    ) -> None:
        self.state = state
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.node_health: NodeHealthMonitor | None = None
        if state.config.node_health:
            self.node_health = NodeHealthMonitor(
                state.config,
                state.api,
                state.health,
                state.metrics,
                pods={} if pods is None else pods,  # an Index: empty (falsy) this early, filled later
                acting=lambda: state.leadership.active,
            )

    async def start(self) -> None:
        """Listen on the ingest and metrics addresses; follow the peering verdict; judge node health."""
        config = self.state.config
        tls = None
        if config.tls_cert_file and config.tls_key_file:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        await self._serve(make_ingest_app(self.state.ingest), config.ingest, tls, "ingest")
        await self._serve(
            make_metrics_app(self.state.metrics, lambda: self.state.started), config.metrics, None, "metrics"
        )
        self._tasks.append(asyncio.create_task(self.state.leadership.run(), name="gpuwarden leadership"))
        if self.node_health is not None:
            self._tasks.append(asyncio.create_task(self.node_health.run(), name="gpuwarden node health"))
        self.state.started = True

    async def _serve(
        self, app: web.Application, address: Address, tls: ssl.SSLContext | None, what: str
    ) -> None:
        # Access logs at 2,000 reports a second would drown everything else; errors are logged by the handler.
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, address.host, address.port, ssl_context=tls, backlog=1024).start()
        logger.info("Serving %s on %s%s.", what, address, " (TLS)" if tls else "")

    async def stop(self) -> None:
        """Stand down (remove the pod label), stop the servers, close the API client."""
        self.state.started = False
        for task in reversed(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.state.leadership.step_down()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        await self.state.api.close()

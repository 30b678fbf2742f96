"""``/metrics`` in local mode: the agent's collectors, plus the findings of the local engine.

The agent's collectors (:func:`gpuwarden.agent.metrics.build_registry`) read the latest
snapshot from a :class:`~gpuwarden.agent.snapshots.SnapshotRing`, exactly as on a node;
local mode adds ``gpuwarden_local_finding_active``, one series per active finding, so a
dashboard or an alert can follow what ``watch`` concludes without a cluster.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwarden.agent.http import CleanupContext, build_app
from gpuwarden.agent.metrics import AgentMetrics, build_registry
from gpuwarden.agent.snapshots import SnapshotRing
from gpuwarden.policy import Finding

FINDING_LABELS = ("policy", "rule", "reason", "namespace", "pod")


class FindingCollector(Collector):
    """``gpuwarden_local_finding_active``: 1 per active finding, read from the session at scrape time."""

    def __init__(self, active: Callable[[], Sequence[Finding]]) -> None:
        self._active = active

    def collect(self) -> Iterable[Metric]:
        """One series per active finding; none when nothing is found."""
        family = GaugeMetricFamily(
            "gpuwarden_local_finding_active",
            "1 for each finding local mode holds active (pod is pid/<pid> for a host process).",
            labels=list(FINDING_LABELS),
        )
        for f in self._active():
            family.add_metric([f.policy, f.rule, f.reason, f.namespace, f.pod], 1.0)
        return [family]


def local_registry(
    ring: SnapshotRing, active: Callable[[], Sequence[Finding]], *, backend: str
) -> tuple[CollectorRegistry, AgentMetrics]:
    """A fresh registry: the agent's collectors (node label: this host's name) and the findings."""
    registry, metrics = build_registry(ring, backend=backend, node=socket.gethostname())
    registry.register(FindingCollector(active))
    return registry, metrics


async def start_server(
    registry: CollectorRegistry,
    ring: SnapshotRing,
    host: str | None,
    port: int,
    *,
    background: Iterable[CleanupContext] = (),
) -> tuple[web.AppRunner, list[str]]:
    """Serve the agent's app (``/metrics``, ``/healthz``, ``/readyz``); the runner and its addresses.

    ``OSError`` (the port is taken) propagates after the runner is cleaned up.
    """
    runner = web.AppRunner(build_app(registry, ring, background=background), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, [_address(a) for a in runner.addresses]


def _address(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return str(address)

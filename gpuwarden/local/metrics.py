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

from gpuwarden.agent.http import CleanupContext, build_app, listen
from gpuwarden.agent.metrics import AgentMetrics, build_registry
from gpuwarden.agent.snapshots import SnapshotRing
from gpuwarden.policy import Finding

FINDING_LABELS = ("policy", "rule", "reason", "namespace", "pod", "command")

CommandOf = Callable[[str, str], str]
"""A subject's short command by (namespace, pod); ``""`` for a pod."""


def _no_command(namespace: str, pod: str) -> str:
    return ""


class FindingCollector(Collector):
    """``gpuwarden_local_finding_active``: 1 per active finding, read from the session at scrape time.

    A process's ``command`` label is the short one of the display (basename and arguments, cut at
    60 characters), never the whole command line: a label holding a ``python -c`` script would
    make series as long as the script and a new one per edit of it.
    """

    def __init__(self, active: Callable[[], Sequence[Finding]], command_of: CommandOf = _no_command) -> None:
        self._active = active
        self._command_of = command_of

    def collect(self) -> Iterable[Metric]:
        """One series per active finding; none when nothing is found."""
        family = GaugeMetricFamily(
            "gpuwarden_local_finding_active",
            "1 for each finding local mode holds active "
            "(pod is pid/<pid> for a host process, command its short command line).",
            labels=list(FINDING_LABELS),
        )
        for f in self._active():
            command = self._command_of(f.namespace, f.pod)
            family.add_metric([f.policy, f.rule, f.reason, f.namespace, f.pod, command], 1.0)
        return [family]


def local_registry(
    ring: SnapshotRing,
    active: Callable[[], Sequence[Finding]],
    *,
    backend: str,
    command_of: CommandOf = _no_command,
) -> tuple[CollectorRegistry, AgentMetrics]:
    """A fresh registry: the agent's collectors (node label: this host's name) and the findings."""
    registry, metrics = build_registry(ring, backend=backend, node=socket.gethostname())
    registry.register(FindingCollector(active, command_of))
    return registry, metrics


async def start_server(
    registry: CollectorRegistry,
    ring: SnapshotRing,
    host: str | None,
    port: int,
    *,
    background: Iterable[CleanupContext] = (),
) -> tuple[web.AppRunner, list[str]]:
    """Serve the agent's app (``/metrics``, ``/healthz``, ``/readyz``) with its connection limits
    (:func:`gpuwarden.agent.http.listen`); the runner and its addresses.

    ``OSError`` (the port is taken) propagates after the runner is cleaned up.
    """
    return await listen(build_app(registry, ring, background=background), host, port)

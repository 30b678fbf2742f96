"""Fakes the operator's unit tests share: the API server's answers (TokenReviews, status patches), the
operator's clock, a node's report, and a policy with one pod fed utilization readings.

Kept here rather than in a test module, so that a test in any folder imports them by name (pytest puts
this folder on the path for its conftest) and each test file runs alone."""

from __future__ import annotations

from typing import Any

from gpuwarden.operator.resources import PodRecord
from gpuwarden.operator.state import OperatorState
from gpuwarden.policy.engine import PodView
from gpuwarden.policy.store.series import Point, SeriesKey
from gpuwarden.wire.node import GpuSample, NodeReport, PodRef, Snapshot

T0 = 1_800_000_000.0
"""When the tests' readings begin."""

# -- the ingest endpoint ------------------------------------------------------------------------

AGENT = "system:serviceaccount:gpuwarden-system:gpuwarden-agent"
NODE_EXTRA = "authentication.kubernetes.io/node-name"


class ReviewApi:
    """Answers TokenReviews from a table: token -> (username, the node its pod runs on, or None: unbound)."""

    def __init__(self) -> None:
        self.users: dict[str, tuple[str, str | None]] = {
            "good": (AGENT, "node-1"),
            "good-2": (AGENT, "node-2"),
            "unbound": (AGENT, None),
            "other": ("system:serviceaccount:default:intruder", "node-1"),
        }
        self.reviews = 0
        self.down = False

    async def create_token_review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        self.reviews += 1
        if self.down:
            raise ConnectionError("the API server is away")
        if token not in self.users:
            return {"authenticated": False, "error": "invalid bearer token"}
        username, node = self.users[token]
        user: dict[str, Any] = {"username": username}
        if node is not None:
            user["extra"] = {NODE_EXTRA: [node], "authentication.kubernetes.io/pod-name": ["agent-x"]}
        return {"authenticated": True, "audiences": audiences, "user": user}


class Clock:
    """The operator's clock: a minute after T0, when the tests' reports were taken."""

    def __init__(self) -> None:
        self.now = T0 + 60

    def __call__(self) -> float:
        return self.now


def report(
    node: str = "node-1", seq: int = 0, t: float = T0, agent: str = "agent-a", **kw: Any
) -> NodeReport:
    gpu = GpuSample(
        uuid="GPU-1",
        index=0,
        utilization_gpu=kw.get("util", 42.0),
        memory_used_bytes=2**30,
        memory_total_bytes=80 * 2**30,
        temperature_c=kw.get("temperature"),
        power_watts=kw.get("power"),
        pods=[PodRef(namespace="ns", name=kw.get("pod", "pod-a"))],
    )
    snaps = [Snapshot(timestamp=t + i, gpus=[gpu]) for i in range(kw.get("snapshots", 1))]
    return NodeReport(schema_version=1, node=node, agent_id=agent, seq=seq, snapshots=snaps)


# -- a policy's rounds ---------------------------------------------------------------------------


class StatusApi:
    """Takes status patches and keeps their bodies."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    async def patch_status(self, *args: Any, status: Any = None, manager: str, **kw: Any) -> dict[str, Any]:
        self.patches.append(args[5])
        return {}


POLICY: dict[str, Any] = {
    "apiVersion": "gpuwarden.dev/v1alpha1",
    "kind": "GPUMonitorPolicy",
    "metadata": {"name": "pol", "namespace": "ns", "uid": "pol-uid", "generation": 1},
    "spec": {
        "selector": {"matchLabels": {"app": "x"}},
        "evaluationInterval": "1s",
        "rules": [{"name": "idle", "utilizationFloor": {"percent": 20, "for": "10s"}}],
        "actions": {"renotifyInterval": "1m"},
    },
    "status": {},
}

PODS = {"ns": [PodRecord(PodView("ns", "p", {"app": "x"}), "pod-uid")]}


def feed(state: OperatorState, start: float, end: float, util: float) -> None:
    """Pod p's GPU at ``util`` every second of ``[start, end]``."""
    t = start
    while t <= end:
        state.store.add(
            SeriesKey("ns", "p", "GPU-1"), Point(t=t, gpu_util=util, mem_used=1e9, mem_total=8e10)
        )
        t += 1

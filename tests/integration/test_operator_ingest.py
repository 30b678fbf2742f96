"""End to end: bad input at the ingest endpoint, while a good agent keeps being served.

Real TokenReviews against a real API server: tokens from the TokenRequest API for the agent's
ServiceAccount (audience gpuwarden-operator), for another ServiceAccount, and for the wrong
audience. Each bad request gets its status and reason; the agent's idle pod is still detected.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import (
    AGENT_SA,
    IDLE_RULE,
    World,
    gpu,
    http,
    monitor_policy,
    operator_and_agent,
    pod,
    prepare,
    service_account_token,
    wait_until,
)

from gpuwarden.nodereport import GpuSample, NodeReport, PodRef, Snapshot, dump_report

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024
SHARED = ("shared-busy", "shared-idle")
"""Two pods on one time-sliced GPU: the idle one must be found beside the busy one."""


@dataclass
class Ingest(World):
    token: str
    """The agent's own token: what a well-behaved client sends."""

    def post(self, body: bytes, token: str | None = None, **headers: str) -> tuple[int, Any, Any]:
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        headers.setdefault("Content-Type", "application/json")
        status, payload = http("POST", self.operator.url, body, headers)
        return status, payload, None


def good_report(node: str = "test-node", seq: int = 0, t: float = 1_800_000_000.0) -> bytes:
    gpu_sample = GpuSample(
        uuid="GPU-test", index=0, utilization_gpu=50.0, pods=[PodRef(namespace="elsewhere", name="p")]
    )
    report = NodeReport(
        schema_version=1,
        node=node,
        agent_id="test",
        seq=seq,
        snapshots=[Snapshot(timestamp=t, gpus=[gpu_sample])],
    )
    return dump_report(report)


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ingest]:
    cp = control_plane
    pods = ["notebook-0", *SHARED]
    setup = prepare(cp, tmp_path_factory, "ingest", gpu_pods=pods, labels={"app": "notebook"})
    setup.apply(monitor_policy(setup.namespace, "idle", [IDLE_RULE]))
    uuid = "GPU-1f00aa00-0000-4000-8000-000000000001"
    # A saturated GPU time-sliced by two pods, one of which holds memory and runs no kernel.
    shared = "GPU-1f00aa00-0000-4000-8000-000000000002"
    busy = pod(setup.namespace, "shared-busy", shared, {"app": "notebook"}, 4300)
    idle = pod(setup.namespace, "shared-idle", shared, {"app": "notebook"}, 4301)
    idle["processes"][0]["kernels"] = False
    scenario = setup.scenario(
        "ingest",
        [
            gpu(uuid, 0, [{"kind": "idle", "level": 2, "noise": 1}], [{"kind": "idle", "level": "4Gi"}]),
            gpu(shared, 1, [{"kind": "saturated"}], [{"kind": "idle", "level": "20Gi"}]),
        ],
        [pod(setup.namespace, "notebook-0", uuid, {"app": "notebook"}, 4242), busy, idle],
    )
    limits = [f"--max-body-bytes={MAX_BODY}", "--node-rate=2"]
    with operator_and_agent(setup, scenario, extra_args=limits) as (operator, agent):
        yield Ingest(cp, setup.namespace, operator, agent, setup.token)


def test_missing_token_is_401(world: Ingest) -> None:
    status, payload, _ = world.post(good_report())
    assert (status, payload["reason"]) == (401, "Unauthenticated")
    assert "bearer token" in payload["message"]


def test_garbage_token_is_401(world: Ingest) -> None:
    status, payload, _ = world.post(good_report(), token="not-a-jwt")
    assert (status, payload["reason"]) == (401, "Unauthenticated")


def test_token_for_another_audience_is_401(world: Ingest) -> None:
    wrong = service_account_token(world.cp, world.namespace, AGENT_SA, audience="gpuwarden-test")
    status, payload, _ = world.post(good_report(), token=wrong)
    assert (status, payload["reason"]) == (401, "Unauthenticated")


def test_token_of_another_service_account_is_403(world: Ingest) -> None:
    intruder = service_account_token(world.cp, world.namespace, "intruder")
    status, payload, _ = world.post(good_report(), token=intruder)
    assert (status, payload["reason"]) == (403, "Forbidden")
    assert f"system:serviceaccount:{world.namespace}:intruder" in payload["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"schemaVersion": 1, "node": ', "Invalid JSON"),
        (json.dumps({"hello": "world"}).encode(), "schemaVersion"),
        (
            good_report().replace(b'"schemaVersion":1', b'"schemaVersion":99'),
            "schemaVersion: 99 is not supported",
        ),
        (good_report().replace(b'"utilizationGpu":50.0', b'"utilizationGpu":150.0'), "utilizationGpu"),
    ],
)
def test_malformed_reports_are_400_with_the_reason(world: Ingest, body: bytes, says: str) -> None:
    status, payload, _ = world.post(body, token=world.token)
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert says in payload["message"]


def test_oversized_body_is_413(world: Ingest) -> None:
    status, payload, _ = world.post(b"{" + b" " * MAX_BODY + b"}", token=world.token)
    assert (status, payload["reason"]) == (413, "TooLarge")


def test_a_node_over_its_rate_gets_429_with_retry_after(world: Ingest) -> None:
    statuses = [
        world.post(good_report(node="chatty", seq=i, t=1e9 + i), token=world.token)[0] for i in range(12)
    ]
    assert statuses[:2] == [200, 200]
    assert 429 in statuses


def test_good_agent_is_served_through_all_that(world: Ingest) -> None:
    # Hammer the endpoint with bad requests from a thread while waiting for the agent's finding.
    stop = threading.Event()

    def hammer() -> None:
        bodies = [b"{", b"x" * (MAX_BODY + 10), json.dumps({"schemaVersion": 2}).encode()]
        i = 0
        while not stop.is_set():
            world.post(bodies[i % len(bodies)], token=world.token if i % 2 else None)
            i += 1

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: world.events("Pod", "notebook-0", "GPUUnderutilized"),
            timeout=60,
            what="the idle notebook's Warning",
            alive=world.alive,
        )
    finally:
        stop.set()
        thread.join(timeout=30)
    metrics = world.operator.metrics()
    assert metrics['gpuwarden_operator_reports_rejected_total{reason="invalid"}'] > 0
    assert metrics['gpuwarden_operator_reports_rejected_total{reason="too_large"}'] > 0
    assert metrics['gpuwarden_operator_reports_rejected_total{reason="unauthenticated"}'] > 0
    assert metrics['gpuwarden_operator_reports_rejected_total{reason="internal"}'] == 0
    assert metrics["gpuwarden_operator_points_total"] >= 5
    assert world.operator.alive() is None


def test_the_idle_pod_beside_a_busy_one_on_a_shared_gpu_is_warned_and_the_busy_one_is_not(
    world: Ingest,
) -> None:
    (warning, *_) = wait_until(
        lambda: world.events("Pod", "shared-idle", "GPUUnderutilized"),
        timeout=60,
        what="the idle pod's Warning on the shared GPU",
        alive=world.alive,
    )
    assert "mean per-process SM utilization 0% over 10s, floor 20%" in warning["message"]
    assert world.events("Pod", "shared-busy", "GPUUnderutilized") == []
    assert "shared-busy" not in {v["pod"] for v in world.violations("idle")}

"""End to end: bad input at the ingest endpoint, while a good agent keeps being served.

Real TokenReviews against a real API server: tokens from the TokenRequest API for the agent's
ServiceAccount (audience gpuwarden-operator), for another ServiceAccount, and for the wrong
audience. Each bad request gets its status and reason; the agent's idle pod is still detected.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import (
    AGENT_SA,
    Agent,
    Operator,
    apply,
    apply_crds,
    create_gpu_pod,
    create_peering,
    events,
    gpu,
    http,
    pod,
    service_account_token,
    wait_until,
    write_scenario,
    write_token,
)

from gpuwarden.nodereport import GpuSample, NodeReport, PodRef, Snapshot, dump_report

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024


@dataclass
class World:
    cp: ControlPlane
    namespace: str
    operator: Operator
    agent: Agent
    token: str
    workdir: Path

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
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cp = control_plane
    workdir = tmp_path_factory.mktemp("operator-ingest")
    namespace = cp.create_namespace(f"gw-ingest-{secrets.token_hex(3)}")
    apply_crds(cp)
    create_gpu_pod(cp, namespace, "notebook-0", {"app": "notebook"})
    apply(
        cp,
        {
            "apiVersion": "gpuwarden.dev/v1alpha1",
            "kind": "GPUMonitorPolicy",
            "metadata": {"name": "idle", "namespace": namespace},
            "spec": {
                "selector": {},
                "evaluationInterval": "1s",
                "rules": [
                    {"name": "idle", "utilizationFloor": {"percent": 20, "for": "10s", "signal": "gpuUtil"}}
                ],
            },
        },
    )
    create_peering(cp, namespace, "gpuwarden")
    token = service_account_token(cp, namespace, AGENT_SA)
    token_file = write_token(workdir / "token", token)
    uuid = "GPU-1f00aa00-0000-4000-8000-000000000001"
    scenario = write_scenario(
        workdir / "scenario.yaml",
        "ingest",
        [gpu(uuid, 0, [{"kind": "idle", "level": 2, "noise": 1}], [{"kind": "idle", "level": "4Gi"}])],
        [pod(namespace, "notebook-0", uuid, {"app": "notebook"}, 4242)],
    )
    operator = Operator(
        cp,
        workdir,
        namespace,
        peering="gpuwarden",
        pod_name="gpuwarden-operator-0",
        extra_args=[f"--max-body-bytes={MAX_BODY}", "--node-rate=2"],
    )
    try:
        operator.wait_ready()
        agent = Agent(cp, workdir, scenario, operator.url, token_file, "gpu-node-1")
        try:
            yield World(cp, namespace, operator, agent, token, workdir)
        finally:
            agent.stop()
    finally:
        operator.stop()


def test_missing_token_is_401(world: World) -> None:
    status, payload, _ = world.post(good_report())
    assert (status, payload["reason"]) == (401, "Unauthenticated")
    assert "bearer token" in payload["message"]


def test_garbage_token_is_401(world: World) -> None:
    status, payload, _ = world.post(good_report(), token="not-a-jwt")
    assert (status, payload["reason"]) == (401, "Unauthenticated")


def test_token_for_another_audience_is_401(world: World) -> None:
    wrong = service_account_token(world.cp, world.namespace, AGENT_SA, audience="gpuwarden-test")
    status, payload, _ = world.post(good_report(), token=wrong)
    assert (status, payload["reason"]) == (401, "Unauthenticated")


def test_token_of_another_service_account_is_403(world: World) -> None:
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
def test_malformed_reports_are_400_with_the_reason(world: World, body: bytes, says: str) -> None:
    status, payload, _ = world.post(body, token=world.token)
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert says in payload["message"]


def test_oversized_body_is_413(world: World) -> None:
    status, payload, _ = world.post(b"{" + b" " * MAX_BODY + b"}", token=world.token)
    assert (status, payload["reason"]) == (413, "TooLarge")


def test_a_node_over_its_rate_gets_429_with_retry_after(world: World) -> None:
    statuses = [
        world.post(good_report(node="chatty", seq=i, t=1e9 + i), token=world.token)[0] for i in range(12)
    ]
    assert statuses[:2] == [200, 200]
    assert 429 in statuses


def test_good_agent_is_served_through_all_that(world: World) -> None:
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
            lambda: [e for e in events(world.cp, world.namespace, kind="Pod", name="notebook-0")
                     if e["reason"] == "GPUUnderutilized"],
            timeout=60,
            what="the idle notebook's Warning",
            alive=lambda: world.operator.alive() or world.agent.alive(),
        )  # fmt: skip
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

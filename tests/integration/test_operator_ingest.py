"""End to end: bad input at the ingest endpoint, while a good agent keeps being served.

Real TokenReviews against a real API server: tokens from the TokenRequest API for the agent's
ServiceAccount (audience gpuwarden-operator) bound to an agent pod on a node, as the DaemonSet's
projected tokens are, and unbound ones, ones for another ServiceAccount and for the wrong
audience. Each bad request gets its status and reason; readings the operator must not store
(timestamps out of its clock's bounds, pods on another node) are answered and counted; the
agent's idle pod is still detected, and /metrics still passes promtool.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from controlplane import ControlPlane, in_ci
from operator_support import (
    AGENT_NODE,
    AGENT_SA,
    IDLE_RULE,
    World,
    agent_token,
    create_gpu_pod,
    gpu,
    http,
    monitor_policy,
    operator_and_agent,
    pod,
    prepare,
    service_account_token,
    wait_until,
)

from gpuwarden.wire.node import GpuSample, NodeReport, PodRef, Snapshot, dump_report

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024
PROBE_NODE = "probe-node"
"""Where the tests' own reports come from: a node of its own, so they cost the agent's none of its rate."""
PROBE_POD = "probe-0"
"""A GPU pod on PROBE_NODE."""
SHARED = ("shared-busy", "shared-idle")
"""Two pods on one time-sliced GPU: the idle one must be found beside the busy one."""


@dataclass
class Ingest(World):
    token: str
    """The agent's own token: what a well-behaved client sends."""
    probe_token: str
    """A token bound to an agent pod on PROBE_NODE."""

    def post(self, body: bytes, token: str | None = None, **headers: str) -> tuple[int, Any, Any]:
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        headers.setdefault("Content-Type", "application/json")
        status, payload = http("POST", self.operator.url, body, headers)
        return status, payload, None

    def probe(self, body: bytes, **headers: str) -> tuple[int, Any]:
        status, payload, _ = self.post(body, token=self.probe_token, **headers)
        return status, payload


def good_report(
    node: str = AGENT_NODE,
    seq: int = 0,
    t: float | None = None,
    *,
    namespace: str = "elsewhere",
    name: str = "p",
    util: float = 50.0,
) -> bytes:
    """One snapshot of GPU-test, taken now (or at ``t``), of pod ``namespace/name``."""
    gpu_sample = GpuSample(
        uuid="GPU-test",
        index=0,
        utilization_gpu=util,
        temperature_c=40.0,
        power_watts=100.0,
        memory_used_bytes=2**30,
        pods=[PodRef(namespace=namespace, name=name)],
    )
    report = NodeReport(
        schema_version=1,
        node=node,
        agent_id="test",
        seq=seq,
        snapshots=[Snapshot(timestamp=time.time() if t is None else t, gpus=[gpu_sample])],
    )
    return dump_report(report)


_seqs = iter(range(1, 1_000_000))


def probe_report(world: Ingest, **kw: Any) -> bytes:
    """A report from PROBE_NODE about its own pod (unless told otherwise), with a fresh seq."""
    kw.setdefault("namespace", world.namespace)
    kw.setdefault("name", PROBE_POD)
    return good_report(PROBE_NODE, next(_seqs), **kw)


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
    create_gpu_pod(cp, setup.namespace, PROBE_POD, {"app": "probe"}, node=PROBE_NODE)
    probe_token = agent_token(cp, setup.namespace, PROBE_NODE)
    limits = [f"--max-body-bytes={MAX_BODY}", "--node-rate=20"]
    with operator_and_agent(setup, scenario, extra_args=limits) as (operator, agent):
        yield Ingest(cp, setup.namespace, operator, agent, setup.token, probe_token)


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


def test_an_agent_token_bound_to_no_pod_is_403(world: Ingest) -> None:
    """Issue 19 (1): such a token could report as any node."""
    unbound = service_account_token(world.cp, world.namespace, AGENT_SA)
    status, payload, _ = world.post(good_report(), token=unbound)
    assert (status, payload["reason"]) == (403, "Forbidden")
    assert "bound to no pod" in payload["message"]


def test_a_pod_bound_token_reports_for_its_pods_node_only(world: Ingest) -> None:
    status, payload = world.probe(good_report(node=AGENT_NODE))
    assert (status, payload["reason"]) == (403, "Forbidden")
    assert f"on node {PROBE_NODE}, not {AGENT_NODE}" in payload["message"]


def pod_gpu_util(world: Ingest, pod_name: str) -> float | None:
    """The exported utilization of ``pod_name``'s GPU-test (labels in whatever order they come)."""
    wanted = {f'namespace="{world.namespace}"', f'pod="{pod_name}"', 'gpu="GPU-test"'}
    for key, value in world.operator.metrics().items():
        name, _, labels = key.partition("{")
        if name == "gpuwarden_pod_gpu_utilization_percent" and set(labels[:-1].split(",")) == wanted:
            return value
    return None


def test_a_report_from_the_future_is_refused_and_does_not_freeze_the_pods_series(world: Ingest) -> None:
    """Issue 19 (1): one report at 1e12 made every later real report for that GPU store nothing."""
    before = world.operator.metric('gpuwarden_operator_points_refused_total{reason="future"}')
    status, payload = world.probe(probe_report(world, t=1e12, util=77.0))
    assert (status, payload) == (200, {"accepted": 0, "duplicate": False, "refused": {"future": 1}})
    status, payload = world.probe(probe_report(world, util=33.0))
    assert (status, payload) == (200, {"accepted": 1, "duplicate": False, "refused": {}})
    assert pod_gpu_util(world, PROBE_POD) == 33.0
    assert world.operator.metric('gpuwarden_operator_points_refused_total{reason="future"}') == before + 1


def test_readings_of_a_pod_on_another_node_are_refused(world: Ingest) -> None:
    """Issue 19 (1): any agent could write any pod's series. notebook-0 runs on the agent's node."""
    status, payload = world.probe(probe_report(world, name="notebook-0"))
    assert (status, payload) == (200, {"accepted": 0, "duplicate": False, "refused": {"foreignPod": 1}})
    status, payload = world.probe(probe_report(world, name="no-such-pod"))
    assert (status, payload) == (200, {"accepted": 0, "duplicate": False, "refused": {"unknownPod": 1}})
    assert pod_gpu_util(world, "notebook-0") is None  # only the agent's GPU has its readings
    assert world.operator.metric('gpuwarden_operator_points_refused_total{reason="foreignPod"}') >= 1


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
        # Issue 19 (6): accepted with 200 before.
        (good_report().replace(b'"temperatureC":40.0', b'"temperatureC":NaN'), "temperatureC"),
        (good_report().replace(b'"powerWatts":100.0', b'"powerWatts":Infinity'), "powerWatts"),
        (good_report().replace(b'"powerWatts":100.0', b'"powerWatts":-Infinity'), "powerWatts"),
        (good_report().replace(b'"schemaVersion":1', b'"schemaVersion":"1"'), "schemaVersion"),
        (good_report().replace(b'"schemaVersion":1', b'"schemaVersion":1.0'), "schemaVersion"),
        (
            good_report().replace(b'"memoryUsedBytes":1073741824', b'"memoryUsedBytes":' + b"1" + b"0" * 30),
            "memoryUsedBytes",
        ),
        # Issue 19 (5): a 500 after the seq was booked.
        (
            good_report().replace(b'"memoryUsedBytes":1073741824', b'"memoryUsedBytes":' + b"9" * 4000),
            "memoryUsedBytes",
        ),
        # Issue 19 (2): overflowed the Prometheus client, every scrape a 500 from then on.
        (good_report(t=1.8e9).replace(b'"timestamp":1800000000.0', b'"timestamp":1e308'), "timestamp"),
    ],
)
def test_malformed_reports_are_400_with_the_reason(world: Ingest, body: bytes, says: str) -> None:
    status, payload, _ = world.post(body, token=world.token)
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert says in payload["message"]


def test_a_corrupt_deflate_body_is_400(world: Ingest) -> None:
    """Issue 19 (5): a 500 with a traceback before."""
    packed = zlib.compress(probe_report(world))
    corrupt = packed[:10] + bytes(b ^ 0x5A for b in packed[10:])
    status, payload = world.probe(corrupt, **{"Content-Encoding": "deflate"})
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert world.probe(zlib.compress(probe_report(world)), **{"Content-Encoding": "deflate"})[0] == 200


def test_one_token_claiming_thousands_of_nodes_is_refused_and_limited(world: Ingest) -> None:
    """Issue 19 (3): limited by the claimed name, none of 60,000 names got a 429."""
    before = world.operator.metric('gpuwarden_operator_reports_rejected_total{reason="rate_limited"}')
    statuses = [world.probe(good_report(node=f"claimed-{i}", seq=i))[0] for i in range(300)]
    assert set(statuses) == {403, 429}
    assert statuses.count(429) > 100  # the token's node's bucket: 20, and 20 more a second
    after = world.operator.metric('gpuwarden_operator_reports_rejected_total{reason="rate_limited"}')
    assert after - before == statuses.count(429)


def test_oversized_body_is_413(world: Ingest) -> None:
    status, payload, _ = world.post(b"{" + b" " * MAX_BODY + b"}", token=world.token)
    assert (status, payload["reason"]) == (413, "TooLarge")


def test_a_node_over_its_rate_gets_429_with_retry_after(world: Ingest) -> None:
    chatty = agent_token(world.cp, world.namespace, "chatty-node")
    statuses = [world.post(good_report(node="chatty-node", seq=i), token=chatty)[0] for i in range(100)]
    assert statuses[:20] == [200] * 20  # the burst: a second's worth
    assert 429 in statuses


def test_good_agent_is_served_through_all_that(world: Ingest) -> None:
    # Hammer the endpoint with bad requests from a thread (another node's agent gone bad, and no token
    # at all) while waiting for the agent's finding.
    stop = threading.Event()
    rogue = agent_token(world.cp, world.namespace, "rogue-node")

    def hammer() -> None:
        bodies = [b"{", b"x" * (MAX_BODY + 10), json.dumps({"schemaVersion": 2}).encode()]
        i = 0
        while not stop.is_set():
            world.post(bodies[i % len(bodies)], token=rogue if i % 2 else None)
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


def test_metrics_pass_promtool_and_readiness_holds_after_all_that(world: Ingest) -> None:
    """Issue 19 (2): after the reports above, /metrics must still be served, and parse."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if in_ci():
            pytest.fail("promtool is missing; CI must have it (hack/ensure-system-deps.sh)")
        pytest.skip("promtool is not installed (hack/ensure-system-deps.sh)")
    base = f"http://127.0.0.1:{world.operator.metrics_port}"
    status, text = http("GET", f"{base}/metrics")
    assert status == 200
    assert "gpuwarden_pod_gpu_utilization_percent" in text
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert http("GET", f"{base}/readyz")[0] == 200

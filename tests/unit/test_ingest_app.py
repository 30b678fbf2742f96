"""POST /v1/reports against the real aiohttp app: every refusal with its status and reason, and good
reports served in between."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpuwarden.agent.scenario import ScenarioAttributor, ScriptedBackend, load_scenario
from gpuwarden.agent.snapshots import Sampler, SnapshotRing
from gpuwarden.nodereport import SCHEMA_VERSION, GpuSample, NodeReport, PodRef, Snapshot, dump_report
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.ingest import make_ingest_app
from gpuwarden.operator.state import OperatorState, PolicyKey
from gpuwarden.policy import PodView, PolicyEvaluator
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.series import SeriesKey

AGENT = "system:serviceaccount:gpuwarden-system:gpuwarden-agent"
T0 = 1_800_000_000.0


class FakeApi:
    """Answers TokenReviews from a table: token -> username (None: not authenticated)."""

    def __init__(self) -> None:
        self.users: dict[str, str | None] = {"good": AGENT, "other": "system:serviceaccount:default:intruder"}
        self.reviews = 0
        self.down = False

    async def create_token_review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        self.reviews += 1
        if self.down:
            raise ConnectionError("the API server is away")
        user = self.users.get(token)
        if user is None:
            return {"authenticated": False, "error": "invalid bearer token"}
        return {"authenticated": True, "audiences": audiences, "user": {"username": user}}


def report(
    node: str = "node-1", seq: int = 0, t: float = T0, agent: str = "agent-a", **kw: Any
) -> NodeReport:
    gpu = GpuSample(
        uuid="GPU-1",
        index=0,
        utilization_gpu=kw.get("util", 42.0),
        memory_used_bytes=2**30,
        memory_total_bytes=80 * 2**30,
        pods=[PodRef(namespace="ns", name=kw.get("pod", "pod-a"))],
    )
    snaps = [Snapshot(timestamp=t + i, gpus=[gpu]) for i in range(kw.get("snapshots", 1))]
    return NodeReport(schema_version=1, node=node, agent_id=agent, seq=seq, snapshots=snaps)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[TestClient[Any, Any], OperatorState, FakeApi]]:
    api = FakeApi()
    config = OperatorConfig(max_body_bytes=64 * 1024, node_rate=5.0)
    state = OperatorState(config, api=api)  # type: ignore[arg-type]
    state.leadership.active = True
    client = TestClient(TestServer(make_ingest_app(state.ingest)))
    await client.start_server()
    try:
        yield client, state, api
    finally:
        await client.close()


async def post(
    client: TestClient[Any, Any], body: bytes | str, token: str | None = "good", **headers: str
) -> Any:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    rsp = await client.post("/v1/reports", data=body, headers=headers)
    payload = await rsp.json()
    return rsp.status, payload, rsp.headers


def rejected(state: OperatorState, reason: str) -> float:
    return (
        state.metrics.registry.get_sample_value(
            "gpuwarden_operator_reports_rejected_total", {"reason": reason}
        )
        or 0
    )


async def test_a_good_report_is_stored(setup: Any) -> None:
    client, state, _ = setup
    status, body, _ = await post(client, dump_report(report(snapshots=3)))
    assert (status, body) == (200, {"accepted": 3, "duplicate": False})
    window = state.store.window(SeriesKey("ns", "pod-a", "GPU-1"))
    assert window is not None
    assert len(window) == 3
    assert state.metrics.registry.get_sample_value("gpuwarden_operator_reports_total") == 1


@pytest.mark.parametrize(
    ("token", "status", "reason", "metric"),
    [
        (None, 401, "Unauthenticated", "unauthenticated"),
        ("nonsense", 401, "Unauthenticated", "unauthenticated"),
        ("other", 403, "Forbidden", "forbidden"),
    ],
)
async def test_tokens(setup: Any, token: str | None, status: int, reason: str, metric: str) -> None:
    client, state, _ = setup
    got, body, headers = await post(client, dump_report(report()), token=token)
    assert (got, body["reason"]) == (status, reason)
    assert rejected(state, metric) == 1
    if status == 401:
        assert headers["WWW-Authenticate"].startswith("Bearer")


async def test_basic_auth_is_no_bearer_token(setup: Any) -> None:
    client, _, _ = setup
    rsp = await client.post("/v1/reports", data=b"{}", headers={"Authorization": "Basic Zm9vOmJhcg=="})
    assert rsp.status == 401


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "Invalid JSON"),
        (b"[]", "body"),
        (json.dumps({"schemaVersion": 1, "node": "n"}).encode(), "agentId"),
        (
            dump_report(report()).replace(b'"schemaVersion":1', b'"schemaVersion":99'),
            "schemaVersion: 99 is not supported",
        ),
        (dump_report(report()).replace(b'"uuid"', b'"uuidx"'), "uuid"),
    ],
)
async def test_bad_reports_get_400_with_the_field(setup: Any, body: bytes, says: str) -> None:
    client, state, _ = setup
    status, payload, _ = await post(client, body)
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert says in payload["message"]
    assert rejected(state, "invalid") == 1


async def test_oversized_by_content_length(setup: Any) -> None:
    client, state, _ = setup
    status, payload, _ = await post(client, b"x" * (64 * 1024 + 1))
    assert (status, payload["reason"]) == (413, "TooLarge")
    assert rejected(state, "too_large") == 1


async def test_oversized_while_streaming_without_content_length(setup: Any) -> None:
    client, _, _ = setup

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"x" * 1024

    rsp = await client.post("/v1/reports", data=chunks(), headers={"Authorization": "Bearer good"})
    assert rsp.status == 413
    assert (await rsp.json())["reason"] == "TooLarge"


async def test_rate_limited_per_node_with_retry_after(setup: Any) -> None:
    client, state, _ = setup
    statuses = [(await post(client, dump_report(report(seq=i, t=T0 + i))))[0] for i in range(5)]
    assert statuses == [200] * 5
    status, payload, headers = await post(client, dump_report(report(seq=5, t=T0 + 5)))
    assert (status, payload["reason"]) == (429, "RateLimited")
    assert int(headers["Retry-After"]) >= 1
    # Another node is not affected.
    assert (await post(client, dump_report(report(node="node-2"))))[0] == 200
    assert rejected(state, "rate_limited") == 1


async def test_duplicates_are_acknowledged_and_ignored_and_replays_accepted(setup: Any) -> None:
    client, state, _ = setup
    first = dump_report(report(seq=7, t=T0 + 10))
    assert (await post(client, first))[1] == {"accepted": 1, "duplicate": False}
    assert (await post(client, first))[1] == {"accepted": 0, "duplicate": True}
    # A restarted agent (new id) replays older snapshots: accepted, stored only where newer.
    replay = dump_report(report(seq=0, t=T0 + 5, agent="agent-b", snapshots=10))
    assert (await post(client, replay))[1] == {"accepted": 4, "duplicate": False}  # T0+11..14
    assert state.metrics.registry.get_sample_value("gpuwarden_operator_reports_duplicate_total") == 1


async def test_standby_answers_503(setup: Any) -> None:
    client, state, _ = setup
    state.leadership.active = False
    status, payload, headers = await post(client, dump_report(report()))
    assert (status, payload["reason"], headers["Retry-After"]) == (503, "Standby", "1")


async def test_token_review_outage_is_503_and_not_cached(setup: Any) -> None:
    client, _, api = setup
    api.down = True
    status, payload, _ = await post(client, dump_report(report()))
    assert (status, payload["reason"]) == (503, "AuthUnavailable")
    api.down = False
    assert (await post(client, dump_report(report())))[0] == 200


async def test_reviews_are_cached(setup: Any) -> None:
    client, _, api = setup
    for i in range(5):
        await post(client, dump_report(report(node=f"n{i}")))
    assert api.reviews == 1


async def test_bad_reports_never_cost_good_ones(setup: Any) -> None:
    client, state, _ = setup
    bodies = [b"{", dump_report(report(node="a")), b"x" * 70_000, dump_report(report(node="b"))]
    results = [(await post(client, b))[0] for b in bodies]
    assert results == [400, 200, 413, 200]
    window = state.store.window(SeriesKey("ns", "pod-a", "GPU-1"))
    assert window is not None
    assert len(window) == 1


async def test_an_internal_error_is_a_500_for_that_report_only(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, state, _ = setup

    def explode(_: NodeReport) -> int:
        raise RuntimeError("bug")

    monkeypatch.setattr(state.ingest, "accept", explode)
    status, payload, _ = await post(client, dump_report(report()))
    assert (status, payload["reason"]) == (500, "InternalError")
    monkeypatch.undo()
    assert (await post(client, dump_report(report(seq=1, t=T0 + 1))))[0] == 200


async def test_reports_wake_the_policies_of_their_namespace(setup: Any) -> None:
    client, state, _ = setup
    here = state.open_policy(PolicyKey("ns", "p"))
    there = state.open_policy(PolicyKey("elsewhere", "p"))
    await post(client, dump_report(report()))
    assert here.data_pending
    assert not there.data_pending


async def test_namespaces_out_of_scope_are_not_kept() -> None:
    state = OperatorState(OperatorConfig(namespaces=("other",)), api=FakeApi())  # type: ignore[arg-type]
    assert state.accept(report()) == 0
    assert len(state.store) == 0


async def test_an_idle_pod_beside_a_busy_one_on_a_shared_gpu_is_found_through_the_ingest(setup: Any) -> None:
    # The agent's own loop (the scripted backend, per-process utilization every 10 s, the
    # scenario's attribution) sends shared-gpu to the ingest; the operator's engine judges the
    # store. On GPU 0 the notebook's process runs no kernel beside the saturated server, and
    # embed-0 was allocated a replica it runs nothing on; on GPU 1 nothing is read per process.
    client, state, _ = setup
    clock = [T0]
    backend = ScriptedBackend(load_scenario("shared-gpu"), origin=T0)
    backend.open()
    sampler = Sampler(backend, SnapshotRing(), clock=lambda: clock[0])
    attributor = ScenarioAttributor(backend)
    snapshots = []
    for t in range(91):
        clock[0] = T0 + t
        snapshots.append(attributor.annotate(sampler.sample_once(with_processes=t % 10 == 0).snapshot))
    for seq, start in enumerate(range(0, 91, 30)):  # batched, as the agent sends after an outage
        batch = snapshots[start : start + 30]
        body = dump_report(
            NodeReport(schema_version=SCHEMA_VERSION, node="n", agent_id="a", seq=seq, snapshots=batch)
        )
        assert (await post(client, body))[0] == 200
    spec = parse_spec(
        {
            "selector": {},
            "rules": [
                {"name": "idle", "utilizationFloor": {"percent": 10, "for": "1m"}},
                {"name": "hot", "utilizationCeiling": {"percent": 90, "for": "1m"}},
            ],
        }
    )
    pods = [PodView(p.ref.namespace, p.ref.name) for p in backend.scenario.pods]
    evaluation = PolicyEvaluator("default/shared", spec).evaluate(pods, state.store, T0 + 90)
    found = {(f.rule, f.pod): f.message for f in evaluation.active}
    assert sorted(found) == [("hot", "llm-server-0"), ("idle", "embed-0"), ("idle", "notebook-0")]
    assert found["idle", "notebook-0"] == "mean per-process SM utilization 0% over 1m, floor 10%"
    nothing = (
        "mean per-process SM utilization (no process of its own on the shared GPU) 0% over 1m, floor 10%"
    )
    assert found["idle", "embed-0"] == nothing
    assert found["hot", "llm-server-0"].startswith("mean per-process SM utilization 9")
    # Each pod's memory on the shared GPU is its processes' sum, not the device's.
    window = state.store.window(
        SeriesKey("research", "notebook-0", "GPU-5a1b2c3d-0e1f-4a2b-8c3d-4e5f6a7b8c01")
    )
    assert window is not None
    assert window.points()[-1].mem_used == pytest.approx(10 * 2**30, rel=1e-3)

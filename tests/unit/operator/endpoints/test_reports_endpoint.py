"""POST /v1/reports against the real aiohttp app: every refusal with its status and reason, the wire's
bounds (types, timestamps, the reporting node and its pods), and good reports served in between."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from operator_fakes import T0, Clock, ReviewApi, report

from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend
from gpuwarden.agent.snapshots import Sampler, SnapshotRing
from gpuwarden.operator.admission import MAX_FUTURE_SKEW, MAX_GPUS_PER_POD, MAX_REPORT_AGE
from gpuwarden.operator.composition import Operator, build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints.reports import (
    AGENTS_PER_NODE,
    SEQ_WINDOW,
    ReportBook,
    make_ingest_app,
)
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.state import OperatorState
from gpuwarden.policy import PodView, PolicyEvaluator
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.store.series import SeriesKey
from gpuwarden.sim.scenario import load_scenario
from gpuwarden.wire.node import (
    SCHEMA_VERSION,
    GpuHealth,
    GpuSample,
    NodeReport,
    PodRef,
    Snapshot,
    XidEvent,
    dump_report,
)


def pod_index(state: OperatorState) -> None:
    """What Kopf's pod index says, synced: pod-a runs on node-1, pod-b on node-2."""
    state.pod_nodes = {("ns", "pod-a"): ["node-1"], ("ns", "pod-b"): ["node-2"]}
    state.pods_synced = True


@pytest.fixture
async def setup() -> AsyncIterator[tuple[TestClient[Any, Any], Operator, ReviewApi]]:
    api = ReviewApi()
    config = OperatorConfig(max_body_bytes=64 * 1024, node_rate=5.0)
    op = build_operator(config, api=api, clock=Clock())  # type: ignore[arg-type]
    op.parts.shard.active = True
    pod_index(op.state)
    client = TestClient(TestServer(make_ingest_app(op.ingest)))
    await client.start_server()
    try:
        yield client, op, api
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


def rejected(op: Operator, reason: str) -> float:
    return (
        op.parts.metrics.registry.get_sample_value(
            "gpuwarden_operator_reports_rejected_total", {"reason": reason}
        )
        or 0
    )


def refused(op: Operator, reason: str) -> float:
    get = op.parts.metrics.registry.get_sample_value
    return get("gpuwarden_operator_points_refused_total", {"reason": reason}) or 0


def stored(op: Operator, pod: str = "pod-a") -> list[float]:
    window = op.state.store.window(SeriesKey("ns", pod, "GPU-1"))
    return [] if window is None else [p.t for p in window.points()]


async def test_a_good_report_is_stored(setup: Any) -> None:
    client, op, _ = setup
    status, body, _ = await post(client, dump_report(report(snapshots=3)))
    assert (status, body) == (200, {"accepted": 3, "duplicate": False, "refused": {}})
    window = op.state.store.window(SeriesKey("ns", "pod-a", "GPU-1"))
    assert window is not None
    assert len(window) == 3
    assert op.parts.metrics.registry.get_sample_value("gpuwarden_operator_reports_total") == 1


@pytest.mark.parametrize(
    ("token", "status", "reason", "metric"),
    [
        (None, 401, "Unauthenticated", "unauthenticated"),
        ("nonsense", 401, "Unauthenticated", "unauthenticated"),
        ("other", 403, "Forbidden", "forbidden"),
        ("unbound", 403, "Forbidden", "forbidden"),  # could claim any node
    ],
)
async def test_tokens(setup: Any, token: str | None, status: int, reason: str, metric: str) -> None:
    client, op, _ = setup
    got, body, headers = await post(client, dump_report(report()), token=token)
    assert (got, body["reason"]) == (status, reason)
    assert rejected(op, metric) == 1
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
    client, op, _ = setup
    status, payload, _ = await post(client, body)
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert says in payload["message"]
    assert rejected(op, "invalid") == 1


async def test_oversized_by_content_length(setup: Any) -> None:
    client, op, _ = setup
    status, payload, _ = await post(client, b"x" * (64 * 1024 + 1))
    assert (status, payload["reason"]) == (413, "TooLarge")
    assert rejected(op, "too_large") == 1


async def test_oversized_while_streaming_without_content_length(setup: Any) -> None:
    client, _, _ = setup

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"x" * 1024

    rsp = await client.post("/v1/reports", data=chunks(), headers={"Authorization": "Bearer good"})
    assert rsp.status == 413
    assert (await rsp.json())["reason"] == "TooLarge"


async def test_rate_limited_per_node_with_retry_after(setup: Any) -> None:
    client, op, _ = setup
    statuses = [(await post(client, dump_report(report(seq=i, t=T0 + i))))[0] for i in range(5)]
    assert statuses == [200] * 5
    status, payload, headers = await post(client, dump_report(report(seq=5, t=T0 + 5)))
    assert (status, payload["reason"]) == (429, "RateLimited")
    assert int(headers["Retry-After"]) >= 1
    # Another node is not affected.
    assert (await post(client, dump_report(report(node="node-2", pod="pod-b")), token="good-2"))[0] == 200
    assert rejected(op, "rate_limited") == 1


async def test_claimed_node_names_cost_no_state_and_do_not_escape_the_limit(setup: Any) -> None:
    """Issue 19 (3): one token, thousands of node names. Limit and duplicate book are the token's node's."""
    client, op, _ = setup
    statuses = [
        (await post(client, dump_report(report(node=f"claimed-{i}", seq=i, t=T0 + i))))[0]
        for i in range(2000)
    ]
    assert statuses[:5] == [403] * 5  # a name not the token's node's: refused...
    assert 200 not in statuses
    assert statuses.count(429) > 1500  # ...and counted against the token's node, like any report
    assert len(op.ingest.limiter) == 1
    assert len(op.ingest.book) == 0
    assert len(op.state.store) == 0


async def test_duplicates_are_acknowledged_and_ignored_and_replays_accepted(setup: Any) -> None:
    client, op, _ = setup
    first = dump_report(report(seq=7, t=T0 + 10))
    assert (await post(client, first))[1] == {"accepted": 1, "duplicate": False, "refused": {}}
    assert (await post(client, first))[1] == {"accepted": 0, "duplicate": True, "refused": {}}
    # A restarted agent (new id) replays older snapshots: accepted, stored only where newer.
    replay = dump_report(report(seq=0, t=T0 + 5, agent="agent-b", snapshots=10))
    assert (await post(client, replay))[1] == {"accepted": 4, "duplicate": False, "refused": {}}
    assert op.parts.metrics.registry.get_sample_value("gpuwarden_operator_reports_duplicate_total") == 1


async def test_standby_answers_503(setup: Any) -> None:
    client, op, _ = setup
    op.parts.shard.active = False
    status, payload, headers = await post(client, dump_report(report()))
    assert (status, payload["reason"], headers["Retry-After"]) == (503, "Standby", "1")


async def test_standby_closes_the_connection(setup: Any) -> None:
    """An agent's keep-alive connection to a replica that stopped acting is closed with the answer:
    kept, its retries would stay on that replica for ever (connection tracking keeps a Service's
    connection on its pod), never reaching the one that acts."""
    client, op, _ = setup
    op.parts.shard.active = False
    body = dump_report(report())
    request = (
        b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    try:
        writer.write(request)
        # The whole answer and then end-of-file, well before the server's keep-alive timeout.
        answer = await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert b"\r\nConnection: close\r\n" in answer


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
        assert (await post(client, dump_report(report(seq=i, t=T0 + i))))[0] == 200
    assert api.reviews == 1


async def test_bad_reports_never_cost_good_ones(setup: Any) -> None:
    client, op, _ = setup
    bodies = [b"{", dump_report(report()), b"x" * 70_000, dump_report(report(seq=1, t=T0 + 1))]
    results = [(await post(client, b))[0] for b in bodies]
    assert results == [400, 200, 413, 200]
    assert stored(op) == [T0, T0 + 1]


async def test_an_internal_error_is_a_500_counted_and_its_retry_is_stored(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 (5): a 500 must not record the seq, or the agent's retry is answered duplicate and lost."""
    client, op, _ = setup

    def explode(*_: Any) -> Any:
        raise RuntimeError("bug")

    body = dump_report(report(seq=3))
    monkeypatch.setattr(op.ingest.admission, "accept", explode)
    status, payload, _ = await post(client, body)
    assert (status, payload["reason"]) == (500, "InternalError")
    assert rejected(op, "internal") == 1
    monkeypatch.undo()
    status, payload, _ = await post(client, body)  # the agent's retry: same seq, same snapshots
    assert (status, payload) == (200, {"accepted": 1, "duplicate": False, "refused": {}})
    assert stored(op) == [T0]


async def test_a_4000_digit_integer_is_a_400_not_a_500_and_loses_nothing(setup: Any) -> None:
    """Issue 19 (5): it overflowed float() in intake after the seq was booked."""
    client, _, _ = setup
    huge = dump_report(report(seq=3)).replace(
        b'"memoryUsedBytes":1073741824', b'"memoryUsedBytes":' + b"9" * 4000
    )
    status, payload, _ = await post(client, huge)
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert "memoryUsedBytes" in payload["message"]
    # The same seq, now valid, is stored: nothing was booked for the refused one.
    assert (await post(client, dump_report(report(seq=3))))[1]["accepted"] == 1


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
async def test_a_corrupt_compressed_body_is_a_400(setup: Any, encoding: str) -> None:
    client, op, _ = setup
    packed = zlib.compress(dump_report(report()))
    corrupt = packed[:10] + bytes(b ^ 0x5A for b in packed[10:])
    status, payload, _ = await post(client, corrupt, **{"Content-Encoding": encoding})
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert encoding in payload["message"]
    assert rejected(op, "internal") == 0
    # The client's next request is served (on a new connection: that one was closed).
    assert (await post(client, dump_report(report())))[0] == 200


async def test_a_compression_bomb_is_413_after_inflating_no_more_than_the_limit(setup: Any) -> None:
    client, _, _ = setup
    bomb = gzip.compress(b" " * (64 * 2**20))  # 64 MiB of spaces in 64 KiB
    assert len(bomb) < 64 * 1024
    status, payload, _ = await post(client, bomb, **{"Content-Encoding": "gzip"})
    assert (status, payload["reason"]) == (413, "TooLarge")


@pytest.mark.parametrize(
    ("body", "encoding", "status", "reason"),
    [
        (zlib.compress(b"{}")[:-3], "deflate", 400, "InvalidReport"),  # truncated
        (b"{}", "br", 415, "UnsupportedEncoding"),
    ],
)
async def test_encodings_we_cannot_decode(
    setup: Any, body: bytes, encoding: str, status: int, reason: str
) -> None:
    client, _, _ = setup
    got, payload, _ = await post(client, body, **{"Content-Encoding": encoding})
    assert (got, payload["reason"]) == (status, reason)


async def test_a_corrupt_body_refused_before_reading_it_costs_the_connection_nothing(
    setup: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the fuzzer: aiohttp drained the unread body after our 403, failed to decode it, logged an
    unhandled error and dropped the connection the client was about to reuse."""
    client, _, _ = setup
    corrupt = b"x\x9c" + bytes(range(256)) * 40
    for _ in range(3):
        assert (await post(client, corrupt, token="other", **{"Content-Encoding": "deflate"}))[0] == 403
        assert (await post(client, dump_report(report())))[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_compressed_body_is_read(setup: Any) -> None:
    client, op, _ = setup
    status, _, _ = await post(client, zlib.compress(dump_report(report())), **{"Content-Encoding": "deflate"})
    assert status == 200
    assert stored(op) == [T0]


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        (b'"temperatureC":50.0', b'"temperatureC":NaN', "temperatureC"),
        (b'"temperatureC":50.0', b'"temperatureC":Infinity', "temperatureC"),
        (b'"temperatureC":50.0', b'"temperatureC":-Infinity', "temperatureC"),
        (b'"powerWatts":300.0', b'"powerWatts":NaN', "powerWatts"),
        (b'"powerWatts":300.0', b'"powerWatts":Infinity', "powerWatts"),
        (b'"powerWatts":300.0', b'"powerWatts":1e400', "powerWatts"),  # parses as infinity
        (b'"schemaVersion":1', b'"schemaVersion":"1"', "schemaVersion"),
        (b'"schemaVersion":1', b'"schemaVersion":1.0', "schemaVersion"),
        (b'"schemaVersion":1', b'"schemaVersion":true', "schemaVersion"),
        (
            b'"memoryUsedBytes":1073741824',
            b'"memoryUsedBytes":1000000000000000000000000000000',
            "memoryUsedBytes",
        ),
        (b'"memoryTotalBytes":85899345920', b'"memoryTotalBytes":-1', "memoryTotalBytes"),
        (b'"seq":0', b'"seq":1' + b"0" * 30, "seq"),
        (b'"timestamp":1800000000.0', b'"timestamp":1e308', "timestamp"),
        (b'"timestamp":1800000000.0', b'"timestamp":"1800000000"', "timestamp"),
        (b'"index":0', b'"index":0.0', "index"),
    ],
)
async def test_wire_types_are_strict_and_bounded(setup: Any, old: bytes, new: bytes, field: str) -> None:
    """Issue 19 (6), and (2)'s 1e308 timestamp that overflowed the Prometheus client."""
    client, op, _ = setup
    body = dump_report(report(temperature=50.0, power=300.0))
    assert old in body
    status, payload, _ = await post(client, body.replace(old, new))
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert field in payload["message"]
    assert len(op.state.store) == 0


def health_report(t: float = T0, xid_t: float = T0) -> NodeReport:
    """Version 2: GPU-1 with an XID 79 and an uncorrected ECC count."""
    gpu = (
        report()
        .snapshots[0]
        .gpus[0]
        .model_copy(
            update={
                "health": GpuHealth(xids=[XidEvent(code=79, timestamp=xid_t)], ecc_uncorrected_aggregate=1)
            }
        )
    )
    return NodeReport(
        schema_version=2, node="node-1", agent_id="a", seq=0, snapshots=[Snapshot(timestamp=t, gpus=[gpu])]
    )


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        (b'"code":79,"timestamp":1800000000.0', b'"code":79,"timestamp":1e308', "timestamp"),
        (b'"code":79,"timestamp":1800000000.0', b'"code":79,"timestamp":NaN', "timestamp"),
        (
            b'"eccUncorrectedAggregate":1',
            b'"eccUncorrectedAggregate":' + b"9" * 4000,
            "eccUncorrectedAggregate",
        ),
        (b'"eccUncorrectedAggregate":1', b'"eccUncorrectedAggregate":1.0', "eccUncorrectedAggregate"),
    ],
)
async def test_health_is_bounded_too(setup: Any, old: bytes, new: bytes, field: str) -> None:
    client, op, _ = setup
    body = dump_report(health_report())
    assert old in body
    status, payload, _ = await post(client, body.replace(old, new))
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert field in payload["message"]
    assert op.state.health.gpu("GPU-1", node="node-1") is None


async def test_a_snapshot_from_the_future_gives_the_health_store_nothing(setup: Any) -> None:
    client, op, _ = setup
    assert (await post(client, dump_report(health_report(t=1e12))))[1]["refused"] == {"future": 1}
    assert op.state.health.gpu("GPU-1", node="node-1") is None
    assert (await post(client, dump_report(health_report().model_copy(update={"seq": 1}))))[0] == 200
    record = op.state.health.gpu("GPU-1", node="node-1")
    assert record is not None
    assert (record.node, [code for _, code in record.xids]) == ("node-1", [79])


async def test_a_timestamp_from_the_future_is_refused_and_never_freezes_a_series(setup: Any) -> None:
    """Issue 19 (1): one report at 1e12 made every later real report store nothing."""
    client, op, _ = setup
    status, payload, _ = await post(client, dump_report(report(seq=0, t=1e12)))
    assert (status, payload) == (200, {"accepted": 0, "duplicate": False, "refused": {"future": 1}})
    assert refused(op, "future") == 1
    for i in range(1, 4):
        assert (await post(client, dump_report(report(seq=i, t=T0 + i))))[1]["accepted"] == 1
    assert stored(op) == [T0 + 1, T0 + 2, T0 + 3]
    assert "1000000000000" not in (op.parts.metrics.exposition()).decode()


async def test_the_skew_bounds_are_those_stated(setup: Any) -> None:
    client, op, _ = setup
    now = op.ingest.clock()
    times = [
        now - MAX_REPORT_AGE - 1,
        now - MAX_REPORT_AGE + 1,
        now + MAX_FUTURE_SKEW - 1,
        now + MAX_FUTURE_SKEW + 1,
    ]
    snapshots = [Snapshot(timestamp=t, gpus=report().snapshots[0].gpus) for t in times]
    body = dump_report(NodeReport(schema_version=1, node="node-1", agent_id="a", seq=0, snapshots=snapshots))
    status, payload, _ = await post(client, body)
    assert (status, payload) == (
        200,
        {"accepted": 2, "duplicate": False, "refused": {"past": 1, "future": 1}},
    )
    assert stored(op) == [times[2]]  # (times[1] aged out of the 10-minute retention at once)


async def test_a_pod_on_another_node_is_refused(setup: Any) -> None:
    """Issue 19 (1): any agent could write any pod's series."""
    client, op, _ = setup
    status, payload, _ = await post(client, dump_report(report(pod="pod-b")))  # pod-b runs on node-2
    assert (status, payload) == (200, {"accepted": 0, "duplicate": False, "refused": {"foreignPod": 1}})
    assert refused(op, "foreignPod") == 1
    assert stored(op, "pod-b") == []
    assert (await post(client, dump_report(report(node="node-2", pod="pod-b")), token="good-2"))[1][
        "accepted"
    ] == 1


async def test_an_unknown_pod_is_refused_once_the_index_is_synced(setup: Any) -> None:
    client, op, _ = setup
    op.state.pods_synced = False  # just started: the agents' replays name pods Kopf has not listed yet
    assert (await post(client, dump_report(report(pod="new"))))[1]["accepted"] == 1
    op.state.pods_synced = True
    status, payload, _ = await post(client, dump_report(report(seq=1, t=T0 + 1, pod="ghost")))
    assert (status, payload) == (200, {"accepted": 0, "duplicate": False, "refused": {"unknownPod": 1}})
    assert refused(op, "unknownPod") == 1


async def test_a_report_for_another_node_than_the_tokens_is_403(setup: Any) -> None:
    client, op, _ = setup
    status, payload, _ = await post(client, dump_report(report(node="node-2", pod="pod-b")))
    assert (status, payload["reason"]) == (403, "Forbidden")
    assert "node-1, not node-2" in payload["message"]
    assert len(op.state.store) == 0


async def test_reports_wake_the_policies_of_their_namespace(setup: Any) -> None:
    client, op, _ = setup
    here = op.state.open_policy(PolicyKey("ns", "p"))
    there = op.state.open_policy(PolicyKey("elsewhere", "p"))
    await post(client, dump_report(report()))
    assert here.data_pending
    assert not there.data_pending


async def test_namespaces_out_of_scope_are_not_kept_nor_refused() -> None:
    op = build_operator(OperatorConfig(namespaces=("other",)), api=ReviewApi())  # type: ignore[arg-type]
    pod_index(op.state)
    intake = op.ingest.admission.accept(report(), "node-1", T0)
    assert (intake.stored, intake.refused) == (0, {})
    assert len(op.state.store) == 0


async def test_an_idle_pod_beside_a_busy_one_on_a_shared_gpu_is_found_through_the_ingest(setup: Any) -> None:
    # The agent's own loop (the scripted backend, per-process utilization every 10 s, the
    # scenario's attribution) sends shared-gpu to the ingest; the operator's engine judges the
    # store. On GPU 0 the notebook's process runs no kernel beside the saturated server, and
    # embed-0 was allocated a replica it runs nothing on; on GPU 1 nothing is read per process.
    client, op, _ = setup
    clock = [T0]
    backend = ScriptedBackend(load_scenario("shared-gpu"), origin=T0)
    backend.open()
    sampler = Sampler(backend, SnapshotRing(), clock=lambda: clock[0])
    attributor = ScenarioAttributor(backend)
    snapshots = []
    for t in range(91):
        clock[0] = T0 + t
        snapshots.append(attributor.annotate(sampler.sample_once(with_processes=t % 10 == 0).snapshot))
    # The scenario's pods run on the token's node.
    op.state.pod_nodes = {
        **op.state.pod_nodes,
        **{(p.ref.namespace, p.ref.name): ["node-1"] for p in backend.scenario.pods},
    }
    for seq, start in enumerate(range(0, 91, 30)):  # batched, as the agent sends after an outage
        batch = snapshots[start : start + 30]
        body = dump_report(
            NodeReport(schema_version=SCHEMA_VERSION, node="node-1", agent_id="a", seq=seq, snapshots=batch)
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
    evaluation = PolicyEvaluator("default/shared", spec).evaluate(pods, op.state.store, T0 + 90)
    found = {(f.rule, f.pod): f.message for f in evaluation.active}
    assert sorted(found) == [("hot", "llm-server-0"), ("idle", "embed-0"), ("idle", "notebook-0")]
    assert found["idle", "notebook-0"] == "mean per-process SM utilization 0% over 1m, floor 10%"
    nothing = (
        "mean per-process SM utilization (no process of its own on the shared GPU) 0% over 1m, floor 10%"
    )
    assert found["idle", "embed-0"] == nothing
    assert found["hot", "llm-server-0"].startswith("mean per-process SM utilization 9")
    # Each pod's memory on the shared GPU is its processes' sum, not the device's.
    window = op.state.store.window(
        SeriesKey("research", "notebook-0", "GPU-5a1b2c3d-0e1f-4a2b-8c3d-4e5f6a7b8c01")
    )
    assert window is not None
    assert window.points()[-1].mem_used == pytest.approx(10 * 2**30, rel=1e-3)


# -- issue 27 --------------------------------------------------------------------------------------


async def test_a_forged_seq_jump_holds_no_later_report_back(setup: Any) -> None:
    """Issue 27: the node's token pushed its agent's seq far ahead; the agent's later reports were
    dropped as duplicates."""
    client, _, _ = setup
    assert (await post(client, dump_report(report(seq=2**52, t=T0))))[1]["accepted"] == 1
    status, payload, _ = await post(client, dump_report(report(seq=8, t=T0 + 1)))
    assert (status, payload) == (200, {"accepted": 1, "duplicate": False, "refused": {}})
    assert (await post(client, dump_report(report(seq=8, t=T0 + 1))))[1]["duplicate"] is True


def test_the_seq_book_is_bounded_per_agent_and_per_node() -> None:
    book = ReportBook()
    for seq in range(SEQ_WINDOW + 1):
        book.record("n", report(seq=seq))
    assert not book.is_duplicate("n", report(seq=0))  # fell out of the window
    assert book.is_duplicate("n", report(seq=SEQ_WINDOW))
    for k in range(AGENTS_PER_NODE):
        book.record("n", report(agent=f"restarted-{k}"))
    assert not book.is_duplicate("n", report(seq=SEQ_WINDOW))  # the first agent was forgotten
    assert book.is_duplicate("n", report(agent=f"restarted-{AGENTS_PER_NODE - 1}"))


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
async def test_bytes_after_a_compressed_body_are_refused(setup: Any, encoding: str) -> None:
    """Issue 27: a gzip body with trailing junk was accepted."""
    client, _, _ = setup
    body = dump_report(report())
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    status, payload, _ = await post(client, packed + b"junk", **{"Content-Encoding": encoding})
    assert (status, payload["reason"]) == (400, "InvalidReport")
    assert f"4 bytes after its {encoding} stream" in payload["message"]
    assert (await post(client, packed, **{"Content-Encoding": encoding}))[0] == 200


async def test_a_pods_gpus_are_bounded(setup: Any) -> None:
    """Issue 27 (4): readings of one pod on ever new GPUs made a series each. Here 9 GPUs of 8 MIG
    devices each (every GPU has room for them): the pod gets MAX_GPUS_PER_POD series."""
    client, op, _ = setup
    pod = [PodRef(namespace="ns", name="pod-a")]

    def migs(first: int) -> list[GpuSample]:
        return [
            GpuSample(uuid=f"GPU-{g}", index=g, mig_id=f"MIG-{g}-{m}", utilization_gpu=1.0, pods=pod)
            for g in range(9)
            for m in range(first, first + 4)
        ]

    # A snapshot lists at most 64 devices: the 72 come in two.
    snapshots = [Snapshot(timestamp=T0, gpus=migs(0)), Snapshot(timestamp=T0 + 1, gpus=migs(4))]
    body = NodeReport(schema_version=1, node="node-1", agent_id="a", seq=0, snapshots=snapshots)
    status, payload, _ = await post(client, dump_report(body))
    extra = 9 * 8 - MAX_GPUS_PER_POD
    assert (status, payload["accepted"], payload["refused"]) == (
        200,
        MAX_GPUS_PER_POD,
        {"tooManyGpus": extra},
    )
    assert len(op.state.store.series_of("ns", "pod-a")) == MAX_GPUS_PER_POD
    assert refused(op, "tooManyGpus") == extra


async def test_health_takes_no_foreign_pod_and_no_xid_from_the_future(setup: Any) -> None:
    """Issue 27 (1, 2): node-2 lists node-1's pod on its GPU with an XID, one far ahead."""
    client, op, _ = setup
    gpu = GpuSample(
        uuid="GPU-2",
        index=0,
        pods=[PodRef(namespace="ns", name="pod-a")],
        health=GpuHealth(xids=[XidEvent(code=48, timestamp=T0), XidEvent(code=79, timestamp=1e12)]),
    )
    body = NodeReport(
        schema_version=2, node="node-2", agent_id="a", seq=0, snapshots=[Snapshot(timestamp=T0, gpus=[gpu])]
    )
    status, payload, _ = await post(client, dump_report(body), token="good-2")
    assert (status, payload["refused"]) == (200, {"foreignPod": 1, "future": 1})
    record = op.state.health.gpu("GPU-2", node="node-2")
    assert record is not None
    assert (list(record.xids), record.current) == ([(T0, 48)], ())
    assert op.state.health.gpus_of("ns", "pod-a", since=0) == []

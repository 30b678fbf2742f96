"""The operator's side end to end on the real ingest app: the node's plan in the answer to its agent's
report (read by the agent's own ReportSender and Scraper), and the scrapes a report carries stored only
for pods of the reporting node, within the clock's bounds."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from gpuwarden.agent.metrics import ScrapeMetrics
from gpuwarden.agent.scrape import ListedPod, Scraper
from gpuwarden.agent.sender import ReportSender
from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints import make_ingest_app
from gpuwarden.operator.scrape import AVAILABLE, ServicePod, ServicePolicy, availability
from gpuwarden.operator.state import OperatorState
from gpuwarden.policy import Histogram, LabelSelector, PodId, ServiceScrape
from gpuwarden.wire.node import NodeReport, Snapshot, dump_report
from gpuwarden.wire.scrape import ScrapeFailure, ServiceHistogram, ServiceSample, parse_plan

AGENT = "system:serviceaccount:gpuwarden-system:gpuwarden-agent"
T0 = 1_800_000_000.0
LATENCY = "vllm:e2e_request_latency_seconds"


class Api:
    """TokenReview: the token "node-1" is the agent's on node-1."""

    async def create_token_review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        extra = {
            "authentication.kubernetes.io/node-name": [token],
            "authentication.kubernetes.io/pod-name": ["a"],
        }
        return {"authenticated": True, "audiences": audiences, "user": {"username": AGENT, "extra": extra}}


@pytest.fixture
async def served() -> AsyncIterator[tuple[TestClient[Any, Any], OperatorState]]:
    operator = build_operator(OperatorConfig(), api=Api(), clock=lambda: T0 + 60)  # type: ignore[arg-type]
    operator.parts.shard.active = True
    state = operator.state
    state.pod_nodes = {
        ("serving", "llm-0"): ["node-1"],
        ("serving", "llm-1"): ["node-1"],
        ("serving", "far"): ["node-2"],
    }
    state.pods_synced = True
    state.service_pods = {
        "node-1": [
            ServicePod("serving", "llm-0", "u-0", "127.0.0.1", {"app": "llm"}, annotated_port=8000),
            ServicePod("serving", "llm-1", "u-1", "10.1.0.6", {"app": "llm"}),  # no port anywhere
        ],
        "node-2": [ServicePod("serving", "far", "u-far", "10.2.0.5", {"app": "llm"}, annotated_port=8000)],
    }
    selector = LabelSelector(match_labels=(("app", "llm"),))
    state.service_policies = {"serving": [ServicePolicy("latency", selector, frozenset({LATENCY}), 5.0)]}
    client = TestClient(TestServer(make_ingest_app(operator.ingest)))
    await client.start_server()
    try:
        yield client, state
    finally:
        await client.close()


def report(seq: int, services: list[ServiceSample]) -> bytes:
    snapshot = Snapshot(timestamp=T0, gpus=[], services=services)
    return dump_report(
        NodeReport(schema_version=6, node="node-1", agent_id="a", seq=seq, snapshots=[snapshot])
    )


async def post(client: TestClient[Any, Any], body: bytes) -> dict[str, Any]:
    rsp = await client.post("/v1/reports", data=body, headers={"Authorization": "Bearer node-1"})
    assert rsp.status == 200, await rsp.text()
    answer: dict[str, Any] = await rsp.json()
    return answer


async def test_the_answer_carries_the_nodes_plan_and_only_its_pods(served: Any) -> None:
    client, state = served
    answer = await post(client, report(0, []))
    plan = parse_plan(answer["scrape"])
    assert [(t.name, t.ip, t.port, t.metrics, t.interval_seconds) for t in plan.targets] == [
        ("llm-0", "127.0.0.1", 8000, [LATENCY], 5.0)
    ]
    # The pod with no port gets a NoPort scrape for its policy's condition, once; the other node's pod
    # is not this node's.
    pods = [PodId("serving", n) for n in ("llm-0", "llm-1", "far")]
    assert availability(latest(state), pods) == (
        "False",
        "EndpointsFailing",
        "1 of 1 pods' metrics cannot be read: NoPort 1 (llm-1).",
    )
    duplicate = await post(client, report(0, []))
    assert duplicate["duplicate"] is True
    assert duplicate["scrape"] == answer["scrape"]
    assert len(state.services.scrapes(PodId("serving", "llm-1"))) == 1


async def test_without_a_policy_that_reads_pods_the_answer_has_no_plan(served: Any) -> None:
    client, state = served
    state.service_policies = {}
    answer = await post(client, report(0, []))
    assert answer == {"accepted": 0, "duplicate": False, "refused": {}}


def latest(state: OperatorState) -> Callable[[PodId], ServiceScrape | None]:
    def newest(pod: PodId) -> ServiceScrape | None:
        kept = state.services.scrapes(pod)
        return kept[-1] if kept else None

    return newest


async def test_scrapes_are_stored_for_the_nodes_own_pods_within_the_clocks_bounds(served: Any) -> None:
    client, state = served

    def sample(name: str, at: float = T0, error: ScrapeFailure | None = None) -> ServiceSample:
        histograms = (
            [] if error else [ServiceHistogram(name=LATENCY, bounds=[0.5], counts=[1], count=2, sum=1.5)]
        )
        uid = {"llm-0": "u-0"}.get(name, f"u-{name}")
        return ServiceSample(
            namespace="serving", name=name, uid=uid, at=at, error=error, histograms=histograms
        )

    answer = await post(
        client,
        report(
            0,
            [
                sample("llm-0"),
                sample("llm-0", at=T0 + 1, error=ScrapeFailure.TIMEOUT),
                sample("far"),  # node-2's pod: node-1 may not speak for it
                sample("ghost"),  # no such GPU pod
                sample("llm-0", at=T0 + 3600),  # ahead of the operator's clock
            ],
        ),
    )
    assert answer["refused"] == {"foreignPod": 1, "unknownPod": 1, "future": 1}
    scrapes = state.services.scrapes(PodId("serving", "llm-0"))
    assert [(s.at, s.error) for s in scrapes] == [(T0, None), (T0 + 1, "Timeout")]
    (histogram,) = scrapes[0].histograms.values()
    assert histogram == Histogram((0.5, math.inf), (1.0, 2.0), 1.5)
    assert state.services.scrapes(PodId("serving", "far")) == ()
    assert state.services.scrapes(PodId("serving", "ghost")) == ()


async def test_only_the_pods_and_metrics_the_plan_asks_for_are_kept(served: Any) -> None:
    """Issue 45: with no policy reading the pods' metrics, one node's token sent scrapes of the largest
    legal shape for each of its pods, and the operator kept them all (912 MB)."""
    client, state = served
    big = ServiceHistogram(
        name="junk_seconds", bounds=[float(b) for b in range(64)], counts=[0] * 64, count=0, sum=0
    )
    asked = ServiceHistogram(name=LATENCY, bounds=[0.5], counts=[1], count=2, sum=1.5)

    def sample(name: str, uid: str, at: float) -> ServiceSample:
        return ServiceSample(namespace="serving", name=name, uid=uid, at=at, histograms=[asked, big])

    answer = await post(
        client,
        report(
            0,
            [
                sample("llm-0", "u-0", T0),  # planned: its latency kept, junk_seconds not
                sample("llm-0", "u-old", T0 + 1),  # the pod's name, another pod's uid
                sample("llm-1", "u-1", T0),  # node-1's, selected, but not planned (no port)
            ],
        ),
    )
    assert answer["refused"] == {"notPlanned": 3}
    (kept,) = state.services.scrapes(PodId("serving", "llm-0"))
    assert set(kept.histograms) == {LATENCY}
    assert [s.error for s in state.services.scrapes(PodId("serving", "llm-1"))] == ["NoPort"]

    state.service_policies = {}  # nobody asks any more: nothing is kept
    answer = await post(client, report(1, [sample("llm-0", "u-0", T0 + 2)]))
    assert answer["refused"] == {"notPlanned": 1}
    assert len(state.services.scrapes(PodId("serving", "llm-0"))) == 1


async def test_the_agents_sender_hands_the_plan_to_its_scraper(served: Any, tmp_path: Path) -> None:
    client, _ = served
    token = tmp_path / "token"
    token.write_text("node-1")
    registry = CollectorRegistry()
    listed = {"u-0": ListedPod("serving", "llm-0", frozenset({"127.0.0.1"}))}
    scraper = Scraper(listed.get, ScrapeMetrics(registry))
    sender = ReportSender(
        str(client.make_url("/v1/reports")),
        "node-1",
        token,
        registry=registry,
        on_answer=lambda answer: scraper.accept_plan(answer.get("scrape")),
    )
    sender.submit(Snapshot(timestamp=T0, gpus=[]))
    await sender.flush()
    assert [(t.name, t.port) for t in scraper.targets] == [("llm-0", 8000)]
    assert registry.get_sample_value("gpuwarden_agent_service_targets") == 1
    assert AVAILABLE == "ServiceMetricsAvailable"
    assert json.loads(json.dumps(scraper.targets[0].model_dump(by_alias=True)))["intervalSeconds"] == 5.0

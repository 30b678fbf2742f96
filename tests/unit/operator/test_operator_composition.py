"""The composition root's wiring: not sharded, one shard of one that owns everything and takes no
verdicts; a deleted pod forgotten by the records and the per-pod gauges alike; the scaler, built by
:func:`build_operator` over the operator's API client, posts its Events through the operator's Event
poster like every other Event (looptime: the poster's backoffs take no real time).

The API client is an in-memory API server that serves a Deployment's ``/scale`` and keeps Events by
name, answering as scripted (event_store_support.py; test_kube_events.py tests the poster itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from event_store_support import EventStore
from operator_fakes import T0 as REPORTED
from operator_fakes import report

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.scaling import WorkloadScaler
from gpuwarden.operator.sharding import Leadership, Sharding
from gpuwarden.policy import SeriesKey
from gpuwarden.policy.spec.model import ScaleAction, ScaleDirection, ScaleTargetRef

NS = "inference"
T0 = 1_800_000_000.0
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/llm-server/scale"


@dataclass(frozen=True)
class Saturated:
    """An active finding as the scaler reads it."""

    rule: str
    pod: str


class ApiServer(EventStore):
    """A Deployment of ``replicas`` behind ``/scale``, no HPA, and Events by name, each Event POST
    answered as ``answers`` says (:class:`EventStore`)."""

    def __init__(self, *answers: str, replicas: int = 2) -> None:
        super().__init__(*answers)
        self.replicas = replicas

    async def request(
        self, method: str, path: str, *, body: Mapping[str, Any] | None = None, **_: Any
    ) -> dict[str, Any]:
        if path == SCALE_PATH and method == "GET":
            return self._scale()
        if path == SCALE_PATH and method == "PATCH":
            assert body is not None
            self.replicas = body["spec"]["replicas"]
            return self._scale()
        if path.endswith("/horizontalpodautoscalers"):
            return {"items": []}
        assert body is not None
        return await super().request(method, path, body=dict(body))

    def _scale(self) -> dict[str, Any]:
        return {
            "metadata": {"uid": "uid-target", "resourceVersion": "1"},
            "spec": {"replicas": self.replicas},
        }

    def announced(self) -> list[tuple[str, str]]:
        return sorted((e["involvedObject"]["kind"], e["reason"]) for e in self.events.values())


@pytest.mark.parametrize("shards", [False, True])
async def test_the_mode_is_chosen_once_and_not_sharded_is_a_shard_of_one(shards: bool) -> None:
    mode = {"shards": True, "pod_namespace": "gw"} if shards else {}
    operator = build_operator(OperatorConfig(identity="op-0", **mode))  # type: ignore[arg-type]
    shard = operator.parts.shard
    assert isinstance(shard, Sharding) == shards
    # The runners, the ingest and the services are all given the one shard.
    assert operator.lifecycle.shard is shard
    assert operator.ingest.route == shard.route
    if not shards:
        assert type(shard) is Leadership
        shard.active = True
        assert shard.acting()
        assert shard.route("any-node") is None
        assert shard.owns_node("any-node")
        assert shard.acts_on_policy("ns", "any-policy")
        assert shard.verdicts_to("ns", "any-policy") is None
        assert shard.members() == 0
    # Only a shard of several takes other shards' verdicts: 503 Standby (no view yet), else no route.
    client = TestClient(TestServer(operator.lifecycle.ingest_app))
    await client.start_server()
    try:
        rsp = await client.post("/v1/verdicts", data=b"{}")
        assert rsp.status == (503 if shards else 404)
    finally:
        await client.close()


def test_a_deleted_pod_is_forgotten_by_the_records_and_the_per_pod_gauges() -> None:
    operator = build_operator(OperatorConfig(), clock=lambda: REPORTED + 60)
    operator.ingest.admission.accept(report(pod="pod-a"), "node-1", REPORTED + 60)
    key = SeriesKey("ns", "pod-a", "GPU-1")
    gauges = operator.parts.metrics.latest
    assert operator.state.store.window(key) is not None
    assert len(gauges) == 1
    operator.forget_pod("ns", "pod-a")
    assert operator.state.store.window(key) is None
    assert len(gauges) == 0


def scale_up() -> ScaleAction:
    step = ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=60)
    return ScaleAction(
        target_ref=ScaleTargetRef("apps/v1", "Deployment", "llm-server"),
        min_replicas=1,
        max_replicas=4,
        scale_up_on=("saturated",),
        scale_down_on=(),
        scale_up=step,
        scale_down=step,
    )


@pytest.mark.looptime
async def test_a_scale_whose_events_meet_an_outage_and_an_etcd_stall_announces_each_once() -> None:
    api = ApiServer("unreachable", "stored_then_504")
    operator = build_operator(OperatorConfig(identity="op-0"), api=api, clock=lambda: T0)  # type: ignore[arg-type]
    findings = [Saturated("saturated", "a"), Saturated("saturated", "b")]

    scaler = operator.parts.scaler
    assert isinstance(scaler, WorkloadScaler)  # the runners' scaler, Events through the runners' sink
    outcome = await scaler.reconcile(PolicyKey(NS, "llm-serving"), scale_up(), findings, 2, T0, [])

    assert outcome.applied
    assert api.replicas == 3
    # Queued, not posted inside the evaluation round: the round never waits for the API server.
    assert api.attempts == 0
    posting = asyncio.create_task(operator.lifecycle.events.run())
    try:
        await asyncio.wait_for(operator.lifecycle.events.drain(), timeout=600)
    finally:
        posting.cancel()
    # The policy's Event met no answer, then a stall that stored it: retried under its name, once.
    assert api.attempts == 4
    assert api.announced() == [("Deployment", "ScaledUp"), ("GPUMonitorPolicy", "ScaledUp")]

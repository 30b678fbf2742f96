"""The composition root's wiring: the scaler, built by :func:`build_operator` over the operator's API
client, posts its Events through the operator's Event poster like every other Event (looptime: the
poster's backoffs take no real time).

The API client is an in-memory API server that serves a Deployment's ``/scale`` and keeps Events by
name, answering as scripted (event_store_support.py; test_operator_posting.py tests the poster itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from event_store_support import EventStore

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.scaling import WorkloadScaler
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
    posting = asyncio.create_task(operator.services.events.run())
    try:
        await asyncio.wait_for(operator.services.events.drain(), timeout=600)
    finally:
        posting.cancel()
    # The policy's Event met no answer, then a stall that stored it: retried under its name, once.
    assert api.attempts == 4
    assert api.announced() == [("Deployment", "ScaledUp"), ("GPUMonitorPolicy", "ScaledUp")]

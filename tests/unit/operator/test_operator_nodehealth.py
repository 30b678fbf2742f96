"""The node view of GPU health without a cluster: the verdict, the Events, the condition writes and the
cordon, against a fake API that keeps Nodes and Events as the API server would (the real one is
tests/integration/test_operator_node_health.py's)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from gpuwarden.operator.config import ConfigError, CordonMode, OperatorConfig
from gpuwarden.operator.kube.client import ApiError
from gpuwarden.operator.kube.events import event_body
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.nodehealth import (
    CONDITION,
    CORDON_ANNOTATION,
    NodeHealthMonitor,
    NodeSettings,
    incident_event,
    node_verdict,
)
from gpuwarden.operator.resources import ObjectRef, PodRecord
from gpuwarden.policy.engine import PodView
from gpuwarden.policy.store.health import HealthStore
from gpuwarden.policy.xids import CRITICAL_XIDS
from gpuwarden.wire.node import (
    ClockEventReason,
    DeviceState,
    GpuHealth,
    GpuSample,
    PodRef,
    Snapshot,
    XidEvent,
)

T0 = 1_800_000_000.0
NODE = "gpu-node-1"
GPU = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
POD = PodRef(namespace="ml", name="train-0")
SETTINGS = NodeSettings(xids=CRITICAL_XIDS, hold=60.0)


class FakeApi:
    """Nodes by name and the Events posted, with the API server's answers for what the monitor calls
    (and the Event sink's: what the poster would create)."""

    def __init__(self, *nodes: str) -> None:
        self.nodes: dict[str, dict[str, Any]] = {
            n: {"metadata": {"name": n, "uid": f"uid-{n}", "annotations": {}}, "spec": {}, "status": {}}
            for n in nodes
        }
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.condition_writes = 0
        self.gets = 0

    def _node(self, name: str) -> dict[str, Any]:
        if name not in self.nodes:
            raise ApiError(404, f'nodes "{name}" not found')
        return self.nodes[name]

    async def get(self, path: str) -> dict[str, Any]:
        self.gets += 1
        return self._node(path.rsplit("/", 1)[-1])

    async def patch_node_condition(self, node: str, condition: Mapping[str, Any], *, manager: str) -> Any:
        conditions = self._node(node)["status"].setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c["type"] != condition["type"]] + [dict(condition)]
        self.condition_writes += 1
        return {}

    async def cordon_node(self, node: str, annotations: Mapping[str, str], *, manager: str) -> Any:
        body = self._node(node)
        body["spec"]["unschedulable"] = True
        body["metadata"]["annotations"].update(annotations)
        return {}

    async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        """The operator's Event sink: the Event as the poster would create it, at once."""
        body = event_body(regarding, type_, reason, message, instance="op-0", now=T0)
        self.events.append((body["metadata"]["namespace"], body))

    def condition(self, node: str = NODE) -> dict[str, Any] | None:
        found = [c for c in self._node(node)["status"].get("conditions", []) if c["type"] == CONDITION]
        return found[0] if found else None

    def reasons(self, kind: str) -> list[str]:
        return [e["reason"] for _, e in self.events if e["involvedObject"]["kind"] == kind]


def sample(health: dict[str, Any] | None = None, *, lost: bool = False, ecc: int = 0) -> GpuSample:
    if lost:
        return GpuSample(
            uuid=GPU, index=2, state=DeviceState.LOST, pods=[POD], health=GpuHealth(**(health or {}))
        )
    return GpuSample(uuid=GPU, index=2, ecc_uncorrected=ecc, pods=[POD], health=GpuHealth(**(health or {})))


class World:
    def __init__(
        self,
        cordon: CordonMode = CordonMode.OFF,
        *,
        nodes: tuple[str, ...] = (NODE,),
        observe_only: bool = False,
    ) -> None:
        self.api = FakeApi(*nodes)
        self.health = HealthStore(retention_seconds=3600)
        self.now = T0
        config = OperatorConfig(
            node_health=True,
            node_health_hold=60.0,
            cordon=cordon,
            identity="op-0",
            observe_only=observe_only,
        )
        view = PodView(POD.namespace, POD.name)
        self.pods = {POD.namespace: [PodRecord(view=view, uid="uid-train-0")]}
        self.monitor = NodeHealthMonitor(
            config,
            self.api,  # type: ignore[arg-type]
            self.health,
            OperatorMetrics(),
            self.api,
            pods=lambda: self.pods,
            clock=lambda: self.now,
        )

    def report(self, gpu: GpuSample, node: str = NODE) -> None:
        self.health.observe(Snapshot(timestamp=self.now, gpus=[gpu]), node=node)

    async def step(self, seconds: float = 1.0, gpu: GpuSample | None = None) -> None:
        self.now += seconds
        self.report(gpu or sample())
        await self.monitor.step()


async def test_a_healthy_node_gets_a_true_condition_once() -> None:
    world = World()
    for _ in range(5):
        await world.step()
    condition = world.api.condition()
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("True", "GPUsHealthy")
    assert world.api.condition_writes == 1  # nothing changed after the first write
    assert world.api.events == []  # nothing recovered: it was never unhealthy


async def test_an_xid_on_a_lost_gpu_makes_it_false_with_events_on_node_and_pod_then_true_again() -> None:
    world = World()
    await world.step()
    healthy_since = world.api.condition()["lastTransitionTime"]  # type: ignore[index]
    await world.step(gpu=sample({"xids": [XidEvent(code=79, timestamp=world.now + 1)]}, lost=True))
    condition = world.api.condition()
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "GPULost")
    assert condition["message"].startswith(f"GPU 2 ({GPU}): off the bus since ")
    assert "XID 79 (GPU has fallen off the bus" in condition["message"]
    assert condition["lastTransitionTime"] != healthy_since
    assert world.api.reasons("Node") == ["GPULost", "GPUXidError"]
    assert world.api.reasons("Pod") == ["GPULost", "GPUXidError"]
    namespaces = {kind: ns for ns, e in world.api.events for kind in [e["involvedObject"]["kind"]]}
    assert namespaces == {"Node": "default", "Pod": "ml"}
    pod_event = next(
        e
        for _, e in world.api.events
        if e["involvedObject"]["kind"] == "Pod" and "XID" in e["reason"].upper()
    )
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "train-0", "namespace": "ml", "uid": "uid-train-0"}
    assert pod_event["involvedObject"] == pod
    assert pod_event["type"] == "Warning"
    assert pod_event["message"].startswith(
        f"on node {NODE}: GPU 2 ({GPU}): XID 79 (GPU has fallen off the bus"
    )
    node_event = next(e for _, e in world.api.events if e["involvedObject"]["kind"] == "Node")
    assert node_event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": NODE,
        "uid": f"uid-{NODE}",
    }
    assert node_event["reportingInstance"] == "op-0"

    for _ in range(3):  # still lost: nothing new
        await world.step(gpu=sample(lost=True))
    assert len(world.api.events) == 4
    await world.step(gpu=sample())  # back on the bus, but the XID holds for a minute
    assert world.api.condition()["reason"] == "GPUXidError"  # type: ignore[index]
    for _ in range(60):
        await world.step()
    condition = world.api.condition()
    assert (condition["status"], condition["reason"]) == ("True", "GPUsHealthy")  # type: ignore[index]
    assert world.api.reasons("Node")[-1] == "GPUHealthRecovered"


async def test_observe_only_posts_the_events_and_leaves_the_node_as_it_is() -> None:
    world = World(CordonMode.DRY_RUN, observe_only=True)
    await world.step()
    await world.step(gpu=sample({"xids": [XidEvent(code=79, timestamp=world.now + 1)]}, lost=True))
    assert world.api.condition_writes == 0
    assert world.api.condition() is None
    assert world.api.reasons("Node") == ["GPULost", "GPUXidError", "GPUNodeCordonDryRun"]
    assert world.api.reasons("Pod") == ["GPULost", "GPUXidError"]


async def test_a_condition_found_on_the_node_keeps_its_transition_time_and_is_not_rewritten() -> None:
    world = World()
    since = "2026-01-01T00:00:00Z"
    world.api.nodes[NODE]["status"]["conditions"] = [
        {
            "type": CONDITION,
            "status": "True",
            "reason": "GPUsHealthy",
            "message": "old words",
            "lastTransitionTime": since,
        }
    ]
    await world.step()
    condition = world.api.condition()
    assert condition["lastTransitionTime"] == since  # type: ignore[index]
    assert condition["message"] != "old words"  # type: ignore[index]
    assert world.api.condition_writes == 1
    assert world.api.gets == 1  # read once, at first sight


@pytest.mark.parametrize("mode", list(CordonMode))
async def test_cordon_only_when_on_and_once(mode: CordonMode) -> None:
    world = World(mode)
    await world.step()
    await world.step(gpu=sample(lost=True))
    await world.step(gpu=sample(lost=True))
    node = world.api.nodes[NODE]
    cordoned = [r for r in world.api.reasons("Node") if r.startswith("GPUNodeCordon")]
    if mode is CordonMode.ON:
        assert node["spec"]["unschedulable"] is True
        assert node["metadata"]["annotations"][CORDON_ANNOTATION].endswith(" GPULost")
        assert cordoned == ["GPUNodeCordoned"]
    else:
        assert "unschedulable" not in node["spec"]
        assert CORDON_ANNOTATION not in node["metadata"]["annotations"]
        assert cordoned == (["GPUNodeCordonDryRun"] if mode is CordonMode.DRY_RUN else [])


async def test_a_node_cordoned_by_someone_else_is_left_as_it_is() -> None:
    world = World(CordonMode.ON)
    world.api.nodes[NODE]["spec"]["unschedulable"] = True
    await world.step(gpu=sample(lost=True))
    assert CORDON_ANNOTATION not in world.api.nodes[NODE]["metadata"]["annotations"]
    assert "GPUNodeCordoned" not in world.api.reasons("Node")


async def test_a_node_the_api_server_does_not_know_is_looked_up_again_later() -> None:
    world = World(nodes=())
    await world.step(gpu=sample(lost=True))
    assert world.api.gets == 1
    for _ in range(10):
        await world.step(gpu=sample(lost=True))
    assert world.api.gets == 1  # not every second
    world.api.nodes[NODE] = {"metadata": {"name": NODE, "uid": "u"}, "spec": {}, "status": {}}
    await world.step(60.0, gpu=sample(lost=True))
    assert world.api.condition()["reason"] == "GPULost"  # type: ignore[index]


async def test_events_repeat_at_most_once_a_minute_and_a_replayed_incident_gets_none() -> None:
    world = World()
    for _ in range(5):
        await world.step(gpu=sample({"xids": [XidEvent(code=48, timestamp=world.now + 1)]}))
    assert world.api.reasons("Node").count("GPUXidError") == 1
    await world.step(61.0, gpu=sample({"xids": [XidEvent(code=48, timestamp=world.now + 61)]}))
    assert world.api.reasons("Node").count("GPUXidError") == 2
    await world.step(gpu=sample({"xids": [XidEvent(code=95, timestamp=world.now - 600)]}))  # from a replay
    assert "XID 95" not in " ".join(e["message"] for _, e in world.api.events)


async def test_xids_not_counted_get_no_event_and_leave_the_node_healthy() -> None:
    world = World()
    await world.step(gpu=sample({"xids": [XidEvent(code=13, timestamp=world.now + 1)]}))
    assert world.api.events == []
    assert world.api.condition()["status"] == "True"  # type: ignore[index]


async def test_memory_errors_and_hardware_slowdown() -> None:
    world = World()
    await world.step(gpu=sample(ecc=4))  # errors from before this operator: not new
    assert world.api.events == []
    await world.step(gpu=sample(ecc=5))
    await world.step(gpu=sample({"row_remap_pending": True}, ecc=5))
    await world.step(gpu=sample({"clock_event_reasons": [ClockEventReason.HW_THERMAL_SLOWDOWN]}, ecc=5))
    assert world.api.reasons("Node") == ["GPUMemoryError", "GPUMemoryError", "GPUThrottled"]
    assert world.api.condition()["reason"] == "GPUMemoryError"  # type: ignore[index]
    messages = [e["message"] for _, e in world.api.events if e["involvedObject"]["kind"] == "Node"]
    assert "1 new uncorrected ECC error" in messages[0]
    assert "row remapping pending; reset the GPU" in messages[1]
    assert "hwThermalSlowdown" in messages[2]


@pytest.mark.looptime
async def test_only_the_acting_replica_judges() -> None:
    world = World()
    acting = False
    world.monitor._acting = lambda: acting
    world.report(sample(lost=True))
    task = asyncio.create_task(world.monitor.run())
    await asyncio.sleep(5)  # five intervals of fake time
    assert world.api.condition_writes == 0
    acting = True
    await asyncio.sleep(1.5)
    task.cancel()
    assert world.api.condition()["reason"] == "GPULost"  # type: ignore[index]


def test_the_verdict_names_the_most_serious_reason_and_nothing_without_fresh_reports() -> None:
    store = HealthStore(retention_seconds=600)
    store.observe(Snapshot(timestamp=T0, gpus=[sample(ecc=0)]), node=NODE)
    store.observe(
        Snapshot(timestamp=T0 + 1, gpus=[sample({"xids": [XidEvent(code=79, timestamp=T0 + 1)]}, ecc=1)]),
        node=NODE,
    )
    verdict = node_verdict(store.gpus_on(NODE), T0 + 2, SETTINGS)
    assert verdict is not None
    assert (verdict.status, verdict.reason) == ("False", "GPUXidError")
    assert "1 uncorrected ECC error since" in verdict.message
    assert node_verdict(store.gpus_on(NODE), T0 + 120, SETTINGS) is None


def test_incident_events_say_what_to_do() -> None:
    store = HealthStore(retention_seconds=600)
    store.observe(
        Snapshot(timestamp=T0, gpus=[sample({"xids": [XidEvent(code=64, timestamp=T0)]}, lost=True)]),
        node=NODE,
    )
    events = [incident_event(i, SETTINGS) for i in store.incidents()]
    assert events[0] is not None
    assert events[0][0] == "GPULost"
    assert "drain and reboot the node" in events[0][1]
    assert events[1] is not None
    assert events[1][0] == "GPUXidError"
    assert events[1][1].startswith(f"GPU 2 ({GPU}): XID 64 (memory row remapping or page retirement failed; ")


def test_node_health_flags() -> None:
    assert not OperatorConfig.defaults(env={}).node_health
    config = OperatorConfig.parse(
        [
            "--node-health",
            "--node-health-xids",
            "79, 48,79",
            "--node-health-hold",
            "2m",
            "--cordon",
            "dry-run",
        ],
        {},
    )
    assert (config.node_health_xids, config.node_health_hold, config.cordon) == (
        (79, 48),
        120.0,
        CordonMode.DRY_RUN,
    )
    assert OperatorConfig.parse(["--node-health"], {}).node_health_xids == CRITICAL_XIDS
    for argv, flag in (
        (["--cordon", "on"], "--cordon needs --node-health"),
        (["--node-health", "--node-health-xids", "79,x"], "--node-health-xids"),
        (["--node-health", "--node-health-hold", "0s"], "--node-health-hold"),
    ):
        with pytest.raises(ConfigError, match=flag):
            OperatorConfig.parse(argv, {})
    parser = argparse.ArgumentParser()
    OperatorConfig.add_arguments(parser)
    args = parser.parse_args(["--node-health"])
    args.cordon = "yes"  # argparse refuses it first; a Namespace built otherwise is checked all the same
    with pytest.raises(ConfigError, match="--cordon"):
        OperatorConfig.from_args(args, {})


async def test_one_nodes_failure_never_stops_the_others() -> None:
    """Issue 27 (2): an error judging one node (there, an XID in year 33658) stopped the loop for every
    node sorted after it."""
    other = "gpu-node-2"
    world = World(nodes=(NODE, other))
    patch = world.api.patch_node_condition

    async def failing(node: str, condition: Mapping[str, Any], *, manager: str) -> Any:
        if node == NODE:
            raise RuntimeError("something no one foresaw")
        return await patch(node, condition, manager=manager)

    world.api.patch_node_condition = failing  # type: ignore[method-assign]
    world.report(sample(), node=other)
    await world.step()
    condition = world.api.condition(other)
    assert condition is not None
    assert condition["status"] == "True"
    assert world.api.condition(NODE) is None

"""End to end: GPU health from a scripted agent to a Node's condition, Events and cordon, on the API server.

Two operators (``--node-health`` with ``--cordon=dry-run``, and with ``--cordon=on``), each in its own
namespace with its own Node object and scripted agent, played at the same time. The scenario, per node:

- GPU 0 (pod ``broken-0``, busy): XID 79 and off the bus at 8 s, back at 20 s with one uncorrected ECC
  error, a hardware slowdown from 22 s to 25 s. With ``--node-health-hold=8s`` the node is unhealthy from
  8 s to about 28 s (the ECC error's hold), healthy before and after.
- GPU 1 (pod ``hot-0``): 10% busy, thermally throttled until 30 s, then not. Its idle finding
  (utilizationFloor 20% for 10 s) must wait for the throttling to end: a throttled GPU is not idle.

The policy also has a gpuHealth rule (clearAfter 8s): ``GPUUnhealthy`` on ``broken-0`` and resolved.

A Node without a kubelet keeps whatever status it is given, so the condition is only the operator's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import (
    IDLE_RULE,
    Setup,
    World,
    create_gpu_pod,
    create_node,
    events,
    get,
    gpu,
    monitor_policy,
    pod,
    prepare,
    wait_until,
)

pytestmark = pytest.mark.integration

LABELS = {"app": "gpu-job"}
HOLD = "8s"
UNHEALTHY = 8.0  # the XID and the lost GPU
HEALTHY_AGAIN = 28.0  # the ECC error at 20 s, held for 8 s
THROTTLED_UNTIL = 30.0
TIMEOUT = 90.0


def scenario(namespace: str, tag: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    broken, hot = f"GPU-nh{tag}-0000-4000-8000-000000000000", f"GPU-nh{tag}-0001-4000-8000-000000000001"
    gpus = [
        gpu(broken, 0, [{"kind": "idle", "level": 60, "noise": 1}], [{"kind": "idle", "level": "20Gi"}]),
        gpu(hot, 1, [{"kind": "idle", "level": 10, "noise": 1}], [{"kind": "idle", "level": "20Gi"}]),
    ]
    gpus[0]["health"] = [
        {"kind": "xid", "at": "8s", "code": 79},
        {"kind": "lost", "at": "8s"},
        {"kind": "recover", "at": "20s"},
        {"kind": "ecc", "at": "20s", "uncorrected": 1},
        {"kind": "throttle", "at": "22s", "reasons": ["hwSlowdown"]},
        {"kind": "throttle", "at": "25s", "reasons": []},
    ]
    gpus[1]["health"] = [
        {"kind": "throttle", "at": "0s", "reasons": ["swThermalSlowdown"]},
        {"kind": "throttle", "at": f"{THROTTLED_UNTIL:.0f}s", "reasons": []},
    ]
    pods = [pod(namespace, "broken-0", broken, LABELS, 5100), pod(namespace, "hot-0", hot, LABELS, 5101)]
    return gpus, pods


@dataclass
class NodeWorld(World):
    node: str
    cordon: str
    agent_started: float

    def condition(self) -> dict[str, Any] | None:
        body = get(self.cp, "node", self.node) or {}
        for condition in (body.get("status") or {}).get("conditions") or ():
            if condition["type"] == "GPUHealthy":
                return dict(condition)
        return None

    def node_events(self, reason: str | None = None) -> list[Any]:
        return events(self.cp, "default", kind="Node", name=self.node, reason=reason)

    def pod_events(self, name: str, reason: str | None = None) -> list[Any]:
        return self.events("Pod", name, reason)


def _start(cp: ControlPlane, factory: pytest.TempPathFactory, cordon: str, stack: list[Any]) -> NodeWorld:
    setup: Setup = prepare(cp, factory, f"nodehealth-{cordon}")
    # A Node of its own (cordoned, its condition written) with the pods on it: the operator takes
    # a pod's readings only from the agent of the node the pod runs on.
    node = f"gw-gpu-node-{cordon}-{secrets.token_hex(3)}"
    create_node(cp, node)
    for name in ("broken-0", "hot-0"):
        create_gpu_pod(cp, setup.namespace, name, LABELS, node)
    rules = [IDLE_RULE, {"name": "gpu-health", "gpuHealth": {"clearAfter": HOLD}}]
    setup.apply(monitor_policy(setup.namespace, "health", rules, selector={"matchLabels": LABELS}))
    gpus, pods = scenario(setup.namespace, secrets.token_hex(2))
    path = setup.scenario(f"nodehealth-{cordon}", gpus, pods)
    operator = setup.operator(
        extra_args=["--node-health", f"--node-health-hold={HOLD}", f"--cordon={cordon}"]
    )
    stack.append(operator)
    operator.wait_ready()
    started = time.time()
    agent = setup.agent(path, operator, node=node)
    stack.append(agent)
    return NodeWorld(cp, setup.namespace, operator, agent, node=node, cordon=cordon, agent_started=started)


@pytest.fixture(scope="module")
def worlds(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, NodeWorld]]:
    """Both operators and their agents, playing at the same time."""
    stack: list[Any] = []
    try:
        started = {mode: _start(control_plane, tmp_path_factory, mode, stack) for mode in ("dry-run", "on")}
        yield started
    finally:
        for proc in reversed(stack):
            proc.stop()


@pytest.fixture(params=["dry-run", "on"])
def world(worlds: dict[str, NodeWorld], request: pytest.FixtureRequest) -> NodeWorld:
    return worlds[request.param]


def _time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _event_time(event: dict[str, Any]) -> float:
    return _time(event.get("eventTime") or event["lastTimestamp"])


def test_condition_turns_false_with_the_xid_and_the_lost_gpu(world: NodeWorld) -> None:
    condition = wait_until(
        lambda: (c := world.condition()) and c["status"] == "False" and c,
        timeout=TIMEOUT,
        what=f"GPUHealthy=False on {world.node}",
        alive=world.alive,
    )
    assert condition["reason"] in ("GPULost", "GPUXidError")
    assert "GPU 0 (GPU-nh" in condition["message"]
    assert condition["lastTransitionTime"].endswith("Z")


def test_events_on_the_node_and_the_pod_say_what_happened(world: NodeWorld) -> None:
    wanted = ("GPUXidError", "GPULost", "GPUMemoryError", "GPUThrottled")
    on_node = wait_until(
        lambda: found if all((found := {r: world.node_events(r) for r in wanted}).values()) else None,
        timeout=TIMEOUT,
        what=f"every GPU health Event on {world.node}",
        alive=world.alive,
    )
    (xid,) = on_node["GPUXidError"]
    assert xid["type"] == "Warning"
    assert "XID 79 (GPU has fallen off the bus" in xid["message"]
    assert "reboot the node" in xid["message"]
    assert xid["involvedObject"].get("namespace", "") == ""  # a Node has none: kubectl describe finds it
    assert xid["involvedObject"]["uid"] == get(world.cp, "node", world.node)["metadata"]["uid"]
    assert "hwSlowdown" in on_node["GPUThrottled"][0]["message"]
    described = world.cp.kubectl("describe", "node", world.node, check=True).stdout
    assert "GPUXidError" in described
    assert "GPULost" in described

    uid = get(world.cp, "pod", "broken-0", "-n", world.namespace)["metadata"]["uid"]
    on_pod = wait_until(
        lambda: (
            found if all((found := {r: world.pod_events("broken-0", r) for r in wanted}).values()) else None
        ),
        timeout=30,
        what="every GPU health Event on broken-0",
        alive=world.alive,
    )
    for reason, items in on_pod.items():
        assert items[0]["type"] == "Warning", reason
        assert items[0]["involvedObject"]["uid"] == uid, reason
        assert items[0]["message"].startswith(f"on node {world.node}: GPU 0 "), reason
    assert not world.pod_events("hot-0", "GPUXidError"), "an XID of GPU 0 landed on the pod of GPU 1"


def test_condition_clears_when_the_gpus_recover(world: NodeWorld) -> None:
    condition = wait_until(
        lambda: (
            (c := world.condition())
            and c["status"] == "True"
            and world.node_events("GPUHealthRecovered")
            and c
        ),
        timeout=TIMEOUT + HEALTHY_AGAIN,
        what=f"GPUHealthy=True again on {world.node}",
        alive=world.alive,
    )
    assert condition["reason"] == "GPUsHealthy"
    (recovered,) = world.node_events("GPUHealthRecovered")
    assert recovered["type"] == "Normal"
    xid = world.node_events("GPUXidError")[0]
    # Healthy again only once the ECC error (20 s) was held for 8 s, about 20 s after the XID.
    assert _time(condition["lastTransitionTime"]) - _event_time(xid) >= HEALTHY_AGAIN - UNHEALTHY - 3


def test_cordon_only_when_on_and_never_in_dry_run(worlds: dict[str, NodeWorld]) -> None:
    on, dry = worlds["on"], worlds["dry-run"]
    wait_until(
        lambda: on.node_events("GPUNodeCordoned"), timeout=TIMEOUT, what="GPUNodeCordoned", alive=on.alive
    )
    node = get(on.cp, "node", on.node)
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"]["gpuwarden.dev/cordoned"].split()[1] in ("GPULost", "GPUXidError")
    (said,) = wait_until(
        lambda: dry.node_events("GPUNodeCordonDryRun"),
        timeout=TIMEOUT,
        what="GPUNodeCordonDryRun",
        alive=dry.alive,
    )
    assert "nothing changed" in said["message"]
    # Through the whole story (until healthy again), the dry run never cordoned.
    wait_until(
        lambda: (c := dry.condition()) and c["status"] == "True",
        timeout=TIMEOUT + HEALTHY_AGAIN,
        what="the dry run's node healthy again",
        alive=dry.alive,
    )
    node = get(dry.cp, "node", dry.node)
    assert not node["spec"].get("unschedulable")
    assert "gpuwarden.dev/cordoned" not in (node["metadata"].get("annotations") or {})
    assert not dry.node_events("GPUNodeCordoned")
    assert len(on.node_events("GPUNodeCordoned")) == 1  # once, not again while it stays unhealthy
    assert len(dry.node_events("GPUNodeCordonDryRun")) == 1


def test_the_gpu_health_rule_fires_and_resolves_on_the_pod(world: NodeWorld) -> None:
    (warning, *_) = wait_until(
        lambda: world.pod_events("broken-0", "GPUUnhealthy"),
        timeout=TIMEOUT,
        what="GPUUnhealthy",
        alive=world.alive,
    )
    assert warning["type"] == "Warning"
    assert "XID 79" in warning["message"] or "off the bus" in warning["message"]
    assert "policy health, rule gpu-health" in warning["message"]
    (resolved, *_) = wait_until(
        lambda: world.pod_events("broken-0", "GPUUnhealthyResolved"),
        timeout=TIMEOUT + HEALTHY_AGAIN,
        what="GPUUnhealthyResolved",
        alive=world.alive,
    )
    assert resolved["type"] == "Normal"


def test_a_throttled_gpu_is_not_flagged_idle(world: NodeWorld) -> None:
    (idle, *_) = wait_until(
        lambda: world.pod_events("hot-0", "GPUUnderutilized"),
        timeout=TIMEOUT + THROTTLED_UNTIL,
        what="GPUUnderutilized on hot-0 once its throttling ended",
        alive=world.alive,
    )
    # At 10% it is idle from the first 10 s on; throttled, it is not: the finding waits for the end
    # of the throttling (30 s into the scenario, which starts after the agent process does).
    assert _event_time(idle) - world.agent_started >= THROTTLED_UNTIL, idle["message"]

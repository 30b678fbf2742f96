"""End to end: the anomaly rule kind, through the operator and a scripted agent, on a real API server.

Two pods, each with one GPU: ``cron-0`` bursts to 80% for 3 s every 15 s (a scheduled job), and
``cache-0`` holds its memory flat, then from ``CLIMB_AT`` grows it steadily (an unbounded cache).
One policy with one anomaly rule per metric: the two findings must carry different reasons, in the
Events and in the status, and say what they saw.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import World, gpu, monitor_policy, operator_and_agent, pod, prepare, wait_until

pytestmark = pytest.mark.integration

CLIMB_AT = 130.0
"""After the 2m window is covered; the climb is anomalous until it fills about half of it (60 s)."""
LABELS = {"app": "patterns"}
PODS = ("cron-0", "cache-0")


def scenario(namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    uuids = [f"GPU-a0a0000{i}-0000-4000-8000-00000000000{i}" for i in range(2)]
    bursts = {"kind": "idle", "level": 5, "noise": 1, "spikeEvery": "15s", "spikeFor": "3s", "spikeLevel": 80}
    gpus = [
        gpu(uuids[0], 0, [bursts], [{"kind": "idle", "level": "30Gi", "noise": "4Mi"}]),
        gpu(
            uuids[1],
            1,
            [{"kind": "idle", "level": 50, "noise": 2}],
            [
                {"kind": "idle", "level": "20Gi", "noise": "4Mi"},
                {"kind": "leak", "at": f"{int(CLIMB_AT)}s", "start": "20Gi", "rate": "6Gi/m", "noise": "4Mi"},
            ],
        ),
    ]
    return gpus, [pod(namespace, name, uuids[i], LABELS, 5000 + i) for i, name in enumerate(PODS)]


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    setup = prepare(control_plane, tmp_path_factory, "anomaly", gpu_pods=PODS, labels=LABELS)
    rules = [
        {"name": "bursts", "anomaly": {"metric": "utilization", "window": "2m"}},
        {"name": "climb", "anomaly": {"metric": "memory", "window": "2m", "minDeviation": 1}},
    ]
    setup.apply(monitor_policy(setup.namespace, "patterns", rules, selector={"matchLabels": LABELS}))
    gpus, pods = scenario(setup.namespace)
    with operator_and_agent(setup, setup.scenario("anomaly", gpus, pods)) as (operator, agent):
        yield World(control_plane, setup.namespace, operator, agent)


def test_periodic_bursts_are_named_a_scheduled_job(world: World) -> None:
    (event, *_) = wait_until(
        lambda: world.events("Pod", "cron-0", "GPUPeriodicSpikes"),
        timeout=180,
        what="GPUPeriodicSpikes on cron-0",
        alive=world.alive,
    )
    assert event["type"] == "Warning"
    assert "every 15s" in event["message"]
    assert "like a scheduled job" in event["message"]
    assert "policy patterns, rule bursts" in event["message"]
    assert not world.events("Pod", "cron-0", "GPUSteadyClimb")


def test_a_steady_climb_is_named_apart_from_spikes(world: World) -> None:
    (event, *_) = wait_until(
        lambda: world.events("Pod", "cache-0", "GPUSteadyClimb"),
        timeout=CLIMB_AT + 120,
        what="GPUSteadyClimb on cache-0",
        alive=world.alive,
    )
    assert event["type"] == "Warning"
    assert "GPU memory climbs steadily" in event["message"]
    assert "like an unbounded cache" in event["message"]
    assert "rule climb" in event["message"]
    assert not world.events("Pod", "cache-0", "GPUPeriodicSpikes")
    assert not world.events("Pod", "cache-0", "GPUSpike")


def test_status_carries_each_pattern_as_its_reason(world: World) -> None:
    def both() -> dict[str, str] | None:
        reasons = {v["pod"]: v["reason"] for v in world.violations("patterns")}
        return reasons if len(reasons) == 2 else None

    reasons = wait_until(both, timeout=CLIMB_AT + 120, what="both patterns in status", alive=world.alive)
    assert reasons == {"cron-0": "GPUPeriodicSpikes", "cache-0": "GPUSteadyClimb"}
    by_pod = {v["pod"]: v for v in world.violations("patterns")}
    assert by_pod["cron-0"]["gpu"].startswith("GPU-a0a0")

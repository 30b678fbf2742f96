"""End to end: the operator and a scripted agent as their own processes, against a real API server.

One scenario, one node, six GPU pods, each breaking one rule kind from the start and recovering at
``RECOVER_AT`` seconds: idle (utilizationFloor), saturated (utilizationCeiling), near out-of-memory
(memoryCeiling), leaking (memoryGrowth), leaking fast enough to fill its card within minutes
(memoryGrowth's GPUMemoryExhaustionImminent, found on its urgent 40 s span, with the time left), and
holding two GPUs while it works on one (idleGpus).
One module-scoped world, which every test only reads and waits on, so their order does not matter;
the tests that delete a pod or change a spec have their own. The agent authenticates with a
TokenRequest token of its ServiceAccount (audience gpuwarden-operator); the policy is applied with
kubectl; the pods are Pod objects bound to a node by name (no scheduler, no kubelet: they stay
Pending).

For each kind: the Warning Event with the right reason and message on the right pod and on the policy,
the violation in the policy's status, then the Normal Event when it recovers and the violation gone
from status. And no storm: while a violation holds, one Warning and one more per renotifyInterval.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import (
    IDLE_RULE,
    World,
    apply,
    gpu,
    monitor_policy,
    operator_and_agent,
    pod,
    prepare,
    wait_until,
)

pytestmark = pytest.mark.integration

RECOVER_AT = 100.0
"""Scenario second at which every GPU recovers (idle, saturated, near-OOM fire at ~10 s, leak at ~60 s)."""
RENOTIFY = 60.0
LABELS = {"team": "e2e", "app": "trainer"}

# pod -> (rule, Event reason, a phrase the Warning must carry)
CASES = {
    "idle-0": ("idle", "GPUUnderutilized", "floor 20%"),
    "busy-0": ("saturated", "GPUSaturated", "ceiling 90%"),
    "full-0": ("near-oom", "GPUMemoryNearLimit", "limit 90%"),
    "leak-0": ("leak", "GPUMemoryLeakSuspected", "GPU memory grows"),
    "flood-0": ("leak", "GPUMemoryExhaustionImminent", "GPU memory grows 40Gi/m over 40s"),
    "partial-0": ("unused", "GPUIdleInPod", "1 of 2 GPUs idle"),
}
GPUS_OF = {"partial-0": 2}
"""Pods with more than one GPU."""


def scenario(namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    at = f"{int(RECOVER_AT)}s"
    uuids = [f"GPU-e2e0000{i}-0000-4000-8000-00000000000{i}" for i in range(7)]
    gpus = [
        gpu(uuids[0], 0, [{"kind": "idle", "level": 3, "noise": 1}, {"kind": "idle", "at": at, "level": 60}],
            [{"kind": "idle", "level": "9Gi"}]),
        gpu(uuids[1], 1, [{"kind": "saturated", "level": 98}, {"kind": "idle", "at": at, "level": 50}],
            [{"kind": "idle", "level": "40Gi"}]),
        gpu(uuids[2], 2, [{"kind": "idle", "level": 50, "noise": 2}],
            [{"kind": "idle", "level": "135Gi", "noise": "64Mi"},
             {"kind": "idle", "at": at, "level": "20Gi"}]),
        gpu(uuids[3], 3, [{"kind": "idle", "level": 50, "noise": 2}],
            [{"kind": "leak", "start": "20Gi", "rate": "3Gi/m", "noise": "2Mi"},
             {"kind": "idle", "at": at, "level": "26Gi"}]),
        gpu(uuids[4], 4, [{"kind": "idle", "level": 50, "noise": 2}],
            [{"kind": "leak", "start": "20Gi", "rate": "40Gi/m", "noise": "2Mi"},
             {"kind": "idle", "at": at, "level": "26Gi"}]),
        gpu(uuids[5], 5, [{"kind": "idle", "level": 80, "noise": 2}], [{"kind": "idle", "level": "30Gi"}]),
        gpu(uuids[6], 6, [{"kind": "idle", "level": 1}, {"kind": "idle", "at": at, "level": 60}],
            [{"kind": "idle", "level": "2Gi"}]),
    ]  # fmt: skip
    pods = [pod(namespace, name, uuids[i], LABELS, 4000 + i) for i, name in enumerate(CASES)]
    pods[-1]["gpus"].append(uuids[6])  # partial-0 holds GPU 5, which it uses, and GPU 6, which it does not
    return gpus, pods


def policy(namespace: str) -> dict[str, Any]:
    rules = [
        IDLE_RULE,
        {"name": "saturated", "utilizationCeiling": {"percent": 90, "for": "10s", "signal": "gpuUtil"}},
        {"name": "near-oom", "memoryCeiling": {"percent": 90, "for": "10s"}},
        {"name": "leak", "memoryGrowth": {"rate": "1Gi/m", "window": "1m", "minFit": 0.8}},
        {"name": "unused", "idleGpus": {"for": "10s"}},
    ]
    return monitor_policy(
        namespace,
        "gpus",
        rules,
        selector={"matchLabels": {"team": "e2e"}},
        actions={"events": True, "renotifyInterval": "1m"},
    )


class Rules(World):
    def warnings(self, pod_name: str, reason: str) -> list[Any]:
        return self.events("Pod", pod_name, reason)

    def policy_events(self) -> list[Any]:
        return self.events("GPUMonitorPolicy", "gpus")

    def status(self) -> dict[str, Any]:
        return self.policy_status("gpus")


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rules]:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "rules", gpu_pods=CASES, labels=LABELS)
    setup.apply(policy(setup.namespace))
    gpus, pods = scenario(setup.namespace)
    with operator_and_agent(setup, setup.scenario("rules", gpus, pods)) as (operator, agent):
        yield Rules(cp, setup.namespace, operator, agent)


def _time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event.get("eventTime") or event["lastTimestamp"]).timestamp()


@pytest.mark.parametrize("pod_name", list(CASES))
def test_a_violation_warns_on_the_pod_and_the_policy(world: Rules, pod_name: str) -> None:
    rule, reason, phrase = CASES[pod_name]
    timeout = 120 if rule == "leak" else 60
    (first, *_) = wait_until(
        lambda: world.warnings(pod_name, reason),
        timeout=timeout,
        what=f"{reason} on {pod_name}",
        alive=world.alive,
    )
    assert first["type"] == "Warning"
    assert phrase in first["message"]
    if rule == "leak":  # the time left, in every leak's message; and what an imminent one means
        assert "; the card (140Gi) is full in " in first["message"]  # CARD: an H200's 143771Mi
    if reason == "GPUMemoryExhaustionImminent":
        assert "runs out of GPU memory soon" in first["message"]
    assert f"policy gpus, rule {rule}" in first["message"]
    assert first["involvedObject"]["namespace"] == world.namespace
    assert first["reportingComponent"] == "gpuwarden-operator"
    on_policy = [e for e in world.policy_events() if e["reason"] == reason]
    assert on_policy, f"no {reason} on the policy"
    assert on_policy[0]["message"].startswith(f"pod {pod_name}: ")
    assert on_policy[0]["type"] == "Warning"


def test_status_lists_every_violation(world: Rules) -> None:
    def all_of_them() -> dict[str, Any] | None:
        status = world.status()
        return status if len(status.get("violations") or []) == len(CASES) else None

    status = wait_until(all_of_them, timeout=120, what="a violation per pod in status", alive=world.alive)
    assert status["matchedPods"] == len(CASES)
    assert status["violatingPods"] == len(CASES)
    assert status["observedGeneration"] == 1
    by_pod = {v["pod"]: v for v in status["violations"]}
    for pod_name, (rule, reason, _) in CASES.items():
        assert (by_pod[pod_name]["rule"], by_pod[pod_name]["reason"]) == (rule, reason)
        assert by_pod[pod_name]["since"].endswith("Z")
    assert by_pod["leak-0"]["gpu"].startswith("GPU-")
    assert by_pod["full-0"]["gpu"].startswith("GPU-")
    assert by_pod["partial-0"]["gpu"] == "GPU-e2e00006-0000-4000-8000-000000000006"  # the idle one
    # Newest first: the leak needed a full minute of data, so it started last; the flood, 40 s of it.
    assert [v["pod"] for v in status["violations"][:2]] == ["leak-0", "flood-0"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", "Evaluating")
    assert (conditions["Violating"]["status"], conditions["Violating"]["reason"]) == (
        "True",
        "ViolationsActive",
    )


@pytest.mark.parametrize("pod_name", list(CASES))
def test_recovery_is_a_normal_event_and_leaves_status(world: Rules, pod_name: str) -> None:
    _, reason, _ = CASES[pod_name]
    resolved = f"{reason}Resolved"
    (event, *_) = wait_until(
        lambda: world.warnings(pod_name, resolved), timeout=RECOVER_AT + 90, what=resolved, alive=world.alive
    )
    assert event["type"] == "Normal"
    assert "back within the rule" in event["message"]
    assert any(e["reason"] == resolved for e in world.policy_events())
    wait_until(
        lambda: all(v["pod"] != pod_name for v in world.status().get("violations") or []),
        timeout=30,
        what=f"{pod_name} gone from status.violations",
    )


def test_no_event_storm(world: Rules) -> None:
    """One Warning when a violation starts, then one per renotifyInterval while it holds, never more."""
    wait_until(
        lambda: not world.status().get("violations"),
        timeout=RECOVER_AT + 120,
        what="every violation resolved",
    )
    for pod_name, (_, reason, _) in CASES.items():
        warnings = world.warnings(pod_name, reason)
        (resolved,) = world.warnings(pod_name, f"{reason}Resolved")
        held = _time(resolved) - _time(warnings[0])
        # One more per full interval held (the Events' own timestamps may put an end within a second of one).
        expected = {1 + int((held + slack) // RENOTIFY) for slack in (-2.0, 0.0, 2.0)}
        assert len(warnings) in expected, (pod_name, held, [e["message"] for e in warnings])
        gaps = [_time(b) - _time(a) for a, b in itertools.pairwise(warnings)]
        assert all(gap >= RENOTIFY - 1 for gap in gaps), gaps
        if len(warnings) > 1:
            assert warnings[1]["message"].startswith("still, for ")
    # Status is written when something happens, not at every one-second evaluation: once at the first
    # round, then only in rounds that announced something (an Event on the policy), and at least when
    # the violations came and when they went.
    writes = world.operator.metric("gpuwarden_operator_status_writes_total")
    evaluations = world.operator.metric("gpuwarden_operator_evaluation_duration_seconds_count")
    announced = len(world.policy_events())
    assert evaluations > RECOVER_AT * 0.8
    assert 3 <= writes <= 1 + announced, (writes, announced, evaluations)
    conditions = {c["type"]: c for c in world.status()["conditions"]}
    assert conditions["Violating"]["status"] == "False"


def test_per_pod_gpu_series_and_operator_metrics(world: Rules) -> None:
    reports = 10
    metrics = wait_until(
        lambda: (
            m
            if (m := world.operator.metrics()).get("gpuwarden_operator_reports_total", 0) >= reports
            else None
        ),
        timeout=60,
        what=f"{reports} reports",
        alive=world.alive,
    )
    for pod_name in CASES:
        series = [
            k for k in metrics if k.startswith("gpuwarden_pod_gpu_utilization_percent{") and pod_name in k
        ]
        assert len(series) == GPUS_OF.get(pod_name, 1), pod_name
    assert metrics['gpuwarden_operator_reports_rejected_total{reason="invalid"}'] == 0
    assert metrics["gpuwarden_operator_tokenreviews"] <= 3  # cached: not one per report
    assert metrics["gpuwarden_operator_active"] == 1


def test_both_ran_the_whole_time(world: Rules) -> None:
    assert world.alive() is None


def test_a_deleted_pod_leaves_the_metrics_at_once(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """On its own operator and agent: it stops the agent and deletes a pod, which the world must not see."""
    cp = control_plane
    names = ("idle-0", "busy-0")
    setup = prepare(cp, tmp_path_factory, "podgone", gpu_pods=names, labels=LABELS)
    setup.apply(policy(setup.namespace))
    gpus, pods = scenario(setup.namespace)
    scenario_file = setup.scenario("podgone", gpus[:2], [p for p in pods if p["name"] in names])
    series = "gpuwarden_pod_gpu_utilization_percent{"
    with operator_and_agent(setup, scenario_file) as (operator, agent):
        wait_until(
            lambda: all(any(k.startswith(series) and n in k for k in operator.metrics()) for n in names),
            timeout=60,
            what="both pods' series",
            alive=lambda: operator.alive() or agent.alive(),
        )
        agent.stop()  # it would report the scripted pod again
        # Forced: without a kubelet a bound pod's graceful deletion never completes (no DELETED event).
        cp.kubectl("delete", "pod", "idle-0", "-n", setup.namespace, "--grace-period=0", "--force")
        # Well before the 60 s staleness limit: the deletion itself removes the series.
        wait_until(
            lambda: not any(k.startswith(series) and "idle-0" in k for k in operator.metrics()),
            timeout=20,
            what="idle-0's series gone",
            alive=operator.alive,
        )
        assert any(k.startswith(series) and "busy-0" in k for k in operator.metrics())


def test_a_percent_under_one_is_warned_in_the_ready_condition(world: Rules) -> None:
    """Issue 45: ``percent: 0.2`` (meant as 20%) was legal without a word. It is legal still (0.2% may be
    meant), and the policy evaluates, but its Ready condition says what it reads as. It selects no pod."""
    rules = [{"name": "low", "utilizationFloor": {"percent": 0.2, "for": "10s"}}]
    apply(
        world.cp,
        monitor_policy(world.namespace, "fraction", rules, selector={"matchLabels": {"app": "none"}}),
    )

    def ready() -> dict[str, Any] | None:
        conditions = world.policy_status("fraction").get("conditions") or []
        return next((c for c in conditions if c["type"] == "Ready"), None)

    condition: dict[str, Any] = wait_until(ready, timeout=60, what="the policy's Ready", alive=world.alive)
    assert (condition["status"], condition["reason"]) == ("True", "Evaluating")
    assert condition["message"].endswith(
        "Warning: rule low: percent 0.2 means 0.2%, not 20% (percent is 0 to 100)."
    ), condition


def test_a_spec_change_is_read_at_once_not_an_interval_later(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """On its own operator: a policy evaluated hourly sleeps between rounds; its update handler wakes it."""
    setup = prepare(control_plane, tmp_path_factory, "specchange")
    rule = {"name": "idle", "utilizationFloor": {"percent": 20, "for": "1h"}}
    hourly = monitor_policy(setup.namespace, "hourly", [rule])
    hourly["spec"]["evaluationInterval"] = "1h"
    setup.apply(hourly)

    def observed() -> Any:
        return setup.policy_status("hourly").get("observedGeneration")

    with setup.operator() as operator:
        operator.wait_ready()
        wait_until(lambda: observed() == 1, timeout=60, what="the first round's status", alive=operator.alive)
        generation = setup.patch_spec("hourly", {"actions": {"renotifyInterval": "2h"}})
        wait_until(
            lambda: observed() == generation,
            timeout=30,
            what=f"generation {generation} evaluated well before the hour",
            alive=operator.alive,
        )

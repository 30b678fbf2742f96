"""The status builder: conditions, transition times, violations capped and ordered, restore."""

from __future__ import annotations

import math
from typing import Any

from gpuwarden.kubetime import format_time
from gpuwarden.operator.policies.status import (
    MAX_VIOLATIONS,
    PolicyVerdict,
    build_status,
    findings_from_status,
    owned_part,
)
from gpuwarden.policy.engine import Evaluation
from gpuwarden.policy.findings import Finding
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.rules import memory_ceiling, rule_type, utilization
from gpuwarden.policy.rules.common import RuleKind
from gpuwarden.policy.store.series import PodId

T0 = 1_800_000_000.0

SPEC = parse_spec(
    {
        "selector": {"matchLabels": {"app": "x"}},
        "evaluationInterval": "10s",
        "rules": [
            {"name": "idle", "utilizationFloor": {"percent": 20, "for": "5m"}},
            {"name": "oom", "memoryCeiling": {"percent": 90, "for": "1m"}},
        ],
    }
)


def finding(pod: str, rule: str = "idle", kind: RuleKind = utilization.FLOOR_KIND, at: float = T0) -> Finding:
    return Finding(
        policy="ns/p",
        rule=rule,
        kind=kind,
        reason=rule_type(kind).reason,
        namespace="ns",
        pod=pod,
        gpus=("GPU-a", "GPU-b"),
        value=3.0,
        threshold=20.0,
        unit="percent",
        started_at=at,
        message=f"{pod} is idle",
    )


def evaluation(active: list[Finding], matched: int) -> Evaluation:
    pods = tuple(PodId("ns", f"pod-{i}") for i in range(matched))
    violating = tuple(sorted({PodId(f.namespace, f.pod) for f in active}))
    return Evaluation(
        at=T0, transitions=(), active=tuple(active), matched_pods=pods, violating_pods=violating
    )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_healthy_policy_is_ready_and_not_violating() -> None:
    status = build_status(PolicyVerdict(3, 10.0, evaluation=evaluation([], 4)), None, T0)
    assert status["observedGeneration"] == 3
    assert status["matchedPods"] == 4
    assert status["violatingPods"] == 0
    assert status["violations"] == []
    c = conditions(status)
    assert c["Ready"]["status"] == "True"
    assert c["Ready"]["reason"] == "Evaluating"
    assert c["Ready"]["observedGeneration"] == 3
    assert c["Violating"]["status"] == "False"
    assert c["Violating"]["reason"] == "NoViolations"
    assert c["Ready"]["lastTransitionTime"] == format_time(T0)


def test_a_warning_stays_ready_and_is_in_the_message() -> None:
    warning = "rule idle: percent 0.2 means 0.2%, not 20% (percent is 0 to 100)"
    status = build_status(PolicyVerdict(3, 10.0, warnings=(warning,), evaluation=evaluation([], 4)), None, T0)
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Evaluating")
    assert ready["message"] == f"The policy is valid and evaluated every 10s. Warning: {warning}."


def test_invalid_spec_is_not_ready_with_the_message() -> None:
    status = build_status(PolicyVerdict(2, spec_error="spec.rules[0].name: duplicate"), None, T0)
    c = conditions(status)
    assert c["Ready"] == {
        "type": "Ready",
        "status": "False",
        "reason": "InvalidSpec",
        "message": "spec.rules[0].name: duplicate",
        "lastTransitionTime": format_time(T0),
        "observedGeneration": 2,
    }
    assert c["Violating"]["status"] == "Unknown"
    assert status["violations"] == []


def test_transition_time_moves_only_when_the_status_moves() -> None:
    first = build_status(PolicyVerdict(1, 10.0, evaluation=evaluation([], 2)), None, T0)
    # Later, same verdict with other counts: the message changes, the transition time does not.
    second = build_status(PolicyVerdict(1, 10.0, evaluation=evaluation([], 3)), first, T0 + 60)
    assert conditions(second)["Violating"]["lastTransitionTime"] == format_time(T0)
    assert conditions(second)["Violating"]["message"] != conditions(first)["Violating"]["message"]
    # Then a violation: Violating flips, Ready stays.
    third = build_status(
        PolicyVerdict(1, 10.0, evaluation=evaluation([finding("pod-0")], 3)), second, T0 + 120
    )
    assert conditions(third)["Violating"]["status"] == "True"
    assert conditions(third)["Violating"]["lastTransitionTime"] == format_time(T0 + 120)
    assert conditions(third)["Ready"]["lastTransitionTime"] == format_time(T0)


def test_same_verdict_builds_the_same_status() -> None:
    verdict = PolicyVerdict(1, 10.0, evaluation=evaluation([finding("pod-0")], 3))
    first = build_status(verdict, None, T0)
    assert build_status(verdict, first, T0 + 999) == first


def test_violations_are_capped_and_newest_first() -> None:
    active = [finding(f"pod-{i}", at=T0 + 100 - i) for i in range(30)]  # the engine's order: newest first
    status = build_status(PolicyVerdict(1, 10.0, evaluation=evaluation(active, 30)), None, T0 + 200)
    violations = status["violations"]
    assert len(violations) == MAX_VIOLATIONS
    assert [v["pod"] for v in violations] == [f"pod-{i}" for i in range(MAX_VIOLATIONS)]
    assert status["violatingPods"] == 30
    assert violations[0] == {
        "pod": "pod-0",
        "rule": "idle",
        "reason": "GPUUnderutilized",
        "message": "pod-0 is idle",
        "since": format_time(T0 + 100),
    }


def test_violation_message_is_the_announced_one_and_gpu_only_for_memory_rules() -> None:
    idle = finding("a")
    oom = finding("b", rule="oom", kind=memory_ceiling.KIND)
    verdict = PolicyVerdict(1, 10.0, evaluation=evaluation([idle, oom], 2), messages={idle.key: "announced"})
    by_pod = {v["pod"]: v for v in build_status(verdict, None, T0)["violations"]}
    assert by_pod["a"]["message"] == "announced"
    assert "gpu" not in by_pod["a"]
    assert by_pod["b"]["gpu"] == "GPU-a"
    assert by_pod["b"]["reason"] == "GPUMemoryNearLimit"


def test_long_messages_are_clipped_to_the_crd_limit() -> None:
    f = finding("a")
    verdict = PolicyVerdict(1, 10.0, evaluation=evaluation([f], 1), messages={f.key: "x" * 5000})
    assert len(build_status(verdict, None, T0)["violations"][0]["message"]) == 1024


def test_problem_makes_it_not_ready_and_foreign_conditions_and_scale_are_kept() -> None:
    previous = {
        "conditions": [
            {"type": "Scaling", "status": "True", "reason": "X", "message": "", "lastTransitionTime": "t"}
        ],
        "scale": {"currentReplicas": 2},
    }
    verdict = PolicyVerdict(
        1, 10.0, evaluation=evaluation([], 1), problem=("ScaleTargetNotFound", "no such thing")
    )
    status = build_status(verdict, previous, T0)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "ScaleTargetNotFound")
    assert c["Scaling"]["reason"] == "X"
    assert status["scale"] == {"currentReplicas": 2}
    status = build_status(
        PolicyVerdict(1, 10.0, evaluation=evaluation([], 1), scale={"desiredReplicas": 3}), status, T0
    )
    assert status["scale"] == {"desiredReplicas": 3}


def test_reclaim_writes_its_condition_and_state_and_a_removed_reclaim_takes_them_away() -> None:
    verdict = PolicyVerdict(
        1,
        10.0,
        evaluation=evaluation([], 1),
        reclaim={"pendingWorkloads": 1, "lastReclaimTime": None, "lastReclaimMessage": None},
        reclaim_condition=("False", "BreakerOpen", "circuit breaker open"),
    )
    status = build_status(verdict, None, T0)
    assert conditions(status)["ReclaimActive"]["reason"] == "BreakerOpen"
    assert status["reclaim"]["pendingWorkloads"] == 1
    assert owned_part(status)["reclaim"] == status["reclaim"]
    # A round whose reclaimer answered nothing new keeps what was written.
    kept = build_status(PolicyVerdict(1, 10.0, evaluation=evaluation([], 1)), status, T0 + 10)
    assert kept["reclaim"] == status["reclaim"]
    assert "ReclaimActive" in conditions(kept)
    # The spec lost its reclaim: the condition goes and a merge patch's null removes status.reclaim.
    gone = build_status(
        PolicyVerdict(1, 10.0, evaluation=evaluation([], 1), reclaiming=False), status, T0 + 20
    )
    assert "ReclaimActive" not in conditions(gone)
    assert gone["reclaim"] is None


def test_owned_part_ignores_foreign_fields() -> None:
    assert owned_part({"matchedPods": 1, "kopf": {"x": 1}}) == {"matchedPods": 1}
    assert owned_part(None) == {}


def test_findings_round_trip_through_status() -> None:
    idle = finding("a", at=T0 - 300)
    oom = finding("b", rule="oom", kind=memory_ceiling.KIND, at=T0 - 60)
    status = build_status(PolicyVerdict(1, 10.0, evaluation=evaluation([oom, idle], 2)), None, T0)
    status["violations"].append({"pod": "c", "rule": "removed-rule", "reason": "X", "since": format_time(T0)})
    status["violations"].append({"pod": "d", "rule": "idle", "reason": "X", "since": "garbage"})
    restored = findings_from_status(status, SPEC, policy="ns/p", namespace="ns")
    assert [(f.pod, f.rule, f.kind, f.started_at) for f in restored] == [
        ("b", "oom", memory_ceiling.KIND, T0 - 60),
        ("a", "idle", utilization.FLOOR_KIND, T0 - 300),
    ]
    assert restored[0].gpus == ("GPU-a",)
    assert restored[1].message == "a is idle"
    assert math.isnan(restored[1].value)
    assert findings_from_status(None, SPEC, policy="ns/p", namespace="ns") == []
    assert findings_from_status({"violations": "nonsense"}, SPEC, policy="ns/p", namespace="ns") == []

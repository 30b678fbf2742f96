"""The operator's bookkeeping of scaling policies, end to end: the operator as a process on a real
kube-apiserver (no agent: without readings a policy still evaluates, every other interval).

- A scale action removed from a policy takes its status with it at the next evaluation.
- Conflicts between policies come from Kopf's index of the namespace's policies, kept up to date
  by the watch, and no round lists the policies (the API server's own request counter says so).

Each test has its own namespace and operator, so none depends on another's leftovers.
"""

from __future__ import annotations

from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import Operator, Setup, get, parse_metrics, prepare, wait_until
from test_operator_scaling import APP, deployment, policy

pytestmark = pytest.mark.integration

EVALUATION_COUNT = "gpuwarden_operator_evaluation_duration_seconds_count"


def conditions(setup: Setup, name: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in setup.policy_status(name).get("conditions") or []}


def reason(setup: Setup, name: str, ctype: str) -> str | None:
    return (conditions(setup, name).get(ctype) or {}).get("reason")


def wait_reason(setup: Setup, operator: Operator, name: str, ctype: str, want: str) -> None:
    """Until policy ``name``'s condition ``ctype`` has the reason ``want``."""
    wait_until(
        lambda: reason(setup, name, ctype) == want,
        timeout=60,
        what=f"policy {name}: {ctype} {want}",
        alive=operator.alive,
    )


def policy_lists(cp: ControlPlane) -> float:
    """LISTs of GPUMonitorPolicies the API server has answered since it started (its /metrics)."""
    text = cp.kubectl("get", "--raw", "/metrics", check=True).stdout
    return sum(
        value
        for sample, value in parse_metrics(text).items()
        if sample.startswith("apiserver_request_total{")
        and 'resource="gpumonitorpolicies"' in sample
        and 'verb="LIST"' in sample
    )


def wait_rounds(operator: Operator, rounds: int) -> None:
    """Until the operator has run ``rounds`` more evaluations (of any of its policies)."""
    start = operator.metric(EVALUATION_COUNT)
    wait_until(
        lambda: operator.metric(EVALUATION_COUNT) >= start + rounds,
        timeout=60,
        what=f"{rounds} more evaluations",
        alive=operator.alive,
    )


def test_removing_the_scale_action_makes_the_policy_ready_at_its_next_evaluation(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "unscale")
    ns = setup.namespace
    setup.apply(policy(ns, "lost", interval="1s"))  # its Deployment does not exist
    with setup.operator() as operator:
        operator.wait_ready()
        wait_reason(setup, operator, "lost", "Ready", "ScaleTargetNotFound")
        assert reason(setup, "lost", "ScalingActive") == "ScaleTargetNotFound"

        remove = '[{"op": "remove", "path": "/spec/actions/scale"}]'
        cp.kubectl("patch", "gmp", "lost", "-n", ns, "--type=json", "-p", remove, check=True)
        generation = get(cp, "gmp", "lost", "-n", ns)["metadata"]["generation"]
        # The first status written for the new generation is that of its first evaluation.
        status = wait_until(
            lambda: s if (s := setup.policy_status("lost")).get("observedGeneration") == generation else None,
            timeout=30,
            what=f"a status for generation {generation}",
            alive=operator.alive,
        )
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Evaluating")
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Violating"]  # ScalingActive went
    assert "scale" not in status


def test_conflicts_come_from_the_policy_index_without_a_list_per_round(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "claims")
    ns = setup.namespace
    setup.apply(deployment(ns, replicas=2))
    setup.apply(policy(ns, "a", interval="1s"))
    setup.apply(policy(ns, "watcher", dry_run=True, interval="1s"))  # same target, only watches
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other"}
    setup.apply(policy(ns, "elsewhere", target=other, interval="1s"))
    with setup.operator() as operator:
        operator.wait_ready()
        wait_reason(setup, operator, "a", "ScalingActive", "Active")
        assert reason(setup, "watcher", "ScalingActive") == "DryRun"

        lists = policy_lists(cp)
        wait_rounds(operator, 9)  # nine rounds in all, about three of each policy
        assert policy_lists(cp) == lists

        # A second acting policy on the same Deployment: the index learns of it, and both stop.
        setup.apply(policy(ns, "b", interval="1s"))
        for name in ("a", "b"):
            wait_reason(setup, operator, name, "ScalingActive", "PolicyConflict")
            message = conditions(setup, name)["ScalingActive"]["message"]
            assert f"not scaling Deployment {APP}: policies a, b all target it" in message

        # b only watches now: a acts again.
        setup.apply(policy(ns, "b", dry_run=True, interval="1s"))
        wait_reason(setup, operator, "a", "ScalingActive", "Active")
    assert get(cp, "deployment", APP, "-n", ns)["spec"]["replicas"] == 2  # nothing asked for a change

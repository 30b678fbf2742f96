"""``gpuwarden check``'s judgments, from objects shaped as the API server returns them: each problem
names what is wrong and what to set. (The whole check runs as the chart's ``helm test`` on the test node:
tests/integration/test_chart_on_node.py.)"""

from __future__ import annotations

from typing import Any

from test_crd_schema import VALIDATOR

from gpuwarden.operator.check import (
    check_policy,
    daemonset_problems,
    parse_metrics,
    pod_problem,
    reporting_problem,
)

DS = {"metadata": {"name": "gpuwarden-agent"}}


def daemonset(desired: int, created: int) -> dict[str, Any]:
    return {**DS, "status": {"desiredNumberScheduled": desired, "currentNumberScheduled": created}}


def test_a_daemonset_on_no_node_names_the_node_selector() -> None:
    (problem,) = daemonset_problems(daemonset(0, 0), [])
    assert "runs on no node" in problem
    assert "agent.nodeSelector" in problem


def test_pods_refused_by_pod_security_quote_the_refusal_and_name_the_label() -> None:
    refused = {
        "reason": "FailedCreate",
        "message": 'Error creating: pods "gpuwarden-agent-x" is forbidden: violates PodSecurity '
        '"baseline:latest": host namespaces (hostPID=true)',
    }
    (problem,) = daemonset_problems(daemonset(2, 0), [refused])
    assert 'violates PodSecurity "baseline:latest"' in problem
    assert "pod-security.kubernetes.io/enforce=privileged" in problem


def test_a_daemonset_with_all_its_pods_has_no_problem() -> None:
    assert daemonset_problems(daemonset(3, 3), [{"reason": "SuccessfulCreate", "message": "ok"}]) == []
    assert daemonset_problems(daemonset(3, 2), []) == [
        "the agent DaemonSet gpuwarden-agent has created 2 of its 3 pods"
    ]


def agent_pod(ready: bool, **container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "gpuwarden-agent-abcde"},
        "spec": {"nodeName": "gpu-1"},
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [
                {"name": "agent", "image": "r.example/gpuwarden/gpuwarden-agent:0.1.0", **container}
            ],
        },
    }


def test_an_agent_that_cannot_see_a_gpu_is_named_with_its_own_message() -> None:
    message = (
        "gpuwarden agent: nvml backend cannot start: NVML failed to initialise: NVML Shared Library "
        "Not Found\n"
        "  ... agent.runtimeClassName=nvidia ..."
    )
    pod = agent_pod(
        False,
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        lastState={"terminated": {"exitCode": 1, "message": message}},
    )
    problem = pod_problem(pod)
    assert problem is not None
    assert problem.startswith("agent pod gpuwarden-agent-abcde on gpu-1 exited (1): gpuwarden agent: nvml")
    assert "agent.runtimeClassName=nvidia" in problem


def test_an_image_that_cannot_be_pulled_names_the_registry_values() -> None:
    pod = agent_pod(False, state={"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})
    problem = pod_problem(pod)
    assert problem is not None
    assert "cannot pull its image r.example/gpuwarden/gpuwarden-agent:0.1.0" in problem
    assert "global.imageRegistry" in problem


def test_a_running_agent_without_fresh_samples_is_named_and_a_ready_one_is_not() -> None:
    problem = pod_problem(agent_pod(False, state={"running": {}}))
    assert problem is not None
    assert "not Ready" in problem
    assert "fresh samples" in problem
    assert pod_problem(agent_pod(True, state={"running": {}})) is None


EXPOSITION = """# HELP gpuwarden_agent_reports_sent_total Reports the operator accepted.
# TYPE gpuwarden_agent_reports_sent_total counter
gpuwarden_agent_reports_sent_total {sent}
# HELP gpuwarden_agent_report_errors_total Report POSTs that did not deliver, by reason.
# TYPE gpuwarden_agent_report_errors_total counter
gpuwarden_agent_report_errors_total{{reason="unauthorized"}} {unauthorized}
gpuwarden_agent_report_errors_total{{reason="connection"}} 0.0
"""


def scrape(sent: float, unauthorized: float) -> dict[str, float]:
    return parse_metrics(EXPOSITION.format(sent=sent, unauthorized=unauthorized))


def test_reports_delivered_between_two_scrapes_reach_the_operator() -> None:
    assert reporting_problem("p", scrape(10, 0), scrape(14, 0)) is None


def test_reports_failing_are_named_by_reason() -> None:
    problem = reporting_problem("p", scrape(10, 2), scrape(10, 7))
    assert problem == "agent pod p is not reaching the operator: its reports fail (unauthorized x5)"
    silent = reporting_problem("p", scrape(10, 2), scrape(10, 2))
    assert silent == "agent pod p is not reaching the operator: it delivered no report between two scrapes"


def test_the_check_policy_selects_no_pod_and_is_evaluated_every_second() -> None:
    policy = check_policy("gpuwarden-system")
    assert policy["metadata"]["namespace"] == "gpuwarden-system"
    assert policy["spec"]["evaluationInterval"] == "1s"
    assert policy["spec"]["selector"] == {"matchLabels": {"gpuwarden.dev/check": "no-such-pod"}}
    assert list(VALIDATOR.iter_errors({**policy, "metadata": {"name": "x"}})) == []  # the CRD admits it

"""End to end: two operator replicas with Kopf peering. Only the one with the higher priority acts:
it labels its own pod ``gpuwarden.dev/ingest-active=true``, accepts reports, posts the Events and
writes the status; the other removes the label, answers 503 and writes nothing. When the acting one
leaves, the other takes over (and resumes the violation instead of announcing it again).
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import (
    AGENT_SA,
    Agent,
    Operator,
    apply,
    apply_crds,
    create_gpu_pod,
    create_peering,
    create_plain_pod,
    events,
    get,
    gpu,
    http,
    pod,
    service_account_token,
    wait_until,
    write_scenario,
    write_token,
)

pytestmark = pytest.mark.integration

LABEL = "gpuwarden.dev/ingest-active"


def test_only_the_acting_replica_writes_and_the_other_takes_over(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    workdir = tmp_path_factory.mktemp("operator-ha")
    namespace = cp.create_namespace(f"gw-ha-{secrets.token_hex(3)}")
    apply_crds(cp)
    create_gpu_pod(cp, namespace, "idle-0", {"app": "x"})
    for name in ("operator-a", "operator-b"):
        create_plain_pod(cp, namespace, name)
    apply(
        cp,
        {
            "apiVersion": "gpuwarden.dev/v1alpha1",
            "kind": "GPUMonitorPolicy",
            "metadata": {"name": "idle", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "x"}},
                "evaluationInterval": "1s",
                "rules": [
                    {"name": "idle", "utilizationFloor": {"percent": 20, "for": "10s", "signal": "gpuUtil"}}
                ],
            },
        },
    )
    create_peering(cp, namespace, "gpuwarden")
    token = service_account_token(cp, namespace, AGENT_SA)
    token_file = write_token(workdir / "token", token)
    uuid = "GPU-4a000000-0000-4000-8000-000000000001"
    scenario = write_scenario(
        workdir / "scenario.yaml",
        "ha",
        [gpu(uuid, 0, [{"kind": "idle", "level": 3, "noise": 1}], [{"kind": "idle", "level": "8Gi"}])],
        [pod(namespace, "idle-0", uuid, {"app": "x"}, 1234)],
    )

    def labelled() -> set[str]:
        pods = get(cp, "pods", "-n", namespace, "-l", f"{LABEL}=true")["items"]
        return {p["metadata"]["name"] for p in pods}

    def warnings() -> list[Any]:
        return [
            e for e in events(cp, namespace, kind="Pod", name="idle-0") if e["reason"] == "GPUUnderutilized"
        ]

    def peers() -> set[str]:
        peering = get(cp, "kopfpeering", "gpuwarden", "-n", namespace) or {}
        return set((peering.get("status") or {}).keys())

    def violations() -> list[Any]:
        status = (get(cp, "gpumonitorpolicy", "idle", "-n", namespace) or {}).get("status") or {}
        return list(status.get("violations") or [])

    # A rolling update's order: the first replica runs, then the second joins.
    a = Operator(cp, workdir, namespace, peering="gpuwarden", pod_name="operator-a", priority=200)
    b: Operator | None = None
    agents: list[Agent] = []
    try:
        a.wait_ready(active=True, timeout=90)
        b = Operator(cp, workdir, namespace, peering="gpuwarden", pod_name="operator-b", priority=100)
        wait_until(
            lambda: "operator-b" in peers(), timeout=60, what="operator-b in the peering", alive=b.alive
        )
        b.wait_ready(active=False, timeout=30)
        assert wait_until(lambda: labelled() == {"operator-a"}, timeout=30, what="only operator-a labelled")

        # The stand-by refuses reports (the agent would retry); the acting one takes them.
        status, payload = http("POST", b.url, b"{}", {"Authorization": f"Bearer {token}"})
        assert (status, payload["reason"]) == (503, "Standby")
        agents.append(Agent(cp, workdir, scenario, a.url, token_file, "gpu-node-1"))
        (warning,) = wait_until(warnings, timeout=60, what="the Warning", alive=a.alive)
        assert warning["reportingInstance"] == "operator-a"
        wait_until(violations, timeout=30, what="the violation in status")

        # A while later: still only operator-a's doing.
        wait_until(
            lambda: a.metric("gpuwarden_operator_evaluation_duration_seconds_count") >= 15,
            timeout=60,
            what="operator-a evaluating",
        )
        assert {e["reportingInstance"] for e in events(cp, namespace)} == {"operator-a"}
        assert b.metric("gpuwarden_operator_status_writes_total") == 0
        assert b.metric("gpuwarden_operator_evaluation_duration_seconds_count") == 0
        assert b.metric("gpuwarden_operator_reports_total") == 1  # the refused one above
        assert a.metric("gpuwarden_operator_status_writes_total") >= 1

        # operator-a leaves (graceful: Kopf drops its peering entry, it removes its label).
        a.stop()
        b.wait_ready(active=True, timeout=60)
        assert wait_until(lambda: labelled() == {"operator-b"}, timeout=30, what="operator-b labelled")
        agents.append(Agent(cp, workdir, scenario, b.url, token_file, "gpu-node-2"))
        wait_until(
            lambda: (
                b.metric("gpuwarden_operator_evaluation_duration_seconds_count") >= 20
                and b.metric("gpuwarden_operator_points_total") >= 15
            ),
            timeout=90,
            what="operator-b evaluating fresh data",
            alive=b.alive,
        )
        assert len(warnings()) == 1  # resumed from status, not announced again
        assert (
            b.metric(f'gpuwarden_operator_findings{{namespace="{namespace}",policy="idle",rule="idle"}}') == 1
        )
    finally:
        for agent in agents:
            agent.stop()
        if b is not None:
            b.stop()
        a.stop()

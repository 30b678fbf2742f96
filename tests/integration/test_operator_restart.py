"""End to end: the operator is killed mid-scenario and started again; the ongoing violation is resumed
from the policy's status (and rebuilt from the agent's replay), not announced again.
"""

from __future__ import annotations

import secrets

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
    events,
    get,
    gpu,
    pod,
    service_account_token,
    wait_until,
    write_scenario,
    write_token,
)

pytestmark = pytest.mark.integration


def test_a_restart_does_not_announce_an_ongoing_violation_again(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    workdir = tmp_path_factory.mktemp("operator-restart")
    namespace = cp.create_namespace(f"gw-restart-{secrets.token_hex(3)}")
    apply_crds(cp)
    create_gpu_pod(cp, namespace, "idle-0", {"app": "x"})
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
                "actions": {"renotifyInterval": "1h"},
            },
        },
    )
    create_peering(cp, namespace, "gpuwarden")
    token = write_token(workdir / "token", service_account_token(cp, namespace, AGENT_SA))
    uuid = "GPU-4e57a470-0000-4000-8000-000000000001"
    scenario = write_scenario(
        workdir / "scenario.yaml",
        "restart",
        [gpu(uuid, 0, [{"kind": "idle", "level": 3, "noise": 1}], [{"kind": "idle", "level": "8Gi"}])],
        [pod(namespace, "idle-0", uuid, {"app": "x"}, 1234)],
    )

    def warnings() -> list[dict[str, object]]:
        found = events(cp, namespace, kind="Pod", name="idle-0")
        return [e for e in found if e["reason"] == "GPUUnderutilized"]

    def violations() -> list[dict[str, object]]:
        status = (get(cp, "gpumonitorpolicy", "idle", "-n", namespace) or {}).get("status") or {}
        return list(status.get("violations") or [])

    # Same pod name both times: a restarted container of the same replica (same peering identity).
    first = Operator(cp, workdir, namespace, peering="gpuwarden", pod_name="gpuwarden-operator-0")
    agent: Agent | None = None
    second: Operator | None = None
    try:
        first.wait_ready()
        agent = Agent(cp, workdir, scenario, first.url, token, "gpu-node-1")
        wait_until(warnings, timeout=60, what="the first Warning", alive=first.alive)
        (since,) = [v["since"] for v in wait_until(violations, timeout=30, what="the violation in status")]

        first.kill()  # SIGKILL: no goodbye, no cleanup, its peering entry stays until it expires

        # The agent buffers while nobody listens; the new process listens where the old one did.
        assert agent.alive() is None
        second = Operator(
            cp,
            workdir,
            namespace,
            peering="gpuwarden",
            pod_name="gpuwarden-operator-0",
            ports=(first.ingest_port, first.metrics_port),
        )
        second.wait_ready()

        # Evaluate for a good while with the replayed and fresh data: well past the rule's 10 s window.
        wait_until(
            lambda: (
                second.metric("gpuwarden_operator_evaluation_duration_seconds_count") >= 25
                and second.metric("gpuwarden_operator_points_total") >= 20
            ),
            timeout=90,
            what="the restarted operator evaluating fresh data",
            alive=second.alive,
        )
        assert len(warnings()) == 1, [e["message"] for e in warnings()]
        (after,) = violations()
        assert after["since"] == since  # the same violation, resumed
        findings = f'gpuwarden_operator_findings{{namespace="{namespace}",policy="idle",rule="idle"}}'
        assert second.metric(findings) == 1
        resolved = [e for e in events(cp, namespace, kind="Pod", name="idle-0") if e["type"] == "Normal"]
        assert resolved == []
    finally:
        if agent is not None:
            agent.stop()
        if second is not None:
            second.stop()
        first.stop()

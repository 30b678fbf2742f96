"""End to end: the operator is killed mid-scenario and started again; the ongoing violation is resumed
from the policy's status (and rebuilt from the agent's replay), not announced again.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import idle_pod, prepare, wait_until

pytestmark = pytest.mark.integration


def test_a_restart_does_not_announce_an_ongoing_violation_again(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "restart")
    uuid = "GPU-4e57a470-0000-4000-8000-000000000001"
    scenario = idle_pod(setup, "restart", uuid, actions={"renotifyInterval": "1h"})

    def warnings() -> list[dict[str, Any]]:
        return setup.events("Pod", "idle-0", "GPUUnderutilized")

    def violations() -> list[dict[str, Any]]:
        return setup.violations("idle")

    # Every process is stopped on the way out (the stack unwinds in reverse).
    with ExitStack() as running:
        # Same pod name both times: a restarted container of the same replica (same peering identity).
        first = running.enter_context(setup.operator())
        first.wait_ready()
        agent = running.enter_context(setup.agent(scenario, first))
        wait_until(warnings, timeout=60, what="the first Warning", alive=first.alive)
        (since,) = [v["since"] for v in wait_until(violations, timeout=30, what="the violation in status")]

        first.kill()  # SIGKILL: no goodbye, no cleanup, its peering entry stays until it expires

        # The agent buffers while nobody listens; the new process listens where the old one did.
        assert agent.alive() is None
        second = running.enter_context(setup.operator(ports=(first.ingest_port, first.metrics_port)))
        second.wait_ready()

        # Evaluate for a good while with the replayed and fresh data: well past the rule's 10 s window.
        wait_until(
            lambda: second.evaluated(25, points=20),
            timeout=90,
            what="the restarted operator evaluating fresh data",
            alive=second.alive,
        )
        assert len(warnings()) == 1, [e["message"] for e in warnings()]
        (after,) = violations()
        assert after["since"] == since  # the same violation, resumed
        assert second.findings("idle", "idle") == 1
        resolved = [e for e in setup.events("Pod", "idle-0") if e["type"] == "Normal"]
        assert resolved == []

"""End to end: the operator is killed (SIGKILL) mid-violation and started again.

What survives: every snapshot the agent took while no operator listened (it buffers them and
replays them to the new process, oldest first), and the ongoing violation, resumed from the
policy's status and re-judged on the replayed readings, not announced again.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import delivery, idle_pod, prepare, wait_until

pytestmark = pytest.mark.integration

OUTAGE_SNAPSHOTS = 11
"""Snapshots the agent buffers before the operator comes back: they span the rule's 10 s window,
so that the replay alone lets the new process judge the violation."""


def test_a_killed_operator_loses_no_buffered_snapshot_and_announces_nothing_twice(
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

        # Nobody listens now, so nothing leaves the buffer: what the agent took and no longer holds is
        # what the first process acknowledged (and lost with its memory).
        down = wait_until(
            lambda: agent.metrics() or None, timeout=30, what="the agent's metrics", alive=agent.alive
        )
        acknowledged = int(
            down["gpuwarden_agent_samples_total"] - down["gpuwarden_agent_report_buffer_snapshots"]
        )
        wait_until(
            lambda: agent.metrics().get("gpuwarden_agent_report_buffer_snapshots", 0) >= OUTAGE_SNAPSHOTS,
            timeout=60,
            what=f"{OUTAGE_SNAPSHOTS} snapshots buffered by the agent",
            alive=agent.alive,
        )
        # The new process listens where the old one did.
        second = running.enter_context(setup.operator(ports=(first.ingest_port, first.metrics_port)))
        second.wait_ready()

        # Everything taken since the first process died reached the second, once: its readings are
        # exactly the agent's snapshots since then (one GPU: one reading a snapshot).
        replayed = wait_until(
            lambda: d if (d := delivery(agent, second)) is not None and d.buffered == 0 else None,
            timeout=60,
            what="the agent's buffer replayed to the restarted operator",
            alive=lambda: second.alive() or agent.alive(),
        )
        assert replayed.dropped == 0
        assert replayed.taken - acknowledged >= OUTAGE_SNAPSHOTS
        assert replayed.stored == replayed.taken - acknowledged, replayed

        # Evaluate a while on the replayed and fresh readings: a full window of them from the start.
        rounds = second.metric("gpuwarden_operator_evaluation_duration_seconds_count")
        wait_until(
            lambda: second.evaluated(rounds + 8, points=replayed.stored + 5),
            timeout=60,
            what="the restarted operator evaluating the replay and fresh data",
            alive=second.alive,
        )
        assert setup.announcements("Pod", "idle-0", "GPUUnderutilized") == 1, [
            e["message"] for e in warnings()
        ]
        assert setup.announcements("GPUMonitorPolicy", "idle", "GPUUnderutilized") == 1
        (after,) = violations()
        assert after["since"] == since  # the same violation, resumed
        assert second.findings("idle", "idle") == 1
        resolved = [e for e in setup.events("Pod", "idle-0") if e["type"] == "Normal"]
        assert resolved == []

"""End to end: two operator replicas with Kopf peering. Only the one with the higher priority acts:
it labels its own pod ``gpuwarden.dev/ingest-active=true``, accepts reports, posts the Events and
writes the status; the other removes the label, answers 503 and writes nothing. When the acting one
leaves, the other takes over (and resumes the violation instead of announcing it again).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import PEERING, create_plain_pod, events, get, http, idle_pod, prepare, wait_until

pytestmark = pytest.mark.integration

LABEL = "gpuwarden.dev/ingest-active"


def test_only_the_acting_replica_writes_and_the_other_takes_over(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "ha")
    namespace = setup.namespace
    scenario = idle_pod(setup, "ha", "GPU-4a000000-0000-4000-8000-000000000001")
    for name in ("operator-a", "operator-b"):
        create_plain_pod(cp, namespace, name)

    def labelled() -> set[str]:
        pods = get(cp, "pods", "-n", namespace, "-l", f"{LABEL}=true")["items"]
        return {p["metadata"]["name"] for p in pods}

    def warnings() -> list[Any]:
        return setup.events("Pod", "idle-0", "GPUUnderutilized")

    def peers() -> set[str]:
        peering = get(cp, "kopfpeering", PEERING, "-n", namespace) or {}
        return set((peering.get("status") or {}).keys())

    # Every process is stopped on the way out, the agents first (the stack unwinds in reverse).
    with ExitStack() as running:
        # A rolling update's order: the first replica runs, then the second joins.
        a = running.enter_context(setup.operator("operator-a", priority=200))
        a.wait_ready(active=True, timeout=90)
        b = running.enter_context(setup.operator("operator-b", priority=100))
        wait_until(
            lambda: "operator-b" in peers(), timeout=60, what="operator-b in the peering", alive=b.alive
        )
        b.wait_ready(active=False, timeout=30)
        assert wait_until(lambda: labelled() == {"operator-a"}, timeout=30, what="only operator-a labelled")

        # The stand-by refuses reports (the agent would retry); the acting one takes them.
        status, payload = http("POST", b.url, b"{}", {"Authorization": f"Bearer {setup.token}"})
        assert (status, payload["reason"]) == (503, "Standby")
        running.enter_context(setup.agent(scenario, a))
        (warning,) = wait_until(warnings, timeout=60, what="the Warning", alive=a.alive)
        assert warning["reportingInstance"] == "operator-a"
        wait_until(lambda: setup.violations("idle"), timeout=30, what="the violation in status")

        # A while later: still only operator-a's doing.
        wait_until(lambda: a.evaluated(15), timeout=60, what="operator-a evaluating")
        assert {e["reportingInstance"] for e in events(cp, namespace)} == {"operator-a"}
        assert b.metric("gpuwarden_operator_status_writes_total") == 0
        assert b.metric("gpuwarden_operator_evaluation_duration_seconds_count") == 0
        assert b.metric("gpuwarden_operator_reports_total") == 1  # the refused one above
        assert a.metric("gpuwarden_operator_status_writes_total") >= 1

        # operator-a leaves (graceful: Kopf drops its peering entry, it removes its label).
        a.stop()
        b.wait_ready(active=True, timeout=60)
        assert wait_until(lambda: labelled() == {"operator-b"}, timeout=30, what="operator-b labelled")
        running.enter_context(setup.agent(scenario, b))  # (the first one keeps trying operator-a)
        wait_until(
            lambda: b.evaluated(20, points=15),
            timeout=90,
            what="operator-b evaluating fresh data",
            alive=b.alive,
        )
        assert len(warnings()) == 1  # resumed from status, not announced again
        assert b.findings("idle", "idle") == 1

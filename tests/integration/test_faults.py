"""End to end, one fault each, with what survives it written as assertions (the operator killed
mid-scenario is tests/integration/test_operator_restart.py).

- The agent is killed (SIGKILL) and another started: its reports, with a new agent id and seqs
  from 0 again, are all stored (none taken for a retry); the violation carries on, announced once.
- The GPU falls off the bus mid-run (the scenario's ``lost``/``recover``): it sends no readings (a
  gap, not zeros), so the violation stays as it was, is not resolved and not announced again; when
  the GPU is back and busy, the series resumes and the violation ends on its readings.
- kube-apiserver is restarted under load: reports keep being taken (the token's review is cached),
  the violation found meanwhile is announced once when the API server is back, status converges,
  and the watches come back (a spec change is seen).
- etcd is stopped (SIGSTOP) for 30 s: the same, against an API server that hangs rather than refuses.

The last two run on a control plane of this module's own, so that a fault never reaches the
session's. Every wait is on a condition, but for the 30 s of the etcd outage, which is the fault.

Events are counted by the involved object's uid with their ``count``, as the operator created them.
A violation's ``Resolved`` Event goes through Kopf's per-object queue behind its Warning, so once it
is there no retry of the Warning is still pending, and "announced once" is final.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from types import TracebackType
from typing import Any, Self

import pytest
from controlplane import Binaries, ControlPlane, running_control_plane
from operator_support import (
    Agent,
    Operator,
    Setup,
    delivery,
    get,
    http,
    idle_pod,
    operator_and_agent,
    prepare,
    wait_until,
)

from gpuwarden.wire.node import SCHEMA_VERSION, GpuSample, NodeReport, PodRef, Snapshot, dump_report

pytestmark = pytest.mark.integration

UUID = "GPU-fa000000-0000-4000-8000-000000000001"
NODE = "gpu-node-1"
"""Where create_gpu_pod puts the pods and the tests' agent runs."""
ETCD_OUTAGE_S = 30.0
LOAD_PODS = ("load-0", "load-1", "load-2", "load-3")


@pytest.fixture(scope="module")
def own_control_plane(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A control plane for this module alone: the API server and etcd faults stay in it."""
    with running_control_plane(control_plane_binaries, tmp_path_factory.mktemp("faults-cp")) as cp:
        yield cp


# -- what the tests read -----------------------------------------------------------------------


def warnings(setup: Setup) -> tuple[int, int]:
    """How often the violation was announced on the pod and on the policy."""
    return (
        setup.announcements("Pod", "idle-0", "GPUUnderutilized"),
        setup.announcements("GPUMonitorPolicy", "idle", "GPUUnderutilized"),
    )


def since_of_the_violation(setup: Setup) -> str:
    (violation,) = wait_until(lambda: setup.violations("idle"), timeout=30, what="the violation in status")
    return str(violation["since"])


def gpu_state(agent: Agent) -> str | None:
    """The state the agent reports its GPU in (``ok``, ``lost``), None before its first sample."""
    for key in agent.metrics():
        if key.startswith("gpuwarden_gpu_up{") and (m := re.search(r'state="(\w+)"', key)):
            return m.group(1)
    return None


def pod_gauge(operator: Operator, name: str, pod: str) -> float | None:
    """One of the operator's per-pod GPU gauges for ``pod``, None while it has none."""
    for key, value in operator.metrics().items():
        if key.startswith(name + "{") and f'pod="{pod}"' in key:
            return value
    return None


def resolved(setup: Setup) -> list[dict[str, Any]]:
    return setup.events("Pod", "idle-0", "GPUUnderutilizedResolved")


def spec_change_observed(setup: Setup) -> None:
    """Change the policy's spec and wait until its status names the new generation: the operator's
    watch of policies works again and its daemon evaluates and writes."""
    patch = {"spec": {"actions": {"renotifyInterval": "2h"}}}
    setup.cp.kubectl(
        "patch", "gpumonitorpolicy", "idle", "-n", setup.namespace, "--type=merge", "-p", json.dumps(patch),
        check=True,
    )  # fmt: skip
    generation = get(setup.cp, "gpumonitorpolicy", "idle", "-n", setup.namespace)["metadata"]["generation"]
    wait_until(
        lambda: setup.policy_status("idle").get("observedGeneration") == generation,
        timeout=60,
        what=f"status.observedGeneration {generation}",
    )


class ReportLoad:
    """Reports in the agent's wire format for :data:`LOAD_PODS` on the agent's node, ``rate`` a
    second from a thread, as a second agent on that node would send them; answers counted by status
    (0: no answer)."""

    def __init__(self, setup: Setup, url: str, rate: float = 25.0) -> None:
        self.answered: Counter[int] = Counter()
        self._headers = {"Authorization": f"Bearer {setup.token}", "Content-Type": "application/json"}
        self._namespace = setup.namespace
        self._url = url
        self._period = 1.0 / rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="report load", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Send no more; return once the last report is answered."""
        self._stop.set()
        self._thread.join(timeout=60)

    def body(self, seq: int) -> bytes:
        gpus = [
            GpuSample(
                uuid=f"GPU-fa000000-0000-4000-8000-1000000000{index:02d}",
                index=index,
                model="NVIDIA H200",
                utilization_gpu=50.0,
                sm_active=40.0,
                memory_used_bytes=20 * 2**30,
                memory_total_bytes=141 * 2**30,
                pods=[PodRef(namespace=self._namespace, name=name, container="main")],
            )
            for index, name in enumerate(LOAD_PODS)
        ]
        report = NodeReport(
            schema_version=SCHEMA_VERSION,
            node=NODE,
            agent_id="report-load",
            seq=seq,
            snapshots=[Snapshot(timestamp=time.time(), gpus=gpus)],
        )
        return dump_report(report)

    def _run(self) -> None:
        seq = 0
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                status, _ = http("POST", self._url, self.body(seq), self._headers)
            except OSError:
                status = 0
            self.answered[status] += 1
            seq += 1
            due += self._period
            self._stop.wait(max(0.0, due - time.monotonic()))  # the load's pace


# -- the agent ---------------------------------------------------------------------------------


def test_a_killed_agent_is_replaced_and_the_finding_carries_on(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    setup = prepare(control_plane, tmp_path_factory, "agentkill")
    scenario = idle_pod(setup, "agentkill", UUID, actions={"renotifyInterval": "1h"})
    with ExitStack() as running:
        operator = running.enter_context(setup.operator())
        operator.wait_ready()
        first = running.enter_context(setup.agent(scenario, operator))
        wait_until(lambda: warnings(setup) == (1, 1), timeout=60, what="the Warning", alive=operator.alive)
        since = since_of_the_violation(setup)

        first.kill()  # SIGKILL: what it had not delivered yet (at 1 Hz, at most a snapshot) is gone
        second = running.enter_context(setup.agent(scenario, operator))

        # A new agent id with seqs from 0 again: a restarted agent, not retries of the old one's reports.
        def settled(more: int = 0) -> Any:
            d = delivery(second, operator)
            return d is not None and d.buffered == 0 and d.taken >= more and d

        start = wait_until(lambda: settled(1), timeout=60, what="the new agent's first report")
        end = wait_until(
            lambda: settled(start.taken + 10),
            timeout=60,
            what="a rule window of the new agent's readings stored",
            alive=lambda: operator.alive() or second.alive(),
        )
        assert end.stored - start.stored == end.taken - start.taken, (start, end)
        assert operator.metric("gpuwarden_operator_reports_duplicate_total") == 0

        # Judged on the new agent's readings alone for a while: the same violation, not a new one.
        rounds = operator.metric("gpuwarden_operator_evaluation_duration_seconds_count")
        wait_until(lambda: operator.evaluated(rounds + 3), timeout=30, what="three more evaluations")
        assert warnings(setup) == (1, 1), setup.events("Pod", "idle-0")
        assert [v["since"] for v in setup.violations("idle")] == [since]
        assert [e for e in setup.events("Pod", "idle-0") if e["type"] == "Normal"] == []
        assert operator.findings("idle", "idle") == 1


# -- the GPU -----------------------------------------------------------------------------------


def test_a_gpu_lost_mid_run_keeps_its_finding_until_its_readings_come_back(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    setup = prepare(control_plane, tmp_path_factory, "gpulost")
    # Idle from the start (the finding at ~10 s), lost from 14 s to 20 s, idle again, busy from 30 s.
    health = [{"kind": "lost", "at": "14s"}, {"kind": "recover", "at": "20s"}]
    scenario = idle_pod(
        setup, "gpulost", UUID, actions={"renotifyInterval": "1h"}, busy_at="30s", health=health
    )
    with operator_and_agent(setup, scenario) as (operator, agent):
        alive = lambda: operator.alive() or agent.alive()  # noqa: E731
        wait_until(lambda: warnings(setup) == (1, 1), timeout=60, what="the Warning", alive=alive)
        since = since_of_the_violation(setup)
        wait_until(lambda: gpu_state(agent) == "lost", timeout=30, what="the GPU lost", alive=alive)
        wait_until(lambda: gpu_state(agent) == "ok", timeout=30, what="the GPU back", alive=alive)

        # Lost, it had no readings (a gap, not zeros): the violation held, and is not announced again.
        assert resolved(setup) == [], [e["message"] for e in resolved(setup)]
        assert [v["since"] for v in setup.violations("idle")] == [since]
        assert warnings(setup) == (1, 1)

        # Busy from 30 s: the series resumes, and the violation ends on its readings.
        (event,) = wait_until(lambda: resolved(setup), timeout=60, what="the violation resolved", alive=alive)
        assert "back within the rule" in event["message"], event["message"]
        assert (pod_gauge(operator, "gpuwarden_pod_gpu_utilization_percent", "idle-0") or 0) > 40
        assert warnings(setup) == (1, 1), setup.events("Pod", "idle-0")
        wait_until(lambda: setup.violations("idle") == [], timeout=30, what="the violation gone from status")
        assert operator.findings("idle", "idle") == 0


# -- the control plane -------------------------------------------------------------------------


def converged(setup: Setup, operator: Operator, agent: Agent, load: ReportLoad | None = None) -> None:
    """After a control-plane fault: status, Events and watches caught up, and nothing was lost."""
    alive = lambda: operator.alive() or agent.alive()  # noqa: E731
    wait_until(lambda: setup.violations("idle"), timeout=60, what="the violation in status", alive=alive)
    spec_change_observed(setup)
    wait_until(lambda: resolved(setup), timeout=60, what="the violation resolved", alive=alive)
    assert warnings(setup) == (1, 1), setup.events("Pod", "idle-0")
    assert setup.announcements("Pod", "idle-0", "GPUUnderutilizedResolved") == 1
    assert operator.metric("gpuwarden_operator_active") == 1
    assert operator.metric('gpuwarden_operator_reports_rejected_total{reason="internal"}') == 0
    if load is not None:
        load.stop()
        assert set(load.answered) == {200}, load.answered
    loaded = 0 if load is None else len(LOAD_PODS) * load.answered[200]
    books = wait_until(
        lambda: d if (d := delivery(agent, operator)) is not None and d.buffered == 0 else None,
        timeout=30,
        what="the agent's books",
    )
    # The same operator process throughout: everything the agent took, and every reading of the
    # load's accepted reports, is in its store.
    assert books.dropped == 0
    assert books.stored == books.taken + loaded, (books, loaded)


def test_an_api_server_restart_under_load_loses_no_report_and_no_announcement(
    own_control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = own_control_plane
    setup = prepare(cp, tmp_path_factory, "apirestart", gpu_pods=LOAD_PODS)
    scenario = idle_pod(setup, "apirestart", UUID, actions={"renotifyInterval": "1h"}, busy_at="25s")
    with ExitStack() as running:
        # The load and the agent speak for the same node: room for both in its rate limit.
        operator = running.enter_context(setup.operator(extra_args=["--node-rate=200"]))
        operator.wait_ready()
        agent = running.enter_context(setup.agent(scenario, operator))
        load = running.enter_context(ReportLoad(setup, operator.url))
        wait_until(lambda: load.answered[200] >= 10, timeout=30, what="the load's first reports")

        assert operator.findings("idle", "idle") == 0  # it is to be found while the API server is away
        cp.stop_apiserver()
        try:
            before = load.answered[200]
            # The rule fires with no API server: ingestion and evaluation do not need it.
            wait_until(
                lambda: operator.findings("idle", "idle") == 1,
                timeout=60,
                what="the violation found while the API server is away",
                alive=operator.alive,
            )
            # And the reports keep being taken: a second's load and more, the API server still away.
            wait_until(
                lambda: load.answered[200] > before + 25,
                timeout=30,
                what=f"25 more reports taken while the API server is away (answered: {load.answered})",
                alive=operator.alive,
            )
            assert cp.apiserver is None
        finally:
            cp.start_apiserver()
        converged(setup, operator, agent, load)


def test_etcd_stopped_for_30s_the_operator_rides_it_out_and_catches_up(
    own_control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = own_control_plane
    setup = prepare(cp, tmp_path_factory, "etcdstop")
    scenario = idle_pod(setup, "etcdstop", UUID, actions={"renotifyInterval": "1h"}, busy_at="38s")
    with operator_and_agent(setup, scenario) as (operator, agent):
        wait_until(lambda: operator.metric("gpuwarden_operator_points_total") >= 2, timeout=30, what="data")

        cp.pause_etcd()
        stopped = time.monotonic()
        try:
            # The API server hangs on everything that reaches etcd; the rule fires all the same.
            wait_until(
                lambda: operator.findings("idle", "idle") == 1,
                timeout=ETCD_OUTAGE_S,
                what="the violation found while etcd is stopped",
                alive=operator.alive,
            )
            time.sleep(max(0.0, ETCD_OUTAGE_S - (time.monotonic() - stopped)))  # the outage itself
            # Reports were taken throughout (the token's review is cached): all the agent took is stored.
            wait_until(
                lambda: (
                    (d := delivery(agent, operator)) is not None and d.buffered == 0 and d.stored == d.taken
                ),
                timeout=10,
                what="every snapshot stored while etcd is stopped",
            )
        finally:
            cp.resume_etcd()
        converged(setup, operator, agent)

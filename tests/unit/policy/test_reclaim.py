"""actions.reclaim's pure decisions, on an injected clock: the spec, idle workloads, recent work,
the warning and grace period, and the circuit breaker."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.reclaim import (
    CircuitBreaker,
    Idle,
    ReclaimPlanner,
    ReclaimStepKind,
    WorkloadRef,
    idle_workloads,
    recently_active,
)
from gpuwarden.policy.spec.fields import SpecError
from gpuwarden.policy.spec.model import ReclaimAction, ReclaimMethod
from gpuwarden.policy.store.series import PodId, Point, SeriesKey, SeriesStore

T0 = 1_900_000_000.0
NB = WorkloadRef("apps/v1", "Deployment", "notebook")
JOB = WorkloadRef("batch/v1", "Job", "train")
IDLE_RULE = {"name": "idle", "utilizationFloor": {"percent": 20, "for": "5m", "signal": "gpuUtil"}}


def spec_with(reclaim: dict[str, object], *rules: dict[str, object]) -> ReclaimAction:
    spec = parse_spec({"selector": {}, "rules": list(rules or (IDLE_RULE,)), "actions": {"reclaim": reclaim}})
    assert spec.actions.reclaim is not None
    return spec.actions.reclaim


ACTION = spec_with({"rules": ["idle"], "action": "ScaleToZero"})


@dataclass(frozen=True)
class F:
    rule: str
    pod: str
    started_at: float


# --- the spec --------------------------------------------------------------------------------------


def test_the_spec_defaults_to_dry_run_a_ten_minute_grace_and_five_an_hour() -> None:
    expected = ReclaimAction(
        rules=("idle",), method=ReclaimMethod.SCALE_TO_ZERO, grace_seconds=600.0, max_per_hour=5, dry_run=True
    )
    assert expected == ACTION


@pytest.mark.parametrize(
    ("reclaim", "rules", "message"),
    [
        (
            {"rules": ["busy"], "action": "Suspend"},
            ({"name": "busy", "utilizationCeiling": {"percent": 90}},),
            'spec.actions.reclaim.rules[0]: "busy" is a utilizationCeiling rule; reclaim acts on'
            " utilizationFloor or idleGpus rules",
        ),
        (
            {"rules": ["some"], "action": "ScaleToZero"},
            ({"name": "some", "idleGpus": {}},),
            'spec.actions.reclaim.rules[0]: "some" is a idleGpus rule (another GPU of the pod works): only'
            " action Annotate fits it",
        ),
        (
            {"rules": ["idle"], "action": "Delete"},
            (IDLE_RULE,),
            'spec.actions.reclaim.action: "Delete" is not one of ScaleToZero, Suspend, Annotate',
        ),
        (
            {"rules": ["idle"], "action": "Suspend", "gracePeriod": "5s"},
            (IDLE_RULE,),
            'spec.actions.reclaim.gracePeriod: "5s" is too short; must be at least 10s',
        ),
        (
            {"rules": ["nope"], "action": "Suspend"},
            (IDLE_RULE,),
            'spec.actions.reclaim.rules[0]: "nope" is not a rule in spec.rules',
        ),
    ],
)
def test_the_spec_refuses_what_cannot_reclaim(
    reclaim: dict[str, object], rules: tuple[dict[str, object], ...], message: str
) -> None:
    with pytest.raises(SpecError) as caught:
        spec_with(reclaim, *rules)
    assert str(caught.value) == message


def test_idle_gpus_may_annotate() -> None:
    action = spec_with({"rules": ["some"], "action": "Annotate"}, {"name": "some", "idleGpus": {}})
    assert action.method is ReclaimMethod.ANNOTATE


# --- idle workloads --------------------------------------------------------------------------------


def test_a_workload_is_idle_only_when_every_pod_is() -> None:
    findings = [F("idle", "nb-0", T0), F("idle", "nb-1", T0 + 30), F("idle", "train-0", T0)]
    pods = {NB: ["nb-0", "nb-1"], JOB: ["train-0", "train-1"]}
    idle = idle_workloads(ACTION, findings, pods)
    # The notebook's last pod turned idle at T0 + 30: from then on all were.
    assert idle == {NB: Idle(("nb-0", "nb-1"), T0 + 30, "idle on 2/2 pods")}


def test_findings_of_other_rules_and_pods_that_worked_do_not_count() -> None:
    pods = {NB: ["nb-0"]}
    assert idle_workloads(ACTION, [F("leak", "nb-0", T0)], pods) == {}
    assert idle_workloads(ACTION, [F("idle", "nb-0", T0)], pods, active=[PodId("ns", "nb-0")]) == {}


def test_recent_work_is_a_gpu_at_the_floor_over_the_last_interval_and_silence_is_not_idle() -> None:
    store = SeriesStore(retention_seconds=3600, max_points=1000)
    now = T0 + 600
    for t in range(int(T0), int(now) + 1, 10):
        store.add(SeriesKey("ns", "idle", "GPU-0"), Point(t, gpu_util=2.0))
        # Idle for ten minutes, then at 90% for the last 10 s: real work, long before the 5m mean moves.
        store.add(SeriesKey("ns", "waking", "GPU-1"), Point(t, gpu_util=90.0 if t >= now - 10 else 2.0))
        if t < T0 + 300:  # silent for the last five minutes
            store.add(SeriesKey("ns", "silent", "GPU-2"), Point(t, gpu_util=2.0))
    pods = [PodId("ns", p) for p in ("idle", "waking", "silent")]
    rules = parse_spec({"selector": {}, "rules": [IDLE_RULE]}).rules
    active = recently_active({p: store.series_of(*p) for p in pods}, ACTION, rules, now, 10.0)
    assert active == {PodId("ns", "waking"), PodId("ns", "silent")}


# --- the warning and the grace period ----------------------------------------------------------------


def idle_nb(since: float = T0) -> dict[WorkloadRef, Idle]:
    return {NB: Idle(("nb-0",), since, "idle on 1/1 pods")}


def test_warned_then_due_exactly_one_grace_period_later() -> None:
    planner = ReclaimPlanner(grace_seconds=600)
    (warn,) = planner.plan(idle_nb(), T0)
    assert (warn.kind, warn.due_at) == (ReclaimStepKind.WARN, T0 + 600)
    for t in range(10, 600, 10):
        assert planner.plan(idle_nb(), T0 + t) == []
    assert planner.pending() == {NB: T0 + 600}
    (due,) = planner.plan(idle_nb(), T0 + 600)
    assert due.kind is ReclaimStepKind.DUE


def test_work_in_the_grace_period_cancels_and_idleness_afterwards_starts_over() -> None:
    planner = ReclaimPlanner(grace_seconds=600)
    planner.plan(idle_nb(), T0)
    (cancel,) = planner.plan({}, T0 + 300)
    assert (cancel.kind, cancel.workload) == (ReclaimStepKind.CANCEL, NB)
    assert planner.pending() == {}
    (warn,) = planner.plan(idle_nb(T0 + 400), T0 + 400)
    assert (warn.kind, warn.due_at) == (ReclaimStepKind.WARN, T0 + 1000)


def test_a_finished_workload_is_not_acted_on_twice_nor_cancelled() -> None:
    planner = ReclaimPlanner(grace_seconds=60)
    planner.plan(idle_nb(), T0)
    (due,) = planner.plan(idle_nb(), T0 + 60)
    planner.finish(due.workload)
    assert planner.plan(idle_nb(), T0 + 70) == []
    assert planner.plan({}, T0 + 80) == []  # its pods went (scaled to zero): no cancellation
    assert [s.kind for s in planner.plan(idle_nb(), T0 + 90)] == [ReclaimStepKind.WARN]


def test_a_due_workload_held_back_stays_due() -> None:
    planner = ReclaimPlanner(grace_seconds=60)
    planner.plan(idle_nb(), T0)
    for t in (60, 70, 80):
        assert [s.kind for s in planner.plan(idle_nb(), T0 + t)] == [ReclaimStepKind.DUE]


# --- the circuit breaker ---------------------------------------------------------------------------


def test_the_breaker_opens_at_the_limit_and_closes_an_hour_after_the_oldest() -> None:
    breaker = CircuitBreaker(limit=3)
    for t in (0, 100, 200):
        assert breaker.allows(T0 + t)
        breaker.record(T0 + t)
    assert not breaker.allows(T0 + 300)
    assert breaker.count(T0 + 300) == 3
    assert breaker.closes_at(T0 + 300) == T0 + 3600
    assert not breaker.allows(T0 + 3599)
    assert breaker.allows(T0 + 3600)
    assert breaker.closes_at(T0 + 3600) is None

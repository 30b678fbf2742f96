"""GPU health in the engine: the health store, gpuHealth, and throttling beside utilization findings.

Snapshots go in the way the operator takes them (series points and health records from the same
snapshot), the engine judges, findings come out: pure, on made-up time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuwarden.policy import PodView, PolicyEvaluator, Resolution, SeriesStore, Transition
from gpuwarden.policy.parse import SpecError, parse_spec
from gpuwarden.policy.rules.gpu_health import GpuHealthRule, gpu_problems
from gpuwarden.policy.rules.throttling import THROTTLED_SHARE, Throttling
from gpuwarden.policy.store.health import HealthStore, IncidentKind
from gpuwarden.policy.store.intake import points_from_snapshot
from gpuwarden.policy.xids import CRITICAL_XIDS, XIDS, describe_xid
from gpuwarden.wire.node import (
    ClockEventReason,
    DeviceState,
    GpuHealth,
    GpuSample,
    NodeReport,
    PodRef,
    ProcessSample,
    ReportError,
    Snapshot,
    XidEvent,
    dump_report,
    parse_report,
)

T0 = 1_800_000_000.0
GPU = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
OTHER = "GPU-bbbbbbbb-0000-4000-8000-000000000000"
POD = PodRef(namespace="ns", name="job-0", container="main")
VIEW = PodView("ns", "job-0", {"app": "x"})

Health = Callable[[int], dict[str, Any]]


def sample(i: int, uuid: str = GPU, *, util: float = 50.0, health: dict[str, Any] | None = None) -> GpuSample:
    state = DeviceState(health.pop("state")) if health and "state" in health else DeviceState.OK
    ecc = health.pop("ecc", 0) if health else 0
    if state is DeviceState.LOST:
        return GpuSample(
            uuid=uuid, index=0, state=state, pods=[POD], health=GpuHealth(**health) if health else None
        )
    return GpuSample(
        uuid=uuid,
        index=0 if uuid == GPU else 1,
        utilization_gpu=util,
        memory_used_bytes=2**30,
        memory_total_bytes=80 * 2**30,
        ecc_uncorrected=ecc,
        pods=[POD],
        health=GpuHealth(**{"clock_event_reasons": [], **(health or {})}),
    )


class World:
    """A series store and a health store fed with the same snapshots, and a policy over them."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.store = SeriesStore(retention_seconds=3600, max_points=3600)
        self.health = HealthStore(retention_seconds=3600)
        self.evaluator = PolicyEvaluator("ns/p", parse_spec(spec), namespace="ns")
        self.t = T0

    def feed(self, seconds: int, *, util: float = 50.0, health: Health = lambda i: {}) -> None:
        for i in range(seconds):
            snapshot = Snapshot(timestamp=self.t, gpus=[sample(i, util=util, health=health(i))])
            self.store.extend(points_from_snapshot(snapshot))
            self.health.observe(snapshot, node="node-1")
            self.t += 1

    def evaluate(self) -> Any:
        return self.evaluator.evaluate([VIEW], self.store, self.t - 1, self.health)


def policy(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"selector": {}, "rules": list(rules)}


HEALTH_RULE = {"name": "health", "gpuHealth": {"clearAfter": "1m"}}
FLOOR = {"name": "idle", "utilizationFloor": {"percent": 20, "for": "1m", "signal": "gpuUtil"}}
CEILING = {"name": "hot", "utilizationCeiling": {"percent": 90, "for": "1m", "signal": "gpuUtil"}}


def started(evaluation: Any) -> list[Any]:
    return [t for t in evaluation.transitions if t.transition is Transition.STARTED]


def resolved(evaluation: Any) -> list[Any]:
    return [t for t in evaluation.transitions if t.transition is Transition.RESOLVED]


# -- the XID table -----------------------------------------------------------------------------------


def test_the_xid_table_explains_the_common_codes_and_marks_the_critical_ones() -> None:
    assert CRITICAL_XIDS == (48, 62, 64, 74, 79, 95, 119, 120, 140)
    assert "fallen off the bus" in describe_xid(79)
    assert "reboot the node" in describe_xid(79)
    assert not XIDS[13].critical  # an application's own fault
    assert describe_xid(9999) == "XID 9999 (see NVIDIA's XID catalog for its meaning)"


# -- gpuHealth ----------------------------------------------------------------------------------------


def test_an_xid_fires_the_rule_with_its_meaning_and_clears_after_clear_after() -> None:
    world = World(policy(HEALTH_RULE))
    world.feed(10)
    assert not world.evaluate().active
    xid_at = world.t
    world.feed(1, health=lambda i: {"xids": [XidEvent(code=79, timestamp=xid_at)]})
    (start,) = started(world.evaluate())
    finding = start.finding
    assert finding.reason == "GPUUnhealthy"
    assert finding.gpus == (GPU,)
    assert finding.message.startswith(f"GPU 0 ({GPU}): XID 79 (GPU has fallen off the bus")
    world.feed(59)  # healthy samples, but the XID counts for a minute after it (60 s included)
    assert world.evaluate().active
    world.feed(2)
    (end,) = resolved(world.evaluate())
    assert end.resolution is Resolution.RECOVERED


def test_xids_not_listed_do_not_count() -> None:
    world = World(policy({"name": "health", "gpuHealth": {"xids": [79]}}))
    world.feed(5, health=lambda i: {"xids": [XidEvent(code=48, timestamp=T0 + i)]})
    assert not world.evaluate().active
    world = World(policy({"name": "app-errors", "gpuHealth": {"xids": [13, 31]}}))
    world.feed(5, health=lambda i: {"xids": [XidEvent(code=31, timestamp=T0 + i)]} if i == 4 else {})
    (start,) = started(world.evaluate())
    assert "XID 31 (GPU memory page fault" in start.finding.message


def test_a_lost_gpu_fires_at_once_and_clears_when_it_is_back() -> None:
    world = World(policy(HEALTH_RULE))
    world.feed(5)
    world.feed(3, health=lambda i: {"state": "lost"})
    (start,) = started(world.evaluate())
    assert "off the bus since" in start.finding.message
    world.feed(1)
    (end,) = resolved(world.evaluate())
    assert end.resolution is Resolution.RECOVERED


def test_a_new_uncorrected_ecc_error_and_a_failed_repair_count() -> None:
    world = World(policy(HEALTH_RULE))
    world.feed(5, health=lambda i: {"ecc": 2})  # errors from before: not new
    assert not world.evaluate().active
    world.feed(1, health=lambda i: {"ecc": 3})
    (start,) = started(world.evaluate())
    assert "1 uncorrected ECC error since" in start.finding.message
    world = World(policy(HEALTH_RULE))
    world.feed(3, health=lambda i: {"row_remap_failed": True})
    (start,) = started(world.evaluate())
    assert "row remapping failed (reset the GPU)" in start.finding.message
    world = World(policy({"name": "health", "gpuHealth": {"memoryErrors": False}}))
    world.feed(3, health=lambda i: {"row_remap_failed": True, "ecc": i})
    assert not world.evaluate().active


def test_throttling_counts_only_when_listed_and_only_once_it_lasted_for() -> None:
    throttled: Health = lambda i: {"clock_event_reasons": [ClockEventReason.HW_THERMAL_SLOWDOWN]}  # noqa: E731
    world = World(policy(HEALTH_RULE))
    world.feed(400, health=throttled)
    assert not world.evaluate().active  # by default throttling alone is no fault
    world = World(policy({"name": "hot", "gpuHealth": {"throttling": ["thermal"], "for": "2m"}}))
    world.feed(100, health=throttled)
    assert not world.evaluate().active
    world.feed(30, health=throttled)
    (start,) = started(world.evaluate())
    assert "throttled (thermal) for 2m" in start.finding.message
    world.feed(1)
    assert resolved(world.evaluate())


def test_a_break_in_the_throttling_restarts_its_for() -> None:
    world = World(policy({"name": "hot", "gpuHealth": {"throttling": ["power"], "for": "1m"}}))
    power: Health = lambda i: {"clock_event_reasons": [ClockEventReason.SW_POWER_CAP] if i != 40 else []}  # noqa: E731
    world.feed(90, health=power)  # throttled 0-39 and 41-89: 49 s without a break
    assert not world.evaluate().active
    world.feed(15, health=lambda i: power(i + 90))
    assert world.evaluate().active


def test_a_gpu_gone_quiet_has_nothing_to_judge() -> None:
    world = World(policy(HEALTH_RULE))
    world.feed(3, health=lambda i: {"state": "lost"})
    assert world.evaluate().active
    world.t += 120  # nothing reported: the finding stays as it was (NoData after 10 minutes)
    evaluation = world.evaluate()
    assert [t.transition for t in evaluation.transitions] == [Transition.ONGOING]


def test_gpu_health_parses_with_the_crds_defaults_and_refuses_nonsense() -> None:
    (rule,) = parse_spec(policy({"name": "h", "gpuHealth": {}})).rules
    assert rule == GpuHealthRule(name="h")
    assert rule.xids == CRITICAL_XIDS
    (rule,) = parse_spec(policy({"name": "h", "gpuHealth": {"xids": [13.0], "throttling": ["power"]}})).rules
    assert isinstance(rule, GpuHealthRule)
    assert (rule.xids, rule.throttling) == ((13,), (Throttling.POWER,))
    bad = [
        ({"xids": [0]}, "spec.rules[0].gpuHealth.xids[0]: 0 is out of range"),
        ({"xids": [79, 79]}, "spec.rules[0].gpuHealth.xids[1]: duplicate XID 79"),
        ({"xids": ["79"]}, "spec.rules[0].gpuHealth.xids[0]: must be an XID code"),
        ({"throttling": ["hot"]}, 'spec.rules[0].gpuHealth.throttling[0]: "hot" is not one of thermal'),
        ({"clearAfter": "0s"}, 'spec.rules[0].gpuHealth.clearAfter: "0s" is too short'),
        (
            {"xids": [], "gpuLost": False, "memoryErrors": False},
            "spec.rules[0].gpuHealth: gpuHealth counts nothing",
        ),
        ({"holdFor": "1m"}, "spec.rules[0].gpuHealth.holdFor: unknown field"),
    ]
    for body, message in bad:
        with pytest.raises(SpecError) as err:
            parse_spec(policy({"name": "h", "gpuHealth": body}))
        assert str(err.value).startswith(message), (body, str(err.value))


# -- throttling beside utilization ---------------------------------------------------------------------

THERMAL: Health = lambda i: {"clock_event_reasons": [ClockEventReason.SW_THERMAL_SLOWDOWN]}  # noqa: E731


def test_a_throttled_gpu_at_low_utilization_is_not_idle() -> None:
    world = World(policy(FLOOR))
    world.feed(90, util=10.0, health=THERMAL)
    evaluation = world.evaluate()
    assert not evaluation.active
    (outcome,) = evaluation.outcomes
    assert not outcome.holds
    assert outcome.message.endswith("; throttled 100% of the window (thermal): not idle")


def test_the_same_gpu_unthrottled_is_idle() -> None:
    world = World(policy(FLOOR))
    world.feed(90, util=10.0)
    (start,) = started(world.evaluate())
    assert "throttled" not in start.finding.message


def test_throttling_does_not_excuse_an_idle_process_beside_a_busy_one_on_a_shared_gpu() -> None:
    # Measured on the H200: a busy job's matmuls hold the GPU at its power cap (SW_POWER_CAP all
    # along), and the job beside it that runs no kernel must still be flagged: its own share of
    # SM time is 0 whatever the clocks.
    busy, idle = PodRef(namespace="ns", name="serve-0"), POD
    store, health = SeriesStore(retention_seconds=3600, max_points=3600), HealthStore(retention_seconds=3600)
    evaluator = PolicyEvaluator("ns/p", parse_spec(policy(FLOOR)), namespace="ns")
    for i in range(90):
        gpu = sample(i, util=99.0, health={"clock_event_reasons": [ClockEventReason.SW_POWER_CAP]})
        gpu = gpu.model_copy(
            update={
                "pods": [busy, idle],
                "processes": [
                    ProcessSample(pid=1, used_memory_bytes=2**30, sm_util=99.0, pod=busy),
                    ProcessSample(pid=2, used_memory_bytes=2**31, sm_util=0.0, pod=idle),
                ],
            }
        )
        snapshot = Snapshot(timestamp=T0 + i, gpus=[gpu])
        store.extend(points_from_snapshot(snapshot))
        health.observe(snapshot, node="node-1")
    views = [VIEW, PodView("ns", "serve-0", {"app": "x"})]
    evaluation = evaluator.evaluate(views, store, T0 + 89, health)
    (start,) = started(evaluation)
    assert start.finding.pod == "job-0"
    assert "per-process SM utilization" in start.finding.message
    assert "throttled" not in start.finding.message


def test_throttling_clears_an_active_idle_finding_with_the_reason() -> None:
    world = World(policy(FLOOR))
    world.feed(90, util=10.0)
    assert world.evaluate().active
    world.feed(40, util=10.0, health=THERMAL)  # 40 of the window's 60 s throttled
    (end,) = resolved(world.evaluate())
    assert end.resolution is Resolution.RECOVERED
    assert end.finding.message.endswith("(thermal): not idle")


def test_throttled_less_than_half_the_window_is_still_idle() -> None:
    world = World(policy(FLOOR))
    short = int(60 * THROTTLED_SHARE) - 5
    world.feed(90, util=10.0, health=lambda i: THERMAL(i) if i >= 90 - short else {})
    assert started(world.evaluate())


def test_a_saturated_throttled_gpu_still_saturates_and_says_it_is_throttled() -> None:
    world = World(policy(CEILING))
    world.feed(
        90, util=98.0, health=lambda i: {"clock_event_reasons": [ClockEventReason.HW_POWER_BRAKE_SLOWDOWN]}
    )
    (start,) = started(world.evaluate())
    assert start.finding.message.endswith("; throttled 100% of the window (power)")


def test_idle_and_application_clocks_are_not_throttling() -> None:
    world = World(policy(FLOOR))
    world.feed(90, util=10.0, health=lambda i: {"clock_event_reasons": [ClockEventReason.GPU_IDLE]})
    assert started(world.evaluate())


# -- the health store ---------------------------------------------------------------------------------


def test_incidents_are_what_changed_each_once() -> None:
    store = HealthStore(retention_seconds=600)
    timeline: list[dict[str, Any]] = [
        {},
        {"xids": [XidEvent(code=79, timestamp=T0 + 1)], "state": "lost"},
        {"state": "lost"},
        {"ecc": 1},
        {"ecc": 1, "row_remap_pending": True},
        {"ecc": 1, "row_remap_pending": True, "clock_event_reasons": [ClockEventReason.HW_SLOWDOWN]},
        {"ecc": 1, "row_remap_pending": True, "clock_event_reasons": [ClockEventReason.HW_SLOWDOWN]},
    ]
    for i, health in enumerate(timeline):
        store.observe(Snapshot(timestamp=T0 + i, gpus=[sample(i, health=dict(health))]), node="n")
    store.observe(
        Snapshot(timestamp=T0 + 2, gpus=[sample(2, health={"state": "lost"})]), node="n"
    )  # a replay
    kinds = [(i.kind, i.at - T0) for i in store.incidents()]
    assert kinds == [
        (IncidentKind.LOST, 1),
        (IncidentKind.XID, 1),
        (IncidentKind.ECC, 3),  # the count rose from 0 (before the GPU was lost) to 1
        (IncidentKind.MEMORY_REPAIR, 4),
        (IncidentKind.HW_SLOWDOWN, 5),
    ]
    assert all(i.pods == (("ns", "job-0"),) for i in store.incidents())
    assert [i.seq for i in store.incidents(after=3)] == [4, 5]


def test_the_store_forgets_what_aged_out() -> None:
    store = HealthStore(retention_seconds=60)
    store.observe(
        Snapshot(timestamp=T0, gpus=[sample(0, health={"xids": [XidEvent(code=48, timestamp=T0)]})])
    )
    store.observe(Snapshot(timestamp=T0 + 100, gpus=[sample(1, OTHER)]))
    store.prune(T0 + 100)
    assert store.gpu(GPU) is None
    assert [r.uuid for r in store.gpus_of("ns", "job-0", since=0)] == [OTHER]
    store.forget_pod("ns", "job-0")
    assert store.gpus_of("ns", "job-0", since=0) == []


def test_a_pod_that_left_a_gpu_was_on_it_until_it_left() -> None:
    store = HealthStore(retention_seconds=600)
    other = PodRef(namespace="ns", name="next-0")
    for i in range(10):
        gpu = sample(i)
        if i >= 5:  # the GPU went to another pod
            gpu = gpu.model_copy(update={"pods": [other]})
        store.observe(Snapshot(timestamp=T0 + i, gpus=[gpu]), node="n")
    assert [r.uuid for r in store.gpus_of("ns", "job-0", since=T0 + 4)] == [GPU]
    assert store.gpus_of("ns", "job-0", since=T0 + 5) == []
    assert [r.uuid for r in store.gpus_of("ns", "next-0", since=T0 + 9)] == [GPU]
    store.prune(T0 + 4 + 601)
    assert store.gpus_of("ns", "job-0", since=0) == []
    assert [r.uuid for r in store.gpus_of("ns", "next-0", since=0)] == [GPU]


def test_problems_order_and_staleness() -> None:
    store = HealthStore(retention_seconds=600)
    health = {"state": "lost", "xids": [XidEvent(code=79, timestamp=T0)]}
    store.observe(Snapshot(timestamp=T0, gpus=[sample(0, health=health)]), node="n")
    (record,) = store.gpus_on("n")
    problems = gpu_problems(record, T0 + 5, xids=CRITICAL_XIDS, hold=60)
    assert [p.reason for p in problems] == ["GPULost", "GPUXidError"]
    assert [p.reason for p in gpu_problems(record, T0 + 120, xids=CRITICAL_XIDS, hold=60)] == ["GPULost"]
    assert not record.fresh(T0 + 61, 60)


# -- the wire -------------------------------------------------------------------------------------------


def report(version: int, health: GpuHealth | None) -> bytes:
    snapshot = Snapshot(timestamp=T0, gpus=[GpuSample(uuid=GPU, index=0, health=health)])
    return dump_report(
        NodeReport(schema_version=version, node="n", agent_id="a", seq=0, snapshots=[snapshot])
    )


def test_health_is_schema_version_2_and_version_1_is_still_accepted_without_it() -> None:
    health = GpuHealth(
        xids=[XidEvent(code=79, timestamp=T0)], clock_event_reasons=[ClockEventReason.HW_SLOWDOWN]
    )
    parsed = parse_report(report(2, health))
    assert parsed.snapshots[0].gpus[0].health == health
    assert parse_report(report(1, None)).schema_version == 1
    with pytest.raises(ReportError, match="health: not part of schemaVersion 1"):
        parse_report(report(1, health))
    with pytest.raises(ReportError, match="clockEventReasons"):
        parse_report(
            report(2, None).replace(b'"index":0', b'"index":0,"health":{"clockEventReasons":["hot"]}')
        )

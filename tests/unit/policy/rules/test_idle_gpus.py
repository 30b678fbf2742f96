"""idleGpus: some of a pod's GPUs idle while another works, judged per GPU, through the engine.

Snapshots go in as the operator takes them (series points and health records from the same
snapshot), the policy is parsed from its CRD body, and the findings come out: pure, on made-up time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from gpuwarden.policy import PodView, PolicyEvaluator, SeriesStore, SpecError, Transition, parse_spec
from gpuwarden.policy.rules.common import WindowParams
from gpuwarden.policy.rules.idle_gpus import IdleGpus, evaluate_idle_gpus
from gpuwarden.policy.spec.model import Signal
from gpuwarden.policy.store.health import HealthStore
from gpuwarden.policy.store.intake import points_from_snapshot
from gpuwarden.policy.store.series import PodId
from gpuwarden.wire.node import ClockEventReason, GpuHealth, GpuSample, PodRef, ProcessSample, Snapshot

T0 = 1_800_000_000.0
POD = PodRef(namespace="ns", name="trainer-0", container="main")
VIEW = PodView("ns", "trainer-0", {"app": "train"})
RULE = {"name": "unused", "idleGpus": {"for": "2m"}}

# Per GPU and second: (SM activity, utilization.gpu); None leaves the reading out.
Activity = Callable[[int, int], tuple[float | None, float | None]]


def uuid(gpu: int) -> str:
    return f"GPU-{gpu:08x}-0000-4000-8000-000000000000"


def levels(*sm: float) -> Activity:
    """Each GPU at its own steady SM activity (utilization.gpu reads 100 on all, as a trickle makes it)."""
    return lambda gpu, i: (sm[gpu], 100.0)


class World:
    """A series store and a health store fed with one node's snapshots, and a policy over them."""

    def __init__(self, *rules: dict[str, Any], gpus: int) -> None:
        self.store = SeriesStore(retention_seconds=3600, max_points=3600)
        self.health = HealthStore(retention_seconds=3600)
        self.evaluator = PolicyEvaluator(
            "ns/p", parse_spec({"selector": {}, "rules": list(rules)}), namespace="ns"
        )
        self.gpus = gpus
        self.t = T0

    def feed(
        self,
        seconds: int,
        activity: Activity,
        *,
        silent: Callable[[int, int], bool] = lambda gpu, i: False,
        throttled: Sequence[int] = (),
    ) -> None:
        for i in range(seconds):
            gpus = []
            for g in range(self.gpus):
                if silent(g, i):
                    continue
                sm, util = activity(g, i)
                reasons = [ClockEventReason.HW_THERMAL_SLOWDOWN] if g in throttled else []
                gpus.append(
                    GpuSample(
                        uuid=uuid(g),
                        index=g,
                        sm_active=sm,
                        utilization_gpu=util,
                        memory_used_bytes=2**30,
                        memory_total_bytes=80 * 2**30,
                        pods=[POD],
                        health=GpuHealth(clock_event_reasons=reasons),
                    )
                )
            snapshot = Snapshot(timestamp=self.t, gpus=gpus)
            self.store.extend(points_from_snapshot(snapshot))
            self.health.observe(snapshot, node="node-1")
            self.t += 1

    def evaluate(self) -> Any:
        return self.evaluator.evaluate([VIEW], self.store, self.t - 1, self.health)

    def transitions(self) -> list[Transition]:
        return [t.transition for t in self.evaluate().transitions]


def test_three_idle_gpus_of_eight_fire_where_the_pooled_floor_sees_a_busy_pod() -> None:
    floor = {"name": "floor", "utilizationFloor": {"percent": 20, "for": "2m"}}
    world = World(RULE, floor, gpus=8)
    world.feed(130, levels(95, 95, 95, 95, 95, 0.4, 0.0, 1.0))
    (start,) = world.evaluate().transitions
    assert start.transition is Transition.STARTED
    finding = start.finding
    assert (finding.rule, finding.reason) == ("unused", "GPUIdleInPod")
    assert finding.gpus == (uuid(6), uuid(5), uuid(7))  # least used first
    assert finding.value == pytest.approx(0.0)
    assert finding.message == (
        "3 of 8 GPUs idle: mean SM activity (GPM) below 5% over 2m (lowest 0%),"
        " while the busiest averaged 95%"
    )


def test_it_clears_only_once_every_gpu_is_clearly_in_use() -> None:
    world = World(RULE, gpus=2)
    world.feed(130, levels(90, 1))
    assert world.transitions() == [Transition.STARTED]
    world.feed(130, levels(90, 7))  # above percent, inside the margin: no change
    assert world.transitions() == [Transition.ONGOING]
    world.feed(130, levels(90, 12))  # at percent + hysteresis or more
    (end,) = world.evaluate().transitions
    assert end.transition is Transition.RESOLVED
    assert end.finding.message == (
        "no GPU idle: the least used averaged 12% SM activity (GPM) over 2m, idle below 5%"
    )


def test_a_pod_whose_gpus_are_all_idle_or_that_has_one_gpu_is_the_floor_s_not_this_rule_s() -> None:
    world = World(RULE, gpus=4)
    world.feed(130, levels(0, 0, 1, 2))
    assert world.transitions() == []
    single = World(RULE, gpus=1)
    single.feed(130, levels(0))
    assert single.transitions() == []


def test_an_active_finding_stays_while_the_pod_goes_wholly_idle() -> None:
    world = World(RULE, gpus=2)
    world.feed(130, levels(80, 0))
    assert world.transitions() == [Transition.STARTED]
    world.feed(130, levels(0, 0))  # the work stopped on the busy GPU too: still GPUs left idle
    assert world.transitions() == [Transition.ONGOING]


def test_the_other_gpus_must_be_in_use_not_merely_above_idle() -> None:
    world = World(RULE, gpus=2)
    world.feed(130, levels(8, 0))  # 8% is not idle, but under percent + hysteresis (10%)
    assert world.transitions() == []


def test_a_gap_in_one_gpu_s_readings_never_counts_as_idle() -> None:
    world = World(RULE, gpus=2)
    world.feed(130, levels(90, 0), silent=lambda gpu, i: gpu == 1 and 40 <= i < 70)
    assert world.transitions() == []
    world.feed(120, levels(90, 0))  # a whole covered window since the gap
    assert world.transitions() == [Transition.STARTED]


def test_the_signal_decides_what_idle_is() -> None:
    # utilization.gpu reads 100 under a trickle of tiny kernels; SM activity says the GPU is idle.
    trickle: Activity = lambda gpu, i: (90.0, 100.0) if gpu == 0 else (0.5, 100.0)  # noqa: E731
    world = World(RULE, gpus=2)
    world.feed(130, trickle)
    assert world.transitions() == [Transition.STARTED]
    by_util = World({"name": "unused", "idleGpus": {"for": "2m", "signal": "gpuUtil"}}, gpus=2)
    by_util.feed(130, trickle)
    assert by_util.transitions() == []
    # auto falls back to utilization.gpu per GPU where it has no SM activity.
    no_gpm: Activity = lambda gpu, i: (None, 97.0 if gpu == 0 else 2.0)  # noqa: E731
    fallback = World(RULE, gpus=2)
    fallback.feed(130, no_gpm)
    (start,) = fallback.evaluate().transitions
    assert "mean GPU utilization (device counter) below 5%" in start.finding.message


def test_a_throttled_gpu_is_not_idle() -> None:
    world = World(RULE, gpus=2)
    world.feed(130, levels(90, 1), throttled=[1])
    assert world.transitions() == []


def test_on_a_shared_gpu_the_pod_is_judged_by_its_own_processes() -> None:
    # The pod's second GPU is shared: its share there is its own processes' SM utilization (0: it
    # holds memory and runs no kernel), whatever the device's counters say of its neighbour's work.
    other = PodRef(namespace="ns", name="serve-0")
    world = World(RULE, gpus=1)
    for _ in range(130):
        gpus = [
            GpuSample(uuid=uuid(0), index=0, sm_active=88.0, utilization_gpu=99.0, pods=[POD]),
            GpuSample(
                uuid=uuid(1),
                index=1,
                sm_active=70.0,
                utilization_gpu=99.0,
                pods=[POD, other],
                processes=[
                    ProcessSample(pid=1, used_memory_bytes=2**30, sm_util=0.0, pod=POD),
                    ProcessSample(pid=2, used_memory_bytes=2**31, sm_util=70.0, pod=other),
                ],
            ),
        ]
        world.store.extend(points_from_snapshot(Snapshot(timestamp=world.t, gpus=gpus)))
        world.t += 1
    (start,) = world.evaluate().transitions
    assert start.finding.gpus == (uuid(1),)
    assert "mean per-process SM utilization below 5%" in start.finding.message


def test_the_evaluator_alone_reads_the_least_used_gpu_and_names_the_idle_ones() -> None:
    world = World(RULE, gpus=3)
    world.feed(130, levels(60, 3, 40))
    rule = IdleGpus(name="unused", for_seconds=120, percent=5, signal=Signal.AUTO)
    out = evaluate_idle_gpus(
        rule, PodId("ns", "trainer-0"), world.store.series_of("ns", "trainer-0"), world.t - 1, WindowParams()
    )
    assert (out.holds, out.clears, out.value, out.gpu_count) == (True, False, 3.0, 3)
    assert out.gpus == (uuid(1),)


def test_idle_gpus_parses_with_the_crds_defaults_and_refuses_nonsense() -> None:
    (rule,) = parse_spec({"selector": {}, "rules": [{"name": "u", "idleGpus": {}}]}).rules
    assert rule == IdleGpus(name="u", for_seconds=600, percent=5.0, signal=Signal.AUTO, hysteresis=5.0)
    bad = {
        "percent": (
            {"percent": 101},
            "spec.rules[0].idleGpus.percent: 101 is out of range; must be between 0 and 100",
        ),
        "for": (
            {"for": "10 min"},
            'spec.rules[0].idleGpus.for: "10 min" is not a duration such as 10s, 5m or 1h30m',
        ),
        "signal": ({"signal": "sm"}, "spec.rules[0].idleGpus.signal:"),
        "typo": ({"precent": 5}, 'spec.rules[0].idleGpus.precent: unknown field (did you mean "percent"?)'),
    }
    for field, (body, message) in bad.items():
        with pytest.raises(SpecError) as err:
            parse_spec({"selector": {}, "rules": [{"name": "u", "idleGpus": body}]})
        assert str(err.value).startswith(message), (field, str(err.value))

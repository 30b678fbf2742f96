"""ScaleDecider: signal, range, stabilization, cooldown and step; properties over random histories."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.scaling.decider import (
    Blocker,
    Direction,
    ScaleDecider,
    ScaleDecision,
    StepKind,
    findings_by_pod,
    min_pods_needed,
    scale_step,
    step_size,
)
from gpuwarden.policy.scaling.predictive import View, WorkloadLoad
from gpuwarden.policy.spec.model import ScaleAction, ScaleDirection, ScaleForecast, ScaleTargetRef, Signal

TARGET = ScaleTargetRef("apps/v1", "Deployment", "llm-server")
UP_RULE, DOWN_RULE = "saturated", "idle-gpu"

Findings = Mapping[str, frozenset[str]]


def action(
    *,
    lo: int = 1,
    hi: int = 8,
    up: ScaleDirection | None = None,
    down: ScaleDirection | None = None,
    min_pods: int | None = 1,
    min_pods_percent: float | None = None,
    up_on: tuple[str, ...] = (UP_RULE,),
    down_on: tuple[str, ...] = (DOWN_RULE,),
) -> ScaleAction:
    return ScaleAction(
        target_ref=TARGET,
        min_replicas=lo,
        max_replicas=hi,
        scale_up_on=up_on,
        scale_down_on=down_on,
        scale_up=up or ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=60),
        scale_down=down or ScaleDirection(stabilization_seconds=300, step_replicas=1, cooldown_seconds=300),
        scale_up_min_pods=min_pods,
        scale_up_min_pods_percent=min_pods_percent,
    )


def pods(n: int, *rules: str) -> Findings:
    """``n`` pods, each violating ``rules``."""
    return {f"pod-{i}": frozenset(rules) for i in range(n)}


SATURATED_2 = pods(2, UP_RULE)
IDLE_2 = pods(2, DOWN_RULE)


# --- the signal ---------------------------------------------------------------------------------------


def test_scale_up_on_any_pod_by_default() -> None:
    d = ScaleDecider().decide(action(), 2, {"a": frozenset({UP_RULE})}, matched_pods=4, now=0)
    assert (d.desired, d.direction, d.blocked_by) == (3, Direction.UP, None)
    assert d.reason == "saturated on 1/4 pods"


def test_scale_up_min_pods_count() -> None:
    a = action(min_pods=2)
    one = ScaleDecider().decide(a, 2, {"a": frozenset({UP_RULE})}, matched_pods=4, now=0)
    assert (one.desired, one.direction) == (2, Direction.NONE)
    assert "up needs 2" in one.reason
    two = ScaleDecider().decide(a, 2, pods(2, UP_RULE), matched_pods=4, now=0)
    assert two.desired == 3


@pytest.mark.parametrize(
    ("percent", "matched", "needed"),
    [(50, 4, 2), (50, 3, 2), (100, 3, 3), (1, 3, 1), (34, 3, 2), (33, 3, 1), (50, 0, 1)],
)
def test_min_pods_percent_rounds_up(percent: float, matched: int, needed: int) -> None:
    assert min_pods_needed(action(min_pods=None, min_pods_percent=percent), matched) == needed


def test_scale_down_needs_every_matched_pod() -> None:
    a = action(down=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=0))
    some = ScaleDecider().decide(a, 3, pods(2, DOWN_RULE), matched_pods=3, now=0)
    assert (some.desired, some.direction) == (3, Direction.NONE)
    assert (
        some.reason
        == "no scaling signal: saturated on 0/3 pods (up needs 1); idle-gpu on 2/3 pods (down needs all)"
    )
    every = ScaleDecider().decide(a, 3, pods(3, DOWN_RULE), matched_pods=3, now=0)
    assert (every.desired, every.direction, every.reason) == (2, Direction.DOWN, "idle-gpu on 3/3 pods")


def test_no_pods_no_signal() -> None:
    a = action(down=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=0))
    d = ScaleDecider().decide(a, 3, {}, matched_pods=0, now=0)
    assert (d.desired, d.direction, d.reason) == (3, Direction.NONE, "no matched pods")


def test_findings_beyond_the_matched_count_do_not_count_twice() -> None:
    a = action(down=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=0))
    d = ScaleDecider().decide(a, 3, pods(5, DOWN_RULE), matched_pods=3, now=0)
    assert d.reason == "idle-gpu on 3/3 pods"


def test_up_wins_over_down() -> None:
    a = action(up_on=("near-oom",), down=ScaleDirection(stabilization_seconds=0, step_replicas=1))
    both = {"a": frozenset({DOWN_RULE, "near-oom"}), "b": frozenset({DOWN_RULE})}
    d = ScaleDecider().decide(a, 3, both, matched_pods=2, now=0)
    assert (d.desired, d.reason) == (4, "near-oom on 1/2 pods")


def test_reason_names_the_rules_that_hold_in_spec_order() -> None:
    a = action(up_on=("saturated", "near-oom"))
    d = ScaleDecider().decide(
        a, 1, {"a": frozenset({"near-oom"}), "b": frozenset({"saturated"})}, matched_pods=2, now=0
    )
    assert d.reason == "saturated, near-oom on 2/2 pods"


def test_rules_outside_the_scale_lists_are_ignored() -> None:
    d = ScaleDecider().decide(action(), 2, pods(2, "leak"), matched_pods=2, now=0)
    assert (d.desired, d.direction) == (2, Direction.NONE)


def test_only_up_rules_never_scales_down() -> None:
    a = action(down_on=(), down=ScaleDirection(stabilization_seconds=0, step_replicas=1))
    d = ScaleDecider().decide(a, 3, {}, matched_pods=2, now=0)
    assert (d.direction, d.reason) == (
        Direction.NONE,
        "no scaling signal: saturated on 0/2 pods (up needs 1)",
    )


def test_findings_by_pod_groups_rules() -> None:
    @dataclass
    class F:
        rule: str
        pod: str

    grouped = findings_by_pod([F("saturated", "a"), F("near-oom", "a"), F("idle-gpu", "b")])
    assert grouped == {"a": frozenset({"saturated", "near-oom"}), "b": frozenset({"idle-gpu"})}


# --- step -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "percent", "current", "step"),
    [
        (2, None, 5, 2),
        (None, 50, 4, 2),
        (None, 50, 3, 2),  # 1.5 rounds up
        (None, 10, 10, 1),  # exactly 1, not 2 from a float ceiling
        (None, 33, 3, 1),
        (None, 10, 1, 1),  # at least one
        (None, 200, 3, 6),
    ],
)
def test_step_size(replicas: int | None, percent: float | None, current: int, step: int) -> None:
    direction = ScaleDirection(stabilization_seconds=0, step_replicas=replicas, step_percent=percent)
    assert step_size(direction, current) == step


def test_percent_step_is_clamped_to_max() -> None:
    a = action(hi=5, up=ScaleDirection(stabilization_seconds=0, step_percent=100))
    assert ScaleDecider().decide(a, 4, SATURATED_2, matched_pods=2, now=0).desired == 5


def test_percent_step_down_is_clamped_to_min() -> None:
    a = action(lo=2, down=ScaleDirection(stabilization_seconds=0, step_percent=90))
    assert ScaleDecider().decide(a, 4, IDLE_2, matched_pods=2, now=0).desired == 2


# --- range ----------------------------------------------------------------------------------------------


def test_at_max_is_blocked() -> None:
    d = ScaleDecider().decide(action(hi=3), 3, SATURATED_2, matched_pods=2, now=0)
    assert (d.desired, d.direction, d.blocked_by) == (3, Direction.UP, Blocker.AT_MAX_REPLICAS)
    assert d.reason == "saturated on 2/2 pods; already at maxReplicas 3"
    assert d.steady_reason == d.reason


def test_at_min_is_blocked() -> None:
    a = action(lo=2, down=ScaleDirection(stabilization_seconds=0, step_replicas=1))
    d = ScaleDecider().decide(a, 2, IDLE_2, matched_pods=2, now=0)
    assert (d.desired, d.blocked_by) == (2, Blocker.AT_MIN_REPLICAS)


def test_above_max_comes_back_at_once() -> None:
    decider = ScaleDecider()
    decider.record_scale(ScaleDecision(11, 10, Direction.DOWN, ""), now=0)  # a cooldown running
    d = decider.decide(action(hi=4), 10, SATURATED_2, matched_pods=2, now=1)
    assert (d.desired, d.direction, d.reason) == (4, Direction.DOWN, "10 replicas exceed maxReplicas 4")


def test_below_min_comes_back_at_once() -> None:
    d = ScaleDecider().decide(action(lo=3), 1, IDLE_2, matched_pods=2, now=0)
    assert (d.desired, d.direction, d.reason) == (3, Direction.UP, "1 replicas are below minReplicas 3")


def test_zero_replicas_pauses_scaling() -> None:
    d = ScaleDecider().decide(action(lo=2), 0, SATURATED_2, matched_pods=2, now=0)
    assert (d.desired, d.direction, d.blocked_by) == (0, Direction.NONE, Blocker.SCALED_TO_ZERO)
    assert not d.changes


# --- stabilization and cooldown -------------------------------------------------------------------------


def test_scale_down_waits_for_its_window() -> None:
    decider = ScaleDecider()
    a = action(down=ScaleDirection(stabilization_seconds=300, step_replicas=1, cooldown_seconds=0))
    for t in range(0, 300, 10):
        d = decider.decide(a, 3, IDLE_2, matched_pods=2, now=t)
        assert (d.desired, d.blocked_by) == (3, Blocker.STABILIZATION_WINDOW), t
        # What the status shows does not tick with the clock.
        assert d.steady_reason == "idle-gpu on 2/2 pods; waiting out the 5m scale-down stabilization window"
    assert d.reason == "idle-gpu on 2/2 pods for 4m50s; waiting out the 5m scale-down stabilization window"
    d = decider.decide(a, 3, IDLE_2, matched_pods=2, now=300)
    assert (d.desired, d.reason) == (2, "idle-gpu on 2/2 pods for 5m")


def test_one_contrary_recommendation_restarts_the_window() -> None:
    decider = ScaleDecider()
    a = action(down=ScaleDirection(stabilization_seconds=300, step_replicas=1, cooldown_seconds=0))
    decider.decide(a, 3, IDLE_2, matched_pods=2, now=0)
    decider.decide(a, 3, {"pod-0": frozenset({DOWN_RULE})}, matched_pods=2, now=290)  # one pod busy
    assert decider.decide(a, 3, IDLE_2, matched_pods=2, now=300).blocked_by is Blocker.STABILIZATION_WINDOW
    assert decider.decide(a, 3, IDLE_2, matched_pods=2, now=599).blocked_by is Blocker.STABILIZATION_WINDOW
    assert decider.decide(a, 3, IDLE_2, matched_pods=2, now=600).desired == 2


def test_scale_up_window() -> None:
    decider = ScaleDecider()
    a = action(up=ScaleDirection(stabilization_seconds=30, step_replicas=1, cooldown_seconds=0))
    assert decider.decide(a, 2, SATURATED_2, matched_pods=2, now=0).blocked_by is Blocker.STABILIZATION_WINDOW
    assert decider.decide(a, 2, SATURATED_2, matched_pods=2, now=30).desired == 3


def test_cooldown_spaces_steps_in_one_direction() -> None:
    decider = ScaleDecider()
    a = action()  # scale up: no window, cooldown 60s
    first = decider.decide(a, 2, SATURATED_2, matched_pods=2, now=0)
    assert first.desired == 3
    decider.record_scale(first, now=0)
    held = decider.decide(a, 3, SATURATED_2, matched_pods=2, now=59)
    assert (held.desired, held.blocked_by) == (3, Blocker.COOLDOWN)
    assert held.reason == "saturated on 2/2 pods for 59s; cooling down: last scale up 59s ago, cooldown 1m"
    assert held.steady_reason == "saturated on 2/2 pods; cooling down (1m)"
    assert decider.decide(a, 3, SATURATED_2, matched_pods=2, now=60).desired == 4


def test_cooldown_starts_only_when_recorded() -> None:
    decider = ScaleDecider()
    a = action()
    assert decider.decide(a, 2, SATURATED_2, matched_pods=2, now=0).desired == 3
    # Not applied (say the PATCH failed): the next evaluation may try again.
    assert decider.decide(a, 2, SATURATED_2, matched_pods=2, now=10).desired == 3


def test_cooldown_is_per_direction() -> None:
    decider = ScaleDecider()
    a = action(down=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=300))
    up = decider.decide(a, 2, SATURATED_2, matched_pods=2, now=0)
    decider.record_scale(up, now=0)
    down = decider.decide(a, 3, IDLE_2, matched_pods=2, now=1)
    assert (down.desired, down.direction) == (2, Direction.DOWN)


def test_the_policy_stands_by_its_last_change_through_the_cooldown() -> None:
    """dryRun (or an HPA not there yet): the target stays at 2, the policy keeps asking for 3."""
    decider = ScaleDecider()
    a = action()
    first = decider.decide(a, 2, SATURATED_2, matched_pods=2, now=0)
    decider.record_scale(first, now=0)
    assert (first.desired, first.wanted) == (3, 3)
    waiting = decider.decide(a, 2, SATURATED_2, matched_pods=2, now=30)
    assert (waiting.desired, waiting.wanted, waiting.blocked_by) == (2, 3, Blocker.COOLDOWN)
    followed = decider.decide(a, 3, SATURATED_2, matched_pods=2, now=40)
    assert (followed.desired, followed.wanted) == (3, 3)
    calm = decider.decide(a, 2, {}, matched_pods=2, now=50)  # the wish is gone: ask for what is there
    assert calm.wanted == 2
    again = decider.decide(a, 2, SATURATED_2, matched_pods=2, now=60)
    assert (again.desired, again.wanted) == (3, 3)


def test_standing_by_a_step_down() -> None:
    decider = ScaleDecider()
    a = action(down=ScaleDirection(stabilization_seconds=0, step_replicas=2, cooldown_seconds=300))
    decider.record_scale(decider.decide(a, 5, IDLE_2, matched_pods=2, now=0), now=0)
    assert decider.decide(a, 5, IDLE_2, matched_pods=2, now=10).wanted == 3
    # A spec change lowering maxReplicas below it: still within the range.
    assert decider.decide(action(lo=4, down=a.scale_down), 5, IDLE_2, matched_pods=2, now=20).wanted == 4


def test_restore_starts_both_cooldowns() -> None:
    decider = ScaleDecider()
    decider.restore(last_scale_at=100)
    a = action(down=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=300))
    assert decider.decide(a, 2, SATURATED_2, matched_pods=2, now=120).blocked_by is Blocker.COOLDOWN
    assert decider.decide(a, 2, IDLE_2, matched_pods=2, now=399).blocked_by is Blocker.COOLDOWN
    assert decider.decide(a, 2, IDLE_2, matched_pods=2, now=400).desired == 1


def test_example_policy_defaults() -> None:
    """The CRD's defaults: react up at once 1/min; down after 5m, 1 per 5m."""
    spec = parse_spec(
        {
            "selector": {},
            "rules": [
                {"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5m"}},
                {"name": "saturated", "utilizationCeiling": {"percent": 95, "for": "2m"}},
            ],
            "actions": {
                "scale": {
                    "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm-server"},
                    "maxReplicas": 4,
                    "scaleUpOn": ["saturated"],
                    "scaleDownOn": ["idle-gpu"],
                }
            },
        }
    )
    assert spec.actions.scale is not None
    replicas = simulate(spec.actions.scale, 1, [(float(t), SATURATED_2) for t in range(0, 600, 10)])
    assert replicas.changes == [(0, 2), (60, 3), (120, 4)]
    replicas = simulate(spec.actions.scale, 4, [(float(t), IDLE_2) for t in range(0, 1800, 10)])
    assert replicas.changes == [(300, 3), (600, 2), (900, 1)]


# --- simulation and properties -------------------------------------------------------------------------


@dataclass
class Run:
    """What a simulated Scaler did: (time, replicas after) per change, and every decision."""

    changes: list[tuple[float, int]]
    decisions: list[ScaleDecision]


def simulate(
    a: ScaleAction,
    replicas: int,
    steps: Sequence[tuple[float, Findings]],
    matched: int = 2,
    loads: Sequence[float] = (),
) -> Run:
    """Feed ``steps`` to a decider and apply each change at once, as the Scaler does.

    With ``loads`` (cycled), each evaluation also brings a load sample, for ``a.forecast``.
    """
    decider = ScaleDecider()
    run = Run([], [])
    for i, (now, by_pod) in enumerate(steps):
        load = WorkloadLoad(loads[i % len(loads)], replicas, replicas) if loads else None
        d = decider.decide(a, replicas, by_pod, matched, now, load)
        run.decisions.append(d)
        if d.changes:
            decider.record_scale(d, now)
            replicas = d.desired
            run.changes.append((now, replicas))
    return run


SIGNALS: list[Findings] = [
    SATURATED_2,
    IDLE_2,
    {},
    {"pod-0": frozenset({DOWN_RULE})},  # one of two idle: no signal
    {"pod-0": frozenset({UP_RULE}), "pod-1": frozenset({DOWN_RULE})},
]

durations = st.sampled_from([0.0, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0])


@st.composite
def directions(draw: st.DrawFn) -> ScaleDirection:
    percent = draw(st.booleans())
    return ScaleDirection(
        stabilization_seconds=draw(durations),
        step_replicas=None if percent else draw(st.integers(1, 4)),
        step_percent=float(draw(st.integers(1, 200))) if percent else None,
        cooldown_seconds=draw(durations),
    )


@st.composite
def actions(draw: st.DrawFn) -> ScaleAction:
    lo = draw(st.integers(1, 6))
    hi = draw(st.integers(lo, 12))
    percent = draw(st.booleans())
    return action(
        lo=lo,
        hi=hi,
        up=draw(directions()),
        down=draw(directions()),
        min_pods=None if percent else draw(st.integers(1, 3)),
        min_pods_percent=float(draw(st.integers(1, 100))) if percent else None,
    )


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[float, Findings]]:
    """Evaluations at irregular, increasing times with arbitrary signals."""
    gaps = draw(st.lists(st.sampled_from([1.0, 5.0, 10.0, 10.0, 30.0, 61.0]), min_size=1, max_size=120))
    signals = draw(st.lists(st.sampled_from(SIGNALS), min_size=len(gaps), max_size=len(gaps)))
    now, steps = 0.0, []
    for gap, signal in zip(gaps, signals, strict=True):
        now += gap
        steps.append((now, signal))
    return steps


FORECAST = ScaleForecast("saturated", 95.0, Signal.AUTO, "idle-gpu", 20.0)


@st.composite
def loads(draw: st.DrawFn) -> list[float]:
    """Nothing (a policy without forecast), or a random walk of the load: ramps, plateaus, noise."""
    if not draw(st.booleans()):
        return []
    level = draw(st.floats(0, 1200))
    out = []
    for step in draw(st.lists(st.floats(-40, 40), min_size=1, max_size=120)):
        level = max(0.0, level + step)
        out.append(level)
    return out


def with_forecast(a: ScaleAction, walk: list[float]) -> ScaleAction:
    return replace(a, forecast=FORECAST) if walk else a


@settings(max_examples=300, deadline=None)
@given(a=actions(), start=st.integers(1, 20), steps=histories(), walk=loads())
def test_desired_always_within_range(
    a: ScaleAction, start: int, steps: list[tuple[float, Findings]], walk: list[float]
) -> None:
    a = with_forecast(a, walk)
    run = simulate(a, start, steps, loads=walk)
    for d in run.decisions:
        assert a.min_replicas <= d.desired <= a.max_replicas
        assert a.min_replicas <= d.wanted <= a.max_replicas
    # After the first decision, the target is in range and stays there.
    assert all(a.min_replicas <= r <= a.max_replicas for _, r in run.changes)


@settings(max_examples=300, deadline=None)
@given(a=actions(), start=st.integers(1, 12), steps=histories(), walk=loads())
def test_cooldown_respected(
    a: ScaleAction, start: int, steps: list[tuple[float, Findings]], walk: list[float]
) -> None:
    start = min(max(start, a.min_replicas), a.max_replicas)  # range restoration is exempt by design
    a = with_forecast(a, walk)
    run = simulate(a, start, steps, loads=walk)
    last: dict[Direction, float] = {}
    for d, (now, _) in zip(run.decisions, steps, strict=True):
        if d.changes:
            behavior = a.scale_up if d.direction is Direction.UP else a.scale_down
            if d.direction in last:
                assert now - last[d.direction] >= behavior.cooldown_seconds
            last[d.direction] = now


@settings(max_examples=300, deadline=None)
@given(a=actions(), start=st.integers(1, 12), steps=histories(), walk=loads())
def test_no_direction_change_inside_the_window(
    a: ScaleAction, start: int, steps: list[tuple[float, Findings]], walk: list[float]
) -> None:
    """A change against the previous one comes at least its direction's stabilization window later."""
    start = min(max(start, a.min_replicas), a.max_replicas)
    a = with_forecast(a, walk)
    run = simulate(a, start, steps, loads=walk)
    changes = [(now, d.direction) for d, (now, _) in zip(run.decisions, steps, strict=True) if d.changes]
    for (t1, d1), (t2, d2) in itertools.pairwise(changes):
        if d1 is not d2:
            window = (a.scale_up if d2 is Direction.UP else a.scale_down).stabilization_seconds
            assert t2 - t1 >= window


@settings(max_examples=200, deadline=None)
@given(
    period=st.integers(1, 29),
    phase=st.integers(0, 1),
    jitter=st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=400, max_size=400),
)
def test_oscillating_signal_does_not_flap(period: int, phase: int, jitter: list[float]) -> None:
    """Utilization hovering at the idle threshold: the idle finding comes and goes on one pod.

    The down wish never lasts a whole 5m window, so nothing moves; and a
    saturation signal that alternates with idleness moves replicas up only.
    """
    a = action(down=ScaleDirection(stabilization_seconds=300, step_replicas=1, cooldown_seconds=0))
    hovering: list[tuple[float, Findings]] = []
    alternating: list[tuple[float, Findings]] = []
    for i, j in enumerate(jitter):
        now = i * 10.0 + j
        idle_phase = (i // period + phase) % 2 == 0
        hovering.append((now, IDLE_2 if idle_phase else {"pod-0": frozenset({DOWN_RULE})}))
        alternating.append((now, IDLE_2 if idle_phase else SATURATED_2))
    assert simulate(a, 4, hovering).changes == []
    run = simulate(a, 4, alternating)
    assert run.changes, "saturation still scales up"
    assert all(d.direction is Direction.UP for d in run.decisions if d.changes)


# --- forecast-driven scaling --------------------------------------------------------------------------


def every_10s(minutes: float, findings: Findings, start: float = 0.0) -> list[tuple[float, Findings]]:
    return [(start + 10.0 * i, findings) for i in range(int(minutes * 6))]


def ramp_then(flat_minutes: int, level: float, slope_per_minute: float, minutes: int) -> list[float]:
    """Per 10 s evaluation: ``level`` for ``flat_minutes``, then rising by ``slope_per_minute``."""
    return [level] * (flat_minutes * 6) + [level + slope_per_minute * i / 6 for i in range(minutes * 6)]


def test_the_forecast_scales_up_before_any_pod_is_saturated() -> None:
    a = replace(action(), forecast=FORECAST)
    walk = ramp_then(15, 150.0, 10.0, 10)  # two replicas at 75%, then +10 a minute
    run = simulate(a, 2, every_10s(25, {}), loads=walk)
    (first, *_) = [d for d in run.decisions if d.changes]
    assert (first.current, first.desired, first.direction) == (2, 3, Direction.UP)
    assert first.summary == "forecast above saturated's ceiling (95%) in 3m"
    assert first.reason.startswith("forecast above saturated's ceiling (95%) in 3m: ")
    assert "% per replica (80% interval " in first.reason
    at = run.changes[0][0]
    assert walk[int(at / 10)] / 2 < 95  # still under the ceiling when it acted


def test_the_forecast_holds_a_scale_down_back_while_the_load_is_coming_back() -> None:
    a = replace(action(), forecast=FORECAST)
    # Idle by the rules (10% each on four), but rising: 40 -> 100 over the next minutes.
    walk = ramp_then(15, 40.0, 0.0, 0) + ramp_then(0, 40.0, 6.0, 15)
    run = simulate(a, 4, every_10s(15, IDLE_2) + every_10s(15, IDLE_2, start=900.0), loads=walk)
    held = [d for d in run.decisions[90:] if d.direction is Direction.NONE and "but the forecast" in d.reason]
    assert held
    assert (
        held[-1].summary
        == "idle-gpu on 2/2 pods, but the forecast rises above idle-gpu's floor (20%) within 3m"
    )
    # Without the forecast the rules alone step down, one per cooldown.
    assert simulate(action(), 4, every_10s(30, IDLE_2)).changes


def test_a_flat_low_forecast_lets_the_rules_scale_down() -> None:
    a = replace(action(), forecast=FORECAST)
    run = simulate(a, 4, every_10s(30, IDLE_2), loads=[20.0])
    assert run.changes[0] == (300.0, 3)  # as the rules alone: after the 5m window


def test_an_unsure_forecast_leaves_the_decision_to_the_rules() -> None:
    a = replace(action(), forecast=FORECAST)
    rng = random.Random(4)
    noisy = [rng.choice((10.0, 300.0)) for _ in range(180)]
    alone = simulate(action(), 4, every_10s(30, IDLE_2))
    run = simulate(a, 4, every_10s(30, IDLE_2), loads=noisy)
    assert run.changes == alone.changes


def test_a_saturated_pod_scales_up_whatever_the_forecast_says() -> None:
    a = replace(action(), forecast=FORECAST)
    steps = every_10s(15, {}) + every_10s(1, SATURATED_2, start=900.0)
    run = simulate(a, 2, steps, loads=[20.0])  # a forecast of 10% per replica
    assert run.changes == [(900.0, 3)]
    assert run.decisions[-6].reason == "saturated on 2/2 pods"


def test_decisions_without_forecast_keep_no_predictor() -> None:
    decider = ScaleDecider()
    decider.decide(replace(action(), forecast=FORECAST), 2, {}, 2, 0.0, WorkloadLoad(100, 2, 2))
    assert decider.verdict is not None
    assert decider.verdict.view is View.NO_HISTORY
    decider.decide(action(), 2, {}, 2, 10.0, WorkloadLoad(100, 2, 2))
    assert decider.predictor is None
    assert decider.verdict is None


@pytest.mark.parametrize("seed", range(5))
def test_the_forecast_does_not_flap_on_a_flat_noisy_load(seed: int) -> None:
    """Six hours of two replicas at ~80% with noise and no finding: the forecast never scales down, and
    each scale-up it asks for lowers the per-replica forecast, so they do not pile up."""
    rng = random.Random(seed)
    a = replace(action(), forecast=FORECAST)
    walk, ar = [], 0.0
    for _ in range(6 * 360):
        ar = 0.98 * ar + rng.gauss(0, 2)
        walk.append(160 * (1 + ar / 100) + rng.gauss(0, 5))
    run = simulate(a, 2, every_10s(360, {}), loads=walk)
    assert all(d.direction is not Direction.DOWN for d in run.decisions if d.changes)
    assert len(run.changes) <= 1


# --- the step: what is recorded given the owner's outcome ---------------------------------------------


@dataclass(frozen=True)
class Active:
    rule: str
    pod: str


SATURATED_FINDINGS = [Active(UP_RULE, "a"), Active(UP_RULE, "b")]


@pytest.mark.parametrize(
    ("dry_run", "made", "kind", "cooling"),
    [
        (False, True, StepKind.APPLY, True),
        (False, False, StepKind.APPLY, False),  # refused or failed: decided afresh next time
        (True, False, StepKind.ANNOUNCE, True),  # dryRun: announced, its cooldown runs all the same
    ],
)
def test_a_step_records_a_change_made_or_announced_only(
    dry_run: bool, made: bool, kind: StepKind, cooling: bool
) -> None:
    a = replace(action(), dry_run=dry_run)
    decider = ScaleDecider()
    step = scale_step(decider, a, 2, SATURATED_FINDINGS, 2, now=0)
    assert (step.kind, step.decision.desired) == (kind, 3)
    assert step.settle(made=made) is cooling
    with pytest.raises(RuntimeError):
        step.settle(made=made)
    after = scale_step(decider, a, 3 if made else 2, SATURATED_FINDINGS, 2, now=10)
    assert (after.decision.blocked_by is Blocker.COOLDOWN) is cooling


def test_a_step_that_changes_nothing_holds() -> None:
    step = scale_step(ScaleDecider(), action(hi=2), 2, SATURATED_FINDINGS, 2, now=0)
    assert (step.kind, step.decision.blocked_by) == (StepKind.HOLD, Blocker.AT_MAX_REPLICAS)
    assert step.settle(made=False) is False

"""PolicyEvaluator: selection, lifecycle, hysteresis, re-notification, snooze, spec edits, restore, replay."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpuwarden.policy import (
    Evaluation,
    Finding,
    FindingTransition,
    PodId,
    PodView,
    Point,
    PolicyEvaluator,
    Resolution,
    SeriesKey,
    SeriesStore,
    Transition,
    WindowParams,
    horizon_seconds,
    snoozed_until,
)
from gpuwarden.policy.rules import utilization
from gpuwarden.policy.rules.growth import MemoryGrowth
from gpuwarden.policy.rules.memory_ceiling import MemoryCeiling
from gpuwarden.policy.rules.utilization import UtilizationCeiling, UtilizationFloor
from gpuwarden.policy.spec.model import Actions, LabelSelector, PolicySpec, Rule, Signal

T0 = 1_749_999_960.0
GI = 2**30
MI = 2**20
CARD = 80 * GI
IDLE = UtilizationFloor(name="idle-gpu", percent=20, for_seconds=300)
HOT = UtilizationCeiling(name="saturated", percent=95, for_seconds=120)
NEAR_OOM = MemoryCeiling(name="near-oom", for_seconds=60, percent=90)
LEAK = MemoryGrowth(name="leak", rate_bytes_per_second=100 * MI / 60, window_seconds=1800, min_fit=0.8)
APP = LabelSelector(match_labels=(("app", "llm"),))
LLM = {"app": "llm"}

Reading = Callable[[float], Point]


def spec(*rules: Rule, renotify: float = 3600.0, selector: LabelSelector = APP) -> PolicySpec:
    return PolicySpec(selector=selector, rules=rules, actions=Actions(renotify_seconds=renotify))


def sm(value: float | Callable[[float], float], mem: float = 10 * GI) -> Reading:
    """Readings with SM activity ``value`` (a constant or a function of seconds since T0)."""

    def at(t: float) -> Point:
        v = value(t - T0) if callable(value) else value
        return Point(t, gpu_util=v, sm_active=v, mem_used=mem, mem_total=CARD, power_w=100.0)

    return at


class Scenario:
    """Feeds 1 s readings per pod into a store and evaluates every ``every`` seconds."""

    def __init__(self, evaluator: PolicyEvaluator, every: float = 10.0) -> None:
        self.evaluator = evaluator
        self.store = SeriesStore(retention_seconds=3600, max_points=3600)
        self.every = every
        self.t = T0
        self.pods: dict[PodId, tuple[PodView, Reading]] = {}
        self.silent: set[PodId] = set()
        """Pods that exist but send no readings (their node went quiet)."""
        self.evaluations: list[Evaluation] = []

    def pod(
        self,
        name: str,
        reading: Reading,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        view = PodView("ns", name, LLM if labels is None else labels, annotations or {})
        self.pods[view.id] = (view, reading)

    def remove(self, name: str) -> None:
        del self.pods[PodId("ns", name)]

    def run(self, seconds: float) -> list[FindingTransition]:
        """Advance ``seconds``; return the transitions of the evaluations made meanwhile."""
        out: list[FindingTransition] = []
        stop = self.t + seconds
        while self.t < stop:
            self.t += 1
            for view, reading in self.pods.values():
                if view.id in self.silent:
                    continue
                self.store.add(SeriesKey(view.namespace, view.name, f"GPU-{view.name}"), reading(self.t))
            if (self.t - T0) % self.every == 0:
                result = self.evaluator.evaluate([v for v, _ in self.pods.values()], self.store, self.t)
                self.evaluations.append(result)
                out.extend(result.transitions)
        return out


def kinds(transitions: Iterable[FindingTransition]) -> list[Transition]:
    return [t.transition for t in transitions]


def announced(transitions: Iterable[FindingTransition]) -> list[tuple[Transition, str, str]]:
    return [
        (t.transition, t.finding.rule, t.finding.pod)
        for t in transitions
        if t.transition is not Transition.ONGOING
    ]


def test_lifecycle_started_ongoing_resolved() -> None:
    sc = Scenario(PolicyEvaluator("ns/policy", spec(IDLE), namespace="ns"))
    sc.pod("a", sm(3.0))
    first = sc.run(300)  # readings from T0+1: the 5m window is covered at T0+300
    assert kinds(first) == [Transition.STARTED]
    started = first[0].finding
    assert started.reason == "GPUUnderutilized"
    assert started.kind == utilization.FLOOR_KIND
    assert (started.policy, started.namespace, started.pod, started.gpus) == (
        "ns/policy",
        "ns",
        "a",
        ("GPU-a",),
    )
    assert started.started_at == T0 + 300
    assert started.message == "mean SM activity (GPM) 3% over 5m, floor 20%"

    assert set(kinds(sc.run(100))) == {Transition.ONGOING}
    assert sc.evaluator.active()[0].started_at == started.started_at

    sc.pod("a", sm(80.0))  # back to work: the window mean climbs past 20 + 5
    later = sc.run(300)
    assert kinds(later)[-1] is Transition.RESOLVED
    assert later[-1].resolution is Resolution.RECOVERED
    assert later[-1].finding.started_at == started.started_at
    assert later[-1].finding.value >= 25
    assert sc.evaluator.active() == []
    assert sc.evaluations[-1].violating_pods == ()


def test_renotify_at_the_interval_and_no_more() -> None:
    sc = Scenario(PolicyEvaluator("ns/policy", spec(IDLE, renotify=120)))
    sc.pod("a", sm(0.0))
    transitions = sc.run(300 + 600)
    counts = Counter(kinds(transitions))
    assert counts[Transition.STARTED] == 1
    assert counts[Transition.RENOTIFY] == 5  # 600 s of ongoing violation, every 120 s
    renotified = [t.at for t in transitions if t.transition is Transition.RENOTIFY]
    assert all(b - a == 120 for a, b in itertools.pairwise(renotified))


@settings(max_examples=20, deadline=None)
@given(
    threshold=st.sampled_from([20.0, 50.0]),
    hysteresis=st.floats(2, 10),
    spread=st.floats(0.01, 0.99),
    period=st.integers(2, 400),
)
def test_value_hovering_at_the_threshold_does_not_flap(
    threshold: float, hysteresis: float, spread: float, period: int
) -> None:
    """Readings swinging either side of the threshold, within the margin: one start at most, never a clear."""
    low, high = threshold - spread * hysteresis, threshold + spread * hysteresis
    floor = UtilizationFloor("idle", threshold, 300, hysteresis=hysteresis)
    ceiling = UtilizationCeiling("hot", threshold, 300, hysteresis=hysteresis)
    sc = Scenario(PolicyEvaluator("ns/p", spec(floor, ceiling)))
    sc.pod("a", sm(lambda s: low if (s // period) % 2 else high))
    transitions = sc.run(1800)
    for rule in ("idle", "hot"):
        mine = Counter(t.transition for t in transitions if t.finding.rule == rule)
        assert mine[Transition.STARTED] <= 1
        assert mine[Transition.RESOLVED] == 0


def test_flapping_values_past_the_margins_do_transition() -> None:
    # The opposite check: crossing both lines does start and clear, so the test above is not vacuous.
    sc = Scenario(PolicyEvaluator("ns/p", spec(IDLE)))
    sc.pod("a", sm(lambda s: 0.0 if (s // 600) % 2 == 0 else 60.0))
    counts = Counter(kinds(sc.run(2400)))
    assert counts[Transition.STARTED] == 2
    assert counts[Transition.RESOLVED] == 2


def test_snooze_silences_a_rule_until_the_time_given() -> None:
    until = "2025-06-15T15:17:40Z"  # T0 + 700 s
    assert snoozed_until({"snooze.gpuwarden.dev/idle-gpu": until}, "idle-gpu") == T0 + 700
    sc = Scenario(PolicyEvaluator("ns/p", spec(IDLE, HOT)))
    sc.pod("a", sm(0.0))
    assert announced(sc.run(310)) == [(Transition.STARTED, "idle-gpu", "a")]
    sc.pod("a", sm(0.0), annotations={"snooze.gpuwarden.dev/idle-gpu": until})
    snoozed = sc.run(10)
    assert announced(snoozed) == [(Transition.RESOLVED, "idle-gpu", "a")]
    assert snoozed[0].resolution is Resolution.SNOOZED
    assert announced(sc.run(370)) == []  # still idle, still snoozed
    assert [o.rule for o in sc.evaluations[-1].outcomes] == ["saturated"]  # the other rule still runs
    assert announced(sc.run(20)) == [(Transition.STARTED, "idle-gpu", "a")]  # the snooze ran out


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2025-06-15T15:17:40Z", T0 + 700),
        ("2025-06-15T17:17:40+02:00", T0 + 700),
        ("2025-06-15T15:17:40", T0 + 700),  # no offset: UTC
        ("tomorrow", None),
        ("", None),
    ],
)
def test_snooze_annotation_parsing(value: str, expected: float | None) -> None:
    assert snoozed_until({"snooze.gpuwarden.dev/r": value}, "r") == expected
    assert snoozed_until({"snooze.gpuwarden.dev/other": value}, "r") is None


def test_selection_namespace_and_resolution_causes() -> None:
    sc = Scenario(PolicyEvaluator("ns/p", spec(IDLE), namespace="ns"))
    sc.pod("a", sm(0.0))
    sc.pod("b", sm(0.0))
    sc.pod("web", sm(0.0), labels={"app": "web"})
    sc.run(310)
    result = sc.evaluations[-1]
    assert result.matched_pods == (PodId("ns", "a"), PodId("ns", "b"))
    assert result.violating_pods == (PodId("ns", "a"), PodId("ns", "b"))
    sc.pod("a", sm(0.0), labels={"app": "other"})
    sc.remove("b")
    transitions = sc.run(10)
    assert {(t.finding.pod, t.resolution) for t in transitions} == {
        ("a", Resolution.NOT_SELECTED),
        ("b", Resolution.POD_GONE),
    }
    assert sc.evaluations[-1].matched_pods == ()
    # Another namespace's pods are not this policy's business.
    other = sc.evaluator.evaluate([PodView("other", "a", LLM)], sc.store, sc.t)
    assert other.matched_pods == ()


def test_update_spec_keeps_findings_of_surviving_rules() -> None:
    sc = Scenario(PolicyEvaluator("ns/p", spec(IDLE, NEAR_OOM)))
    sc.pod("a", sm(0.0, mem=0.95 * CARD))
    assert sorted(announced(sc.run(310))) == [
        (Transition.STARTED, "idle-gpu", "a"),
        (Transition.STARTED, "near-oom", "a"),
    ]
    # near-oom removed, idle-gpu edited (same name and kind): only the removed one resolves.
    sc.evaluator.update_spec(spec(UtilizationFloor("idle-gpu", 10, 300)))
    transitions = sc.run(10)
    assert announced(transitions) == [(Transition.RESOLVED, "near-oom", "a")]
    assert transitions[-1].resolution is Resolution.RULE_REMOVED
    # idle-gpu becomes a ceiling under the same name: the floor finding ends, nothing new starts.
    sc.evaluator.update_spec(spec(UtilizationCeiling("idle-gpu", 95, 120)))
    transitions = sc.run(10)
    assert announced(transitions) == [(Transition.RESOLVED, "idle-gpu", "a")]
    assert transitions[0].resolution is Resolution.RULE_REMOVED


def test_restore_avoids_reannouncing_and_resolves_without_data() -> None:
    live = Scenario(PolicyEvaluator("ns/p", spec(IDLE)))
    live.pod("a", sm(0.0))
    live.pod("b", sm(0.0))
    live.run(400)
    persisted = live.evaluator.active()
    assert len(persisted) == 2

    # The operator restarts: an empty store, findings restored from the policy's status.
    restarted = PolicyEvaluator("ns/p", spec(IDLE), no_data_seconds=120)
    restarted.restore(persisted, now=live.t)
    sc = Scenario(restarted)
    sc.t = live.t
    sc.pod("a", sm(0.0))  # a's agent replays its buffer and goes on
    sc.pod("b", sm(0.0))
    sc.silent.add(PodId("ns", "b"))  # b's node stays quiet
    transitions = sc.run(400)
    assert Transition.STARTED not in kinds(transitions)
    assert [
        (t.finding.pod, t.resolution, t.at - live.t)
        for t in transitions
        if t.transition is Transition.RESOLVED
    ] == [("b", Resolution.NO_DATA, 120)]
    (a,) = restarted.active()
    assert a.started_at == next(f.started_at for f in persisted if f.pod == "a")


def test_replayed_samples_rederive_the_same_findings() -> None:
    """Live evaluation every 10 s and one evaluation after a full replay agree on what is active."""
    rules = (IDLE, HOT, NEAR_OOM, LEAK)
    live = Scenario(PolicyEvaluator("ns/p", spec(*rules)))
    live.pod("idle", sm(2.0))
    live.pod("hot", sm(99.0))
    live.pod("full", sm(50.0, mem=0.97 * CARD))
    live.pod("leaky", lambda t: Point(t, sm_active=50.0, mem_used=GI + 3 * MI * (t - T0), mem_total=CARD))
    live.pod("fine", sm(50.0))
    live.run(2100)

    replayed = PolicyEvaluator("ns/p", spec(*rules))
    result = replayed.evaluate([v for v, _ in live.pods.values()], live.store, live.t)

    def summary(findings: Iterable[Finding]) -> set[tuple[str, str, tuple[str, ...], float]]:
        return {(f.rule, f.pod, f.gpus, round(f.value, 6)) for f in findings}

    assert summary(result.active) == summary(live.evaluator.active())
    assert {(f.rule, f.pod) for f in result.active} == {
        ("idle-gpu", "idle"),
        ("saturated", "hot"),
        ("near-oom", "full"),
        ("leak", "leaky"),
    }
    assert kinds(result.transitions) == [Transition.STARTED] * 4


def test_growth_for_must_hold_at_every_evaluation() -> None:
    leak = MemoryGrowth("leak", 100 * MI / 60, 1800, 0.8, for_seconds=300)
    sc = Scenario(PolicyEvaluator("ns/p", spec(leak)))
    sc.pod("a", lambda t: Point(t, sm_active=50.0, mem_used=GI + 3 * MI * (t - T0), mem_total=CARD))
    sc.run(200)
    assert not any(o.holds for e in sc.evaluations for o in e.outcomes)
    transitions = sc.run(600)
    first_hold = next(e.at for e in sc.evaluations if any(o.holds for o in e.outcomes))
    (started,) = [t for t in transitions if t.transition is Transition.STARTED]
    assert started.at == first_hold + 300
    assert started.finding.reason == "GPUMemoryLeakSuspected"
    assert started.finding.fit is not None
    assert started.finding.seconds_to_full is not None


def test_evaluation_lists_findings_newest_first_and_announcements() -> None:
    sc = Scenario(PolicyEvaluator("ns/p", spec(IDLE, NEAR_OOM)))
    sc.pod("a", sm(0.0, mem=0.95 * CARD))  # near-oom after 60 s, idle after 300 s
    sc.run(300)
    result = sc.evaluations[-1]
    assert [f.rule for f in result.active] == ["idle-gpu", "near-oom"]
    assert result.active[0].started_at > result.active[1].started_at
    assert len(result.outcomes) == 2
    assert announced(result.announcements()) == [(Transition.STARTED, "idle-gpu", "a")]


def test_pods_without_series_are_selected_but_not_judged() -> None:
    evaluator = PolicyEvaluator("ns/p", spec(IDLE, selector=LabelSelector()))
    store = SeriesStore(600, 600)
    result = evaluator.evaluate([PodView("ns", "cpu-only")], store, T0)
    assert result.matched_pods == (PodId("ns", "cpu-only"),)
    assert result.transitions == ()
    assert result.outcomes[0].value is None


def test_horizon_covers_the_longest_rule() -> None:
    assert horizon_seconds(spec(IDLE, LEAK)) == 1800 * 1.05 + 60 + 30
    assert (
        PolicyEvaluator("ns/p", spec(IDLE), params=WindowParams(stale_after_seconds=10)).horizon_seconds()
        == 340
    )


@settings(max_examples=60, deadline=None)
@given(
    for_seconds=st.floats(1.0, 600.0),
    dt=st.floats(0.05, 30.0),
    explicit=st.sampled_from([None, 5.0, 60.0]),
)
def test_a_young_series_never_holds_before_its_readings_span_for_minus_one_interval(
    for_seconds: float, dt: float, explicit: float | None
) -> None:
    """The operator's report: with no earlier data, ``for: 10s`` fired after about 6 s of readings.

    A series that starts at ``t0`` and reads every ``dt``: no rule holds as of a
    sample before ``t0 + for - dt`` (the leading edge may be uncovered by one
    interval, never by ``max_gap``), and every one holds from ``t0 + for`` on
    once the window has a few readings whose intervals the gap limit allows.
    The 1 µs slack absorbs float rounding of epoch timestamps (about 0.24 µs).
    """
    assume(for_seconds / dt <= 400)
    rules = (
        UtilizationFloor("idle", 20, for_seconds, signal=Signal.SM_ACTIVE),
        UtilizationCeiling("hot", 95, for_seconds, signal=Signal.GPU_UTIL),
        MemoryCeiling("full", for_seconds, percent=90),
    )
    evaluator = PolicyEvaluator("ns/p", spec(*rules), params=WindowParams(max_gap_seconds=explicit))
    store = SeriesStore(retention_seconds=3600, max_points=4000)
    pods = [PodView("ns", "young", LLM)]
    key = SeriesKey("ns", "young", "GPU-0")
    earliest = T0 + for_seconds - dt - 1e-6
    started: dict[str, float] = {}
    for k in range(int((for_seconds + 2 * dt) / dt) + 2):
        t = T0 + k * dt
        # Idle by SM activity, saturated by utilization.gpu, memory at 95%: all three rules' values hold.
        store.add(key, Point(t, gpu_util=100.0, sm_active=0.0, mem_used=0.95 * CARD, mem_total=CARD))
        for outcome in evaluator.evaluate(pods, store, t).outcomes:
            if outcome.holds:
                assert t >= earliest, (outcome.rule, t - T0)
                started.setdefault(outcome.rule, t)
    if for_seconds >= 2 * dt and (explicit is None or explicit >= dt):
        # Live too: by the first sample at or after t0 + for.
        due = T0 + dt * math.ceil(for_seconds / dt - 1e-9) + 1e-6
        assert started.keys() == {"idle", "hot", "full"}
        assert all(at <= due for at in started.values()), (started, due - T0)


def test_for_10s_at_1s_sampling_starts_on_the_10th_reading_not_the_6th() -> None:
    """The reported case, exactly: readings at t0, t0+1, ... and ``for: 10s``."""
    rule = UtilizationFloor("idle", 20, 10)
    evaluator = PolicyEvaluator("ns/p", spec(rule), params=WindowParams())
    store = SeriesStore(retention_seconds=600, max_points=600)
    pods = [PodView("ns", "young", LLM)]
    start = None
    for k in range(20):
        store.add(SeriesKey("ns", "young", "GPU-0"), sm(0.0)(T0 + k))
        result = evaluator.evaluate(pods, store, T0 + k)
        if start is None and any(t.transition is Transition.STARTED for t in result.transitions):
            start = k
    # As of t0 + 9 the window [t0 - 1, t0 + 9] lacks one interval at its start: the earliest start.
    # (It started at k == 5 when the start could lack max_gap, 5 s.)
    assert start == 9

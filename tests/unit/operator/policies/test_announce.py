"""Which Events an evaluation calls for, and the book that keeps them from repeating."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwarden.operator.policies.announce import Announcer, EventSpec, Target, announce
from gpuwarden.operator.resources import ObjectRef
from gpuwarden.policy.engine import Evaluation
from gpuwarden.policy.findings import Finding, FindingTransition, Resolution, Transition
from gpuwarden.policy.rules import growth, memory_ceiling, rule_type, utilization
from gpuwarden.policy.rules.common import RuleKind

T0 = 1_800_000_000.0


def finding(pod: str = "p", kind: RuleKind = utilization.FLOOR_KIND, message: str = "3% over 5m") -> Finding:
    return Finding(
        policy="ns/pol",
        rule="idle",
        kind=kind,
        reason=rule_type(kind).reason,
        namespace="ns",
        pod=pod,
        gpus=("GPU-1",),
        value=3.0,
        threshold=20.0,
        unit="percent",
        started_at=T0,
        message=message,
    )


def ev(*steps: FindingTransition) -> Evaluation:
    return Evaluation(
        at=steps[0].at if steps else T0, transitions=steps, active=(), matched_pods=(), violating_pods=()
    )


def step(
    t: Transition, at: float, f: Finding | None = None, why: Resolution | None = None
) -> FindingTransition:
    return FindingTransition(t, f or finding(), at, why)


def test_a_start_warns_on_the_pod_and_the_policy_with_the_figure_and_its_meaning() -> None:
    book = Announcer("pol")
    planned = book.plan(ev(step(Transition.STARTED, T0)))
    assert [(e.target, e.type, e.reason) for e in planned] == [
        (Target.POD, "Warning", "GPUUnderutilized"),
        (Target.POLICY, "Warning", "GPUUnderutilized"),
    ]
    assert "3% over 5m" in planned[0].message
    assert "idle" in planned[0].message
    assert "pol" in planned[0].message
    assert "sit mostly idle" in planned[0].message
    assert planned[1].message.startswith("pod p: ")


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        (utilization.FLOOR_KIND, "GPUUnderutilized"),
        (utilization.CEILING_KIND, "GPUSaturated"),
        (memory_ceiling.KIND, "GPUMemoryNearLimit"),
        (growth.KIND, "GPUMemoryLeakSuspected"),
    ],
)
def test_reasons_are_camel_case_per_kind(kind: RuleKind, reason: str) -> None:
    book = Announcer("pol")
    f = finding(kind=kind)
    started = book.plan(ev(step(Transition.STARTED, T0, f)))
    resolved = book.plan(ev(step(Transition.RESOLVED, T0 + 60, f, Resolution.RECOVERED)))
    assert {e.reason for e in started} == {reason}
    assert {(e.type, e.reason) for e in resolved} == {("Normal", reason + "Resolved")}


def test_ongoing_is_silent_and_renotify_says_still() -> None:
    book = Announcer("pol")
    book.plan(ev(step(Transition.STARTED, T0)))
    assert book.plan(ev(step(Transition.ONGOING, T0 + 30))) == []
    again = book.plan(ev(step(Transition.RENOTIFY, T0 + 60)))
    assert [e.type for e in again] == ["Warning", "Warning"]
    assert "still, for 1m" in again[0].message


def test_a_leak_now_imminent_is_announced_at_once_under_its_new_reason_with_the_old_one_named() -> None:
    book = Announcer("pol")
    leak = finding(kind=growth.KIND, message="GPU memory grows 5Gi/m; the card is full in 20m")
    book.plan(ev(step(Transition.STARTED, T0, leak)))
    soon = dataclasses.replace(leak, reason="GPUMemoryExhaustionImminent", message="... full in 14m")
    planned = book.plan(ev(step(Transition.RENOTIFY, T0 + 120, soon)))
    assert {e.reason for e in planned} == {"GPUMemoryExhaustionImminent"}
    assert planned[0].message.startswith("... full in 14m; at this rate it runs out of GPU memory soon")
    assert "(for 2m, was GPUMemoryLeakSuspected)" in planned[0].message
    # Re-notified under the same reason: "still".
    again = book.plan(ev(step(Transition.RENOTIFY, T0 + 3600, soon)))
    assert "still, for 1h" in again[0].message


def test_a_restart_restores_the_messages_announced_before() -> None:
    # Whether to announce again is the engine's (its restored tracker says ONGOING, not STARTED).
    book = Announcer("pol")
    book.restore([finding(message="as announced before")], T0)
    assert book.plan(ev(step(Transition.ONGOING, T0 + 5))) == []
    assert book.messages()[finding().key] == "as announced before"


def test_resolution_says_why_and_a_gone_pod_gets_no_event() -> None:
    book = Announcer("pol")
    book.plan(ev(step(Transition.STARTED, T0)))
    recovered = book.plan(
        ev(step(Transition.RESOLVED, T0 + 125, finding(message="63% over 5m"), Resolution.RECOVERED))
    )
    assert [e.target for e in recovered] == [Target.POD, Target.POLICY]
    assert "resolved after 2m5s, back within the rule: 63% over 5m" in recovered[0].message
    assert book.messages() == {}
    book.plan(ev(step(Transition.STARTED, T0 + 200)))  # a new violation after the end is announced
    gone = book.plan(ev(step(Transition.RESOLVED, T0 + 300, why=Resolution.POD_GONE)))
    assert [e.target for e in gone] == [Target.POLICY]
    assert "the pod is gone" in gone[0].message


def test_events_off_plans_nothing_but_keeps_the_book() -> None:
    book = Announcer("pol")
    assert book.plan(ev(step(Transition.STARTED, T0)), events=False) == []
    assert finding().key in book.messages()


async def test_announce_hands_events_to_the_sink_and_skips_pods_that_are_gone() -> None:
    posted: list[tuple[ObjectRef, str, str]] = []

    class Sink:
        async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
            posted.append((regarding, type_, reason))

    policy = ObjectRef("gpuwarden.dev/v1alpha1", "GPUMonitorPolicy", "ns", "pol", "pol-uid")
    pod = ObjectRef("v1", "Pod", "ns", "p", "u")
    specs = [
        EventSpec(Target.POD, "p", "Warning", "GPUSaturated", "m"),
        EventSpec(Target.POD, "gone", "Warning", "GPUSaturated", "m"),
        EventSpec(Target.POLICY, "gone", "Warning", "GPUSaturated", "m"),
    ]
    queued = await announce(specs, policy=policy, pods={"p": pod}, sink=Sink())
    assert queued == [specs[0], specs[2]]
    assert [o for o, _, _ in posted] == [pod, policy]


def test_a_warning_names_the_claim_its_pod_holds_the_gpu_through_and_a_resolution_does_not() -> None:
    book = Announcer("pol")
    claims = {"p": "p-gpu-x7k2"}

    def claim_of(f: Finding) -> str | None:
        return claims.get(f.pod)

    started = book.plan(ev(step(Transition.STARTED, T0)), claim_of=claim_of)
    assert [e.message.endswith("(policy pol, rule idle, claim p-gpu-x7k2)") for e in started[:1]] == [True]
    assert started[1].message.endswith("(rule idle, claim p-gpu-x7k2)")
    again = book.plan(ev(step(Transition.RENOTIFY, T0 + 3600)), claim_of=claim_of)
    assert all("claim p-gpu-x7k2" in e.message for e in again)
    done = book.plan(ev(step(Transition.RESOLVED, T0 + 7200, why=Resolution.RECOVERED)), claim_of=claim_of)
    assert done
    assert all("claim" not in e.message for e in done)
    # a pod whose GPU came from a device plugin: no claim, as before
    other = Announcer("pol").plan(ev(step(Transition.STARTED, T0, finding(pod="q"))), claim_of=claim_of)
    assert other[0].message.endswith("(policy pol, rule idle)")

"""One policy's rounds: pacing (looptime), spec handling, Events, restore, and status writes."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from operator_fakes import PODS, POLICY, T0, StatusApi, feed

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.pacing import Pacing
from gpuwarden.operator.policies.runner import PolicyRunner, RunnerParts
from gpuwarden.operator.resources import ObjectRef, PolicyKey
from gpuwarden.operator.scaling.seam import ScaleResult
from gpuwarden.policy.spec.model import PolicySpec

# -- pacing ---------------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_due_an_interval_after_the_last_start_once_data_came() -> None:
    loop = asyncio.get_running_loop()
    pacing = Pacing(interval=10)
    start = loop.time()
    loop.call_later(3, pacing.nudge_data, start + 3)  # data before the interval is up: wait for the interval
    due = await pacing.wait_next(start)
    assert loop.time() - start == pytest.approx(10)
    assert due == pytest.approx(start + 10)


@pytest.mark.looptime
async def test_after_the_interval_the_next_data_triggers_at_once() -> None:
    loop = asyncio.get_running_loop()
    pacing = Pacing(interval=10)
    start = loop.time()
    loop.call_later(14, lambda: pacing.nudge_data(loop.time()))
    due = await pacing.wait_next(start)
    assert loop.time() - start == pytest.approx(14)
    assert due == pytest.approx(start + 14)


@pytest.mark.looptime
async def test_without_data_it_still_evaluates_one_interval_later() -> None:
    loop = asyncio.get_running_loop()
    pacing = Pacing(interval=10)
    start = loop.time()
    await pacing.wait_next(start)
    assert loop.time() - start == pytest.approx(20)


@pytest.mark.looptime
async def test_a_spec_change_wakes_it_at_once() -> None:
    loop = asyncio.get_running_loop()
    pacing = Pacing(interval=3600)
    start = loop.time()
    loop.call_later(2, pacing.nudge_spec)
    await pacing.wait_next(start)
    assert loop.time() - start == pytest.approx(2)


# -- rounds ---------------------------------------------------------------------------------------


class Sink:
    """Takes the Events a runner posts: (kind, type, reason)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        self.posted.append((regarding.kind, type_, reason))


def runner_parts(api: StatusApi, clock: list[float], events: Sink) -> RunnerParts:
    """A runner's parts as the composition root builds them, with the Events going to ``events`` and
    neither scaling nor reclaiming."""
    parts = build_operator(OperatorConfig(), api=api, clock=lambda: clock[0]).parts  # type: ignore[arg-type]
    return replace(parts, events=events, scaler=None, reclaimer=None)


@pytest.fixture
def world() -> tuple[RunnerParts, StatusApi, list[tuple[str, str, str]], list[float]]:
    api = StatusApi()
    clock = [T0]
    sink = Sink()
    return runner_parts(api, clock, sink), api, sink.posted, clock


async def test_a_violation_warns_once_then_resolves_and_status_follows(world: Any) -> None:
    parts, api, posted, clock = world
    body = dict(POLICY, status={})
    runner = PolicyRunner(parts, PolicyKey("ns", "pol"))
    pacing = parts.records.open_policy(runner.key)
    feed(parts.records, T0 - 20, T0, util=3)
    await runner.round(body=body, pods=PODS["ns"], pacing=pacing)
    assert posted == [
        ("Pod", "Warning", "GPUUnderutilized"),
        ("GPUMonitorPolicy", "Warning", "GPUUnderutilized"),
    ]
    assert api.patches[-1]["violatingPods"] == 1
    assert api.patches[-1]["violations"][0]["reason"] == "GPUUnderutilized"
    assert pacing.interval == 1.0

    # Ongoing for 30 s: no Event, no status write.
    for _ in range(30):
        clock[0] += 1
        feed(parts.records, clock[0], clock[0], util=3)
        await runner.round(body=body, pods=PODS["ns"], pacing=pacing)
    assert len(posted) == 2
    assert len(api.patches) == 1

    # Re-notified after a minute.
    for _ in range(30):
        clock[0] += 1
        feed(parts.records, clock[0], clock[0], util=3)
        await runner.round(body=body, pods=PODS["ns"], pacing=pacing)
    assert len(posted) == 4
    assert len(api.patches) == 1  # the same figure was announced again: the status did not change
    assert (
        parts.metrics.registry.get_sample_value(
            "gpuwarden_operator_findings", {"namespace": "ns", "policy": "pol", "rule": "idle"}
        )
        == 1
    )

    # Recovered: busy for a while, until the window's mean passes the floor and its hysteresis.
    for _ in range(12):
        clock[0] += 1
        feed(parts.records, clock[0], clock[0], util=90)
        await runner.round(body=body, pods=PODS["ns"], pacing=pacing)
    assert posted[-2:] == [
        ("Pod", "Normal", "GPUUnderutilizedResolved"),
        ("GPUMonitorPolicy", "Normal", "GPUUnderutilizedResolved"),
    ]
    assert api.patches[-1]["violations"] == []
    assert api.patches[-1]["violatingPods"] == 0
    assert (
        parts.metrics.registry.get_sample_value(
            "gpuwarden_operator_events_total", {"type": "Warning", "reason": "GPUUnderutilized"}
        )
        == 4
    )


async def test_an_invalid_spec_is_not_ready_and_the_fix_is_picked_up(world: Any) -> None:
    parts, api, posted, _ = world
    bad = dict(POLICY, spec={**POLICY["spec"], "rules": []}, metadata={**POLICY["metadata"], "generation": 2})
    runner = PolicyRunner(parts, PolicyKey("ns", "pol"))
    pacing = parts.records.open_policy(runner.key)
    await runner.round(body=bad, pods=PODS["ns"], pacing=pacing)
    ready = {c["type"]: c for c in api.patches[-1]["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("False", "InvalidSpec", 2)
    assert "spec.rules" in ready["message"]
    await runner.round(body=bad, pods=PODS["ns"], pacing=pacing)
    assert len(api.patches) == 1  # unchanged: not written again
    good = dict(POLICY, metadata={**POLICY["metadata"], "generation": 3})
    await runner.round(body=good, pods=PODS["ns"], pacing=pacing)
    ready = {c["type"]: c for c in api.patches[-1]["conditions"]}["Ready"]
    assert (ready["status"], ready["observedGeneration"]) == ("True", 3)
    assert posted == []


async def test_a_restart_resumes_violations_from_status_without_announcing_them(world: Any) -> None:
    parts, api, posted, clock = world
    body = dict(POLICY, status={})
    first = PolicyRunner(parts, PolicyKey("ns", "pol"))
    feed(parts.records, T0 - 20, T0, util=3)
    await first.round(body=body, pods=PODS["ns"], pacing=parts.records.open_policy(first.key))
    assert len(posted) == 2
    written = api.patches[-1]

    # A new process: empty store, status as the previous one wrote it.
    parts2 = replace(runner_parts(api, clock, Sink()), events=parts.events)
    runner = PolicyRunner(parts2, PolicyKey("ns", "pol"))
    pacing = parts2.records.open_policy(runner.key)
    resumed = dict(POLICY, status=written)
    clock[0] += 30
    await runner.round(body=resumed, pods=PODS["ns"], pacing=pacing)  # no data yet
    feed(parts2.records, clock[0] - 30, clock[0], util=3)  # the agent's replay
    clock[0] += 1
    await runner.round(body=resumed, pods=PODS["ns"], pacing=pacing)
    assert len(posted) == 2  # nothing new
    assert len(api.patches) == 1  # and the status was already right


async def test_status_is_not_rewritten_when_another_replica_left_it_right(world: Any) -> None:
    parts, api, _, _ = world
    runner = PolicyRunner(parts, PolicyKey("ns", "pol"))
    pacing = parts.records.open_policy(runner.key)
    await runner.round(body=dict(POLICY), pods=[], pacing=pacing)
    assert len(api.patches) == 1
    other = PolicyRunner(parts, PolicyKey("ns", "pol"))
    await other.round(body=dict(POLICY, status=api.patches[-1]), pods=[], pacing=pacing)
    assert len(api.patches) == 1


@pytest.mark.looptime
async def test_run_survives_a_failing_round_and_cleans_up(
    world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts, _, _, _ = world
    runner = PolicyRunner(parts, PolicyKey("ns", "pol"))
    rounds: asyncio.Queue[float] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def failing(**_: Any) -> None:
        rounds.put_nowait(loop.time())
        raise RuntimeError("bug")

    monkeypatch.setattr(runner, "round", failing)
    task = asyncio.create_task(runner.run(body=POLICY, pods=PODS, policies={}))
    first = await rounds.get()
    assert list(parts.records.running_policies()) == [runner.key]
    parts.records.nudge_policy(runner.key)  # wake it: another round despite the failure, at once
    async with asyncio.timeout(1):  # the next unprompted round is an interval (10 s) away
        second = await rounds.get()
    assert second == pytest.approx(first)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(parts.records.running_policies()) == []


# -- scaling ----------------------------------------------------------------------------------------


class MissingTarget:
    """A scaler whose target does not exist, as the real one reports it; None without actions.scale."""

    async def scale(
        self, policy: PolicyKey, spec: PolicySpec, evaluation: Any, now: float, policies: Any
    ) -> ScaleResult | None:
        if spec.actions.scale is None:
            return None
        message = "Deployment web not found"
        return ScaleResult(
            status={"currentReplicas": None, "desiredReplicas": None},
            problem=("ScaleTargetNotFound", message),
            condition=("False", "ScaleTargetNotFound", message),
        )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


async def test_removing_the_scale_action_clears_its_status_at_the_next_round(world: Any) -> None:
    parts, api, _, _ = world
    runner = PolicyRunner(replace(parts, scaler=MissingTarget()), PolicyKey("ns", "pol"))
    pacing = parts.records.open_policy(runner.key)
    scale = {"targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"}, "maxReplicas": 3}
    scaling = dict(POLICY, spec={**POLICY["spec"], "actions": {"scale": {**scale, "scaleDownOn": ["idle"]}}})
    await runner.round(body=scaling, pods=PODS["ns"], pacing=pacing)
    before = conditions(api.patches[-1])
    assert (before["Ready"]["status"], before["Ready"]["reason"]) == ("False", "ScaleTargetNotFound")
    assert before["ScalingActive"]["reason"] == "ScaleTargetNotFound"

    plain = dict(POLICY, metadata={**POLICY["metadata"], "generation": 2})
    await runner.round(body=plain, pods=PODS["ns"], pacing=pacing)
    after = conditions(api.patches[-1])
    assert (after["Ready"]["status"], after["Ready"]["reason"]) == ("True", "Evaluating")
    assert "ScalingActive" not in after  # the list replaces the old one: the condition goes
    assert api.patches[-1]["scale"] is None  # a merge patch's null removes status.scale
    await runner.round(body=plain, pods=PODS["ns"], pacing=pacing)
    assert len(api.patches) == 2  # and then nothing is left to write

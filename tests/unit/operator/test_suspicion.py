"""The operator's asks to the hooks of pods under a memoryGrowth finding (operator/suspicion.py): what is
asked when, what waits for which node, what each reply says as an Event, and the bounds."""

from __future__ import annotations

import json

from gpuwarden.operator.resources import ObjectRef
from gpuwarden.operator.suspicion import ASK_TTL_S, HookAsks, PodPlace
from gpuwarden.policy import IMMINENT_REASON, Finding, RuleKind
from gpuwarden.policy.rules.growth.snapshot import LAST_CHANCE_S, MIN_RECORDING_S
from gpuwarden.wire.node import MAX_HOOK_ASKS, AllocationSite, HookReply, parse_asks

T0 = 1_765_000_000.0
GiB = 2**30


class Events:
    """Records the Events posted."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str, str]] = []

    async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        self.posted.append((regarding.name, type_, reason, message))


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def place(pod: str, node: str = "gpu-node-1") -> PodPlace:
    return PodPlace(node, ObjectRef("v1", "Pod", "ml", pod, f"uid-{pod}"))


def growth(pod: str = "train-0", reason: str = "GPUMemoryLeakSuspected", full_in: float = 900.0) -> Finding:
    return Finding(
        policy="leaks",
        rule="tensor-leak",
        kind=RuleKind("memoryGrowth"),
        reason=reason,
        namespace="ml",
        pod=pod,
        gpus=("GPU-0",),
        value=5e8,
        threshold=1e6,
        unit="bytes/s",
        started_at=T0,
        message="grows",
        seconds_to_full=full_in,
    )


def waiting(asks: HookAsks, node: str = "gpu-node-1") -> list[tuple[str, str]]:
    return [(a.pod, a.op) for a in parse_asks(json.loads(asks.for_node(node) or "null"))]


def reply(asks: HookAsks, op: str, status: str = "ok", pid: int = 4242, **kw: object) -> HookReply:
    [ask] = [a for a in parse_asks(json.loads(asks.for_node("gpu-node-1") or "[]")) if a.op == op]
    return HookReply.model_validate(
        {
            "id": ask.id,
            "namespace": ask.namespace,
            "pod": ask.pod,
            "pid": pid,
            "op": op,
            "status": status,
            **kw,
        }
    )


async def test_a_leak_is_recorded_then_snapshotted_once_when_imminent_and_each_reply_is_an_event() -> None:
    events, clock = Events(), Clock()
    asks = HookAsks(events, clock)
    places = {"train-0": place("train-0")}
    asks.observe("leaks", [growth()], places.get, {})
    assert waiting(asks) == [("train-0", "record")]
    assert asks.for_node("gpu-node-2") is None
    asks.observe("leaks", [growth()], places.get, {})  # asked again in every answer, filed once
    assert waiting(asks) == [("train-0", "record")]
    asks.replied("gpu-node-1", [reply(asks, "record")])
    await asks.drain()
    assert waiting(asks) == []
    assert events.posted[-1][:3] == ("train-0", "Normal", "GPUMemoryRecording")
    # Imminent, but the history has not run long enough to hold the leak's blocks: not yet.
    clock.now += MIN_RECORDING_S - 1
    asks.observe("leaks", [growth(reason=IMMINENT_REASON)], places.get, {})
    assert waiting(asks) == []
    clock.now += 1
    asks.observe("leaks", [growth(reason=IMMINENT_REASON)], places.get, {})
    assert waiting(asks) == [("train-0", "snapshot")]
    site = AllocationSite(
        file="/app/train.py", line=35, size_bytes=18 * GiB, growth_bytes=17 * GiB, count=9, memory="gpu"
    )
    asks.replied(
        "gpu-node-1",
        [
            reply(
                asks,
                "snapshot",
                file="/snaps/gpuwarden-snapshot-4242-1.pickle",
                sizeBytes=3 << 20,
                sites=[site.model_dump(by_alias=True)],
            )
        ],
    )
    await asks.drain()
    assert events.posted[-1] == (
        "train-0",
        "Normal",
        "GPUMemorySnapshot",
        "pid 4242 wrote /snaps/gpuwarden-snapshot-4242-1.pickle (3Mi); top lines: app/train.py:35 holds 18Gi",
    )
    asks.observe("leaks", [growth(reason=IMMINENT_REASON)], places.get, {})  # one per finding
    assert waiting(asks) == []


async def test_the_card_about_to_be_full_is_snapshotted_at_once_and_a_refusal_is_a_warning() -> None:
    events, clock = Events(), Clock()
    asks = HookAsks(events, clock)
    asks.observe(
        "leaks",
        [growth(reason=IMMINENT_REASON, full_in=LAST_CHANCE_S)],
        {"train-0": place("train-0")}.get,
        {},
    )
    assert waiting(asks) == [("train-0", "record"), ("train-0", "snapshot")]
    asks.replied("gpu-node-1", [reply(asks, "snapshot", status="refused", reason="tooLarge: over 1 GiB")])
    await asks.drain()
    assert events.posted == [
        (
            "train-0",
            "Warning",
            "GPUMemorySnapshotFailed",
            "pid 4242: no snapshot: refused: tooLarge: over 1 GiB",
        )
    ]


async def test_a_pod_without_a_hook_taking_requests_is_not_asked_to_record_again_and_nothing_is_said() -> (
    None
):
    events, clock = Events(), Clock()
    asks = HookAsks(events, clock)
    places = {"train-0": place("train-0")}
    asks.observe("leaks", [growth()], places.get, {})
    asks.replied(
        "gpu-node-1", [reply(asks, "record", status="refused", pid=0, reason="noHookedProcess: none")]
    )
    asks.observe("leaks", [growth()], places.get, {})
    await asks.drain()
    assert waiting(asks) == []
    assert events.posted == []


async def test_replies_are_heard_only_from_the_asked_node_and_unanswered_asks_expire() -> None:
    events, clock = Events(), Clock()
    asks = HookAsks(events, clock)
    places = {"train-0": place("train-0")}
    asks.observe("leaks", [growth()], places.get, {})
    asks.replied("gpu-node-2", [reply(asks, "record")])  # another node answering for this one's ask
    assert waiting(asks) == [("train-0", "record")]
    clock.now += ASK_TTL_S + 1
    asks.observe("leaks", [], places.get, {})
    assert waiting(asks) == []
    asks.observe("leaks", [growth()], places.get, {})  # still leaking: asked again
    assert waiting(asks) == [("train-0", "record")]
    await asks.drain()
    assert events.posted == []


def test_at_most_so_many_asks_wait_for_a_node_and_a_deleted_pod_takes_its_asks() -> None:
    asks = HookAsks(Events(), Clock())
    pods = [f"train-{i}" for i in range(MAX_HOOK_ASKS + 3)]
    asks.observe("leaks", [growth(p) for p in pods], {p: place(p) for p in pods}.get, {})
    assert len(waiting(asks)) == MAX_HOOK_ASKS
    asks.forget_pod("ml", "train-0")
    assert len(waiting(asks)) == MAX_HOOK_ASKS - 1
    assert ("train-0", "record") not in waiting(asks)


async def test_a_rules_snapshot_before_moves_the_moment() -> None:
    """snapshotBefore: 5m: a leak full in 10m (imminent) is not snapshotted yet; full in 5m, it is."""
    events, clock = Events(), Clock()
    asks = HookAsks(events, clock)
    places = {"train-0": place("train-0")}
    asks.observe("leaks", [growth(reason=IMMINENT_REASON, full_in=600)], places.get, {"tensor-leak": 300.0})
    asks.replied("gpu-node-1", [reply(asks, "record")])
    clock.now += MIN_RECORDING_S
    asks.observe("leaks", [growth(reason=IMMINENT_REASON, full_in=600)], places.get, {"tensor-leak": 300.0})
    assert waiting(asks) == []
    asks.observe("leaks", [growth(reason=IMMINENT_REASON, full_in=300)], places.get, {"tensor-leak": 300.0})
    assert waiting(asks) == [("train-0", "snapshot")]
    await asks.drain()

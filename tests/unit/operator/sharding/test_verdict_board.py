"""Sharded mode's verdict merge: the newest verdict per pod wins, a silent shard's pods have nothing to
judge, and the owner's engine runs the findings' lifecycle on the outcomes another shard sent."""

from __future__ import annotations

from gpuwarden.operator.sharding.board import SILENT_INTERVALS, VerdictBoard, outcome_from, pod_verdicts
from gpuwarden.policy.engine import PodView, PolicyEvaluator
from gpuwarden.policy.findings import Resolution, Transition
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.rules import memory_ceiling, utilization
from gpuwarden.policy.store.series import PodId, Point, SeriesKey, SeriesStore
from gpuwarden.wire.verdicts import SCHEMA_VERSION, PodVerdict, RuleVerdict, VerdictReport

T0 = 1_800_000_000.0
SPEC = {
    "selector": {"matchLabels": {"app": "x"}},
    "evaluationInterval": "1s",
    "rules": [{"name": "idle", "utilizationFloor": {"percent": 20, "for": "10s"}}],
    "actions": {"renotifyInterval": "1m"},
}
KINDS = {"idle": utilization.FLOOR_KIND}
Q = PodId("ns", "q")


def verdict(value: float, *, holds: bool, message: str = "m") -> RuleVerdict:
    return RuleVerdict(
        rule="idle", kind="utilizationFloor", holds=holds, clears=not holds, value=value, threshold=20.0,
        unit="percent", gpus=["GPU-1"], message=message,
    )  # fmt: skip


def sent(at: float, *verdicts: PodVerdict, shard: str = "op-b", generation: int | None = 1) -> VerdictReport:
    return VerdictReport(
        schema_version=SCHEMA_VERSION, shard=shard, at=at, namespace="ns", policy="pol",
        generation=generation, pods=list(verdicts),
    )  # fmt: skip


def outcomes(board: VerdictBoard, now: float, generation: int | None = 1) -> dict[PodId, list[float | None]]:
    got = board.outcomes("ns", "pol", kinds=KINDS, generation=generation, interval=10.0, now=now)
    return {pod: [o.value for o in out] for pod, out in got.items()}


def test_the_newest_verdict_on_a_pod_wins_whichever_arrives_last() -> None:
    board = VerdictBoard()
    first = sent(T0 + 10, PodVerdict(pod="q", rules=[verdict(3, holds=True)]))
    assert board.receive(first, T0 + 10) == (1, 0)
    # A shard that judged earlier (its report late, or the pod's node just moved away from it).
    late = sent(T0 + 5, PodVerdict(pod="q", rules=[verdict(90, holds=False)]), shard="op-c")
    assert board.receive(late, T0 + 11) == (0, 0)
    assert outcomes(board, T0 + 11) == {Q: [3.0]}
    board.receive(sent(T0 + 20, PodVerdict(pod="q", rules=[verdict(50, holds=False)]), shard="op-c"), T0 + 20)
    assert outcomes(board, T0 + 20) == {Q: [50.0]}


def test_a_pod_its_shard_fell_silent_on_has_no_verdict_after_three_intervals() -> None:
    board = VerdictBoard()
    board.receive(sent(T0, PodVerdict(pod="q", rules=[verdict(3, holds=True)])), T0)
    assert outcomes(board, T0 + SILENT_INTERVALS * 10.0) == {Q: [3.0]}
    assert outcomes(board, T0 + SILENT_INTERVALS * 10.0 + 0.1) == {}
    assert len(board) == 0  # dropped, not kept for ever


def test_verdicts_of_another_generation_or_rule_kind_are_left_out() -> None:
    board = VerdictBoard()
    board.receive(sent(T0, PodVerdict(pod="q", rules=[verdict(3, holds=True)]), generation=2), T0)
    assert outcomes(board, T0, generation=1) == {}
    assert outcomes(board, T0, generation=2) == {Q: [3.0]}
    other = board.outcomes(
        "ns", "pol", kinds={"idle": memory_ceiling.KIND}, generation=2, interval=10.0, now=T0
    )
    assert other == {Q: []}  # the rule changed kind on the owner: nothing to judge by it
    board.forget("ns", "pol")
    assert outcomes(board, T0, generation=2) == {}


def feed(store: SeriesStore, pod: str, start: float, end: float, util: float) -> None:
    t = start
    while t <= end:
        store.add(SeriesKey("ns", pod, "GPU-1"), Point(t=t, gpu_util=util, mem_used=1e9, mem_total=8e10))
        t += 1


def test_the_owner_starts_resolves_and_keeps_findings_on_the_outcomes_a_shard_sent() -> None:
    spec = parse_spec(SPEC)
    pods = [PodView("ns", "p", {"app": "x"}), PodView("ns", "q", {"app": "x"})]
    shard_store, owner_store = SeriesStore(600, 3600), SeriesStore(600, 3600)
    shard = PolicyEvaluator("ns/pol", spec, namespace="ns")
    owner = PolicyEvaluator("ns/pol", spec, namespace="ns")
    board = VerdictBoard()

    def judge_and_send(now: float) -> None:
        judged = shard.judge([pods[1]], shard_store, now)  # q is on the shard's node
        board.receive(sent(now, *pod_verdicts(judged)), now)

    def owner_round(now: float) -> list[tuple[Transition, str, Resolution | None]]:
        got = board.outcomes("ns", "pol", kinds=KINDS, generation=1, interval=1.0, now=now)
        evaluation = owner.evaluate(pods, owner_store, now, elsewhere={Q: got.get(Q, [])})
        return [(t.transition, t.finding.pod, t.resolution) for t in evaluation.transitions]

    feed(shard_store, "q", T0 - 20, T0, util=3)
    feed(owner_store, "p", T0 - 20, T0, util=50)
    judge_and_send(T0)
    assert owner_round(T0) == [(Transition.STARTED, "q", None)]
    (finding,) = owner.active()
    assert finding.message == "mean GPU utilization (device counter) 3% over 10s, floor 20%"  # the shard's
    assert finding.gpus == ("GPU-1",)

    # The shard goes quiet: the finding goes on unchanged (no data), as a silent pod's does.
    assert owner_round(T0 + 5) == [(Transition.ONGOING, "q", None)]

    feed(shard_store, "q", T0 + 1, T0 + 30, util=60)
    judge_and_send(T0 + 30)
    assert owner_round(T0 + 30) == [(Transition.RESOLVED, "q", Resolution.RECOVERED)]
    assert owner.active() == []


def test_a_rule_verdict_becomes_the_outcome_it_came_from() -> None:
    spec = parse_spec(SPEC)
    store = SeriesStore(600, 3600)
    feed(store, "q", T0 - 20, T0, util=3)
    (outcome,) = PolicyEvaluator("ns/pol", spec, namespace="ns").judge(
        [PodView("ns", "q", {"app": "x"})], store, T0
    )[Q]
    (pod,) = pod_verdicts({Q: [outcome]})
    back = outcome_from(pod.rules[0], utilization.FLOOR_KIND, Q)
    fields = ("rule", "kind", "pod", "value", "threshold", "unit", "holds", "clears", "gpus", "message")
    assert [getattr(back, f) for f in fields] == [getattr(outcome, f) for f in fields]


def test_a_policy_holds_so_many_pods_and_goes_with_its_forgetting() -> None:
    """Issue 27 (7): verdicts were kept for ever, for any number of pods and policies."""
    board = VerdictBoard(max_pods=3)
    pods = [PodVerdict(pod=f"p-{i}", rules=[verdict(3, holds=True)]) for i in range(5)]
    assert board.receive(sent(T0, *pods), T0) == (3, 2)
    # Pods it holds are still taken; new ones are not.
    assert board.receive(sent(T0 + 1, pods[0], pods[4]), T0 + 1) == (1, 1)
    assert (len(board), board.policies()) == (3, 1)
    board.forget("ns", "pol")
    assert (len(board), board.policies()) == (0, 0)
    assert board.receive(sent(T0 + 2), T0 + 2) == (0, 0)
    assert board.policies() == 0  # a report of no pods leaves nothing behind

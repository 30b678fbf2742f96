"""WorkloadScaler against an in-memory API: what it patches, which Events and conditions come out, conflicts.

The same paths run against a real kube-apiserver in tests/integration/test_scaling.py;
here are the ones a real API server cannot easily be made to take (409s, failed
patches, unlistable HPAs) and the bookkeeping (restore, the metric), fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuwarden.kubetime import format_time
from gpuwarden.local.policies import LocalPolicy
from gpuwarden.local.scaler import SimulatedScaler
from gpuwarden.operator.kube.client import JsonObject
from gpuwarden.operator.metrics import DesiredReplicasCollector
from gpuwarden.operator.resources import ObjectRef, PolicyKey
from gpuwarden.operator.scaling.api import (
    HpaRef,
    NotFound,
    Scale,
    ScaleApiError,
    ScaleConflict,
)
from gpuwarden.operator.scaling.claims import PolicyClaim, policy_claim
from gpuwarden.operator.scaling.seam import ScaleResult
from gpuwarden.operator.scaling.workload import WorkloadScaler
from gpuwarden.policy.engine import Evaluation
from gpuwarden.policy.findings import Finding
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.rules import utilization
from gpuwarden.policy.spec.model import ScaleAction, ScaleDirection, ScaleTargetRef
from gpuwarden.policy.store.series import PodId

NS = "inference"
TARGET = ScaleTargetRef("apps/v1", "Deployment", "llm-server")
T0 = 1_800_000_000.0


@dataclass(frozen=True)
class F:
    rule: str
    pod: str


SATURATED = [F("saturated", "a"), F("saturated", "b")]
IDLE = [F("idle-gpu", "a"), F("idle-gpu", "b")]


def policy(name: str = "llm-serving") -> PolicyKey:
    return PolicyKey(NS, name)


def policy_object(
    name: str, *, dry_run: bool = False, target: str = "llm-server", **status: Any
) -> JsonObject:
    """A policy as the API lists it."""
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": {
            "selector": {},
            "rules": [
                {"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5m"}},
                {"name": "saturated", "utilizationCeiling": {"percent": 95, "for": "2m"}},
            ],
            "actions": {
                "scale": {
                    "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                    "maxReplicas": 4,
                    "scaleUpOn": ["saturated"],
                    "scaleDownOn": ["idle-gpu"],
                    "dryRun": dry_run,
                }
            },
        },
        "status": status,
    }


def action(*, dry_run: bool = False, target: ScaleTargetRef = TARGET, hi: int = 4) -> ScaleAction:
    return ScaleAction(
        target_ref=target,
        min_replicas=1,
        max_replicas=hi,
        scale_up_on=("saturated",),
        scale_down_on=("idle-gpu",),
        scale_up=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=60),
        scale_down=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=60),
        dry_run=dry_run,
    )


@dataclass
class FakeCluster:
    """ScaleApi and EventSink in memory."""

    replicas: dict[str, int] = field(default_factory=lambda: {"llm-server": 2})
    hpas: list[HpaRef] = field(default_factory=list)
    events: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(kind/name, type, reason, message)."""
    patches: list[tuple[str, int]] = field(default_factory=list)
    policies: list[JsonObject] = field(default_factory=lambda: [policy_object("llm-serving")])
    patch_error: ScaleApiError | None = None
    list_error: ScaleApiError | None = None
    indexed: list[JsonObject] | None = None
    """The policies the operator's index holds; None: those the API lists."""
    lists: int = 0
    """Calls of list_policies."""
    policies_error: ScaleApiError | None = None

    async def get_scale(self, namespace: str, ref: ScaleTargetRef) -> Scale:
        if ref.name not in self.replicas:
            raise NotFound(f"{ref.kind} {ref.name} not found", 404)
        return Scale(
            target=ObjectRef(ref.api_version, ref.kind, namespace, ref.name, uid="uid-target"),
            replicas=self.replicas[ref.name],
            resource_version="1",
            path=f"/apis/apps/v1/namespaces/{namespace}/deployments/{ref.name}/scale",
        )

    async def patch_scale(self, scale: Scale, replicas: int) -> int:
        if self.patch_error is not None:
            raise self.patch_error
        self.patches.append((scale.target.name, replicas))
        self.replicas[scale.target.name] = replicas
        return replicas

    async def list_hpas(self, namespace: str) -> list[HpaRef]:
        if self.list_error is not None:
            raise self.list_error
        return list(self.hpas)

    async def list_policies(self, namespace: str) -> list[JsonObject]:
        self.lists += 1
        if self.policies_error is not None:
            raise self.policies_error
        return list(self.policies)

    def claims(self) -> list[PolicyClaim]:
        """What the WorkloadScaler is given: the policies of the operator's index."""
        return [policy_claim(p) for p in (self.policies if self.indexed is None else self.indexed)]

    async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        self.events.append((f"{regarding.kind}/{regarding.name}", type_, reason, message))

    def reasons(self) -> list[tuple[str, str]]:
        return [(on, reason) for on, _, reason, _ in self.events]


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@dataclass
class Clock:
    now: float = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def scaler(cluster: FakeCluster, registry: CollectorRegistry, clock: Clock) -> WorkloadScaler:
    scaler = WorkloadScaler(cluster, cluster)
    registry.register(DesiredReplicasCollector(scaler.desired_replicas, clock))
    return scaler


def desired(registry: CollectorRegistry, name: str = "llm-serving") -> float | None:
    return registry.get_sample_value("gpuwarden_policy_desired_replicas", {"namespace": NS, "policy": name})


async def test_scales_up_and_announces_on_both_objects(
    scaler: WorkloadScaler, cluster: FakeCluster, registry: CollectorRegistry
) -> None:
    out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    assert out.applied
    assert cluster.patches == [("llm-server", 3)]
    assert cluster.events == [
        (
            "GPUMonitorPolicy/llm-serving",
            "Normal",
            "ScaledUp",
            "scaled llm-server 2→3: saturated on 2/2 pods",
        ),
        (
            "Deployment/llm-server",
            "Normal",
            "ScaledUp",
            "policy llm-serving: scaled llm-server 2→3: saturated on 2/2 pods",
        ),
    ]
    assert out.status.as_dict() == {
        "currentReplicas": 3,
        "desiredReplicas": 3,
        "lastScaleTime": "2027-01-15T08:00:00Z",
        "lastScaleReason": "scaled llm-server 2→3: saturated on 2/2 pods",
    }
    assert out.result() == ScaleResult(
        status=out.status.as_dict(),
        problem=None,
        condition=("True", "Active", "scaled llm-server 2→3: saturated on 2/2 pods"),
    )
    assert desired(registry) == 3


async def test_every_change_made_or_announced_is_counted_by_its_reason(
    scaler: WorkloadScaler, cluster: FakeCluster
) -> None:
    await scaler.reconcile(policy(), action(), [], 2, T0, cluster.claims())  # nothing to do yet
    # Every reason reads 0 from the first reconcile: the first change then shows as an increase.
    assert scaler.decisions() == {
        (NS, "llm-serving", reason): 0
        for reason in ("ScaledUp", "ScaledDown", "WouldScaleUp", "WouldScaleDown")
    }
    await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 10, cluster.claims())
    await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 30, cluster.claims())  # cooling down
    await scaler.reconcile(policy(), action(dry_run=True), SATURATED, 2, T0 + 70, cluster.claims())
    counted = {reason: n for (_, _, reason), n in scaler.decisions().items() if n}
    assert counted == {"ScaledUp": 1, "WouldScaleUp": 1}


async def test_cooldown_then_next_step(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    held = await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 30, cluster.claims())
    assert not held.applied
    assert "cooling down" in held.condition.message
    assert held.status.last_scale_time == "2027-01-15T08:00:00Z"  # the last change, kept
    await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 60, cluster.claims())
    assert cluster.patches == [("llm-server", 3), ("llm-server", 4)]


async def test_dry_run_announces_and_changes_nothing(
    scaler: WorkloadScaler, cluster: FakeCluster, registry: CollectorRegistry
) -> None:
    out = await scaler.reconcile(policy(), action(dry_run=True), SATURATED, 2, T0, cluster.claims())
    assert not out.applied
    assert cluster.patches == []
    assert cluster.reasons() == [
        ("GPUMonitorPolicy/llm-serving", "WouldScaleUp"),
        ("Deployment/llm-server", "WouldScaleUp"),
    ]
    assert cluster.events[0][3] == "would scale llm-server 2→3: saturated on 2/2 pods (dryRun)"
    assert (out.status.current_replicas, out.status.desired_replicas) == (2, 3)
    assert (out.condition.status, out.condition.reason) == ("False", "DryRun")
    assert desired(registry) == 3
    # The cooldown applies to announcements too: no Event every evaluation.
    held = await scaler.reconcile(policy(), action(dry_run=True), SATURATED, 2, T0 + 10, cluster.claims())
    assert len(cluster.events) == 2
    # ... and the policy keeps asking for 3 meanwhile (what an HPA fed with the metric must see).
    assert (held.status.current_replicas, held.status.desired_replicas) == (2, 3)
    assert desired(registry) == 3


async def test_hpa_conflict_blocks_and_warns_once(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    cluster.hpas = [
        HpaRef("other-hpa", "apps/v1", "Deployment", "unrelated"),
        HpaRef("llm-hpa", "apps/v1", "Deployment", "llm-server"),
    ]
    for t in (0, 10, 20):
        out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + t, cluster.claims())
        assert (out.condition.status, out.condition.reason) == ("False", "HPAConflict")
        assert out.status.desired_replicas == 3  # still computed and published
    assert cluster.patches == []
    assert cluster.reasons() == [
        ("GPUMonitorPolicy/llm-serving", "HPAConflict"),
        ("Deployment/llm-server", "HPAConflict"),
    ]
    assert "HorizontalPodAutoscaler llm-hpa also scales it" in cluster.events[0][3]
    cluster.hpas = []
    assert (await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 30, cluster.claims())).applied


@pytest.mark.parametrize(
    ("hpa_api_version", "conflicts"),
    [("apps/v1", True), ("apps/v1beta2", True), ("", True), ("example.com/v1", False)],
)
def test_hpa_target_matching(hpa_api_version: str, conflicts: bool) -> None:
    assert HpaRef("h", hpa_api_version, "Deployment", "llm-server").targets(TARGET) is conflicts


async def test_hpa_feeding_on_a_dry_run_policy_is_no_conflict(
    scaler: WorkloadScaler, cluster: FakeCluster
) -> None:
    cluster.hpas = [HpaRef("llm-hpa", "apps/v1", "Deployment", "llm-server")]
    out = await scaler.reconcile(policy(), action(dry_run=True), SATURATED, 2, T0, cluster.claims())
    assert out.condition.reason == "DryRun"


async def test_unknown_hpas_mean_no_action(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    cluster.list_error = ScaleApiError("HPAs in inference: 403: forbidden", 403)
    out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    assert (out.condition.reason, cluster.patches) == ("FailedListHPAs", [])


async def test_two_policies_on_one_target_both_stop(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    cluster.policies = [policy_object("a"), policy_object("b")]
    for name in ("b", "a", "b"):
        out = await scaler.reconcile(policy(name), action(), SATURATED, 2, T0, cluster.claims())
        assert (out.condition.status, out.condition.reason) == ("False", "PolicyConflict")
        assert "policies a, b all target it" in out.condition.message
    assert cluster.patches == []
    assert [r for r in cluster.reasons() if r[0].startswith("GPUMonitorPolicy")] == [
        ("GPUMonitorPolicy/b", "PolicyConflict"),
        ("GPUMonitorPolicy/a", "PolicyConflict"),
    ]
    cluster.policies = [policy_object("a")]  # b deleted
    assert (await scaler.reconcile(policy("a"), action(), SATURATED, 2, T0 + 1, cluster.claims())).applied


async def test_the_policies_come_from_the_index_not_from_a_list_per_round(
    scaler: WorkloadScaler, cluster: FakeCluster
) -> None:
    cluster.replicas.update({f"other-{i}": 1 for i in range(8)})
    cluster.policies = [
        policy_object("llm-serving"),
        policy_object("watcher", dry_run=True),
        *(policy_object(f"p{i}", target=f"other-{i}") for i in range(8)),
    ]
    for t in range(0, 300, 10):
        for key, act in [
            (policy(), action()),
            (policy("watcher"), action(dry_run=True)),
            *(
                (policy(f"p{i}"), action(target=ScaleTargetRef("apps/v1", "Deployment", f"other-{i}")))
                for i in range(8)
            ),
        ]:
            out = await scaler.reconcile(key, act, SATURATED, 2, T0 + t, cluster.claims())
            assert out.condition.reason in {"Active", "DryRun"}
    assert cluster.lists == 0
    assert cluster.replicas["llm-server"] == 4  # it acted: no rival among ten policies


async def test_a_rival_only_the_index_still_holds_stops_nobody(
    scaler: WorkloadScaler, cluster: FakeCluster
) -> None:
    # b was deleted while this replica stood by: its index saw no DELETED event.
    cluster.indexed = [policy_object("a"), policy_object("b")]
    cluster.policies = [policy_object("a")]
    assert (await scaler.reconcile(policy("a"), action(), SATURATED, 2, T0, cluster.claims())).applied
    assert cluster.lists == 1  # the list confirms a rival the index shows, and only then


async def test_a_rival_that_cannot_be_confirmed_means_no_action(
    scaler: WorkloadScaler, cluster: FakeCluster
) -> None:
    cluster.policies = [policy_object("a"), policy_object("b")]
    cluster.policies_error = ScaleApiError("GPUMonitorPolicies in inference: 503: unavailable", 503)
    out = await scaler.reconcile(policy("a"), action(), SATURATED, 2, T0, cluster.claims())
    assert (out.condition.status, out.condition.reason) == ("False", "FailedListPolicies")
    assert "cannot list policies to confirm a conflict" in out.condition.message
    assert cluster.patches == []


@pytest.mark.parametrize(
    "other",
    [
        policy_object("watcher", dry_run=True),  # announces only
        policy_object("elsewhere", target="other"),
        {**policy_object("broken"), "spec": {"rules": []}},  # invalid: never evaluated
        {
            **policy_object("leaving"),
            "metadata": {"name": "leaving", "deletionTimestamp": "2027-01-15T08:00:00Z"},
        },
    ],
)
async def test_policies_that_do_not_act_on_the_target_are_no_rivals(
    scaler: WorkloadScaler, cluster: FakeCluster, other: JsonObject
) -> None:
    cluster.policies = [policy_object("a"), other]
    assert (await scaler.reconcile(policy("a"), action(), SATURATED, 2, T0, cluster.claims())).applied


async def test_events_name_the_policy_by_uid(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    uids: list[str] = []

    async def post(regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        uids.append(regarding.uid)

    cluster.post = post  # type: ignore[method-assign]
    await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    assert uids == ["uid-llm-serving", "uid-target"]


async def test_missing_target_makes_the_policy_not_ready(
    scaler: WorkloadScaler, cluster: FakeCluster, registry: CollectorRegistry
) -> None:
    await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    assert desired(registry) == 3
    del cluster.replicas["llm-server"]
    out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 60, cluster.claims())
    assert (out.condition.reason, out.decision) == ("ScaleTargetNotFound", None)
    assert out.status.current_replicas is None
    assert out.status.desired_replicas is None
    assert desired(registry) is None  # no stale value left to drive an HPA
    assert cluster.reasons()[-1] == ("GPUMonitorPolicy/llm-serving", "ScaleTargetNotFound")
    assert out.result().problem == ("ScaleTargetNotFound", "Deployment llm-server not found")


async def test_conflicting_write_is_retried(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    cluster.patch_error = ScaleConflict("changed meanwhile", 409)
    out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    assert not out.applied
    assert out.status.last_scale_time is None
    cluster.patch_error = None
    # No cooldown started by the change that did not happen.
    assert (await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 1, cluster.claims())).applied


async def test_failed_write_warns_once(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    cluster.patch_error = ScaleApiError("Deployment inference/llm-server: 403: forbidden", 403)
    for t in (0, 10):
        out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + t, cluster.claims())
        assert (out.condition.status, out.condition.reason) == ("False", "FailedUpdateScale")
    assert [r for _, _, r, _ in cluster.events] == [
        "FailedUpdateScale",
        "FailedUpdateScale",
    ]  # policy + target


async def test_scaled_to_zero_is_left_alone(scaler: WorkloadScaler, cluster: FakeCluster) -> None:
    cluster.replicas["llm-server"] = 0
    out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0, cluster.claims())
    assert (out.condition.reason, cluster.patches) == ("ScaledToZero", [])


async def test_status_carries_the_cooldown_over_a_restart(
    scaler: WorkloadScaler, cluster: FakeCluster
) -> None:
    cluster.policies = [
        policy_object(
            "llm-serving",
            scale={
                "lastScaleTime": "2027-01-15T08:00:00Z",
                "lastScaleReason": "scaled llm-server 1→2: saturated",
            },
        )
    ]
    out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 30, cluster.claims())
    assert not out.applied
    assert out.status.last_scale_reason == "scaled llm-server 1→2: saturated"
    assert (await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + 60, cluster.claims())).applied


async def test_series_of_a_policy_no_longer_reconciled_goes(
    scaler: WorkloadScaler, cluster: FakeCluster, registry: CollectorRegistry, clock: Clock
) -> None:
    await scaler.reconcile(policy(), action(), IDLE, 2, T0, cluster.claims(), expires_after=30)
    assert desired(registry) == 1
    clock.now = T0 + 30
    assert desired(registry) == 1
    clock.now = T0 + 31  # deleted, no longer scaling, or evaluated by the other replica
    assert desired(registry) is None


def _finding(rule: str, pod: str) -> Finding:
    return Finding(
        "llm-serving", rule, utilization.CEILING_KIND, "R", NS, pod, (), 0.0, 0.0, "percent", T0, ""
    )


def _evaluation(now: float, rule: str) -> Evaluation:
    pods = (PodId(NS, "a"), PodId(NS, "b"))
    active = tuple(_finding(rule, p.name) for p in pods)
    return Evaluation(at=now, transitions=(), active=active, matched_pods=pods, violating_pods=pods)


@pytest.mark.parametrize("dry_run", [False, True])
async def test_the_operator_and_local_mode_take_the_same_scale_steps(
    cluster: FakeCluster, dry_run: bool
) -> None:
    """One evaluation sequence through both owners of a target: the same replicas, wishes and changes.

    Both take :func:`~gpuwarden.policy.scaling.decider.scale_step`; were one to record a change the other
    does not (or apply one in dryRun), a cooldown would differ and so would the steps that follow.
    """
    obj = policy_object("llm-serving", dry_run=dry_run)
    behavior = {"stabilizationWindow": "1m", "step": 1, "cooldown": "1m"}
    obj["spec"]["actions"]["scale"]["behavior"] = {"scaleUp": behavior, "scaleDown": behavior}
    spec = parse_spec(obj["spec"])
    operator = WorkloadScaler(cluster, cluster)
    local = SimulatedScaler(LocalPolicy("llm-serving", NS, spec))
    # Up (held by the window, then a step per cooldown to maxReplicas 4), then down to minReplicas 1.
    rules = ["saturated"] * 12 + ["idle-gpu"] * 14
    replicas: list[tuple[int, int]] = []
    """(operator, local) after each step."""
    changes_operator: list[str] = []
    changes_local: list[str] = []
    """When each recorded a change (made or, in dryRun, announced): the cooldowns start there."""
    for i, rule in enumerate(rules):
        now = T0 + 20.0 * i
        evaluation = _evaluation(now, rule)
        result = await operator.scale(policy(), spec, evaluation, now, cluster.claims())
        assert result is not None
        assert result.status is not None
        last = result.status["lastScaleTime"]
        if last is not None and last not in changes_operator:
            changes_operator.append(last)
        note = local.scale(evaluation, now)
        if note is not None:
            changes_local.append(format_time(note.at))
        assert local.target is not None
        replicas.append((cluster.replicas["llm-server"], local.target.replicas))
    operator_replicas = [o for o, _ in replicas]
    assert operator_replicas == [loc for _, loc in replicas]
    assert changes_operator == changes_local
    if dry_run:
        assert set(operator_replicas) == {2}
        assert len(changes_operator) > 2
    else:
        assert set(operator_replicas) == {1, 2, 3, 4}
        assert len(changes_operator) == 5


async def test_observe_only_neither_reads_nor_scales_and_says_so_once(cluster: FakeCluster) -> None:
    """--observe-only: the chart grants no /scale; the policy is told why, once, by a Warning."""
    scaler = WorkloadScaler(cluster, cluster, observe_only=True)
    del cluster.replicas["llm-server"]  # a read would now fail with NotFound: none may happen
    for t in (0, 10):
        out = await scaler.reconcile(policy(), action(), SATURATED, 2, T0 + t, cluster.claims())
        assert (out.condition.status, out.condition.reason) == ("False", "ObserveOnly")
        assert not out.applied
    assert cluster.patches == []
    assert cluster.reasons() == [("GPUMonitorPolicy/llm-serving", "ObserveOnly")]

"""Sharded mode: the per-pod verdicts other shards sent a policy's owner, merged into the engine's outcomes.

Pure (reports and a clock in, outcomes out); :mod:`.exchange` carries the reports. A
policy's owner judges by the rules the pods on its own nodes, and takes the others' outcomes
from here: per pod, the newest verdict received (by the sender's ``at``: a pod whose node moved
is judged by its new shard from then on); a pod no verdict came for in
:data:`SILENT_INTERVALS` evaluation intervals has nothing to judge (its findings go on
unchanged, and resolve with ``NoData`` as a silent pod's do). See docs/scaling-out.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwarden.policy import Outcome, PodId, RuleKind
from gpuwarden.wire.verdicts import MAX_PODS, PodVerdict, RuleVerdict, VerdictReport

__all__ = ["SILENT_INTERVALS", "VerdictBoard", "outcome_from", "pod_verdicts"]

SILENT_INTERVALS = 3
"""A pod whose shard sent nothing on it for this many evaluation intervals has no verdict."""


@dataclass(frozen=True, slots=True)
class _Received:
    at: float
    """When the sending shard judged (its clock)."""
    received_at: float
    """When it arrived (ours)."""
    shard: str
    generation: int | None
    rules: tuple[RuleVerdict, ...]


class VerdictBoard:
    """The verdicts received, by policy (``namespace/name``) and pod; one per operator.

    Bounded: at most ``max_pods`` pods per policy (the policies are those whose daemons run here,
    checked by the receiving endpoint, and a policy's verdicts go with its daemon: :meth:`forget`).
    """

    def __init__(self, max_pods: int = MAX_PODS) -> None:
        self.max_pods = max_pods
        self._policies: dict[tuple[str, str], dict[str, _Received]] = {}

    def receive(self, report: VerdictReport, now: float) -> tuple[int, int]:
        """Take a shard's report, arrived at ``now``; returns how many pods' verdicts were newer, and
        how many pods new to the policy were refused because it holds ``max_pods`` already."""
        pods = self._policies.setdefault((report.namespace, report.policy), {})
        taken = refused = 0
        for verdict in report.pods:
            known = pods.get(verdict.pod)
            if known is not None and known.at > report.at:
                continue  # a shard that judged the pod later already spoke
            if known is None and len(pods) >= self.max_pods:
                refused += 1
                continue
            pods[verdict.pod] = _Received(
                report.at, now, report.shard, report.generation, tuple(verdict.rules)
            )
            taken += 1
        if not pods:
            del self._policies[report.namespace, report.policy]
        return taken, refused

    def outcomes(
        self,
        namespace: str,
        policy: str,
        *,
        kinds: Mapping[str, RuleKind],
        generation: int | None,
        interval: float,
        now: float,
    ) -> dict[PodId, list[Outcome]]:
        """The outcomes of the policy's rules (``kinds``: rule name -> kind) on every pod a shard
        judged within :data:`SILENT_INTERVALS` ``interval`` s of ``now``, judged by ``generation``.

        A rule whose kind the owner's spec gives another (a spec edit in flight) is left out:
        that pod has nothing to judge by it this time. Verdicts gone silent are dropped.
        """
        pods = self._policies.get((namespace, policy))
        if not pods:
            return {}
        oldest = now - SILENT_INTERVALS * interval
        out: dict[PodId, list[Outcome]] = {}
        for name, received in list(pods.items()):
            if received.received_at < oldest:
                del pods[name]
                continue
            if received.generation != generation:
                continue
            pod_id = PodId(namespace, name)
            out[pod_id] = [
                outcome_from(v, kind, pod_id)
                for v in received.rules
                if (kind := kinds.get(v.rule)) is not None and kind == v.kind
            ]
        return out

    def forget(self, namespace: str, policy: str) -> None:
        """Drop a policy's verdicts (it is deleted, or another replica owns it now)."""
        self._policies.pop((namespace, policy), None)

    def __len__(self) -> int:
        return sum(len(p) for p in self._policies.values())

    def policies(self) -> int:
        """How many policies hold verdicts."""
        return len(self._policies)


def _carried_message(outcome: Outcome) -> str:
    return outcome.detail


def outcome_from(verdict: RuleVerdict, kind: RuleKind, pod: PodId) -> Outcome:
    """The engine's outcome for a rule verdict received on ``pod`` (its message as the shard put it)."""
    return Outcome(
        verdict.rule,
        kind,
        pod,
        verdict.value,
        verdict.threshold,
        verdict.unit,
        holds=verdict.holds,
        clears=verdict.clears and not verdict.holds,
        gpus=tuple(verdict.gpus),
        fit=verdict.fit,
        seconds_to_full=verdict.seconds_to_full,
        reason=verdict.reason,
        detail=verdict.message,
        describe=_carried_message,
    )


def pod_verdicts(judged: Mapping[PodId, Sequence[Outcome]]) -> list[PodVerdict]:
    """What a shard sends of its pods' outcomes: each pod's rules that had something to judge."""
    return [PodVerdict(pod=pod.name, rules=list(_rule_verdicts(judged[pod]))) for pod in sorted(judged)]


def _rule_verdicts(outcomes: Iterable[Outcome]) -> Iterable[RuleVerdict]:
    for o in outcomes:
        if o.value is None or not (math.isfinite(o.value) and math.isfinite(o.threshold)):
            continue
        yield RuleVerdict(
            rule=o.rule,
            kind=o.kind,
            holds=o.holds,
            clears=o.clears,
            value=o.value,
            threshold=o.threshold,
            unit=o.unit,
            gpus=list(o.gpus),
            reason=o.reason,
            message=o.message[:4096],
            fit=_finite(o.fit),
            seconds_to_full=_finite(o.seconds_to_full),
        )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None

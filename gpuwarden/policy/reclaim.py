"""``actions.reclaim``'s decisions: which workloads are idle, the warning and its grace period, and the
circuit breaker. Pure: ``now`` is passed in, nothing is read or written here (the operator's
:mod:`gpuwarden.operator.reclaim` does the API calls; ``bench/reclaim.py`` drives the same code with
a simulated clock).

A workload (a pod's top owner, the operator resolves it) is **idle** when it has a selected pod,
every one of its selected pods has an active finding of one of the reclaim's rules, and none of them
worked during the last evaluation interval (:func:`recently_active`: a GPU's mean at or above the
rule's floor, or a pod with no fresh readings, which cannot be shown idle). The finding alone is not
enough: it clears only when the mean over the whole ``for`` window climbs past the floor plus the
hysteresis, a minute or more into real work, and a grace period ending in that minute would stop the
work.

:class:`ReclaimPlanner` turns the idle set of each evaluation into steps: a new idle workload is
**warned** and due one grace period later; one that stops being idle before then is **cancelled**;
one still idle when due is **due** (the operator acts, or holds it while the breaker is open). A
workload acted on (or, in dryRun, announced) is **done** until it stops being idle, so that it is
not acted on twice.

:class:`CircuitBreaker` counts reclaims in a trailing hour; the operator keeps one per policy
(``maxPerHour``) and one for the cluster (``--reclaim-max-per-hour``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuwarden.policy.rules.activity import pod_activity
from gpuwarden.policy.rules.common import WindowParams, pod_end
from gpuwarden.policy.rules.utilization import UtilizationFloor
from gpuwarden.policy.spec.model import ReclaimAction, Rule
from gpuwarden.policy.store.series import PodId, SeriesKey, Window

__all__ = [
    "BREAKER_WINDOW_SECONDS",
    "CircuitBreaker",
    "Idle",
    "ReclaimPlanner",
    "ReclaimStep",
    "ReclaimStepKind",
    "WorkloadRef",
    "idle_workloads",
    "recently_active",
]

BREAKER_WINDOW_SECONDS = 3600.0
"""The circuit breakers count reclaims over the trailing hour."""


@dataclass(frozen=True, slots=True, order=True)
class WorkloadRef:
    """A workload by apiVersion, kind and name (in the policy's namespace)."""

    api_version: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


class IdleFinding(Protocol):
    """What the idle test reads of an active finding (:class:`~gpuwarden.policy.Finding` has it)."""

    @property
    def rule(self) -> str: ...

    @property
    def pod(self) -> str: ...

    @property
    def started_at(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Idle:
    """A workload whose every selected pod is idle."""

    pods: tuple[str, ...]
    since: float
    """When the last of its pods' findings started: from then on all of them were idle."""
    reason: str
    """e.g. ``idle-gpu on 2/2 pods``."""


def recently_active(
    series_of: Mapping[PodId, Sequence[tuple[SeriesKey, Window]]],
    action: ReclaimAction,
    rules: Iterable[Rule],
    now: float,
    interval_seconds: float,
    params: WindowParams | None = None,
) -> set[PodId]:
    """The pods that worked in the last ``interval_seconds`` (as of their newest sample), or cannot be
    shown idle (no fresh readings): a GPU's mean at or above a reclaim utilizationFloor rule's percent.

    Only utilizationFloor rules are read: an idleGpus rule's pod has a working GPU by definition, and
    its reclaim only annotates.
    """
    params = params or WindowParams()
    floors = [r for r in rules if r.name in action.rules and isinstance(r, UtilizationFloor)]
    if not floors:
        return set()
    active: set[PodId] = set()
    for pod, series in series_of.items():
        end = pod_end(series, now, params)
        if end is None:
            active.add(pod)  # silent: nothing says it is idle now
            continue
        for rule in floors:
            gpus = pod_activity(
                series, rule.signal, end - interval_seconds, end, noise_floor=rule.noise_floor
            )
            if any(g.mean is not None and g.mean >= rule.percent for g in gpus):
                active.add(pod)
                break
    return active


def idle_workloads(
    action: ReclaimAction,
    findings: Iterable[IdleFinding],
    pods_of: Mapping[WorkloadRef, Sequence[str]],
    active: Iterable[PodId] = (),
) -> dict[WorkloadRef, Idle]:
    """The workloads (``pods_of``: each with its selected pods' names) whose every pod has an active
    finding of a reclaim rule and none of which is in ``active``."""
    since: dict[str, float] = {}
    rule_of: dict[str, str] = {}
    for f in findings:
        if f.rule in action.rules and (f.pod not in since or f.started_at < since[f.pod]):
            since[f.pod], rule_of[f.pod] = f.started_at, f.rule
    busy = {p.name for p in active}
    idle: dict[WorkloadRef, Idle] = {}
    for workload, pods in pods_of.items():
        if not pods or any(p not in since or p in busy for p in pods):
            continue
        rules = sorted({rule_of[p] for p in pods})
        idle[workload] = Idle(
            pods=tuple(sorted(pods)),
            since=max(since[p] for p in pods),
            reason=f"{', '.join(rules)} on {len(pods)}/{len(pods)} pods",
        )
    return idle


class ReclaimStepKind(enum.Enum):
    WARN = "warn"
    """Newly idle: announce the reclaim and when it will happen."""
    CANCEL = "cancel"
    """Warned, and no longer idle before it was due: real work (or an opt-out) cancels it."""
    DUE = "due"
    """Warned a grace period ago and still idle: act now (unless the breaker holds it)."""


@dataclass(frozen=True, slots=True)
class ReclaimStep:
    kind: ReclaimStepKind
    workload: WorkloadRef
    due_at: float
    idle: Idle | None
    """None for a cancellation."""


@dataclass(slots=True)
class _Pending:
    warned_at: float
    due_at: float
    done: bool = False


@dataclass(slots=True)
class ReclaimPlanner:
    """One policy's warned workloads and their deadlines."""

    grace_seconds: float
    _pending: dict[WorkloadRef, _Pending] = field(default_factory=dict)

    def plan(self, idle: Mapping[WorkloadRef, Idle], now: float) -> list[ReclaimStep]:
        """The steps of this evaluation, given the workloads idle now (cancellations first)."""
        steps: list[ReclaimStep] = []
        for workload in sorted(self._pending):
            if workload not in idle:
                gone = self._pending.pop(workload)
                if not gone.done:
                    steps.append(ReclaimStep(ReclaimStepKind.CANCEL, workload, gone.due_at, None))
        for workload in sorted(idle):
            pending = self._pending.get(workload)
            if pending is None:
                due = now + self.grace_seconds
                self._pending[workload] = _Pending(now, due)
                steps.append(ReclaimStep(ReclaimStepKind.WARN, workload, due, idle[workload]))
            elif not pending.done and now >= pending.due_at:
                steps.append(ReclaimStep(ReclaimStepKind.DUE, workload, pending.due_at, idle[workload]))
        return steps

    def finish(self, workload: WorkloadRef) -> None:
        """The workload was acted on (or announced in dryRun): no step for it until it is idle anew."""
        if (pending := self._pending.get(workload)) is not None:
            pending.done = True

    def drop(self, workload: WorkloadRef) -> None:
        """Forget a workload (it is warned afresh should it be idle again)."""
        self._pending.pop(workload, None)

    def pending(self) -> dict[WorkloadRef, float]:
        """The warned workloads not yet acted on, with when each is due."""
        return {w: p.due_at for w, p in self._pending.items() if not p.done}


@dataclass(slots=True)
class CircuitBreaker:
    """At most ``limit`` reclaims in any trailing :data:`BREAKER_WINDOW_SECONDS`."""

    limit: int
    window_seconds: float = BREAKER_WINDOW_SECONDS
    _times: deque[float] = field(default_factory=deque)

    def count(self, now: float) -> int:
        """Reclaims in the window ending at ``now``."""
        while self._times and self._times[0] <= now - self.window_seconds:
            self._times.popleft()
        return len(self._times)

    def allows(self, now: float) -> bool:
        """Whether one more reclaim fits."""
        return self.count(now) < self.limit

    def record(self, now: float) -> None:
        self._times.append(now)

    def closes_at(self, now: float) -> float | None:
        """When the next reclaim fits again (None: it fits now)."""
        if self.allows(now):
            return None
        return self._times[len(self._times) - self.limit] + self.window_seconds

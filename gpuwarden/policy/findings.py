"""Findings: what a policy concluded about a pod, and their lifecycle.

A finding is keyed by (rule, namespace, pod). Its lifecycle, one evaluation at a time:

- not active and the rule *holds* (for ``memoryGrowth`` with ``for``: has held at
  every evaluation for ``for`` seconds) → ``STARTED``;
- active and the rule *clears* (the value went past the threshold by the rule's
  hysteresis margin; see :mod:`gpuwarden.policy.rules.common`) → ``RESOLVED`` (``Recovered``);
- active otherwise → ``ONGOING`` with the latest value, or ``RENOTIFY`` once
  ``renotify_seconds`` have passed since the last ``STARTED``/``RENOTIFY``, or at
  once when its reason changed (the outcome's reason differs from the finding's,
  and is not one the outcome lets it keep: an anomaly whose pattern changed, a leak
  whose card is now full soon), so that a finding's reason and message always agree;
- active while the pod is deleted or no longer selected, its rule removed from
  the policy, the rule snoozed on the pod, or no data came for
  ``no_data_seconds`` → ``RESOLVED`` with that cause.

A rule with a ``for`` (the kinds whose record has a ``hold``) starts its finding only after it held
at every evaluation that had something to judge for that long. An evaluation with nothing to judge
(a failed or missed scrape, a node's report late) does not restart that clock by itself: the clock
survives gaps of up to :data:`HOLD_GAP_SECONDS`, as Prometheus's ``for`` survives a missed scrape within
its lookback; a longer gap, or a value that does not hold, restarts it. While a finding is active, an
evaluation with nothing to judge keeps it as it was, and what it announces (a reminder) says how old
its figure is and why (the outcome's ``note``).

Between the threshold and the clear margin nothing changes, so a value
hovering at the threshold yields one ``STARTED`` and no flapping. States are
plain values; :meth:`FindingTracker.restore` seeds them after a restart so that
ongoing violations are not announced again.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from gpuwarden.policy.rules import rule_type
from gpuwarden.policy.rules.common import Outcome, RuleKind
from gpuwarden.units import format_duration

HOLD_GAP_SECONDS = 60.0
"""How long a ``for`` clock survives evaluations with nothing to judge: three missed scrapes at the
default 15 s ``serviceMetrics`` interval, with one to spare; a server whose ``/metrics`` times out now
and then is still judged."""


class Transition(enum.StrEnum):
    """What happened to a finding at one evaluation."""

    STARTED = "Started"
    ONGOING = "Ongoing"
    RENOTIFY = "Renotify"
    """Still ongoing, and ``renotify_seconds`` passed since it was last announced: announce it again."""
    RESOLVED = "Resolved"


class Resolution(enum.StrEnum):
    """Why a finding resolved (a CamelCase reason, fit for an Event)."""

    RECOVERED = "Recovered"
    POD_GONE = "PodGone"
    """The pod is no longer in the evaluated pod list (deleted), or left the policy's namespace."""
    NOT_SELECTED = "NotSelected"
    """The pod no longer matches the policy's selector."""
    RULE_REMOVED = "RuleRemoved"
    SNOOZED = "Snoozed"
    NO_DATA = "NoData"
    """The pod's GPUs sent nothing usable for ``no_data_seconds``."""


class FindingKey(NamedTuple):
    """Identifies a finding within one policy."""

    rule: str
    namespace: str
    pod: str


@dataclass(frozen=True, slots=True)
class Finding:
    """One violation of one rule by one pod.

    ``value`` and ``threshold`` share ``unit``: ``percent`` (utilization, or memory
    as a share of the card), ``bytes`` (memoryCeiling with ``bytes``) or
    ``bytes/s`` (memoryGrowth). ``started_at`` is the ``now`` of the evaluation
    that started it.
    """

    policy: str
    rule: str
    kind: RuleKind
    reason: str
    namespace: str
    pod: str
    gpus: tuple[str, ...]
    value: float
    threshold: float
    unit: str
    started_at: float
    message: str
    fit: float | None = None
    """memoryGrowth only: how straight the growth is, 0..1."""
    seconds_to_full: float | None = None
    """memoryGrowth only: projected seconds until the card is full, None when unknown."""

    @property
    def key(self) -> FindingKey:
        """This finding's key."""
        return FindingKey(self.rule, self.namespace, self.pod)


@dataclass(frozen=True, slots=True)
class FindingTransition:
    """A lifecycle step of a finding at evaluation time ``at``."""

    transition: Transition
    finding: Finding
    at: float
    resolution: Resolution | None = None
    """Set for ``RESOLVED`` only."""


@dataclass(slots=True)
class FindingState:
    """The tracker's record of one active finding."""

    finding: Finding
    notified_at: float
    """When it was last announced (``STARTED`` or ``RENOTIFY``)."""
    data_at: float
    """When an evaluation last had data to judge it."""

    def due_for_renotify(self, now: float, interval: float) -> bool:
        """Whether ``interval`` seconds passed since the last announcement (never, for ``interval <= 0``)."""
        return interval > 0 and now - self.notified_at >= interval


def finding_from(policy: str, outcome: Outcome, started_at: float, reason: str | None = None) -> Finding:
    """A finding stating ``outcome`` (which must carry a value).

    Its reason is ``reason`` when given (the finding's so far, when it keeps it), else the outcome's,
    else the kind's.
    """
    assert outcome.value is not None
    return Finding(
        policy=policy,
        rule=outcome.rule,
        kind=outcome.kind,
        reason=reason or outcome.reason or rule_type(outcome.kind).reason,
        namespace=outcome.pod.namespace,
        pod=outcome.pod.name,
        gpus=outcome.gpus,
        value=outcome.value,
        threshold=outcome.threshold,
        unit=outcome.unit,
        started_at=started_at,
        message=outcome.message,
        fit=outcome.fit,
        seconds_to_full=outcome.seconds_to_full,
    )


class FindingTracker:
    """The active (and pending) findings of one policy, and the rules that move them.

    Pure: it is told ``now``. ``renotify_seconds <= 0`` disables re-notification.
    """

    def __init__(self, policy: str, *, renotify_seconds: float, no_data_seconds: float) -> None:
        self.policy = policy
        self.renotify_seconds = renotify_seconds
        self.no_data_seconds = no_data_seconds
        self._active: dict[FindingKey, FindingState] = {}
        self._pending: dict[FindingKey, tuple[float, float]] = {}
        """A ``for`` clock: since when the rule held, and when it last had something to judge."""

    def observe(
        self, outcome: Outcome, now: float, for_seconds: float = 0.0, *, key: FindingKey | None = None
    ) -> FindingTransition | None:
        """Apply one rule outcome for one pod; return its transition, or None when nothing is active.

        ``for_seconds`` > 0 makes a finding start only after the rule held at every
        evaluation for that long (used by memoryGrowth; the window rules build
        their duration into the window and pass 0). ``key`` spares rebuilding it
        when the caller has it.
        """
        if key is None:
            key = FindingKey(outcome.rule, outcome.pod.namespace, outcome.pod.name)
        state = self._active.get(key)
        if state is None:
            if not outcome.holds:
                clock = self._pending.get(key) if outcome.value is None else None
                if clock is not None and now - clock[1] <= HOLD_GAP_SECONDS:
                    return None  # nothing to judge: the clock goes on (the module doc)
                self._pending.pop(key, None)
                return None
            if for_seconds > 0:
                clock = self._pending.get(key)
                since = now if clock is None else clock[0]
                self._pending[key] = (since, now)
                if now - since < for_seconds:
                    return None
            self._pending.pop(key, None)
            finding = finding_from(self.policy, outcome, started_at=now)
            self._active[key] = FindingState(finding, notified_at=now, data_at=now)
            return FindingTransition(Transition.STARTED, finding, now)

        if outcome.value is None:
            # Nothing to judge (gap, stale node, restart replay still running): keep it as it was.
            if now - state.data_at >= self.no_data_seconds:
                del self._active[key]
                return FindingTransition(Transition.RESOLVED, state.finding, now, Resolution.NO_DATA)
            ongoing = self._ongoing(state, state.finding, now)
            # Said with its age and why, never as if just judged (the finding itself stays as judged).
            why = f": {outcome.note}" if outcome.note else ""
            age = format_duration(round(now - state.data_at))
            stale = f"{ongoing.finding.message}; not judged for {age}{why}"
            return dataclasses.replace(ongoing, finding=dataclasses.replace(ongoing.finding, message=stale))

        current = state.finding.reason
        state.data_at = now
        if outcome.clears:
            # Resolved under the reason it was announced with, so that its Events pair up.
            finding = finding_from(self.policy, outcome, started_at=state.finding.started_at, reason=current)
            del self._active[key]
            return FindingTransition(Transition.RESOLVED, finding, now, Resolution.RECOVERED)
        reason = outcome.reason or rule_type(outcome.kind).reason
        kept = current in (reason, outcome.kept_reason)
        finding = finding_from(
            self.policy, outcome, started_at=state.finding.started_at, reason=current if kept else reason
        )
        if not kept:
            state.finding, state.notified_at = finding, now
            return FindingTransition(Transition.RENOTIFY, finding, now)
        return self._ongoing(state, finding, now)

    def _ongoing(self, state: FindingState, finding: Finding, now: float) -> FindingTransition:
        state.finding = finding
        if state.due_for_renotify(now, self.renotify_seconds):
            state.notified_at = now
            return FindingTransition(Transition.RENOTIFY, finding, now)
        return FindingTransition(Transition.ONGOING, finding, now)

    def resolve(self, key: FindingKey, resolution: Resolution, now: float) -> FindingTransition | None:
        """End a finding for a cause outside its rule (pod gone, rule removed, snoozed); None if inactive."""
        self._pending.pop(key, None)
        state = self._active.pop(key, None)
        if state is None:
            return None
        return FindingTransition(Transition.RESOLVED, state.finding, now, resolution)

    def forget_pending(self, key: FindingKey) -> None:
        """Drop a not-yet-started finding's ``for`` clock (its rule did not run this time)."""
        self._pending.pop(key, None)

    def active_keys(self) -> list[FindingKey]:
        """Keys of the active findings."""
        return list(self._active)

    def pending_keys(self) -> list[FindingKey]:
        """Keys of findings waiting out their ``for``."""
        return list(self._pending)

    def state(self, key: FindingKey) -> FindingState | None:
        """The active state for ``key``, or None."""
        return self._active.get(key)

    def active(self) -> list[Finding]:
        """Active findings, newest first (ties by rule, namespace, pod)."""
        states = sorted(self._active.values(), key=lambda s: s.finding.key)
        states.sort(key=lambda s: s.finding.started_at, reverse=True)
        return [s.finding for s in states]

    def restore(self, findings: Iterable[Finding], now: float) -> None:
        """Seed active findings (from a persisted status after a restart), as if announced at ``now``.

        They keep their ``started_at`` and are not announced again; the next
        evaluations update, re-notify or resolve them like any other.
        """
        for f in findings:
            finding = dataclasses.replace(f, policy=self.policy)
            self._active[finding.key] = FindingState(finding, notified_at=now, data_at=now)

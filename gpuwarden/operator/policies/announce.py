"""Kubernetes Events for findings: what to say, on which object, and when not to say it again.

A violation that starts is announced with a ``Warning`` on the pod and on the
policy, reason its kind's (the ``reason`` of its :class:`~gpuwarden.policy.RuleType`, e.g.
``GPUUnderutilized``) or the more precise one its outcome names (a leak whose card is full within
16 minutes: ``GPUMemoryExhaustionImminent``; an anomaly's pattern: ``GPUPeriodicSpikes``; the whole
list is docs/operator.md's), the figure, and what it means. While it lasts it is announced again (same reason,
"still ...") once every ``actions.renotifyInterval``, and at once under its new reason when that
changes (an anomaly's pattern, a leak now imminent). When it
ends, a ``Normal`` Event with reason ``<Reason>Resolved`` (``GPUSaturatedResolved``)
says why; on the policy only when the pod is gone.

:class:`Announcer` plans Events from an evaluation (pure); :func:`announce` hands them
to the :class:`~gpuwarden.operator.kube.events.EventPoster`, which queues them and posts them
in the background (in order, retried, never twice), so an evaluation never waits for the
API server.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpuwarden.operator.kube import EventSink
from gpuwarden.operator.resources import ObjectRef
from gpuwarden.policy import (
    HOST_IMMINENT_REASON,
    IMMINENT_REASON,
    Evaluation,
    Finding,
    FindingKey,
    FindingTransition,
    Pattern,
    Resolution,
    Transition,
    approx_duration,
    rule_type,
)

__all__ = ["Announcer", "EventSpec", "Target", "announce", "resolved_reason"]

PATTERN_MEANING: Mapping[str, str] = {
    Pattern.SPIKE: "a sudden departure from its usual readings",
    Pattern.PERIODIC: "something on a schedule (a cron job, a batch) drives it at a regular interval",
    Pattern.CLIMB: "readings that keep climbing do not come back by themselves (an unbounded cache or queue)",
    Pattern.SHIFT: "its readings settled at a new level (a second model, a new tenant)",
    IMMINENT_REASON: "at this rate it runs out of GPU memory soon, and crashes: fix the leak or stop it now",
    HOST_IMMINENT_REASON: "at this rate it reaches its memory limit soon, and is killed: fix the leak",
}
"""A finding's meaning where its reason says more than its kind: an anomaly's pattern, an imminent leak."""

WHY_RESOLVED: Mapping[Resolution, str] = {
    Resolution.RECOVERED: "back within the rule",
    Resolution.POD_GONE: "the pod is gone",
    Resolution.NOT_SELECTED: "the pod no longer matches the policy's selector",
    Resolution.RULE_REMOVED: "the rule was removed from the policy",
    Resolution.SNOOZED: "the rule is snoozed on the pod",
    Resolution.NO_DATA: "no readings came from its GPUs for too long",
}


class Target(enum.Enum):
    """Which object an Event is about."""

    POD = "pod"
    POLICY = "policy"


@dataclass(frozen=True, slots=True)
class EventSpec:
    """One Event to post."""

    target: Target
    pod: str
    type: str
    reason: str
    message: str


@dataclass(slots=True)
class _Announcement:
    at: float
    message: str
    reason: str


def _meaning(f: Finding) -> str:
    return PATTERN_MEANING.get(f.reason) or rule_type(f.kind).meaning


def resolved_reason(reason: str) -> str:
    """The Normal Event's reason when a violation of ``reason`` ends."""
    return f"{reason}Resolved"


_WARNED = frozenset({Transition.STARTED, Transition.RENOTIFY})
"""The transitions announced with a Warning (the only ones whose text names the claim)."""


class Announcer:
    """One policy's announcements: which findings were announced, when, and with what message.

    The engine alone decides when a finding starts, re-notifies or resolves
    (:class:`~gpuwarden.policy.findings.FindingTracker` owns the re-notify timing, and a
    restart or takeover restores it from the status); this book keeps what each active
    finding was announced with, for the status.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._announced: dict[FindingKey, _Announcement] = {}

    def restore(self, findings: Iterable[Finding], now: float) -> None:
        """Findings announced before (by a previous run), with the messages they were announced with."""
        for f in findings:
            self._announced[f.key] = _Announcement(now, f.message, f.reason)

    def messages(self) -> dict[FindingKey, str]:
        """The announced message of every active finding."""
        return {k: a.message for k, a in self._announced.items()}

    def plan(
        self,
        evaluation: Evaluation,
        *,
        events: bool = True,
        claim_of: Callable[[Finding], str | None] | None = None,
    ) -> list[EventSpec]:
        """The Events an evaluation calls for (none when ``events`` is off; the book is kept either way).

        ``claim_of`` names the DRA ResourceClaim through which a finding's pod holds its GPU, if any:
        a Warning names it, so the owner knows which claim (and so which template) to fix.
        """
        out: list[EventSpec] = []
        for step in evaluation.transitions:
            out.extend(self._step(step, claim_of))
        return out if events else []

    def _step(
        self, step: FindingTransition, claim_of: Callable[[Finding], str | None] | None
    ) -> list[EventSpec]:
        f = step.finding
        claim = claim_of(f) if claim_of is not None and step.transition in _WARNED else None
        known = self._announced.get(f.key)
        match step.transition:
            case Transition.STARTED:
                self._announced[f.key] = _Announcement(step.at, f.message, f.reason)
                return self._warning(f, f"{f.message}; {_meaning(f)}", claim)
            case Transition.RENOTIFY:
                self._announced[f.key] = _Announcement(step.at, f.message, f.reason)
                lasted = approx_duration(step.at - f.started_at)
                if known is not None and known.reason != f.reason:  # re-described: its shape changed
                    return self._warning(
                        f, f"{f.message}; {_meaning(f)} (for {lasted}, was {known.reason})", claim
                    )
                return self._warning(f, f"still, for {lasted}: {f.message}; {_meaning(f)}", claim)
            case Transition.ONGOING:
                if known is None:  # restored without a book entry: remember it as announced now
                    self._announced[f.key] = _Announcement(step.at, f.message, f.reason)
                return []
            case Transition.RESOLVED:
                self._announced.pop(f.key, None)
                return self._resolved(f, step)
        return []

    def _warning(self, f: Finding, text: str, claim: str | None) -> list[EventSpec]:
        via = "" if claim is None else f", claim {claim}"
        return [
            EventSpec(
                Target.POD, f.pod, "Warning", f.reason, f"{text} (policy {self.policy}, rule {f.rule}{via})"
            ),
            EventSpec(Target.POLICY, f.pod, "Warning", f.reason, f"pod {f.pod}: {text} (rule {f.rule}{via})"),
        ]

    def _resolved(self, f: Finding, step: FindingTransition) -> list[EventSpec]:
        resolution = step.resolution or Resolution.RECOVERED
        lasted = approx_duration(step.at - f.started_at)
        text = f"resolved after {lasted}, {WHY_RESOLVED[resolution]}"
        if resolution is Resolution.RECOVERED and f.message:
            text += f": {f.message}"
        reason = resolved_reason(f.reason)
        policy_event = EventSpec(
            Target.POLICY, f.pod, "Normal", reason, f"pod {f.pod}: {text} (rule {f.rule})"
        )
        if resolution is Resolution.POD_GONE:
            return [policy_event]
        return [
            EventSpec(Target.POD, f.pod, "Normal", reason, f"{text} (policy {self.policy}, rule {f.rule})"),
            policy_event,
        ]


async def announce(
    specs: Iterable[EventSpec], *, policy: ObjectRef, pods: Mapping[str, ObjectRef], sink: EventSink
) -> list[EventSpec]:
    """Hand Events to ``sink``; return those handed over.

    ``pods`` maps a pod name to its reference; an Event for a pod not in it (already gone) is skipped.
    """
    queued = []
    for spec in specs:
        target = policy if spec.target is Target.POLICY else pods.get(spec.pod)
        if target is None:
            continue
        await sink.post(target, spec.type, spec.reason, spec.message)
        queued.append(spec)
    return queued

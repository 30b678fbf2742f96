"""ScaleDecider: how many replicas a policy's scale target should have, HPA-style.

Pure: findings, the target's current replicas and ``now`` come in; a
:class:`ScaleDecision` goes out. Whoever owns the target (the operator's
:class:`~gpuwarden.operator.scaling.WorkloadScaler`, local mode's
:class:`~gpuwarden.local.scaler.SimulatedScaler`) takes one :func:`scale_step` per
evaluation: it reads the replicas, the step decides and says what to do (hold, announce
in dryRun, or apply), the owner does it (its I/O) and settles the step with the outcome,
so that cooldowns start from real changes only.

One decision, in order:

1. **Signal.** *Up* when at least ``scaleUpMinPods`` of the matched pods (a
   count, or a percentage rounded up; at least one) have an active finding of a
   ``scaleUpOn`` rule. *Down* when there is at least one matched pod and every
   matched pod has an active finding of a ``scaleDownOn`` rule. Up wins when both
   hold: a pod short of memory outweighs idle GPUs elsewhere (as the HPA takes
   the largest recommendation of several metrics).
2. **Zero.** A target at 0 replicas is left alone: as with the HPA, scaling a
   workload to zero by hand pauses autoscaling.
3. **Range.** A target outside ``[minReplicas, maxReplicas]`` is brought back to
   the nearest bound at once, whatever the signal, window or cooldown.
4. **Stabilization.** The HPA keeps the recommendations of the window and takes
   the safest (for scale down the highest, for scale up the lowest). Our
   recommendations are relative (one step up, hold, one step down), so the
   safest in a window is *down* only if every recommendation in it was down, and
   *up* only if every one was up. Keeping the start of the current run of equal
   recommendations is the same thing in O(1): act once the run is as old as the
   window. A fresh decider (after a restart) has seen nothing, so it waits a
   full window again; that is the safe side.
5. **Cooldown.** No two changes in one direction closer than its cooldown. Meanwhile the
   policy stands by the last change's replicas (:attr:`ScaleDecision.wanted`) even when the
   target has not followed: in dryRun, or while an HPA fed with them catches up.
6. **Step.** ``step`` replicas, or ``step%`` of the current replicas rounded up
   (at least 1), clamped to the range.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from gpuwarden.policy.humanize import approx_duration
from gpuwarden.policy.scaling.predictive import ForecastVerdict, Predictor, View, WorkloadLoad
from gpuwarden.policy.spec.model import ScaleAction, ScaleDirection, ScaleForecast
from gpuwarden.units import format_duration


class Direction(enum.StrEnum):
    """Which way a decision moves (or wants to move) the replicas."""

    UP = "Up"
    DOWN = "Down"
    NONE = "None"


class Blocker(enum.StrEnum):
    """Why a wish to scale did not become a change (a CamelCase reason)."""

    AT_MAX_REPLICAS = "AtMaxReplicas"
    AT_MIN_REPLICAS = "AtMinReplicas"
    STABILIZATION_WINDOW = "StabilizationWindow"
    COOLDOWN = "Cooldown"
    SCALED_TO_ZERO = "ScaledToZero"


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What the target's replicas should be, and why.

    ``direction`` is the direction of the change, or of the wish when
    ``blocked_by`` says why it did not become one; ``desired == current`` then.
    """

    current: int
    desired: int
    direction: Direction
    reason: str
    """For Events: says how long the wish has held (``saturated on 2/2 pods for 2m``)."""
    blocked_by: Blocker | None = None
    summary: str | None = None
    """``reason`` without elapsed times (None: it has none). It stays the same while nothing changes,
    so a status that carries it is written when something happens, not at every evaluation."""
    standing: int | None = None
    """During a cooldown, the replicas of the change that started it, when the target has not
    followed (in dryRun, or while an HPA fed with them catches up); None otherwise."""

    @property
    def wanted(self) -> int:
        """The replicas the policy asks for (``status.scale.desiredReplicas``, the desired-replicas metric).

        ``desired`` is what to set now; this is what the policy stands by: during a cooldown it
        stays at the last change's replicas, so whoever follows it (an HPA, a person reading
        dryRun) sees one value for the whole cooldown, not the current count back again.
        """
        return self.standing if self.standing is not None else self.desired

    @property
    def steady_reason(self) -> str:
        """The reason as the status shows it: :attr:`summary`, else :attr:`reason`."""
        return self.summary if self.summary is not None else self.reason

    @property
    def changes(self) -> bool:
        """Whether acting on this decision changes the target's replicas."""
        return self.desired != self.current


class ActiveFinding(Protocol):
    """The two fields of a :class:`~gpuwarden.policy.findings.Finding` that scaling reads."""

    @property
    def rule(self) -> str: ...

    @property
    def pod(self) -> str: ...


def findings_by_pod(findings: Iterable[ActiveFinding]) -> dict[str, frozenset[str]]:
    """Active findings grouped as pod name -> names of the rules it violates (an Evaluation's ``active``)."""
    grouped: dict[str, set[str]] = {}
    for f in findings:
        grouped.setdefault(f.pod, set()).add(f.rule)
    return {pod: frozenset(rules) for pod, rules in grouped.items()}


@dataclass(frozen=True, slots=True)
class _Signal:
    direction: Direction
    text: str
    """E.g. ``saturated on 2/3 pods``; for NONE, what was seen and what would be needed."""
    detail: str = ""
    """Figures for the Events only (the forecast's), left out of the steady summary."""


def step_size(direction: ScaleDirection, current: int) -> int:
    """Replicas one step moves from ``current``: the count, or the percentage of it rounded up, at least 1."""
    if direction.step_percent is not None:
        # Fraction: 3 x 33% must round up to 1 and 10 x 10% stay exactly 1, which floats do not promise.
        return max(1, math.ceil(Fraction(current) * Fraction(direction.step_percent) / 100))
    return max(1, direction.step_replicas or 1)


def min_pods_needed(action: ScaleAction, matched_pods: int) -> int:
    """How many matched pods must violate a scaleUpOn rule: the count, or the percentage rounded up; >= 1."""
    if action.scale_up_min_pods_percent is not None:
        return max(1, math.ceil(Fraction(matched_pods) * Fraction(action.scale_up_min_pods_percent) / 100))
    return max(1, action.scale_up_min_pods or 1)


def _signal(action: ScaleAction, by_pod: Mapping[str, Collection[str]], matched_pods: int) -> _Signal:
    up_rules = _violated(action.scale_up_on, by_pod)
    down_rules = _violated(action.scale_down_on, by_pod)
    up_pods = sum(1 for rules in by_pod.values() if any(r in rules for r in action.scale_up_on))
    down_pods = sum(1 for rules in by_pod.values() if any(r in rules for r in action.scale_down_on))
    # The engine only reports matched pods; never let a stale extra count past the denominator.
    up_pods, down_pods = min(up_pods, matched_pods), min(down_pods, matched_pods)
    needed = min_pods_needed(action, matched_pods)
    if action.scale_up_on and matched_pods > 0 and up_pods >= needed:
        return _Signal(Direction.UP, f"{up_rules} on {up_pods}/{matched_pods} pods")
    if action.scale_down_on and matched_pods > 0 and down_pods == matched_pods:
        return _Signal(Direction.DOWN, f"{down_rules} on {down_pods}/{matched_pods} pods")
    if matched_pods == 0:
        return _Signal(Direction.NONE, "no matched pods")
    seen = []
    if action.scale_up_on:
        seen.append(f"{_names(action.scale_up_on)} on {up_pods}/{matched_pods} pods (up needs {needed})")
    if action.scale_down_on:
        seen.append(f"{_names(action.scale_down_on)} on {down_pods}/{matched_pods} pods (down needs all)")
    return _Signal(Direction.NONE, "no scaling signal: " + "; ".join(seen))


def _with_forecast(
    signal: _Signal, verdict: ForecastVerdict | None, forecast: ScaleForecast | None
) -> _Signal:
    """The reactive signal, with the forecast's say where it has one (see :mod:`.predictive`)."""
    if verdict is None or forecast is None or not verdict.has_say or signal.direction is Direction.UP:
        return signal
    if verdict.view is View.UP:
        return _Signal(Direction.UP, verdict.summary(forecast), verdict.detail(forecast.load))
    if verdict.view is View.HOLD_DOWN and signal.direction is Direction.DOWN:
        return _Signal(
            Direction.NONE, f"{signal.text}, but {verdict.summary(forecast)}", verdict.detail(forecast.load)
        )
    return signal


def _violated(rules: Iterable[str], by_pod: Mapping[str, Collection[str]]) -> str:
    """The named rules that some pod violates, in spec order, joined for a message."""
    return _names([r for r in rules if any(r in pod_rules for pod_rules in by_pod.values())])


def _names(rules: Iterable[str]) -> str:
    return ", ".join(rules)


class ScaleDecider:
    """The scaling state of one policy: the current run of equal wishes and the last change each way.

    Pure: every method is told ``now`` (seconds, any monotonic origin shared by the calls).
    """

    def __init__(self) -> None:
        self._run_direction = Direction.NONE
        self._run_since: float | None = None
        self._last_scale: dict[Direction, float] = {}
        self._last_target: tuple[Direction, int] | None = None
        """The direction and replicas of the last change made (or, in dryRun, announced)."""
        self.predictor: Predictor | None = None
        """The load forecast, once a decision with ``forecast`` set was asked for."""
        self.verdict: ForecastVerdict | None = None
        """The forecast's say at the latest decision (None without ``forecast``)."""

    def restore(self, last_scale_at: float) -> None:
        """Seed both cooldowns from a change made before a restart (``status.scale.lastScaleTime``).

        The status does not say which way that change went; starting both
        cooldowns is the safe reading.
        """
        for direction in (Direction.UP, Direction.DOWN):
            self._last_scale[direction] = max(self._last_scale.get(direction, last_scale_at), last_scale_at)

    def record_scale(self, decision: ScaleDecision, now: float) -> None:
        """The target changed as ``decision`` says (or, in dryRun, would have): start its cooldown."""
        if decision.changes:
            direction = Direction.UP if decision.desired > decision.current else Direction.DOWN
            self._last_scale[direction] = now
            self._last_target = (direction, decision.desired)
            if self.predictor is not None:
                self.predictor.startup.scaled(now, decision.current, decision.desired)

    def decide(
        self,
        action: ScaleAction,
        current_replicas: int,
        findings_by_pod: Mapping[str, Collection[str]],
        matched_pods: int,
        now: float,
        load: WorkloadLoad | None = None,
    ) -> ScaleDecision:
        """Decide the target's replicas from the active findings of the ``matched_pods`` selected pods.

        ``findings_by_pod`` maps a pod's name to the names of the rules it
        currently violates (see :func:`findings_by_pod`). With ``action.forecast``,
        ``load`` is this evaluation's load sample (the Evaluation's ``load``),
        and the forecast has its say (:mod:`gpuwarden.policy.scaling.predictive`). Records this
        evaluation's wish for the stabilization windows; does not start a
        cooldown (:meth:`record_scale` does, once the change is made: see :func:`scale_step`).
        """
        signal = _signal(action, findings_by_pod, matched_pods)
        if action.forecast is None:
            self.predictor = self.verdict = None
        else:
            if self.predictor is None:
                self.predictor = Predictor()
            self.predictor.observe(load, now)
            self.verdict = self.predictor.verdict(action.forecast, current_replicas, now)
            signal = _with_forecast(signal, self.verdict, action.forecast)
        held_for = self._observe(signal.direction, now)
        current = current_replicas
        lo, hi = action.min_replicas, action.max_replicas

        if current <= 0:
            return ScaleDecision(
                current,
                current,
                Direction.NONE,
                "target at 0 replicas: scaling paused",
                Blocker.SCALED_TO_ZERO,
            )
        if current > hi:
            return ScaleDecision(current, hi, Direction.DOWN, f"{current} replicas exceed maxReplicas {hi}")
        if current < lo:
            return ScaleDecision(current, lo, Direction.UP, f"{current} replicas are below minReplicas {lo}")
        if signal.direction is Direction.NONE:
            if signal.detail:
                reason = f"{signal.text}: {signal.detail}"
                return ScaleDecision(current, current, Direction.NONE, reason, summary=signal.text)
            return ScaleDecision(current, current, Direction.NONE, signal.text)

        up = signal.direction is Direction.UP
        behavior = action.scale_up if up else action.scale_down
        timed = signal.text if held_for < 1 else f"{signal.text} for {approx_duration(held_for)}"
        if signal.detail:
            timed += f": {signal.detail}"

        def held_back(
            note: str, blocker: Blocker, timed_note: str | None = None, standing: int | None = None
        ) -> ScaleDecision:
            reason = f"{timed}; {timed_note or note}"
            return ScaleDecision(
                current, current, signal.direction, reason, blocker, f"{signal.text}; {note}", standing
            )

        if current == (hi if up else lo):
            if up:
                return held_back(f"already at maxReplicas {hi}", Blocker.AT_MAX_REPLICAS)
            return held_back(f"already at minReplicas {lo}", Blocker.AT_MIN_REPLICAS)
        if held_for < behavior.stabilization_seconds:
            window = format_duration(behavior.stabilization_seconds)
            note = f"waiting out the {window} scale-{'up' if up else 'down'} stabilization window"
            return held_back(note, Blocker.STABILIZATION_WINDOW)
        last = self._last_scale.get(signal.direction)
        if last is not None and now - last < behavior.cooldown_seconds:
            cooldown = format_duration(behavior.cooldown_seconds)
            since = f"last scale {'up' if up else 'down'} {approx_duration(now - last)} ago"
            return held_back(
                f"cooling down ({cooldown})",
                Blocker.COOLDOWN,
                f"cooling down: {since}, cooldown {cooldown}",
                self._standing(signal.direction, current, lo, hi),
            )
        step = step_size(behavior, current)
        desired = min(hi, current + step) if up else max(lo, current - step)
        return ScaleDecision(current, desired, signal.direction, timed, summary=signal.text)

    def _standing(self, direction: Direction, current: int, lo: int, hi: int) -> int | None:
        """The last change's replicas, if it went ``direction`` and the target is short of them."""
        if self._last_target is None or self._last_target[0] is not direction:
            return None
        target = min(max(self._last_target[1], lo), hi)
        short = target > current if direction is Direction.UP else target < current
        return target if short else None

    def _observe(self, direction: Direction, now: float) -> float:
        """Extend or restart the run of equal wishes; return how long the current one has held."""
        if direction is not self._run_direction or self._run_since is None:
            self._run_direction, self._run_since = direction, now
        return max(0.0, now - self._run_since)


class StepKind(enum.StrEnum):
    """What a :class:`ScaleStep` asks of whoever owns the target."""

    HOLD = "Hold"
    """The decision changes nothing: nothing to do, nothing to record."""
    ANNOUNCE = "Announce"
    """dryRun: announce the change; the replicas stay, and its cooldown starts all the same."""
    APPLY = "Apply"
    """Set the target's replicas to ``decision.desired``; settle with whether that was done."""


@dataclass(slots=True)
class ScaleStep:
    """One decide -> apply -> record step of a policy's scaling (from :func:`scale_step`).

    The apply is the caller's (I/O, possibly refused by a conflict or failing); what is recorded
    given its outcome is decided here, by :meth:`settle`, so every caller records alike.
    """

    decider: ScaleDecider
    decision: ScaleDecision
    kind: StepKind
    now: float
    settled: bool = False

    def settle(self, *, made: bool) -> bool:
        """Record the outcome once: ``made``, whether an APPLY's change was made (False: refused or failed).

        An announced (dryRun) change or a made one starts its cooldown; one not made is decided
        afresh next time. Returns whether a change was recorded.
        """
        if self.settled:
            raise RuntimeError("a scale step is settled once")
        self.settled = True
        recorded = self.kind is StepKind.ANNOUNCE or (self.kind is StepKind.APPLY and made)
        if recorded:
            self.decider.record_scale(self.decision, self.now)
        return recorded


def scale_step(
    decider: ScaleDecider,
    action: ScaleAction,
    current_replicas: int,
    findings: Iterable[ActiveFinding],
    matched_pods: int,
    now: float,
    load: WorkloadLoad | None = None,
) -> ScaleStep:
    """Decide ``action``'s target replicas after an evaluation, and say what the target's owner must do.

    ``findings`` are the evaluation's active ones, ``matched_pods`` how many pods it selected,
    ``load`` its load sample (for ``forecast``). Settle the step once the owner has acted.
    """
    decision = decider.decide(action, current_replicas, findings_by_pod(findings), matched_pods, now, load)
    if not decision.changes:
        kind = StepKind.HOLD
    elif action.dry_run:
        kind = StepKind.ANNOUNCE
    else:
        kind = StepKind.APPLY
    return ScaleStep(decider, decision, kind, now)

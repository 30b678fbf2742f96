"""Scaling in local mode, decided as the operator decides it.

A :class:`SimulatedScaler` takes the same pure :func:`~gpuwarden.policy.scaling.decider.scale_step`
after each evaluation with the target's current replicas, applies a change the step asks for and
settles the step, which starts its cooldown. There is no cluster, so the target is a
:class:`SimulatedTarget`: it starts with one replica per pod the policy matches (when it first
matches any) and follows the decisions, 1 -> 2 -> 3 within ``minReplicas``/``maxReplicas``. Whoever
plays the snapshots makes the replicas real: the demo scales the scenario's Deployment of that name
(:meth:`gpuwarden.sim.scenario.Scenario.scale`), whose load then spreads over the new pods once they
start, so scaling out lowers each pod's utilization and stops when it is low enough. A target with no
such Deployment gets no pods: a saturated server then keeps asking, once per cooldown, up to
``maxReplicas``. A ``dryRun: true`` policy leaves the replicas as they are, as the operator would, and
its wish comes back once per cooldown unchanged. A policy with ``forecast`` is asked with each
evaluation's load sample, as the operator asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.local.policies import LocalPolicy
from gpuwarden.local.rows import ScaleNote, TargetRow
from gpuwarden.policy import (
    Evaluation,
    ScaleDecider,
    ScaleDecision,
    StepKind,
    scale_step,
)


@dataclass(slots=True)
class SimulatedTarget:
    """A policy's scale target in local mode: a replica count that follows the decisions."""

    policy: str
    target: str
    """``Deployment inference/llm-server``."""
    initial: int
    """Replicas when the policy first matched pods: one per matched pod."""
    replicas: int
    dry_run: bool
    """The policy's ``dryRun``: decisions are announced, the replicas stay at ``initial``."""
    scaled_up: int = 0
    scaled_down: int = 0

    def apply(self, decision: ScaleDecision) -> None:
        """Take a decision that changes the replicas, as a patched ``/scale`` would."""
        if decision.desired > self.replicas:
            self.scaled_up += 1
        elif decision.desired < self.replicas:
            self.scaled_down += 1
        self.replicas = decision.desired

    @property
    def row(self) -> TargetRow:
        """The target as the display shows it."""
        return TargetRow(self.policy, self.target, self.replicas, self.dry_run)


class SimulatedScaler:
    """Scales one policy's :class:`SimulatedTarget` after each evaluation, as the WorkloadScaler would."""

    def __init__(self, policy: LocalPolicy) -> None:
        self.policy = policy
        self.decider = ScaleDecider()
        self.target: SimulatedTarget | None = None
        """None until the policy first matches a pod (nothing to size the target by before)."""

    def scale(self, evaluation: Evaluation, now: float) -> ScaleNote | None:
        """One scale step after ``evaluation``; a note when it changes (dryRun: would change) the replicas."""
        action = self.policy.spec.actions.scale
        matched = len(evaluation.matched_pods)
        if action is None:
            return None
        target = self.target
        if target is None:
            if matched == 0:
                # Nothing to size the Deployment by yet; the operator would read /scale instead.
                return None
            ref = action.target_ref
            where = f"{self.policy.namespace}/{ref.name}" if self.policy.namespace else ref.name
            target = self.target = SimulatedTarget(
                policy=self.policy.key,
                target=f"{ref.kind} {where}",
                initial=matched,
                replicas=matched,
                dry_run=action.dry_run,
            )
        step = scale_step(
            self.decider, action, target.replicas, evaluation.active, matched, now, evaluation.load
        )
        if step.kind is StepKind.HOLD:
            return None
        applied = step.kind is StepKind.APPLY
        if applied:
            target.apply(step.decision)
        step.settle(made=applied)
        return ScaleNote(
            self.policy.key,
            target.target,
            step.decision,
            now,
            applied=applied,
            namespace=self.policy.namespace or "",
            name=action.target_ref.name,
        )

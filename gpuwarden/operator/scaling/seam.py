"""The seam between a policy's evaluation and the component that scales its workload.

:class:`~gpuwarden.operator.policies.runner.PolicyRunner` calls a :class:`Scaler` after each evaluation and
writes its :class:`ScaleResult` into the policy's status; the composition root plugs in
:class:`~.workload.WorkloadScaler`. Kept apart so that neither the
state nor the runner imports the scaling component, nor each other for its types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpuwarden.operator.resources import PolicyKey
    from gpuwarden.operator.scaling.claims import PolicyClaim
    from gpuwarden.policy import Evaluation, PolicySpec

__all__ = ["SCALING_ACTIVE", "ScaleResult", "Scaler"]

SCALING_ACTIVE = "ScalingActive"
"""The type of the scaler's condition in the policy's status (the status writer keeps it apart)."""


@dataclass(frozen=True, slots=True)
class ScaleResult:
    """What a scaler reports back into the policy's status."""

    status: Mapping[str, Any] | None = None
    """``status.scale`` (currentReplicas, desiredReplicas, lastScaleTime, lastScaleReason)."""
    problem: tuple[str, str] | None = None
    """``(reason, message)`` making the policy not Ready, e.g. ``ScaleTargetNotFound``."""
    condition: tuple[str, str, str] | None = None
    """``(status, reason, message)`` of the ``ScalingActive`` condition."""


class Scaler(Protocol):
    """Acts on ``spec.actions.scale`` after each evaluation (a separate component plugs in here).

    Called after every evaluation, also of a policy without ``actions.scale``: the answer is then
    None, and the scaler forgets what it kept of the policy.
    """

    async def scale(
        self,
        policy: PolicyKey,
        spec: PolicySpec,
        evaluation: Evaluation,
        now: float,
        policies: Iterable[PolicyClaim],
    ) -> ScaleResult | None:
        """Act on ``policy`` after ``evaluation``; ``policies``: the namespace's, from the index."""
        ...

"""``actions.scale``: the seam the evaluation loop calls, and the scaler behind it.

What the rest of the operator imports (only from here): the seam (:class:`Scaler`, its
:class:`ScaleResult`, the :data:`SCALING_ACTIVE` condition type), the scaler the composition root
plugs in (:class:`WorkloadScaler` over a :class:`KubeScaleApi`), and what the policy index keeps
of each policy for it (:class:`PolicyClaim`, :func:`policy_claim`).
"""

from gpuwarden.operator.scaling.api import KubeScaleApi
from gpuwarden.operator.scaling.claims import PolicyClaim, policy_claim
from gpuwarden.operator.scaling.seam import SCALING_ACTIVE, Scaler, ScaleResult
from gpuwarden.operator.scaling.workload import WorkloadScaler

__all__ = [
    "SCALING_ACTIVE",
    "KubeScaleApi",
    "PolicyClaim",
    "ScaleResult",
    "Scaler",
    "WorkloadScaler",
    "policy_claim",
]

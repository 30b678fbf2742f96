"""What a policy claims to scale, as the operator's Kopf index of GPUMonitorPolicies keeps it.

The Scaler looks at the namespace's other policies at every round of a scaling policy (two
acting policies on one workload both stop). Listing and parsing them there cost every round
O(policies), so O(policies²) for a namespace; the index parses a policy once per change of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.policy import ScaleAction, SpecError, parse_spec

__all__ = ["PolicyClaim", "policy_claim"]


@dataclass(frozen=True, slots=True)
class PolicyClaim:
    """One policy of a namespace: who it is and the scale action it acts on."""

    name: str
    uid: str
    action: ScaleAction | None
    """None: no ``actions.scale``, an invalid spec (never evaluated), or being deleted (its daemon
    is stopping): a policy that does not act is nobody's rival."""
    scale_status: Mapping[str, Any] = field(default_factory=dict)
    """Its ``status.scale``, which the Scaler reads back once after a restart (cooldowns run on)."""


def policy_claim(body: Mapping[str, Any]) -> PolicyClaim:
    """The claim of a policy object, as the API serves it."""
    meta = body.get("metadata") or {}
    return PolicyClaim(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        action=None if meta.get("deletionTimestamp") else _scale_action(body.get("spec") or {}),
        scale_status=dict((body.get("status") or {}).get("scale") or {}),
    )


def _scale_action(spec: Mapping[str, Any]) -> ScaleAction | None:
    try:
        return parse_spec(spec).actions.scale
    except SpecError:
        return None  # an invalid policy is not evaluated, so it does not act

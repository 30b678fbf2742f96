"""Kubernetes label-selector matching, with the API server's semantics, for a policy's ``selector``."""

from __future__ import annotations

from collections.abc import Mapping

from gpuwarden.policy.spec.model import LabelRequirement, LabelSelector

__all__ = ["requirement_matches", "selector_matches"]


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Whether a pod with ``labels`` is selected: every matchLabels pair and every requirement holds.

    An empty selector matches every pod, as in Kubernetes.
    """
    return all(labels.get(key) == value for key, value in selector.match_labels) and all(
        requirement_matches(req, labels) for req in selector.match_expressions
    )


def requirement_matches(requirement: LabelRequirement, labels: Mapping[str, str]) -> bool:
    """Whether one matchExpressions entry holds for ``labels``.

    NotIn and DoesNotExist hold for a pod that lacks the key altogether, exactly as in Kubernetes.
    """
    present = requirement.key in labels
    match requirement.operator:
        case "In":
            return present and labels[requirement.key] in requirement.values
        case "NotIn":
            return not present or labels[requirement.key] not in requirement.values
        case "Exists":
            return present
        case "DoesNotExist":
            return not present
        case _:
            # parse_spec admits only the four operators; an unknown one must never select a pod.
            return False

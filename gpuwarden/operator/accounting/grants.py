"""What the API says a pod may be billed for: its GPUs and its start (issue 45), from its spec and status.

A node's agent names the GPUs its pods hold; the operator counts at most what the API allocated them
(:class:`~gpuwarden.accounting.Bound`): the GPUs its containers were given (the largest of its init
containers' and the sum of its app containers', as the scheduler counts a pod's request, each
``nvidia.com/*`` limit a device: a whole GPU, a MIG slice, a time-sliced replica), from its
``status.startTime`` on (its ``creationTimestamp`` until the kubelet sets that; a pod with neither is
billed nothing). A DRA claim does not say here how many devices it holds, so a pod with resource
claims may be billed up to :data:`CLAIMED_GPUS` more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gpuwarden.accounting import Bound
from gpuwarden.kubetime import parse_epoch

__all__ = ["CLAIMED_GPUS", "pod_grant"]

GPU_RESOURCE_PREFIX = "nvidia.com/"
CLAIMED_GPUS = 8.0
"""GPUs a pod's resource claims may be billed for together: a node's GPUs, at most (DGX/HGX: 8)."""


def pod_grant(spec: Mapping[str, Any], status: Mapping[str, Any], meta: Mapping[str, Any]) -> Bound:
    """The pod's :class:`~gpuwarden.accounting.Bound` (see the module doc)."""
    init = max((_gpus(c) for c in spec.get("initContainers") or ()), default=0.0)
    app = sum(_gpus(c) for c in spec.get("containers") or ())
    gpus = max(init, app) + (CLAIMED_GPUS if spec.get("resourceClaims") else 0.0)
    start = parse_epoch(status.get("startTime") or meta.get("creationTimestamp"))
    return Bound(gpus, math.inf if start is None else start)


def _gpus(container: Mapping[str, Any]) -> float:
    resources = container.get("resources") or {}
    # A device-plugin resource's limit is its request (Kubernetes refuses them apart).
    section = resources.get("limits") or resources.get("requests") or {}
    total = 0.0
    for name, value in section.items():
        if str(name).startswith(GPU_RESOURCE_PREFIX):
            try:
                total += float(str(value))
            except ValueError:
                continue
    return total

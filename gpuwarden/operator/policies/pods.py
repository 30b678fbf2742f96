"""Which pods the operator keeps track of, and what it keeps of each (pure functions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwarden.operator.resources import PodRecord
from gpuwarden.policy import SNOOZE_PREFIX, PodView

__all__ = ["pod_record", "requests_gpu"]

GPU_RESOURCE_PREFIX = "nvidia.com/"
"""Device-plugin resources: ``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``, ``nvidia.com/gpu.shared``."""


def requests_gpu(spec: Mapping[str, Any]) -> bool:
    """Whether a pod spec asks for a GPU (a device-plugin resource, or a DRA resource claim).

    Only such pods can have GPU readings; the rest are not worth an index entry.
    """
    if spec.get("resourceClaims"):
        return True
    for container in spec.get("containers") or ():
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            if any(str(name).startswith(GPU_RESOURCE_PREFIX) for name in resources.get(section) or {}):
                return True
    return False


def pod_record(
    *, namespace: str, name: str, uid: str, labels: Mapping[str, str], annotations: Mapping[str, str]
) -> PodRecord:
    """The engine's view of a pod (labels, snooze annotations only) and its uid for Events."""
    snoozes = {k: v for k, v in annotations.items() if k.startswith(SNOOZE_PREFIX)}
    return PodRecord(PodView(namespace, name, dict(labels), snoozes), uid)

"""The operator's names for what it reads and writes in Kubernetes, and the value types that refer to them.

A leaf: it imports nothing of :mod:`gpuwarden.operator`, so any operator module may import it
without an import circle (before, :mod:`~gpuwarden.operator.scaling.seam` needed ``PolicyKey`` from
:mod:`~gpuwarden.operator.state`, which then needed ``Scaler`` from it).

- The CRD's identity (group, version, plural, kind), once: the spec parser checks manifests
  against the same :data:`~gpuwarden.policy.parse.API_VERSION` and
  :data:`~gpuwarden.policy.parse.KIND` (the policy engine may not import the operator).
- The field managers of its server-side applies and patches (``managedFields`` show who wrote what).
- The prefix of its finalizer and of Kopf's bookkeeping annotations.
- :class:`PolicyKey`, :class:`PodRecord` and :class:`ObjectRef`: a policy, a GPU pod as the pod
  index keeps it, and an object an Event is about.
- :func:`controller_ref`: which of an object's ``ownerReferences`` is its controller, as the
  accounting (a pod's workload) and reclaiming (the workload to act on) both read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy import API_VERSION, KIND, PodView

__all__ = [
    "API_VERSION",
    "FIELD_MANAGER",
    "FINALIZER",
    "GROUP",
    "KIND",
    "PLURAL",
    "PREFIX",
    "SCALER_FIELD_MANAGER",
    "VERSION",
    "ObjectRef",
    "PodRecord",
    "PolicyKey",
    "controller_ref",
    "policies_path",
]

GROUP, _, VERSION = API_VERSION.partition("/")
"""``gpuwarden.dev`` and ``v1alpha1``, as Kopf's handlers and the API paths name the CRD."""
PLURAL = "gpumonitorpolicies"

FIELD_MANAGER = "gpuwarden-operator"
"""Who writes a policy's status, the shard Leases, the ingest label and the Node conditions."""
SCALER_FIELD_MANAGER = "gpuwarden-scaler"
"""Who writes a workload's ``replicas`` through its scale subresource (``actions.scale``)."""

PREFIX = GROUP
"""Of the finalizer and of Kopf's progress and diff-base annotations: our domain, not Kopf's."""
FINALIZER = f"{PREFIX}/finalizer"


def policies_path(namespace: str) -> str:
    """The API path of the policies of one namespace."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object Events can be about."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str = ""


@dataclass(frozen=True, slots=True)
class PolicyKey:
    """A policy by namespace and name."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    def object_ref(self, uid: str = "") -> ObjectRef:
        """The policy, as an Event's ``involvedObject``."""
        return ObjectRef(API_VERSION, KIND, self.namespace, self.name, uid)


@dataclass(frozen=True, slots=True)
class PodRecord:
    """What the pod index keeps of a GPU pod: the engine's view and what an Event needs to refer to it."""

    view: PodView
    uid: str

    def object_ref(self) -> ObjectRef:
        """The pod, as an Event's ``involvedObject``."""
        return ObjectRef("v1", "Pod", self.view.namespace, self.view.name, self.uid)


def controller_ref(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``ownerReference`` marked controller in an object's ``metadata`` (the first owner when none
    is marked: objects some tools create); None when it has no owner."""
    refs = [r for r in meta.get("ownerReferences") or () if isinstance(r, Mapping)]
    return next((r for r in refs if r.get("controller")), refs[0] if refs else None)

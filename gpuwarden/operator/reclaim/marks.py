"""What a reclaim writes on a workload, and what puts it back: merge patches built by pure functions.

A reclaim is one merge patch of the workload (or of the Kueue Workload that admits it): the change
(``spec.replicas: 0``, ``spec.suspend: true``, ``spec.active: false``, or nothing) together with
annotations recording what it was before, who did it and when. Being one write, the record and the
change cannot part. The patch carries the ``resourceVersion`` read, so a workload changed meanwhile
(a person scaled it) is not overwritten: the reclaim is decided again.

:func:`restore_patch` reads those annotations back and undoes the change; ``gpuwarden restore`` sends
it, and docs/reclaim.md gives the kubectl line that does the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy import ReclaimMethod

__all__ = [
    "KINDS",
    "OPT_OUT",
    "PREVIOUS_ACTIVE",
    "PREVIOUS_REPLICAS",
    "PREVIOUS_SUSPEND",
    "RECLAIMED_AT",
    "RECLAIMED_BY",
    "Kind",
    "fits",
    "kind_of",
    "opted_out",
    "reclaim_patch",
    "reclaimed",
    "restore_patch",
]

OPT_OUT = "gpuwarden.dev/reclaim"
"""``"false"`` on a workload or its namespace: never reclaimed."""
RECLAIMED_AT = "gpuwarden.dev/reclaimed-at"
RECLAIMED_BY = "gpuwarden.dev/reclaimed-by"
"""``<policy>: <what and why>``."""
PREVIOUS_REPLICAS = "gpuwarden.dev/previous-replicas"
PREVIOUS_SUSPEND = "gpuwarden.dev/previous-suspend"
PREVIOUS_ACTIVE = "gpuwarden.dev/previous-active"
_MARKS = (RECLAIMED_AT, RECLAIMED_BY, PREVIOUS_REPLICAS, PREVIOUS_SUSPEND, PREVIOUS_ACTIVE)


@dataclass(frozen=True, slots=True)
class Kind:
    """A workload kind reclaim knows: its API group, resource, and what ScaleToZero or Suspend sets."""

    group: str
    kind: str
    plural: str
    version: str
    """The version a name-only reference (``gpuwarden restore jobset/x``) is read at."""
    field: str | None
    """``replicas`` (ScaleToZero), ``suspend`` or ``active`` (Suspend); None: owners only followed."""


KINDS = (
    Kind("apps", "Deployment", "deployments", "v1", "replicas"),
    Kind("apps", "StatefulSet", "statefulsets", "v1", "replicas"),
    Kind("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets", "v1", "replicas"),
    Kind("batch", "Job", "jobs", "v1", "suspend"),
    Kind("jobset.x-k8s.io", "JobSet", "jobsets", "v1alpha2", "suspend"),
    Kind("ray.io", "RayCluster", "rayclusters", "v1", "suspend"),
    Kind("kueue.x-k8s.io", "Workload", "workloads", "v1beta2", "active"),
    Kind("apps", "ReplicaSet", "replicasets", "v1", None),
    Kind("", "Pod", "pods", "v1", None),
)
_BY_KIND = {(k.group, k.kind): k for k in KINDS}

_FIELD_OF = {ReclaimMethod.SCALE_TO_ZERO: ("replicas",), ReclaimMethod.SUSPEND: ("suspend", "active")}


def kind_of(api_version: str, kind: str) -> Kind | None:
    """The record of ``kind`` in ``api_version``'s group; None for a kind reclaim does not know."""
    return _BY_KIND.get((api_version.rpartition("/")[0], kind))


def fits(method: ReclaimMethod, api_version: str, kind: str) -> bool:
    """Whether ``method`` can act on this kind (Annotate: on any)."""
    if method is ReclaimMethod.ANNOTATE:
        return True
    record = kind_of(api_version, kind)
    return record is not None and record.field in _FIELD_OF[method]


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def opted_out(obj: Mapping[str, Any]) -> bool:
    """Whether the object (a workload, a namespace) carries ``gpuwarden.dev/reclaim: "false"``."""
    return str(_annotations(obj).get(OPT_OUT, "")).lower() == "false"


def reclaimed(obj: Mapping[str, Any]) -> bool:
    """Whether a reclaim's record is on the object (it stays reclaimed until restored)."""
    return RECLAIMED_AT in _annotations(obj)


def reclaim_patch(
    method: ReclaimMethod, obj: Mapping[str, Any], *, by: str, at: str
) -> tuple[dict[str, Any], str]:
    """The merge patch reclaiming ``obj`` and what it does in words (``1→0``, ``suspended``)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    marks: dict[str, str] = {RECLAIMED_AT: at, RECLAIMED_BY: by}
    change: dict[str, Any] = {}
    record = kind_of(str(obj.get("apiVersion", "")), str(obj.get("kind", "")))
    field = record.field if record is not None and method is not ReclaimMethod.ANNOTATE else None
    if field == "replicas":
        before = int(spec.get("replicas", 1))
        marks[PREVIOUS_REPLICAS], change["replicas"] = str(before), 0
        words = f"scaled to zero ({before}→0)"
    elif field == "suspend":
        marks[PREVIOUS_SUSPEND], change["suspend"] = _bool(spec.get("suspend", False)), True
        words = "suspended"
    elif field == "active":
        marks[PREVIOUS_ACTIVE], change["active"] = _bool(spec.get("active", True)), False
        words = "deactivated (Kueue)"
    else:
        words = "annotated"
    body: dict[str, Any] = {"metadata": {"annotations": marks}}
    if meta.get("resourceVersion"):
        body["metadata"]["resourceVersion"] = meta["resourceVersion"]
    if change:
        body["spec"] = change
    return body, words


def restore_patch(obj: Mapping[str, Any]) -> tuple[dict[str, Any], str] | None:
    """The merge patch undoing a reclaim of ``obj`` and what it does in words; None: not reclaimed."""
    marks = _annotations(obj)
    if not any(k in marks for k in _MARKS):
        return None
    spec: dict[str, Any] = {}
    words = []
    if (replicas := marks.get(PREVIOUS_REPLICAS)) is not None:
        spec["replicas"] = int(replicas)
        words.append(f"replicas {replicas}")
    if (suspend := marks.get(PREVIOUS_SUSPEND)) is not None:
        spec["suspend"] = suspend == "true"
        words.append(f"suspend {suspend}")
    if (active := marks.get(PREVIOUS_ACTIVE)) is not None:
        spec["active"] = active == "true"
        words.append(f"active {active}")
    body: dict[str, Any] = {"metadata": {"annotations": {k: None for k in _MARKS if k in marks}}}
    if (version := (obj.get("metadata") or {}).get("resourceVersion")) is not None:
        body["metadata"]["resourceVersion"] = version
    if spec:
        body["spec"] = spec
    return body, ", ".join(words) or "annotations removed"


def _bool(value: Any) -> str:
    return "true" if value is True else "false"

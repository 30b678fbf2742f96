"""A pod's top owner (the workload it is accounted to), resolved from ownerReferences through the API.

A pod's workload is the top of its chain of controllers: the controller ``ownerReference`` of the
pod, then of that owner, and so on. Only the owners whose own owners matter are read: a ReplicaSet
(a Deployment above it), a Job (a CronJob above it), a StatefulSet (a LeaderWorkerSet or a Kubeflow
Notebook above it) and a Pod (a LeaderWorkerSet's leader pod controls the StatefulSet of its group's
workers); any other kind (DaemonSet, Deployment, LeaderWorkerSet, ...) is taken as the top without
a read. A bare pod is its own workload (kind ``Pod``). An owner that cannot be
read (deleted, or not ours to read) is the top as far as we know; an API server that does not
answer is tried again later (:class:`Unresolved`).

Owners are cached by (namespace, kind, name): their owners never change (Kubernetes does not
re-parent a controller's objects), so a Deployment's hundred pods cost its ReplicaSet one read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpuwarden.operator.kube import ApiError
from gpuwarden.operator.resources import controller_ref

__all__ = ["ObjectReader", "OwnerResolver", "Unresolved", "Workload"]

FOLLOWED = {
    ("apps", "ReplicaSet"): "replicasets",
    ("batch", "Job"): "jobs",
    ("apps", "StatefulSet"): "statefulsets",
    ("", "Pod"): "pods",
}
"""The owners read to find theirs, by (API group, kind): their resource names (the chart's
operator ClusterRole grants ``get`` on exactly these)."""
MAX_DEPTH = 4
"""Owners followed at most: a LeaderWorkerSet's worker pod's (StatefulSet, leader Pod, StatefulSet,
LeaderWorkerSet) is the deepest chain known."""
MAX_CACHED = 100_000
"""Owners remembered (least recently used forgotten first)."""
GONE = frozenset({403, 404, 410})
"""API answers that say an object will not be read: it is gone, or not ours to read."""


class Unresolved(Exception):
    """The API could not be asked now (unreachable, overloaded): try again later."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Who a pod's GPU time is accounted to."""

    kind: str
    name: str
    group: str = ""
    """The value of the pod's group label (``--accounting-group-label``); empty when unset or absent."""


class ObjectReader(Protocol):
    """What the resolver reads objects through: the operator's API client
    (:class:`~gpuwarden.operator.kube.KubeApi`), or the user's in ``gpuwarden report``."""

    async def get(self, path: str) -> Mapping[str, Any]:
        """GET one object by API path; raise :class:`~gpuwarden.operator.kube.ApiError` for anything
        but success (status 404 for an object that is not there)."""
        ...


def controller_of(meta: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(API group, kind, name) of the object's controller ``ownerReference`` (the first owner when none
    is marked controller); None when it has no owner."""
    ref = controller_ref(meta)
    if ref is None or not ref.get("kind") or not ref.get("name"):
        return None
    group = str(ref.get("apiVersion", "")).rpartition("/")[0]
    return group, str(ref["kind"]), str(ref["name"])


class OwnerResolver:
    """Resolves pods to their workloads, caching the owners it reads."""

    def __init__(
        self,
        api: ObjectReader,
        *,
        group_label: str = "",
        follow_owners: bool = True,
        max_cached: int = MAX_CACHED,
    ) -> None:
        # The API object, not its bound ``get``: nothing is read of it until a pod is resolved.
        self._api = api
        self._followed = FOLLOWED if follow_owners else {}
        """Owners read for theirs; none with ``--no-accounting-owners``: the pod's controller is the top."""
        self._group_label = group_label
        self._max_cached = max_cached
        self._tops: OrderedDict[tuple[str, str, str], tuple[str, str]] = OrderedDict()

    async def workload(self, namespace: str, pod: str) -> Workload:
        """The workload of ``namespace/pod``; a pod that cannot be read is its own (kind ``Pod``)."""
        try:
            obj = await self._api.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        except ApiError as exc:
            if exc.status in GONE:
                return Workload("Pod", pod)
            raise Unresolved(f"pod {namespace}/{pod}: API answered {exc.status}") from None
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        group = str(labels.get(self._group_label, "")) if self._group_label else ""
        owner = controller_of(meta)
        if owner is None:
            return Workload("Pod", pod, group)
        kind, name = await self._top(namespace, owner)
        return Workload(kind, name, group)

    async def _top(self, namespace: str, owner: tuple[str, str, str]) -> tuple[str, str]:
        chain: list[tuple[str, str, str]] = []
        top: tuple[str, str] | None = None
        for _ in range(MAX_DEPTH):
            group, kind, name = owner
            chain.append((namespace, kind, name))
            cached = self._tops.get((namespace, kind, name))
            if cached is not None:
                self._tops.move_to_end((namespace, kind, name))
                top = cached
                break
            plural = self._followed.get((group, kind))
            if plural is None:
                top = (kind, name)
                break
            try:
                obj = await self._api.get(f"{_api_root(group)}/namespaces/{namespace}/{plural}/{name}")
            except ApiError as exc:
                if exc.status not in GONE:
                    raise Unresolved(f"{kind} {namespace}/{name}: API answered {exc.status}") from None
                top = (kind, name)
                break
            above = controller_of(obj.get("metadata") or {})
            if above is None:
                top = (kind, name)
                break
            owner = above
        if top is None:
            top = (owner[1], owner[2])
        for link in chain:
            self._tops[link] = top
            self._tops.move_to_end(link)
        while len(self._tops) > self._max_cached:
            self._tops.popitem(last=False)
        return top


def _api_root(group: str) -> str:
    """The path of an API group's v1 (the core group's is ``/api/v1``)."""
    return f"/apis/{group}/v1" if group else "/api/v1"

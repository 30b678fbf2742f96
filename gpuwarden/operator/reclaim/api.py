"""The API calls reclaiming makes: a pod's owners, a workload, its namespace, HPAs, Kueue, one patch.

:class:`ReclaimApi` is what :class:`~.reclaimer.Reclaimer` needs; :class:`KubeReclaimApi` provides it
over the operator's :class:`~gpuwarden.operator.kube.KubeApi`. Owners are read only while the pod's
chain goes through a kind whose own owner matters (a ReplicaSet's Deployment, a Job's JobSet, a
StatefulSet's LeaderWorkerSet, a leader Pod's StatefulSet); a pod's chain is cached by its uid
(Kubernetes never re-parents an object). The chart grants these reads to every operator, and the
writes (``patch`` on the kinds reclaim acts on) only with ``operator.reclaim.enabled``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpuwarden.operator.kube import ApiError, JsonObject, KubeApi
from gpuwarden.operator.reclaim.marks import kind_of
from gpuwarden.operator.resources import ObjectRef, controller_ref

__all__ = ["KubeReclaimApi", "Owner", "ReclaimApi", "ReclaimApiError", "ReclaimConflict", "path_of"]

KUEUE_WORKLOADS = "/apis/kueue.x-k8s.io/{version}/namespaces/{namespace}/workloads"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
"""Newest first, the next only where one is not served (a Kueue before v1beta2). Through v1beta1, an
update of an admitted Workload that Kueue stores as v1beta2 fails v1beta1's own validation rules (a
422 on ``spec.priorityClassSource``, which v1beta2 does not have: seen with Kueue v0.17)."""
MAX_DEPTH = 5
"""Owners followed at most: a LeaderWorkerSet worker's chain (StatefulSet, leader Pod, StatefulSet,
LeaderWorkerSet) is the deepest known."""
MAX_CACHED = 50_000


@dataclass(frozen=True, slots=True)
class Owner:
    """An object in a pod's chain of controllers (the pod itself first)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str = ""

    def ref(self) -> ObjectRef:
        return ObjectRef(self.api_version, self.kind, self.namespace, self.name, self.uid)


class ReclaimApiError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status (0 when none came back)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ReclaimConflict(ReclaimApiError):
    """The object changed between reading and patching it (HTTP 409)."""


class ReclaimApi(Protocol):
    async def chain(self, namespace: str, pod: str, uid: str) -> tuple[Owner, ...]:
        """The pod and its controllers, the pod first; raises ReclaimApiError."""
        ...

    async def read(self, owner: Owner) -> JsonObject | None:
        """The object; None when it is gone."""
        ...

    async def namespace(self, name: str) -> JsonObject: ...

    async def hpa_targets(self, namespace: str, api_version: str, kind: str, name: str) -> list[str]:
        """The HPAs (KEDA's ScaledObjects make one) scaling the workload."""
        ...

    async def kueue_workload(self, owner: Owner) -> JsonObject | None:
        """The Kueue Workload owned by ``owner`` (None: none, or Kueue is not installed)."""
        ...

    async def patch(self, obj: Mapping[str, Any], body: Mapping[str, Any], manager: str) -> JsonObject:
        """Merge-patch ``obj`` (raises ReclaimConflict on a stale resourceVersion)."""
        ...


def path_of(api_version: str, kind: str, namespace: str, name: str) -> str | None:
    """The object's API path; None for a kind reclaim does not know."""
    record = kind_of(api_version, kind)
    if record is None:
        return None
    root = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    return f"{root}/namespaces/{namespace}/{record.plural}/{name}"


FOLLOWED = frozenset({("apps", "ReplicaSet"), ("batch", "Job"), ("apps", "StatefulSet"), ("", "Pod")})
"""The kinds whose owner is looked up (any other is the top of its chain)."""


class KubeReclaimApi:
    """:class:`ReclaimApi` over a :class:`KubeApi`."""

    def __init__(self, kube: KubeApi) -> None:
        self._kube = kube
        self._chains: OrderedDict[str, tuple[Owner, ...]] = OrderedDict()

    async def chain(self, namespace: str, pod: str, uid: str) -> tuple[Owner, ...]:
        if uid and (cached := self._chains.get(uid)) is not None:
            self._chains.move_to_end(uid)
            return cached
        links = [Owner("v1", "Pod", namespace, pod, uid)]
        obj = await self._get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        for _ in range(MAX_DEPTH):
            ref = controller_ref((obj or {}).get("metadata") or {})
            if ref is None:
                break
            owner = Owner(
                str(ref.get("apiVersion", "")),
                str(ref.get("kind", "")),
                namespace,
                str(ref["name"]),
                str(ref.get("uid", "")),
            )
            links.append(owner)
            if (owner.api_version.rpartition("/")[0], owner.kind) not in FOLLOWED:
                break
            path = path_of(owner.api_version, owner.kind, namespace, owner.name)
            obj = await self._get(path) if path else None
        chain = tuple(links)
        if uid:
            self._chains[uid] = chain
            while len(self._chains) > MAX_CACHED:
                self._chains.popitem(last=False)
        return chain

    async def read(self, owner: Owner) -> JsonObject | None:
        path = path_of(owner.api_version, owner.kind, owner.namespace, owner.name)
        return await self._get(path) if path else None

    async def namespace(self, name: str) -> JsonObject:
        return await self._get(f"/api/v1/namespaces/{name}") or {}

    async def hpa_targets(self, namespace: str, api_version: str, kind: str, name: str) -> list[str]:
        path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers"
        try:
            listing = await self._kube.get(path)
        except ApiError as exc:
            raise ReclaimApiError(f"listing HPAs: {exc}", exc.status) from exc
        group = api_version.rpartition("/")[0]
        found = []
        for item in listing.get("items") or []:
            ref = (item.get("spec") or {}).get("scaleTargetRef") or {}
            # Any version of the group is the same object; an HPA that leaves it out matches (safe side).
            same_group = not ref.get("apiVersion") or str(ref["apiVersion"]).rpartition("/")[0] == group
            if ref.get("kind") == kind and ref.get("name") == name and same_group:
                found.append(str((item.get("metadata") or {}).get("name", "")))
        return sorted(found)

    async def kueue_workload(self, owner: Owner) -> JsonObject | None:
        for version in KUEUE_VERSIONS:
            try:
                listing = await self._kube.get(
                    KUEUE_WORKLOADS.format(version=version, namespace=owner.namespace)
                )
                break
            except ApiError as exc:
                if exc.status != 404:  # 404: this version, or Kueue, is not served here
                    raise ReclaimApiError(f"listing Kueue Workloads: {exc}", exc.status) from exc
        else:
            return None
        for item in listing.get("items") or []:
            refs = (item.get("metadata") or {}).get("ownerReferences") or []
            if any(r.get("uid") == owner.uid and r.get("kind") == owner.kind for r in refs):
                return dict(item)
        return None

    async def patch(self, obj: Mapping[str, Any], body: Mapping[str, Any], manager: str) -> JsonObject:
        meta = obj.get("metadata") or {}
        path = path_of(
            str(obj.get("apiVersion", "")), str(obj.get("kind", "")), meta["namespace"], meta["name"]
        )
        if path is None:
            raise ReclaimApiError(f"{obj.get('kind')} is not a kind reclaim acts on")
        try:
            return await self._kube.request(
                "PATCH",
                path,
                body=body,
                params={"fieldManager": manager},
                content_type="application/merge-patch+json",
            )
        except ApiError as exc:
            what = f"{obj.get('kind')} {meta['namespace']}/{meta['name']}"
            if exc.status == 409:
                raise ReclaimConflict(f"{what} changed meanwhile", exc.status) from exc
            raise ReclaimApiError(f"{what}: {exc}", exc.status) from exc

    async def _get(self, path: str) -> JsonObject | None:
        try:
            return await self._kube.get(path)
        except ApiError as exc:
            if exc.status in (403, 404, 410):
                return None  # gone, or not ours to read: the top as far as we know
            raise ReclaimApiError(f"GET {path}: {exc}", exc.status) from exc

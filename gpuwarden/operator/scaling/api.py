"""The API calls that scaling makes: a target's /scale, the namespace's HPAs and policies.

:class:`ScaleApi` and an :class:`~gpuwarden.operator.kube.events.EventSink` are what
:class:`~.workload.WorkloadScaler` needs; :class:`KubeScaleApi` provides the first over
the operator's :class:`~gpuwarden.operator.kube.client.KubeApi` (the credentials Kopf uses), and the
operator's :class:`~gpuwarden.operator.kube.events.EventPoster` the second, as for every other Event.

Only the ``/scale`` subresource is read and written, never the workload itself: the
operator's RBAC grants ``get``/``patch`` on ``deployments/scale`` and nothing on
``deployments``. The plural a kind is served under comes from API discovery (built-in
workloads from a table, saving a request), so any resource with a ``/scale``
subresource can be a target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gpuwarden.operator.kube import ApiError, JsonObject, KubeApi
from gpuwarden.operator.resources import SCALER_FIELD_MANAGER, ObjectRef, policies_path
from gpuwarden.policy import ScaleTargetRef

# The built-in workloads with a /scale subresource: no discovery round trip for them.
_KNOWN_PLURALS = {
    ("apps", "Deployment"): "deployments",
    ("apps", "StatefulSet"): "statefulsets",
    ("apps", "ReplicaSet"): "replicasets",
    ("", "ReplicationController"): "replicationcontrollers",
}


@dataclass(frozen=True, slots=True)
class Scale:
    """A target's /scale subresource as read: ``spec.replicas``, and where to patch it."""

    target: ObjectRef
    replicas: int
    resource_version: str
    path: str
    """The /scale subresource's URL path."""


@dataclass(frozen=True, slots=True)
class HpaRef:
    """A HorizontalPodAutoscaler and the workload its ``scaleTargetRef`` names."""

    name: str
    target_api_version: str
    """Empty when the HPA leaves it out."""
    target_kind: str
    target_name: str

    def targets(self, ref: ScaleTargetRef) -> bool:
        """Whether this HPA scales ``ref`` (same group, kind and name; any version of the group)."""
        if (self.target_kind, self.target_name) != (ref.kind, ref.name):
            return False
        # Versions of one group serve the same objects; a missing apiVersion is read as a match (safe side).
        return not self.target_api_version or group_of(self.target_api_version) == group_of(ref.api_version)


class ScaleApiError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status (0 when none came back)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotFound(ScaleApiError):
    """The object asked for (or the API serving it) does not exist (HTTP 404)."""


class NotScalable(ScaleApiError):
    """The target's kind is not served, is cluster-scoped, or has no /scale subresource."""


class ScaleConflict(ScaleApiError):
    """The target changed between reading and patching its /scale (HTTP 409)."""


class ScaleApi(Protocol):
    """Reading and setting a target's replicas, and finding the HPAs that might also set them."""

    async def get_scale(self, namespace: str, ref: ScaleTargetRef) -> Scale:
        """The target's /scale; raises NotFound (no such target), NotScalable or ScaleApiError."""
        ...

    async def patch_scale(self, scale: Scale, replicas: int) -> int:
        """Set ``spec.replicas`` if the target is unchanged since ``scale`` was read (else ScaleConflict)."""
        ...

    async def list_hpas(self, namespace: str) -> list[HpaRef]:
        """The namespace's HorizontalPodAutoscalers; raises ScaleApiError."""
        ...

    async def list_policies(self, namespace: str) -> list[JsonObject]:
        """The namespace's GPUMonitorPolicies as the API returns them; raises ScaleApiError."""
        ...


def group_of(api_version: str) -> str:
    """``apps/v1`` -> ``apps``; ``v1`` -> ``""`` (the core group)."""
    group, _, version = api_version.rpartition("/")
    return group if version else ""


def _api_root(api_version: str) -> str:
    """``/apis/apps/v1`` for a named group, ``/api/v1`` for the core group."""
    return f"/apis/{api_version}" if group_of(api_version) else f"/api/{api_version}"


class KubeScaleApi:
    """:class:`ScaleApi` over a :class:`KubeApi`."""

    def __init__(self, kube: KubeApi) -> None:
        self._kube = kube
        self._plurals: dict[tuple[str, str], str] = {}
        """(apiVersion, kind) -> plural, for kinds found through discovery."""

    # --- /scale -----------------------------------------------------------------------------------

    async def get_scale(self, namespace: str, ref: ScaleTargetRef) -> Scale:
        """The target's /scale subresource."""
        plural = await self._plural(ref.api_version, ref.kind)
        path = f"{_api_root(ref.api_version)}/namespaces/{namespace}/{plural}/{ref.name}/scale"
        body = await self._request(f"{ref.kind} {namespace}/{ref.name}", "GET", path)
        meta = body.get("metadata") or {}
        return Scale(
            target=ObjectRef(ref.api_version, ref.kind, namespace, ref.name, str(meta.get("uid", ""))),
            replicas=int((body.get("spec") or {}).get("replicas") or 0),
            resource_version=str(meta.get("resourceVersion", "")),
            path=path,
        )

    async def patch_scale(self, scale: Scale, replicas: int) -> int:
        """Merge-patch ``spec.replicas``, guarded by the resourceVersion read (409 -> ScaleConflict)."""
        body: dict[str, Any] = {"spec": {"replicas": replicas}}
        if scale.resource_version:
            # Someone else (a person, a rollout) changed replicas since we looked: decide again instead.
            body["metadata"] = {"resourceVersion": scale.resource_version}
        t = scale.target
        answer = await self._request(
            f"{t.kind} {t.namespace}/{t.name}",
            "PATCH",
            scale.path,
            body=body,
            params={"fieldManager": SCALER_FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )
        return int((answer.get("spec") or {}).get("replicas") or 0)

    async def _plural(self, api_version: str, kind: str) -> str:
        if known := _KNOWN_PLURALS.get((group_of(api_version), kind)):
            return known
        if cached := self._plurals.get((api_version, kind)):
            return cached
        listing = await self._request(f"API {api_version}", "GET", _api_root(api_version))
        resources = [r for r in listing.get("resources") or [] if isinstance(r, dict)]
        names = {r.get("name") for r in resources}
        for r in resources:
            name = str(r.get("name", ""))
            if r.get("kind") == kind and "/" not in name:
                if not r.get("namespaced"):
                    raise NotScalable(
                        f"{kind} ({api_version}) is cluster-scoped; a scale target is namespaced"
                    )
                if f"{name}/scale" not in names:
                    raise NotScalable(f"{kind} ({api_version}) has no /scale subresource")
                self._plurals[(api_version, kind)] = name
                return name
        raise NotScalable(f"the API server serves no kind {kind} in {api_version}")

    # --- HPAs -------------------------------------------------------------------------------------

    async def list_hpas(self, namespace: str) -> list[HpaRef]:
        """The namespace's HPAs (autoscaling/v2; autoscaling/v1 where v2 is not served)."""
        what = f"HPAs in {namespace}"
        try:
            listing = await self._request(
                what, "GET", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers"
            )
        except NotFound:
            listing = await self._request(
                what, "GET", f"/apis/autoscaling/v1/namespaces/{namespace}/horizontalpodautoscalers"
            )
        hpas = []
        for item in listing.get("items") or []:
            ref = (item.get("spec") or {}).get("scaleTargetRef") or {}
            hpas.append(
                HpaRef(
                    name=str((item.get("metadata") or {}).get("name", "")),
                    target_api_version=str(ref.get("apiVersion", "")),
                    target_kind=str(ref.get("kind", "")),
                    target_name=str(ref.get("name", "")),
                )
            )
        return hpas

    # --- policies ---------------------------------------------------------------------------------

    async def list_policies(self, namespace: str) -> list[JsonObject]:
        """The namespace's GPUMonitorPolicies (metadata, spec and status of each)."""
        listing = await self._request(
            f"GPUMonitorPolicies in {namespace}",
            "GET",
            policies_path(namespace),
        )
        return [item for item in listing.get("items") or [] if isinstance(item, dict)]

    # --- plumbing ---------------------------------------------------------------------------------

    async def _request(self, what: str, method: str, path: str, **kwargs: Any) -> JsonObject:
        """One request; the API's errors become ours (404 NotFound, 409 ScaleConflict)."""
        try:
            return await self._kube.request(method, path, **kwargs)
        except ApiError as exc:
            if exc.status == 404:
                raise NotFound(f"{what} not found", exc.status) from exc
            if exc.status == 409:
                raise ScaleConflict(f"{what} changed meanwhile", exc.status) from exc
            raise ScaleApiError(f"{what}: {exc}", exc.status) from exc

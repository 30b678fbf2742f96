"""The pods of one node by UID, listed from the API server: cgroups name pods by UID only.

Optional: without it, a process is attributed through the PodResources answer
alone (see :class:`~gpuwarden.agent.attribution.attributor.PodAttributor`). With it,
the agent's ServiceAccount needs ``list`` on ``pods`` (cluster-wide: the field
selector ``spec.nodeName`` narrows the answer, not the permission).

Every GPU node runs an agent, so the list is cheap for the API server by design: it
is answered from the watch cache (``resourceVersion=0``) and made only when someone
asked for a pod or container the last list did not know (a new pod, a restarted
container), or when it is ``max_age`` old, and never twice within ``min_interval``.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuwarden.agent.account import SERVICE_ACCOUNT_DIR, bearer, in_cluster_api
from gpuwarden.wire.node import PodRef

log = logging.getLogger(__name__)


class NodePodsError(RuntimeError):
    """The pod list could not be fetched or read; the previous list stays in use."""


class _Api(BaseModel):
    # Only the fields we read; the API server sends far more.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Metadata(_Api):
    uid: str
    name: str
    namespace: str
    annotations: dict[str, str] = Field(default_factory=dict)


# A static pod's cgroups carry its own UID; the API server shows a mirror pod with another,
# and the static one in this annotation.
_MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


class _ContainerStatus(_Api):
    name: str
    container_id: str = Field(default="", alias="containerID")
    """``<runtime>://<id>``; empty until the container has been created."""


class _PodIP(_Api):
    ip: str


class _PodStatus(_Api):
    pod_ips: list[_PodIP] = Field(default_factory=list, alias="podIPs")
    container_statuses: list[_ContainerStatus] = Field(default_factory=list, alias="containerStatuses")
    init_container_statuses: list[_ContainerStatus] = Field(
        default_factory=list, alias="initContainerStatuses"
    )
    ephemeral_container_statuses: list[_ContainerStatus] = Field(
        default_factory=list, alias="ephemeralContainerStatuses"
    )


class _Pod(_Api):
    metadata: _Metadata
    status: _PodStatus = Field(default_factory=_PodStatus)


class _PodList(_Api):
    items: list[_Pod]


class NodePods:
    """Pod UID → :class:`PodRef` and container ID → container name, for the pods of one node.

    Call it as a lookup (``node_pods(uid)``); :meth:`refresh` re-lists when that is
    due (see the module's docstring). The token is re-read on every list because the
    kubelet rotates projected tokens.
    """

    def __init__(
        self,
        node: str,
        api_server: str,
        *,
        token_path: str | os.PathLike[str] | None = SERVICE_ACCOUNT_DIR / "token",
        ca_path: str | os.PathLike[str] | None = SERVICE_ACCOUNT_DIR / "ca.crt",
        timeout: float = 10.0,
        max_age: float = 300.0,
        min_interval: float = 10.0,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node = node
        self._url = api_server.rstrip("/") + "/api/v1/pods"
        self._token_path = Path(token_path) if token_path is not None else None
        self._ca_path = Path(ca_path) if ca_path is not None else None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session_factory = session_factory or self._default_session
        self._session: aiohttp.ClientSession | None = None
        self._max_age = max_age
        self._min_interval = min_interval
        self._clock = clock
        self._pods: dict[str, PodRef] = {}
        self._containers: dict[str, str] = {}
        self._ips: dict[str, frozenset[str]] = {}
        self._listed_at: float | None = None
        self._tried_at: float | None = None
        # Keys (pod UIDs, container IDs) asked for that the last list did not know: a reason
        # to list again. One that two lists in a row did not know either (a container already
        # gone, a pod of another node) is settled: asking for it no longer triggers lists.
        # Two, because a container started a moment ago may not be in its pod's status yet.
        self._missed: set[str] = set()
        self._unknown_once: set[str] = set()
        self._settled: set[str] = set()
        self._settled_asked: set[str] = set()

    @classmethod
    def in_cluster(
        cls,
        node: str,
        *,
        timeout: float = 10.0,
        service_account_dir: str | os.PathLike[str] = SERVICE_ACCOUNT_DIR,
    ) -> NodePods | None:
        """Talk to the API server the pod runs under, as its ServiceAccount (the mounted token and CA).

        None, logged once, when there is no API server or no token to reach it with (the
        chart mounts one only with ``agent.podList.enabled``): attribution then relies on
        PodResources alone, which is a configuration, not an error.
        """
        api = in_cluster_api(service_account_dir, "no pod list; pods are attributed through PodResources")
        if api is None:
            return None
        url, account = api
        return cls(
            node,
            url,
            token_path=account / "token",
            ca_path=account / "ca.crt",
            timeout=timeout,
        )

    @property
    def url(self) -> str:
        """The pod list's URL, without the query."""
        return self._url

    def __call__(self, pod_uid: str) -> PodRef | None:
        """The pod with this UID on the node, as of the last successful list."""
        pod = self._pods.get(pod_uid)
        if pod is None:
            self._miss(pod_uid)
        return pod

    def addresses(self, pod_uid: str) -> tuple[PodRef, frozenset[str]] | None:
        """The pod with this UID on the node and its IPs (``status.podIPs``), as of the last list.

        What the pods' scrapes are held to (:mod:`gpuwarden.agent.scrape`): a pod's IPs as the API
        server says the kubelet gave them, on this node.
        """
        pod = self(pod_uid)
        return None if pod is None else (pod, self._ips.get(pod_uid, frozenset()))

    def container_name(self, container_id: str) -> str | None:
        """The name of the container with this runtime ID (the 64 hex digits, no ``runtime://``)."""
        name = self._containers.get(container_id)
        if name is None:
            self._miss(container_id)
        return name

    def _miss(self, key: str) -> None:
        if key in self._settled:
            self._settled_asked.add(key)
        else:
            self._missed.add(key)

    @property
    def due(self) -> bool:
        """Whether :meth:`refresh` would list now."""
        now = self._clock()
        if self._listed_at is None or self._tried_at is None:
            return self._tried_at is None or now - self._tried_at >= self._min_interval
        if now - self._tried_at < self._min_interval:
            return False
        return bool(self._missed) or now - self._listed_at >= self._max_age

    def __len__(self) -> int:
        return len(self._pods)

    async def refresh(self, *, force: bool = False) -> None:
        """List the node's pods if that is :attr:`due` (or ``force``d).

        Raises :class:`NodePodsError` when the list fails; the previous one stays in use.
        """
        if not (force or self.due):
            return
        self._tried_at = self._clock()
        pods = await self._list()
        known = {p.metadata.uid: p for p in pods}
        for p in pods:
            mirror_of = p.metadata.annotations.get(_MIRROR_ANNOTATION)
            if mirror_of:
                known.setdefault(mirror_of, p)
        self._pods = {
            uid: PodRef(namespace=p.metadata.namespace, name=p.metadata.name) for uid, p in known.items()
        }
        self._ips = {p.metadata.uid: frozenset(a.ip for a in p.status.pod_ips) for p in pods}
        self._containers = {
            s.container_id.partition("://")[2]: s.name
            for p in pods
            for s in (
                *p.status.container_statuses,
                *p.status.init_container_statuses,
                *p.status.ephemeral_container_statuses,
            )
            if "://" in s.container_id
        }
        still_unknown = {
            k for k in self._missed | self._settled_asked if k not in self._pods and k not in self._containers
        }
        self._settled = {k for k in still_unknown if k in self._unknown_once or k in self._settled}
        self._unknown_once = still_unknown - self._settled
        self._missed = set(self._unknown_once)  # asked once more, at the next due time
        self._settled_asked = set()
        self._listed_at = self._tried_at

    async def _list(self) -> list[_Pod]:
        if self._session is None:
            self._session = self._session_factory()
        headers = {"Accept": "application/json"}
        if self._token_path is not None:
            try:
                headers["Authorization"] = bearer(self._token_path)
            except OSError as exc:
                raise NodePodsError(f"cannot read the ServiceAccount token: {exc}") from None
        # resourceVersion=0: any recent state will do, so the API server answers from its
        # watch cache instead of etcd; this runs on every GPU node.
        params = {"fieldSelector": f"spec.nodeName={self._node}", "resourceVersion": "0"}
        try:
            async with self._session.get(
                self._url, params=params, headers=headers, timeout=self._timeout
            ) as response:
                body = await response.read()
                if response.status != 200:
                    raise NodePodsError(f"listing pods: HTTP {response.status}: {body[:200]!r}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NodePodsError(f"listing pods: {type(exc).__name__}: {exc}") from None
        try:
            return _PodList.model_validate_json(body).items
        except ValidationError as exc:
            raise NodePodsError(f"listing pods: unexpected answer: {exc.error_count()} errors") from None

    def _default_session(self) -> aiohttp.ClientSession:
        context = ssl.create_default_context(cafile=self._ca_path) if self._ca_path is not None else None
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context or True))

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

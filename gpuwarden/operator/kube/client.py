"""A minimal asyncio client for the few Kubernetes API calls Kopf does not make for us.

Kopf watches, indexes and runs handlers. The operator itself also needs
TokenReviews (to authenticate agents), status writes from a long-running daemon
(Kopf applies a daemon's ``patch`` only when the daemon function returns), its
Events (posted under names of their own: :mod:`.events`), its own pod's label,
reads of the peering object, and in sharded mode the replicas' Leases. Those go through this
client, which logs in as Kopf's fallback login does: in-cluster ServiceAccount first, else the
kubeconfig (:func:`connection_info`); ``gpuwarden report`` gives it the user's kubeconfig context.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from gpuwarden.clients import Credentials, failure, load_credentials, tls_context

__all__ = ["ApiError", "KubeApi", "connection_info"]

JsonObject = dict[str, Any]


class ApiError(Exception):
    """A request the API server refused or could not be reached for; ``status`` 0 when unreachable."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


def connection_info() -> Credentials:
    """The API server and credentials: the pod's ServiceAccount, else the kubeconfig (``$KUBECONFIG``
    or ``~/.kube/config``); a :class:`~gpuwarden.clients.LoginError` when neither is there."""
    return load_credentials(in_cluster_first=True)


def _tls(info: Credentials) -> ssl.SSLContext:
    return tls_context(
        ca_file=info.ca_file,
        ca_data=info.ca_data,
        insecure=info.insecure,
        cert_file=info.cert_file,
        cert_data=info.cert_data,
        key_file=info.key_file,
        key_data=info.key_data,
    )


class KubeApi:
    """JSON requests to one API server.

    Given :class:`~gpuwarden.clients.Credentials`, it uses them as they are. Given a login (a callable
    that returns them; :func:`connection_info` by default), it logs in at its first request, and again
    on a 401 (a rotated projected token) and once they expire (an exec plugin's token).
    """

    def __init__(
        self, login: Credentials | Callable[[], Credentials] = connection_info, *, timeout: float = 10.0
    ) -> None:
        self._login = None if isinstance(login, Credentials) else login
        self._info = login if isinstance(login, Credentials) else None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def credentials(self) -> Credentials:
        """The credentials in use (logging in first if it has not yet). An exec plugin blocks the
        event loop while it runs: once per credential, and in the operator only out of a cluster."""
        if self._info is None:
            assert self._login is not None
            self._info = self._login()
        return self._info

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            info = self.credentials
            tls = _tls(info) if info.server.startswith("https:") else False
            self._session = aiohttp.ClientSession(
                base_url=info.server.rstrip("/") + "/",
                headers=info.headers(),
                connector=aiohttp.TCPConnector(ssl=tls, limit=32),
                timeout=self._timeout,
            )
        return self._session

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JsonObject:
        """Send one request; return the decoded JSON object or raise :class:`ApiError`."""
        if self._login is not None and self._info is not None and self._info.expired(time.time()):
            await self._reload()
        for attempt in (1, 2):
            session = self._open()
            data = None if body is None else json.dumps(body)
            try:
                async with session.request(
                    method,
                    path.lstrip("/"),
                    data=data,
                    params=params,
                    headers={"Content-Type": content_type, "Accept": "application/json"},
                    server_hostname=self.credentials.tls_server_name,
                ) as rsp:
                    text = await rsp.text()
                    if rsp.status == 401 and attempt == 1 and self._login is not None:
                        await self._reload()
                        continue
                    if rsp.status >= 400:
                        raise ApiError(rsp.status, _status_message(text) or rsp.reason or "error")
                    return json.loads(text) if text else {}
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ApiError(0, f"{method} {path}: {failure(exc)}") from exc
        raise ApiError(401, "unauthorized after re-reading credentials")

    async def _reload(self) -> None:
        await self.close()
        self._info = None

    # -- the calls the operator makes --

    async def create_token_review(self, token: str, audiences: list[str]) -> JsonObject:
        """POST a TokenReview; return its ``status``."""
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences},
        }
        rsp = await self.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body=review)
        status = rsp.get("status")
        return status if isinstance(status, dict) else {}

    async def patch_status(
        self,
        group: str,
        version: str,
        plural: str,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        *,
        manager: str,
    ) -> JsonObject:
        """JSON-merge-patch an object's status subresource (keys not given are left alone)."""
        return await self.request(
            "PATCH",
            f"/apis/{group}/{version}/namespaces/{namespace}/{plural}/{name}/status",
            body={"status": status},
            params={"fieldManager": manager},
            content_type="application/merge-patch+json",
        )

    async def patch_pod_labels(
        self, namespace: str, name: str, labels: Mapping[str, str | None], *, manager: str
    ) -> JsonObject:
        """Set (or, with None, remove) labels of a pod."""
        return await self.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body={"metadata": {"labels": dict(labels)}},
            params={"fieldManager": manager},
            content_type="application/merge-patch+json",
        )

    async def get(self, path: str) -> JsonObject:
        """GET one object."""
        return await self.request("GET", path)

    async def patch_node_condition(
        self, node: str, condition: Mapping[str, Any], *, manager: str
    ) -> JsonObject:
        """Set one condition of a Node's status (a strategic merge: the other conditions stay)."""
        return await self.request(
            "PATCH",
            f"/api/v1/nodes/{node}/status",
            body={"status": {"conditions": [dict(condition)]}},
            params={"fieldManager": manager},
            content_type="application/strategic-merge-patch+json",
        )

    async def cordon_node(self, node: str, annotations: Mapping[str, str], *, manager: str) -> JsonObject:
        """Mark a Node unschedulable (``kubectl cordon``), with ``annotations`` saying who and why."""
        return await self.request(
            "PATCH",
            f"/api/v1/nodes/{node}",
            body={"metadata": {"annotations": dict(annotations)}, "spec": {"unschedulable": True}},
            params={"fieldManager": manager},
            content_type="application/merge-patch+json",
        )

    async def list_leases(self, namespace: str, selector: str) -> list[JsonObject]:
        """The Leases of ``namespace`` matching the label ``selector``."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        rsp = await self.request("GET", path, params={"labelSelector": selector})
        items = rsp.get("items")
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    async def renew_lease(self, namespace: str, lease: Mapping[str, Any], *, manager: str) -> JsonObject:
        """Merge-patch a Lease with ``lease`` (a whole object), creating it when it does not exist."""
        name = lease["metadata"]["name"]
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        try:
            return await self.request(
                "PATCH",
                f"{path}/{name}",
                body=lease,
                params={"fieldManager": manager},
                content_type="application/merge-patch+json",
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
        return await self.request("POST", path, body=lease, params={"fieldManager": manager})

    async def delete_lease(self, namespace: str, name: str) -> None:
        """Delete a Lease (gone already is fine)."""
        try:
            await self.request("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> JsonObject:
        """POST a core/v1 Event into ``namespace``."""
        return await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=event)


def _status_message(text: str) -> str:
    """The ``message`` of a metav1.Status body, else the raw text (shortened)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        return str(obj["message"])
    return text[:200]

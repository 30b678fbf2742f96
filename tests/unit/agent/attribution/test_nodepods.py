"""NodePods against a real HTTP server standing in for the API server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpuwarden.agent.attribution import NodePods, NodePodsError
from gpuwarden.wire.node import PodRef

UID_A = "0b0b0b0b-0000-4000-8000-00000000000a"
UID_B = "0b0b0b0b-0000-4000-8000-00000000000b"
UID_C = "0b0b0b0b-0000-4000-8000-00000000000c"


def _pod(uid: str, namespace: str, name: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {"nodeName": "gpu-node-1", "containers": []},
        "status": {"phase": "Running", **status},
    }


PODS = {
    "kind": "PodList",
    "apiVersion": "v1",
    "metadata": {"resourceVersion": "123"},
    "items": [
        _pod(
            UID_A,
            "ml",
            "trainer-0",
            containerStatuses=[
                {"name": "train", "containerID": f"containerd://{'a' * 64}", "ready": True},
                {"name": "logger", "containerID": f"cri-o://{'b' * 64}"},
                {"name": "waiting", "containerID": ""},  # not created yet
                {"name": "pending"},
            ],
            initContainerStatuses=[{"name": "fetch", "containerID": f"docker://{'c' * 64}"}],
        ),
        _pod(UID_B, "infer", "llm-0"),  # no status yet
    ],
}


class FakeApiServer:
    def __init__(self) -> None:
        self.status = 200
        self.body: bytes | None = None
        self.pods_list: dict[str, Any] = {**PODS, "items": list(PODS["items"])}
        self.requests: list[web.Request] = []

    async def pods(self, request: web.Request) -> web.Response:
        self.requests.append(request)
        if self.body is not None:
            return web.Response(status=self.status, body=self.body, content_type="application/json")
        return web.json_response(self.pods_list, status=self.status)


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()
    app = web.Application()
    app.router.add_get("/api/v1/pods", fake.pods)
    async with TestServer(app, host="127.0.0.1") as server:
        yield fake, str(server.make_url(""))


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("first-token\n")
    return path


@pytest.fixture
async def node_pods(api: tuple[FakeApiServer, str], token: Path) -> AsyncIterator[NodePods]:
    pods = NodePods("gpu-node-1", api[1], token_path=token, ca_path=None)
    yield pods
    await pods.close()


async def test_lists_the_nodes_pods(api: tuple[FakeApiServer, str], node_pods: NodePods) -> None:
    await node_pods.refresh()

    request = api[0].requests[0]
    assert request.query["fieldSelector"] == "spec.nodeName=gpu-node-1"
    assert request.query["resourceVersion"] == "0"
    assert request.headers["Authorization"] == "Bearer first-token"
    assert len(node_pods) == 2
    assert node_pods(UID_A) == PodRef(namespace="ml", name="trainer-0")
    assert node_pods(UID_B) == PodRef(namespace="infer", name="llm-0")
    assert node_pods("unknown") is None
    assert node_pods.container_name("a" * 64) == "train"
    assert node_pods.container_name("b" * 64) == "logger"
    assert node_pods.container_name("c" * 64) == "fetch"
    assert node_pods.container_name("") is None


async def test_token_is_reread_on_every_list(
    api: tuple[FakeApiServer, str], node_pods: NodePods, token: Path
) -> None:
    await node_pods.refresh()
    await asyncio.to_thread(token.write_text, "rotated-token")  # the kubelet rotates it
    await node_pods.refresh(force=True)

    assert [r.headers["Authorization"] for r in api[0].requests] == [
        "Bearer first-token",
        "Bearer rotated-token",
    ]


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [(403, b'{"kind":"Status","reason":"Forbidden"}', "HTTP 403"), (200, b"{not json", "unexpected answer")],
)
async def test_a_failed_list_keeps_the_last_one(
    api: tuple[FakeApiServer, str], node_pods: NodePods, status: int, body: bytes, message: str
) -> None:
    await node_pods.refresh()
    api[0].status, api[0].body = status, body

    with pytest.raises(NodePodsError, match=message):
        await node_pods.refresh(force=True)

    assert node_pods(UID_A) == PodRef(namespace="ml", name="trainer-0")


async def test_api_server_unreachable(token: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pods = NodePods("n", f"http://127.0.0.1:{port}", token_path=token, ca_path=None, timeout=5)
    try:
        with pytest.raises(NodePodsError, match="ClientConnectorError"):
            await pods.refresh()
    finally:
        await pods.close()


async def test_token_missing(api: tuple[FakeApiServer, str], tmp_path: Path) -> None:
    pods = NodePods("n", api[1], token_path=tmp_path / "absent", ca_path=None)
    with pytest.raises(NodePodsError, match="token"):
        await pods.refresh()
    assert api[0].requests == []


async def test_lists_only_when_asked_for_something_new_or_when_old(
    api: tuple[FakeApiServer, str], token: Path
) -> None:
    fake, url = api
    now = [0.0]
    pods = NodePods(
        "gpu-node-1", url, token_path=token, ca_path=None, min_interval=10, max_age=300, clock=lambda: now[0]
    )

    async def lists_at(t: float) -> int:
        now[0] = t
        before = len(fake.requests)
        await pods.refresh()
        return len(fake.requests) - before

    try:
        assert await lists_at(0) == 1  # the first list
        assert pods(UID_A) is not None
        assert await lists_at(20) == 0  # nothing new asked: no list

        fake.pods_list["items"].append(_pod(UID_C, "ml", "new-0"))
        assert pods(UID_C) is None  # a new pod's process showed up
        assert await lists_at(20) == 1
        assert pods(UID_C) == PodRef(namespace="ml", name="new-0")

        assert pods("ghost") is None  # never on this node
        assert await lists_at(25) == 0  # within min_interval of the last list
        assert await lists_at(30) == 1
        assert await lists_at(40) == 1  # asked once more: a brand-new container may lag its status
        assert pods("ghost") is None
        assert await lists_at(50) == 0  # settled: no more lists for it
        assert pods.container_name("d" * 64) is None  # a restarted container: new ID
        assert await lists_at(50) == 1
        assert await lists_at(60) == 1  # its second chance

        assert await lists_at(359) == 0
        assert await lists_at(360) == 1  # max_age since the last list
    finally:
        await pods.close()


async def test_a_failed_list_is_retried_after_min_interval(
    api: tuple[FakeApiServer, str], token: Path
) -> None:
    fake, url = api
    now = [0.0]
    pods = NodePods("n", url, token_path=token, ca_path=None, min_interval=10, clock=lambda: now[0])
    fake.status, fake.body = 503, b"{}"
    try:
        with pytest.raises(NodePodsError):
            await pods.refresh()
        now[0] = 5
        await pods.refresh()  # not due: no request, no error
        now[0] = 10
        fake.body = None
        fake.status = 200
        await pods.refresh()
    finally:
        await pods.close()

    assert len(fake.requests) == 2
    assert pods(UID_A) is not None


async def test_static_pods_are_found_by_their_own_uid(api: tuple[FakeApiServer, str], token: Path) -> None:
    fake, url = api
    static_uid = "5b4e8a6f9c3d2e1f0a9b8c7d6e5f4a3b"
    mirror = _pod(UID_C, "kube-system", "gpu-probe-node-1")
    mirror["metadata"]["annotations"] = {"kubernetes.io/config.mirror": static_uid}
    fake.pods_list["items"].append(mirror)
    pods = NodePods("n", url, token_path=token, ca_path=None)
    try:
        await pods.refresh()
    finally:
        await pods.close()

    assert pods(static_uid) == pods(UID_C) == PodRef(namespace="kube-system", name="gpu-probe-node-1")


def test_in_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    pods = NodePods.in_cluster("n", service_account_dir=tmp_path)
    assert pods is not None
    assert pods.url == "https://10.96.0.1:443/api/v1/pods"

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    pods = NodePods.in_cluster("n", service_account_dir=tmp_path)
    assert pods is not None
    assert pods.url == "https://[fd00::1]:443/api/v1/pods"


def test_no_pod_list_without_a_token_or_a_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The chart mounts the API token only with agent.podList.enabled; the env is there regardless.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert NodePods.in_cluster("n", service_account_dir=tmp_path) is None

    (tmp_path / "token").write_text("t")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert NodePods.in_cluster("n", service_account_dir=tmp_path) is None

"""KubeApi's login: an exec plugin's credential kept until it expires, fetched again then and on a 401.

A real HTTP server stands in for the API server and records each request's token; the plugin is a
real process, which numbers the tokens it prints (``t1``, ``t2``...).
"""

from __future__ import annotations

import base64
import functools
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import cast

import kopf
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from tls_support import make_pki

from gpuwarden.clients import load_credentials
from gpuwarden.operator.handlers import login
from gpuwarden.operator.kube import ApiError, KubeApi


class ApiServer:
    """Answers ``GET /api/v1/namespaces/x``; 401 to the tokens in :attr:`refused`."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.refused: set[str] = set()

    async def namespace(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.tokens.append(token)
        if token in self.refused:
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "Namespace", "metadata": {"name": "x"}})


@pytest.fixture
async def server() -> AsyncIterator[tuple[ApiServer, str]]:
    api = ApiServer()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/x", api.namespace)
    async with TestServer(app, host="127.0.0.1") as test_server:
        yield api, str(test_server.make_url("")).rstrip("/")


def counting_plugin(tmp_path: Path, server: str, expires: str) -> Path:
    """A kubeconfig whose user's exec plugin prints token ``t<run>``, expiring at ``expires``."""
    script = tmp_path / "plugin"
    runs = tmp_path / "runs"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "n = len(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text('x' * n)\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',\n"
        f"                  'status': {{'token': f't{{n}}', 'expirationTimestamp': {expires!r}}}}}))\n"
    )
    script.chmod(0o755)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(script),
            "interactiveMode": "Never",
        }
    }
    config = tmp_path / "config"
    config.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "main", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "main",
            }
        )
    )
    return config


def api_for(config: Path) -> KubeApi:
    return KubeApi(functools.partial(load_credentials, str(config)))


async def test_a_credential_is_kept_until_it_expires(tmp_path: Path, server: tuple[ApiServer, str]) -> None:
    api_server, url = server
    kube = api_for(counting_plugin(tmp_path, url, "2099-01-01T00:00:00Z"))
    try:
        for _ in range(3):
            await kube.get("/api/v1/namespaces/x")
    finally:
        await kube.close()
    assert api_server.tokens == ["t1", "t1", "t1"]


async def test_an_expired_credential_is_fetched_again(tmp_path: Path, server: tuple[ApiServer, str]) -> None:
    api_server, url = server
    kube = api_for(counting_plugin(tmp_path, url, "2001-01-01T00:00:00Z"))
    try:
        for _ in range(3):
            await kube.get("/api/v1/namespaces/x")
    finally:
        await kube.close()
    # Expired as soon as it came: each request after the first runs the plugin again.
    assert api_server.tokens == ["t1", "t2", "t3"]


async def test_a_refused_credential_is_fetched_again_once(
    tmp_path: Path, server: tuple[ApiServer, str]
) -> None:
    api_server, url = server
    api_server.refused = {"t1"}
    kube = api_for(counting_plugin(tmp_path, url, "2099-01-01T00:00:00Z"))
    try:
        assert (await kube.get("/api/v1/namespaces/x"))["kind"] == "Namespace"
        api_server.refused = {"t2", "t3"}
        with pytest.raises(ApiError) as caught:
            await kube.get("/api/v1/namespaces/x")
    finally:
        await kube.close()
    assert api_server.tokens == ["t1", "t2", "t2", "t3"]
    assert caught.value.status == 401


async def test_an_inline_ca_and_a_tls_server_name(tmp_path: Path) -> None:
    """A kubeconfig's ``certificate-authority-data`` is trusted, and ``tls-server-name`` is the name
    verified (an API server reached by address whose certificate names only ``kubernetes.default``)."""
    pki = make_pki(tmp_path, names=("kubernetes.default",))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki.cert_file, pki.key_file)
    api_server = ApiServer()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/x", api_server.namespace)
    server = TestServer(app, host="127.0.0.1", scheme="https")
    await server.start_server(ssl=tls)
    try:
        cluster = {
            "server": str(server.make_url("")).rstrip("/"),
            "certificate-authority-data": base64.b64encode(pki.ca_file.read_bytes()).decode(),
        }
        for name, answer in ((None, "not trusted"), ("kubernetes.default", "Namespace")):
            named = cluster | ({"tls-server-name": name} if name else {})
            config = tmp_path / "config"
            config.write_text(
                yaml.safe_dump(
                    {
                        "clusters": [{"name": "c", "cluster": named}],
                        "users": [{"name": "u", "user": {"token": "t"}}],
                        "contexts": [{"name": "main", "context": {"cluster": "c", "user": "u"}}],
                        "current-context": "main",
                    }
                )
            )
            kube = api_for(config)
            try:
                got = (await kube.get("/api/v1/namespaces/x"))["kind"]
            except ApiError as exc:
                got = exc.message
            finally:
                await kube.close()
            assert answer in got
    finally:
        await server.close()
    assert api_server.tokens == ["t"]


def test_kopf_logs_in_as_the_api_client_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kopf's login handler gives Kopf the exec plugin's token and its expiry (Kopf's own kubeconfig
    reader would send no token at all)."""
    monkeypatch.setenv(
        "KUBECONFIG", str(counting_plugin(tmp_path, "https://10.0.0.1:6443", "2030-01-01T00:00:00Z"))
    )
    # Kopf's decorator types it as an activity handler of Kopf's kwargs, of which it reads none.
    info = cast(Callable[[], kopf.ConnectionInfo], login)()
    assert (info.server, info.scheme, info.token) == ("https://10.0.0.1:6443", "Bearer", "t1")
    assert info.expiration is not None
    assert info.expiration.timestamp() == 1893456000.0

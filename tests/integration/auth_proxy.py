"""A reverse proxy in front of a real Prometheus that lets in what a managed one lets in.

Prometheus itself checks no bearer token and no tenant (its ``web.config.file`` has basic auth
only), and managed ones (Mimir, Cortex, Thanos behind kube-rbac-proxy, the clouds' own) want both.
:class:`AuthProxy` is that front, real HTTP over TLS: it answers 401 to a request without a bearer
token the API server authenticates (a TokenReview, as kube-rbac-proxy asks), 401 with Mimir's
"no org id" to one without the tenant header, and forwards the rest (``/api/v1/...``, query
string and all) to Prometheus, answering with Prometheus's status and body.

It runs on an event loop of its own in a thread, so that a test (and the ``gpuwarden report``
processes it starts) can use it synchronously.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import Any

import aiohttp
from aiohttp import web
from controlplane import ControlPlane, free_port

TENANT_HEADER = "X-Scope-OrgID"


class AuthProxy:
    """``https://127.0.0.1:<port>`` in front of ``upstream``, for bearer tokens that ``cp`` authenticates
    and the tenant ``tenant``; serving ``cp``'s own serving certificate (its CA is ``cp.ca_path``)."""

    def __init__(self, upstream: str, cp: ControlPlane, tenant: str) -> None:
        assert cp.pki is not None, "a started control plane"
        self.upstream = upstream.rstrip("/")
        self.cp = cp
        self.tenant = tenant
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.requests: list[tuple[str, int]] = []
        """Each request's path and the status answered."""
        self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._tls.load_cert_chain(cp.pki.serving_cert, cp.pki.serving_key)
        self._api_tls = ssl.create_default_context(cafile=str(cp.ca_path))
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="auth-proxy", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        app = web.Application()
        app.router.add_get("/api/v1/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._tls).start()

    async def _authenticated(self, token: str) -> bool:
        assert self._session is not None
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        async with self._session.post(
            f"{self.cp.server}/apis/authentication.k8s.io/v1/tokenreviews",
            json=review,
            headers={"Authorization": f"Bearer {self.cp.admin_token}"},
            ssl=self._api_tls,
        ) as rsp:
            answer: dict[str, Any] = await rsp.json()
        return bool(answer.get("status", {}).get("authenticated"))

    async def _forward(self, request: web.Request) -> web.Response:
        response = await self._answer(request)
        self.requests.append((request.path, response.status))
        return response

    async def _answer(self, request: web.Request) -> web.Response:
        assert self._session is not None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not token or not await self._authenticated(token):
            return web.Response(status=401, text="Unauthorized\n")
        if request.headers.get(TENANT_HEADER) != self.tenant:
            return web.Response(status=401, text="no org id\n")
        async with self._session.get(self.upstream + request.rel_url.path_qs) as rsp:
            body = await rsp.read()
            return web.Response(status=rsp.status, body=body, content_type=rsp.content_type)

    def stop(self) -> None:
        """Stop serving (the port then refuses connections) and end the thread."""

        async def close() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

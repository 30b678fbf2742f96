"""ReportSender over TLS against a real aiohttp server with a certificate for the ingest Service's name.

The server listens on 127.0.0.1, which its certificate does not name, as a sharded operator's
replica at its pod IP does not: the sender checks the name it is given (``server_name``).
Failures are awaited through the session's trace, never slept on; backoffs run on looptime.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from tls_support import SERVICE_NAME, Pki, make_pki

from gpuwarden.agent.sender import ReportSender
from gpuwarden.wire.node import GpuSample, Snapshot, parse_report


def snap(i: int) -> Snapshot:
    return Snapshot(timestamp=1_700_000_000.0 + i, gpus=[GpuSample(uuid="GPU-0", index=0)])


class Server:
    """An ingest endpoint on 127.0.0.1 (TLS with ``pki``, plain HTTP without); ``answer`` scripts it."""

    def __init__(self, pki: Pki | None) -> None:
        self.pki = pki
        self.bodies: list[bytes] = []
        self.answer: Callable[[], web.Response] = lambda: web.json_response({"accepted": 1})
        self.changed = asyncio.Condition()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/reports", self._ingest)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        tls = None
        if self.pki is not None:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(self.pki.cert_file, self.pki.key_file)
        await web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=tls).start()
        self.port = self.runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"{'https' if self.pki else 'http'}://127.0.0.1:{self.port}/v1/reports"

    async def _ingest(self, request: web.Request) -> web.Response:
        body = await request.read()
        parse_report(body)
        self.bodies.append(body)
        async with self.changed:
            self.changed.notify_all()
        return self.answer()

    async def wait_for(self, n: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.bodies) >= n)


class Failures:
    """Requests that ended in an exception (a refused handshake), as an awaitable count."""

    def __init__(self) -> None:
        self.seen: list[BaseException] = []
        self.changed = asyncio.Condition()
        self.config = aiohttp.TraceConfig()
        self.config.on_request_exception.append(self._failed)

    async def _failed(self, session: aiohttp.ClientSession, context: SimpleNamespace, params: Any) -> None:
        self.seen.append(params.exception)
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, n: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.seen) >= n)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(trace_configs=[self.config])


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "operator")


@pytest.fixture
async def servers() -> AsyncIterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        if server.runner is not None:
            await server.runner.cleanup()


async def serve(servers: list[Server], pki: Pki | None) -> Server:
    server = Server(pki)
    await server.start()
    servers.append(server)
    return server


async def running(sender: ReportSender) -> asyncio.Task[None]:
    sender.submit(snap(0))
    return asyncio.create_task(sender.run())


def errors(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("gpuwarden_agent_report_errors_total", {"reason": reason}) or 0.0


@pytest.mark.looptime
async def test_delivers_to_a_certificate_for_the_service_name_when_told_that_name(
    pki: Pki, servers: list[Server]
) -> None:
    server = await serve(servers, pki)
    sender = ReportSender(
        server.url,
        "gpu-node-1",
        None,
        registry=CollectorRegistry(),
        tls=ssl.create_default_context(cafile=pki.ca_file),
        server_name=SERVICE_NAME,
    )
    task = await running(sender)
    try:
        await server.wait_for(1)
    finally:
        task.cancel()
    assert parse_report(server.bodies[0]).node == "gpu-node-1"


@pytest.mark.looptime
@pytest.mark.parametrize("case", ["another CA", "no server name", "system trust store"])
async def test_refuses_an_operator_it_cannot_verify(
    case: str, pki: Pki, tmp_path: Path, servers: list[Server]
) -> None:
    """Nothing is sent, the token included, to a certificate that is not the operator's."""
    server = await serve(servers, pki)
    registry = CollectorRegistry()
    failures = Failures()
    ca = make_pki(tmp_path / "other").ca_file if case == "another CA" else pki.ca_file
    sender = ReportSender(
        server.url,
        "gpu-node-1",
        None,
        registry=registry,
        tls=None if case == "system trust store" else ssl.create_default_context(cafile=ca),
        server_name=None if case == "no server name" else SERVICE_NAME,
        session_factory=failures.session,
        rng=random.Random(1),
    )
    task = await running(sender)
    try:
        await failures.wait_for(2)  # refused, then refused again after the backoff
    finally:
        task.cancel()
    assert all(isinstance(e, aiohttp.ClientConnectorCertificateError) for e in failures.seen)
    assert errors(registry, "tls") >= 2
    assert server.bodies == []
    assert sender.buffered == 1


@pytest.mark.looptime
async def test_a_plain_http_sender_is_refused_by_a_tls_operator(pki: Pki, servers: list[Server]) -> None:
    server = await serve(servers, pki)
    registry = CollectorRegistry()
    failures = Failures()
    plain = server.url.replace("https://", "http://")
    sender = ReportSender(
        plain, "gpu-node-1", None, registry=registry, session_factory=failures.session, rng=random.Random(1)
    )
    task = await running(sender)
    try:
        await failures.wait_for(1)
    finally:
        task.cancel()
    assert errors(registry, "connection") >= 1
    assert server.bodies == []


@pytest.mark.looptime
async def test_a_421_never_leads_from_https_to_plain_http(
    pki: Pki, servers: list[Server], tmp_path: Path
) -> None:
    """A replica's answer cannot make the agent send its token in clear."""
    service = await serve(servers, pki)
    plain_owner = await serve(servers, None)
    service.answer = lambda: web.json_response(
        {"reason": "NotOwner", "owner": "op-b", "url": plain_owner.url}, status=421
    )
    registry = CollectorRegistry()
    token = tmp_path / "token"
    token.write_text("secret-token")
    sender = ReportSender(
        service.url,
        "gpu-node-1",
        token,
        registry=registry,
        tls=ssl.create_default_context(cafile=pki.ca_file),
        server_name=SERVICE_NAME,
        rng=random.Random(1),
    )
    task = await running(sender)
    try:
        await service.wait_for(2)  # the 421, then the retry to the Service after a backoff
    finally:
        task.cancel()
    assert plain_owner.bodies == []
    assert sender.owner_url is None
    assert errors(registry, "misdirected") >= 1

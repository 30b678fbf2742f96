"""gpuwarden.serving on real TCP sockets: idle and slow connections closed, connections capped by
evicting the least recently heard from, slow requests 408, accept() failures counted."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from gpuwarden.serving import (
    ACCEPT_OUT_OF_RESOURCE,
    FD_RESERVE,
    ConnectionLimiter,
    connection_cap,
    raise_fd_limit,
    serve,
)

FAILSAFE_S = 10.0
"""Only so that a broken test fails instead of hanging; every wait ends on an event well before."""

GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _read_all(request: web.Request) -> web.Response:
    return web.Response(text=str(len(await request.read())))


class Served:
    def __init__(self, runner: web.AppRunner, limiter: ConnectionLimiter) -> None:
        self.runner = runner
        self.limiter = limiter
        self.port = runner.addresses[0][1]

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def _serve(limit: int = 100, **kw: Any) -> Served:
    app = web.Application()
    app.router.add_get("/ok", _ok)
    app.router.add_post("/body", _read_all)
    limiter = ConnectionLimiter(limit)
    return Served(await serve(app, "127.0.0.1", 0, limiter=limiter, **kw), limiter)


@pytest.fixture
async def short() -> AsyncIterator[Served]:
    served = await _serve(idle_timeout=0.3, request_timeout=0.5)
    yield served
    await served.runner.cleanup()


async def _closed(reader: asyncio.StreamReader) -> bool:
    """True once the server closes the connection (EOF or reset); TimeoutError after the failsafe."""
    try:
        async with asyncio.timeout(FAILSAFE_S):
            while await reader.read(4096):
                pass
    except ConnectionResetError:
        pass
    return True


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(GET)
    async with asyncio.timeout(FAILSAFE_S):
        status = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        await reader.readexactly(2)  # "ok"
    return status


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(short: Served) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await short.connect()
    opened = loop.time()
    assert await _closed(reader)
    assert 0.25 <= loop.time() - opened < 3.0
    writer.close()


async def test_a_connection_stuck_half_way_through_its_headers_is_closed(short: Served) -> None:
    loop = asyncio.get_running_loop()
    reader, writer = await short.connect()
    writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    opened = loop.time()
    assert await _closed(reader)
    assert loop.time() - opened < 3.0
    writer.close()


async def test_a_kept_alive_connection_is_closed_once_idle(short: Served) -> None:
    reader, writer = await short.connect()
    assert await _answer(reader, writer) == b"HTTP/1.1 200 OK\r\n"
    assert await _closed(reader)
    writer.close()


async def test_a_body_that_never_finishes_gets_408(short: Served) -> None:
    reader, writer = await short.connect()
    writer.write(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
    async with asyncio.timeout(FAILSAFE_S):
        assert await reader.readline() == b"HTTP/1.1 408 Request Timeout\r\n"
    assert await _closed(reader)
    writer.close()


async def test_at_the_cap_a_new_connection_closes_the_least_recently_heard_from() -> None:
    served = await _serve(limit=3, idle_timeout=60)
    try:
        first_r, first_w = await served.connect()
        victim_r, victim_w = await served.connect()
        third_r, third_w = await served.connect()
        # Heard from in this order (each answered, so each accepted): the second is the least recent.
        for r, w in ((victim_r, victim_w), (first_r, first_w), (third_r, third_w)):
            assert await _answer(r, w) == b"HTTP/1.1 200 OK\r\n"
        new_r, new_w = await served.connect()
        assert await _answer(new_r, new_w) == b"HTTP/1.1 200 OK\r\n"
        assert await _closed(victim_r)
        assert served.limiter.evicted == 1
        assert len(served.limiter) == 3
        # The others are still served.
        assert await _answer(first_r, first_w) == b"HTTP/1.1 200 OK\r\n"
        assert await _answer(third_r, third_w) == b"HTTP/1.1 200 OK\r\n"
        for w in (first_w, victim_w, third_w, new_w):
            w.close()
    finally:
        await served.runner.cleanup()


async def test_a_flood_of_idle_connections_leaves_a_sending_client_served() -> None:
    served = await _serve(limit=20, idle_timeout=60)
    try:
        flood = [await served.connect() for _ in range(200)]
        reader, writer = await served.connect()
        assert await _answer(reader, writer) == b"HTTP/1.1 200 OK\r\n"
        assert len(served.limiter) <= 20
        assert served.limiter.evicted >= 180
        for _, w in flood:
            w.close()
        writer.close()
    finally:
        await served.runner.cleanup()


async def test_accept_running_out_of_descriptors_is_counted_and_still_logged() -> None:
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        limiter = ConnectionLimiter(10)
        limiter.count_accept_errors(loop)
        loop.call_exception_handler({"message": ACCEPT_OUT_OF_RESOURCE, "exception": OSError(24, "EMFILE")})
        loop.call_exception_handler({"message": "something else"})
        assert limiter.accept_errors == 1
        assert [c["message"] for c in seen] == [ACCEPT_OUT_OF_RESOURCE, "something else"]
    finally:
        loop.set_exception_handler(previous)


def test_the_cap_stays_below_the_descriptor_limit() -> None:
    assert connection_cap(1_048_576) == 20_000
    assert connection_cap(1_048_576, 50_000) == 50_000
    assert connection_cap(20_000, 50_000) == 20_000 - FD_RESERVE
    assert connection_cap(1024) == 768  # a quarter kept when that is less than the reserve
    assert connection_cap(1024, 100) == 100
    assert connection_cap(2) == 2
    with pytest.raises(ValueError, match="at least 1"):
        ConnectionLimiter(0)


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowered = min(soft, 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
        now = raise_fd_limit()
        assert now > lowered
        assert now == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

"""HookClient against a real Unix socket: delivery, the agent absent, its restart, backoff, fork."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_socket_support import LineServer

from gpuwarden.hook import HookClient
from gpuwarden.hook.client import BACKOFF_MIN_S

LINE = b'{"v":1,"timestamp":1764770000.5,"devices":[]}\n'


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "hook.sock"


@pytest.fixture
def server(sock_path: Path) -> Iterator[LineServer]:
    srv = LineServer(sock_path)
    yield srv
    srv.close()


def test_a_line_arrives_and_the_kernel_names_the_sender(server: LineServer) -> None:
    client = HookClient(str(server.path))
    assert client.send(LINE)
    conn = server.accept()
    assert conn.line() == LINE
    assert conn.pid == os.getpid()
    assert client.send(LINE)  # the same connection
    assert conn.line() == LINE
    assert (client.unanswered, client.sent, client.dropped, client.connects) == (2, 0, 0, 1)


def test_the_socket_path_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_HOOK_SOCKET", "/tmp/elsewhere.sock")
    assert HookClient().path == "/tmp/elsewhere.sock"
    monkeypatch.delenv("GPUWARDEN_HOOK_SOCKET")
    assert HookClient().path == "/run/gpuwarden/hook.sock"


def test_no_agent_drops_quietly_and_backs_off(sock_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    client = HookClient(str(sock_path), clock=clock)
    caplog.set_level("INFO", "gpuwarden.hook")
    assert not client.send(LINE)  # nothing listens: no exception, a drop
    assert not client.send(LINE)
    assert client.dropped == 2
    assert len([r for r in caplog.records if "no agent" in r.message]) == 1

    server = LineServer(sock_path)
    try:
        clock.now += BACKOFF_MIN_S / 2
        assert not client.send(LINE)  # still backing off: no connect attempt at all
        assert not server.pending()
        clock.now += BACKOFF_MIN_S / 2
        assert client.send(LINE)
        assert server.accept().line() == LINE
        assert (client.unanswered, client.dropped) == (1, 3)
    finally:
        server.close()


def test_backoff_doubles_while_the_agent_stays_away(sock_path: Path) -> None:
    clock = Clock()
    client = HookClient(str(sock_path), clock=clock)
    client.send(LINE)  # fails; next try after 1 s
    clock.now += BACKOFF_MIN_S
    client.send(LINE)  # fails again; next try after 2 s
    server = LineServer(sock_path)
    try:
        clock.now += BACKOFF_MIN_S
        assert not client.send(LINE)
        assert not server.pending()
        clock.now += BACKOFF_MIN_S
        assert client.send(LINE)
    finally:
        server.close()


def test_reconnects_within_the_send_after_the_agent_restarts(sock_path: Path) -> None:
    first = LineServer(sock_path)
    client = HookClient(str(sock_path))
    assert client.send(LINE)
    assert first.accept().line() == LINE
    first.close()  # the agent goes away with its connection
    second = LineServer(sock_path)
    try:
        assert client.send(LINE)  # the broken write is retried once on a new connection
        assert second.accept().line() == LINE
        assert (client.lost, client.unanswered, client.dropped, client.connects) == (1, 1, 0, 2)
    finally:
        second.close()


def test_a_forked_child_connects_as_itself(server: LineServer) -> None:
    client = HookClient(str(server.path))
    assert client.send(LINE)
    parent_conn = server.accept()
    assert parent_conn.line() == LINE

    child = os.fork()
    if child == 0:  # pragma: no cover (the child's exit status is the assertion)
        os._exit(0 if client.send(b'{"child":true}\n') else 1)
    child_conn = server.accept()
    assert child_conn.pid == child  # not the parent's connection, which speaks for the parent
    assert child_conn.line() == b'{"child":true}\n'
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    assert client.send(LINE)  # the parent's connection is untouched by the child's close
    assert parent_conn.line() == LINE

"""The hook socket on a real Unix socket: the kernel names the writer, and every bound holds."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.agent.hooksocket import HookReadings, HookServer, HookSocketError, peer_of
from gpuwarden.hook.client import REFUSED, TAKEN, HookClient
from gpuwarden.wire.hook import MAX_LINE_BYTES, MessageError, parse_message

NOW = 1_800_000_000.0
FAILSAFE_S = 10.0
"""A client's wait for answers: only so that a broken test fails instead of hanging."""


def line(**fields: Any) -> bytes:
    message = {"v": 1, "timestamp": NOW, **fields}
    return json.dumps(message).encode() + b"\n"


class Recorder:
    """The server's events, and a way to wait for them (no sleeps)."""

    def __init__(self) -> None:
        self.messages = 0
        self.refusals: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Event()

    def accepted(self) -> None:
        self.messages += 1
        self._changed.set()

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1
        self._changed.set()

    def poke(self) -> None:
        self._changed.set()

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not done():
                self._changed.clear()
                await self._changed.wait()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def clock() -> Clock:
    return Clock(NOW)


@pytest.fixture
def monotonic() -> Clock:
    return Clock(100.0)


class WatchedReadings(HookReadings):
    """Readings that tell the recorder when a connection ended (so a test can wait for it)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def closed(self, pid: int, now: float) -> None:
        super().closed(pid, now)
        self._recorder.poke()


@pytest.fixture
async def server(
    socket_dir: Path, recorder: Recorder, clock: Clock, monotonic: Clock
) -> AsyncIterator[HookServer]:
    hooks = HookServer(
        socket_dir / "hook.sock",
        WatchedReadings(recorder),
        events=recorder,
        max_connections=3,
        clock=clock,
        monotonic=monotonic,
    )
    await hooks.start()
    try:
        yield hooks
    finally:
        await hooks.close()


async def connect(server: HookServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(server.path))


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server ended the connection (EOF after any answers, or a reset for what it left unread)."""
    try:
        async with asyncio.timeout(10):
            await reader.read()
            return reader.at_eof()
    except ConnectionResetError:
        return True


# ----------------------------------------------------------------------------- the writer's identity


async def test_the_kernel_names_the_writer_of_this_process(server: HookServer, recorder: Recorder) -> None:
    _, writer = await connect(server)
    writer.write(line(step=7))
    await recorder.until(lambda: recorder.messages == 1)
    (reading,) = server.readings.fresh(NOW).values()
    assert (reading.pid, reading.uid) == (os.getpid(), os.getuid())
    assert reading.message.step == 7
    writer.close()


CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode())
print("sent", flush=True)
sys.stdin.read()  # keep the connection until the test is done
"""


@contextlib.asynccontextmanager
async def child_writing(path: Path, text: bytes) -> AsyncIterator[asyncio.subprocess.Process]:
    """Another process that connects to ``path``, writes ``text`` and holds its connection until the
    block ends."""
    child = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", CLIENT, str(path), text.decode()),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None
    try:
        yield child
    finally:
        child.stdin.close()
        assert await child.wait() == 0


async def test_a_message_from_another_process_is_that_processs_whatever_it_claims(
    server: HookServer, recorder: Recorder
) -> None:
    # A "pid" of its own choosing would be refused as an unknown field; nothing else names a process.
    async with child_writing(server.path, line(step=3)) as child:
        await recorder.until(lambda: recorder.messages == 1)
        assert set(server.readings.fresh(NOW)) == {child.pid}
        assert child.pid != os.getpid()


def test_a_pid_in_the_message_is_refused() -> None:
    with pytest.raises(MessageError, match="pid"):
        parse_message(line(pid=1))


# --------------------------------------------------------------------------------------- bounds


async def test_a_line_of_64_kib_is_read_and_a_longer_one_ends_the_connection(
    server: HookServer, recorder: Recorder
) -> None:
    short = line()
    exactly = short[:-1] + b" " * (MAX_LINE_BYTES - len(short) + 1) + b"\n"  # JSON may end in spaces
    assert len(exactly) == MAX_LINE_BYTES + 1  # the newline is not counted
    reader, writer = await connect(server)
    writer.write(exactly)
    await recorder.until(lambda: recorder.messages == 1)
    writer.write(exactly[:-1] + b" \n")
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    assert await closed_by_server(reader)
    assert recorder.refusals == {"tooLong": 1}
    assert recorder.messages == 1


async def test_beyond_the_rate_messages_are_dropped_and_counted(
    server: HookServer, recorder: Recorder, monotonic: Clock
) -> None:
    _, writer = await connect(server)
    writer.write(b"".join(line(step=i) for i in range(15)))
    await recorder.until(lambda: recorder.messages + recorder.refusals["rate"] == 15)
    assert (recorder.messages, recorder.refusals["rate"]) == (10, 5)
    assert server.readings.fresh(NOW)[os.getpid()].message.step == 9  # the newest kept
    monotonic.now += 0.5  # half a second: five more
    writer.write(b"".join(line(step=i) for i in range(20, 26)))
    await recorder.until(lambda: recorder.messages + recorder.refusals["rate"] == 21)
    assert (recorder.messages, recorder.refusals["rate"]) == (15, 6)
    writer.close()


@pytest.mark.parametrize(
    "bad",
    [
        b"not json\n",
        b"\n",
        b'{"v": 2, "timestamp": 1800000000}\n',
        b'{"v": 1.0, "timestamp": 1800000000}\n',
        b'{"v": 1, "timestamp": 1800000000, "host_rss_bytes": 1}\n',  # camelCase only
        b'{"v": 1, "timestamp": 1800000000, "hostRssBytes": -1}\n',
        b'{"v": 1, "timestamp": 1800000000, "devices": [{"uuid": "GPU-a"}, {"uuid": "GPU-a"}]}\n',
        b'{"v": 1, "timestamp": 1800000000, "sites": [{"file": "a.py", "line": 1, "size_bytes": 1, '
        b'"growthBytes": 1, "count": 1}]}\n',
        b"\xff\xfe\n",
    ],
)
async def test_a_malformed_line_is_dropped_and_counted_and_the_connection_goes_on(
    bad: bytes, server: HookServer, recorder: Recorder
) -> None:
    _, writer = await connect(server)
    writer.write(bad + line(step=1))
    await recorder.until(lambda: recorder.messages == 1)
    assert recorder.refusals == {"malformed": 1}
    writer.close()


async def test_connections_beyond_the_bound_are_closed_at_once(
    server: HookServer, recorder: Recorder
) -> None:
    held = [await connect(server) for _ in range(3)]
    for _, writer in held:
        writer.write(line())
    await recorder.until(lambda: recorder.messages == 3)
    reader, _ = await connect(server)
    assert await closed_by_server(reader)
    assert recorder.refusals == {"tooManyConnections": 1}
    held[0][1].close()
    await recorder.until(lambda: server.connections == 2)
    _, writer = await connect(server)
    writer.write(line())
    await recorder.until(lambda: recorder.messages == 4)
    for _, w in [*held[1:], (None, writer)]:
        w.close()


# ------------------------------------------------------------------------------------- readings


async def test_a_reading_is_kept_while_its_connection_is_open_and_forgotten_a_minute_after(
    server: HookServer, recorder: Recorder, clock: Clock
) -> None:
    _, writer = await connect(server)
    writer.write(line(step=1))
    await recorder.until(lambda: recorder.messages == 1)
    readings = server.readings
    assert readings.fresh(NOW + 61) == {}  # too old to attach
    assert len(readings) == 1  # but kept: the connection is open
    assert set(readings.fresh(NOW + 60)) == {os.getpid()}
    clock.now = NOW + 10
    writer.close()
    await recorder.until(lambda: server.connections == 0)
    assert len(readings) == 1  # closed, but not a minute old
    assert readings.fresh(NOW + 61) == {}
    assert len(readings) == 0  # closed and stale: forgotten


def test_readings_keep_the_newest_per_pid_and_are_bounded() -> None:
    from gpuwarden.agent.hooksocket import HookReading

    readings = HookReadings(capacity=3)
    message = parse_message(line())
    readings.opened(1)
    for pid in (1, 2, 3, 4, 5):
        readings.put(HookReading(pid=pid, uid=0, message=message, received_at=NOW + pid))
    # pids 2..5 have no open connection: the oldest of them went first; 1's connection is open.
    assert set(readings.fresh(NOW)) == {1, 4, 5}


def test_a_timestamp_from_the_future_reads_as_when_it_arrived() -> None:
    from gpuwarden.agent.hooksocket import HookReading

    reading = HookReading(pid=1, uid=0, message=parse_message(line(timestamp=NOW + 3600)), received_at=NOW)
    assert reading.read_at == NOW
    readings = HookReadings()
    readings.put(reading)
    assert readings.fresh(NOW + 61) == {}


# ---------------------------------------------------------------------------------- the file


async def test_the_socket_is_open_to_every_user_and_removed_on_close(socket_dir: Path) -> None:
    hooks = HookServer(socket_dir / "hook.sock", HookReadings())
    await hooks.start()
    info = os.lstat(hooks.path)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o666
    await hooks.close()
    assert not hooks.path.exists()


async def test_a_missing_directory_is_created_searchable_by_all(socket_dir: Path) -> None:
    old = os.umask(0o077)
    try:
        hooks = HookServer(socket_dir / "run" / "gpuwarden" / "hook.sock", HookReadings())
        await hooks.start()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(hooks.path.parent).st_mode) == 0o755
    await hooks.close()


async def test_a_stale_socket_is_replaced(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(path))
    left.close()  # an agent that died: the file stays, nobody listens
    hooks = HookServer(path, HookReadings())
    await hooks.start()
    _, writer = await asyncio.open_unix_connection(str(path))
    writer.close()
    await hooks.close()


async def test_a_live_socket_is_not_taken_over(socket_dir: Path) -> None:
    first = HookServer(socket_dir / "hook.sock", HookReadings())
    await first.start()
    try:
        with pytest.raises(HookSocketError, match="another process listens"):
            await HookServer(first.path, HookReadings()).start()
    finally:
        await first.close()


async def test_a_symlink_or_a_file_at_the_path_is_refused_and_left_alone(socket_dir: Path) -> None:
    target = socket_dir / "precious"
    target.write_text("keep me")
    target.chmod(0o600)
    path = socket_dir / "hook.sock"
    path.symlink_to(target)
    with pytest.raises(HookSocketError, match="not a socket"):
        await HookServer(path, HookReadings()).start()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_text() == "keep me"
    with pytest.raises(HookSocketError, match="not a socket"):
        await HookServer(target, HookReadings()).start()


async def test_a_directory_others_may_write_is_refused(socket_dir: Path) -> None:
    shared = socket_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(HookSocketError, match="another user could replace the socket"):
        await HookServer(shared / "hook.sock", HookReadings()).start()
    shared.chmod(0o1777)  # sticky, like /tmp: nobody else may remove or rename what is ours
    hooks = HookServer(shared / "hook.sock", HookReadings())
    await hooks.start()
    await hooks.close()


async def test_closing_ends_open_connections_quietly(
    socket_dir: Path, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    hooks = HookServer(socket_dir / "hook.sock", WatchedReadings(recorder), events=recorder)
    await hooks.start()
    reader, writer = await connect(hooks)
    writer.write(line())
    await recorder.until(lambda: recorder.messages == 1)
    await hooks.close()
    assert await closed_by_server(reader)
    assert hooks.connections == 0
    # Cancelled connection tasks made asyncio 3.11 log "Exception in callback" at ERROR.
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    writer.close()


# ------------------------------------------------------------------ peers, idleness, honest books


async def _hooks(socket_dir: Path, recorder: Recorder, **kw: Any) -> HookServer:
    hooks = HookServer(socket_dir / "hook.sock", WatchedReadings(recorder), events=recorder, **kw)
    await hooks.start()
    return hooks


async def test_one_peer_holding_connections_locks_out_only_itself(
    socket_dir: Path, recorder: Recorder
) -> None:
    # This process is one container, the child another (the per-peer key by PID, for the test).
    me = os.getpid()
    hooks = await _hooks(
        socket_dir, recorder, max_connections=8, max_per_peer=3, peer=lambda pid, uid: str(pid == me)
    )
    try:
        held = [await connect(hooks) for _ in range(3)]
        for _, writer in held:
            writer.write(line())
        await recorder.until(lambda: recorder.messages == 3)
        reader, _ = await connect(hooks)
        assert await closed_by_server(reader)
        assert recorder.refusals == {"peerConnections": 1}
        async with child_writing(hooks.path, line(step=3)) as child:
            await recorder.until(lambda: recorder.messages == 4)
            assert child.pid in hooks.readings.fresh(time.time())
        for _, writer in held:
            writer.close()
    finally:
        await hooks.close()


def test_a_peer_is_its_cgroup_or_else_its_uid(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("0::/kubepods/burstable/podabc/cri-containerd-123.scope\n")
    assert peer_of(42, 1000, tmp_path) == "cgroup:/kubepods/burstable/podabc/cri-containerd-123.scope"
    assert peer_of(43, 1000, tmp_path) == "uid:1000"  # gone, or not ours to read
    assert peer_of(os.getpid(), os.getuid()).startswith("cgroup:")


async def test_a_connection_that_sends_no_line_is_closed_once_idle(
    socket_dir: Path, recorder: Recorder
) -> None:
    hooks = await _hooks(socket_dir, recorder, idle_timeout=0.2)
    try:
        reader, writer = await connect(hooks)
        writer.write(b'{"v": 1, ')  # half a line, then nothing
        assert await closed_by_server(reader)
        assert recorder.refusals == {"idle": 1}
        writer.close()
    finally:
        await hooks.close()


async def test_refused_lines_do_not_keep_a_connection_open(socket_dir: Path, recorder: Recorder) -> None:
    """Issue 45: one empty line every 50 s kept a connection past the 120 s idle timeout, though every
    such line was refused; eight containers of 32 such connections each locked out every other hook."""
    hooks = await _hooks(socket_dir, recorder, idle_timeout=0.3)
    try:
        reader, writer = await connect(hooks)
        writer.write(line())
        assert await reader.readexactly(1) == TAKEN
        refused = 0
        async with asyncio.timeout(FAILSAFE_S):  # on 45's main this kept it open until the failsafe
            while True:
                writer.write(b"\n")  # refused at once (malformed), answered, written again
                try:
                    answer = await reader.read(1)
                except ConnectionResetError:
                    break  # closed with the last line unread
                if not answer:
                    break
                assert answer == REFUSED
                refused += 1
        assert refused > 10
        assert recorder.refusals["idle"] == 1
        assert recorder.refusals["malformed"] + recorder.refusals["rate"] == refused
        writer.close()
    finally:
        await hooks.close()


async def test_at_the_cap_a_new_container_takes_a_place_of_the_one_holding_the_most(
    socket_dir: Path, recorder: Recorder
) -> None:
    """Issue 45: containers holding their 32 connections each filled the 256 in all, and every other
    container's hook was locked out. The places are shared: a new container gets one of the greediest's,
    as long as that one holds two more than the newcomer would."""
    peers = iter(["a", "a", "a", "b", "c", "c", "d"])  # by order of accept (one connection at a time)
    hooks = await _hooks(socket_dir, recorder, max_connections=4, max_per_peer=3, peer=lambda *_: next(peers))
    try:
        held = []
        for step in range(4):  # a holds three, b one: the cap
            reader, writer = await connect(hooks)
            writer.write(line(step=step))
            assert await reader.readexactly(1) == TAKEN
            held.append((reader, writer))
        reader, writer = await connect(hooks)  # c: a's first (longest without a line) makes room
        writer.write(line(step=9))
        assert await reader.readexactly(1) == TAKEN
        assert await closed_by_server(held[0][0])
        assert recorder.refusals == {"tooManyConnections": 1}
        assert hooks.connections == 4
        held.append((reader, writer))
        for i, step in ((1, 10), (2, 11), (3, 12)):  # the others go on
            held[i][1].write(line(step=step))
            assert await held[i][0].readexactly(1) == TAKEN
        late, _ = await connect(hooks)  # c again: a holds two, b and c one: it would take a's as its own
        assert await closed_by_server(late)
        assert recorder.refusals == {"tooManyConnections": 2}
        reader, writer = await connect(hooks)  # d, new: a's second place is its
        writer.write(line(step=13))
        assert await reader.readexactly(1) == TAKEN
        assert await closed_by_server(held[1][0])  # a's longest without a line taken
        assert recorder.refusals == {"tooManyConnections": 3}
        held.append((reader, writer))
        for _, w in held:
            w.close()
    finally:
        await hooks.close()


async def test_the_rate_is_per_process_so_reconnecting_per_line_does_not_refill_it(
    server: HookServer, recorder: Recorder, monotonic: Clock
) -> None:
    for i in range(15):
        reader, writer = await connect(server)
        writer.write(line(step=i))
        assert await reader.readexactly(1) in (TAKEN, REFUSED)  # answered: read before the next
        writer.close()
    assert (recorder.messages, recorder.refusals["rate"]) == (10, 5)
    monotonic.now += 0.5  # half a second: five more, on a new connection
    reader, writer = await connect(server)
    writer.write(b"".join(line(step=i) for i in range(20, 26)))
    assert await reader.readexactly(6) == TAKEN * 5 + REFUSED
    assert (recorder.messages, recorder.refusals["rate"]) == (15, 6)
    writer.close()


async def test_every_line_is_answered_taken_or_refused(server: HookServer, recorder: Recorder) -> None:
    reader, writer = await connect(server)
    writer.write(line(step=1) + b"not json\n" + line(step=2))
    assert await reader.readexactly(3) == TAKEN + REFUSED + TAKEN
    writer.close()


async def test_a_real_client_knows_what_the_agent_took(socket_dir: Path, recorder: Recorder) -> None:
    hooks = await _hooks(socket_dir, recorder)
    try:
        client = HookClient(str(hooks.path), timeout_s=FAILSAFE_S)
        for i in range(15):  # ten a second are taken, the rest refused
            assert await asyncio.to_thread(client.send, line(step=i))
        await asyncio.to_thread(client.close)
        assert (client.sent, client.taken, client.refused, client.lost, client.dropped) == (15, 10, 5, 0, 0)
    finally:
        await hooks.close()


async def test_a_real_client_locked_out_by_the_agent_counts_nothing_as_taken(
    socket_dir: Path, recorder: Recorder
) -> None:
    hooks = await _hooks(socket_dir, recorder, max_per_peer=1)
    try:
        _, hog = await connect(hooks)  # this process's one connection, held
        hog.write(line())
        await recorder.until(lambda: recorder.messages == 1)
        client = HookClient(str(hooks.path), timeout_s=FAILSAFE_S)
        for i in range(10):
            await asyncio.to_thread(client.send, line(step=i))
        await asyncio.to_thread(client.close)
        assert recorder.messages == 1  # the agent took none of the client's
        assert client.taken == 0
        assert client.sent == 0  # nor read any
        assert client.refused + client.lost + client.dropped == 10
        assert client.unanswered == 0
        hog.close()
    finally:
        await hooks.close()

"""The agent's end of the training hook's channel: a Unix stream socket, the writer named by the kernel.

:class:`HookServer` accepts connections on ``--hook-socket`` and reads one hook message
(:mod:`gpuwarden.wire.hook`) per line. Who wrote a line is what ``SO_PEERCRED`` said at
accept: the connecting process's PID in the agent's PID namespace (the host's: the agent runs with
``hostPID``) and its UID. Nothing in a message names a process, so a process can only ever speak
for itself; :class:`HookReadings` keeps the newest message per PID for the sampler's hook stage
(:mod:`gpuwarden.agent.hookattach`).

Each line is answered with one byte, :data:`~gpuwarden.hook.client.TAKEN` (``+``) or
:data:`~gpuwarden.hook.client.REFUSED` (``-``), so that the hook knows what the agent kept
(:class:`~gpuwarden.hook.client.HookClient` counts them); a connection refused outright is closed
without a word, which the hook sees as its end.

Bounds, each refusal counted by reason (:data:`REFUSALS`): a line over 64 KiB ends its connection
(``tooLong``); an unparsable or invalid one is refused (``malformed``); beyond ``rate`` lines a second
from one process (its PID, over all its connections and across reconnecting) the extra ones are
refused unread (``rate``); beyond ``max_per_peer`` connections open from one peer (the container
its process runs in, by cgroup; its UID where the cgroup cannot be read) a new one is closed at
once (``peerConnections``). The ``max_connections`` in all are shared: at the cap, a new connection
of a peer that holds fewer than another peer less one takes the place of that other peer's
connection that has gone longest without a line taken (closed, ``tooManyConnections``), so a new
container always gets one while fewer than ``max_connections`` containers hold any; else the new
one is closed (``tooManyConnections``). A connection that has no line *taken* for ``idle_timeout``
seconds is closed (``idle``; a hook writes every few seconds, and reconnects when it writes again):
refused lines, empty ones included, do not keep it open. So is one that does not read its answers
(``unread``); a peer the kernel cannot name in this PID namespace (PID 0), or whose PID NVML lists
on no GPU (judged by the hook stage), is ``unknownProcess``.

A connection is credited to the process that opened it: a child that inherits the socket writes
as its parent (the same container, so the same pod).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuwarden.hook.client import REFUSED, TAKEN
from gpuwarden.wire.hook import (
    MAX_LINE_BYTES,
    REQUESTS_VERSION,
    HookAnswer,
    HookMessage,
    MessageError,
    parse_message,
)

log = logging.getLogger(__name__)

REFUSALS = (
    "malformed",
    "tooLong",
    "rate",
    "peerConnections",
    "tooManyConnections",
    "idle",
    "unread",
    "unknownProcess",
)
"""The reasons of ``gpuwarden_agent_hook_refused_total{reason}``."""

MAX_AGE = 60.0
"""A reading older than this (seconds) is no longer attached, and forgotten once its connection closed."""
MAX_CONNECTIONS = 256
MAX_PER_PEER = 32
"""Connections open at once from one container (or UID): a pod's processes, eight ranks and their
workers, with room to spare; one container can then lock out no more than itself."""
MESSAGES_PER_SECOND = 10.0
"""Per process; a hook sends one message every few seconds, so this is only a guard."""
IDLE_TIMEOUT = 120.0
"""Seconds a connection may go without a line taken."""
MAX_UNREAD = 4096
"""Answer bytes a peer may leave unread before its connection is closed."""

ASK_TIMEOUT = 60.0
"""How long :meth:`HookServer.ask` waits for the hook's answer: it comes with the hook's next reading
(every 5 s by default, at once when the hook reads in a thread of its own)."""
OPS = ("record", "snapshot")
"""What the agent may ask a hook (docs/hook.md, "Requests")."""

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class HookSocketError(OSError):
    """The socket cannot be created at its path; the message says why."""


class HookEvents(Protocol):
    """What the server and the hook stage count (:class:`gpuwarden.agent.metrics.HookMetrics`)."""

    def accepted(self) -> None:
        """One message parsed and kept."""

    def refused(self, reason: str) -> None:
        """One message or connection refused, for ``reason`` (one of :data:`REFUSALS`)."""


class _NoEvents:
    def accepted(self) -> None:
        pass

    def refused(self, reason: str) -> None:
        pass


@dataclass(frozen=True, slots=True)
class HookReading:
    """A message as the agent received it, with the writer the kernel named."""

    pid: int
    uid: int
    message: HookMessage
    received_at: float
    """The agent's clock (seconds since the epoch) when the line arrived."""

    @property
    def read_at(self) -> float:
        """When the hook read these: its own timestamp, but never later than the line arrived."""
        return min(self.message.timestamp, self.received_at)


class HookReadings:
    """The newest reading per PID, and which PIDs still have a connection open.

    A PID is forgotten once it has no connection open and its reading is older than ``max_age``.
    At most ``capacity`` PIDs are kept: beyond, the oldest reading of a closed connection goes
    first (open connections are fewer than that, so theirs always stay). Used on the event loop only.
    """

    def __init__(self, *, max_age: float = MAX_AGE, capacity: int = 4 * MAX_CONNECTIONS) -> None:
        self.max_age = max_age
        self._capacity = capacity
        self._readings: dict[int, HookReading] = {}
        self._open: dict[int, int] = {}  # pid → connections open

    def opened(self, pid: int) -> None:
        """A connection of ``pid`` was accepted."""
        self._open[pid] = self._open.get(pid, 0) + 1

    def closed(self, pid: int, now: float) -> None:
        """A connection of ``pid`` ended."""
        left = self._open.get(pid, 0) - 1
        if left > 0:
            self._open[pid] = left
        else:
            self._open.pop(pid, None)
        self._forget_stale(now)

    def put(self, reading: HookReading) -> None:
        """Keep ``reading`` as its PID's newest."""
        self._readings.pop(reading.pid, None)  # re-inserted last: the dict stays in order of arrival
        self._readings[reading.pid] = reading
        self._forget_stale(reading.received_at)
        while len(self._readings) > self._capacity:
            closed = next((pid for pid in self._readings if pid not in self._open), None)
            if closed is None:
                break
            del self._readings[closed]

    def newest(self, pid: int) -> HookReading | None:
        """``pid``'s newest reading, however old."""
        return self._readings.get(pid)

    def drop(self, pid: int) -> None:
        """Forget ``pid``'s reading (its next message is judged afresh)."""
        self._readings.pop(pid, None)

    def __len__(self) -> int:
        return len(self._readings)

    def fresh(self, now: float) -> dict[int, HookReading]:
        """The readings no older than ``max_age`` at ``now``, by PID (forgetting the stale of closed ones)."""
        self._forget_stale(now)
        return {pid: r for pid, r in self._readings.items() if now - r.read_at <= self.max_age}

    def _forget_stale(self, now: float) -> None:
        stale = [
            pid
            for pid, r in self._readings.items()
            if pid not in self._open and now - r.read_at > self.max_age
        ]
        for pid in stale:
            del self._readings[pid]


class _Bucket:
    """A token bucket: ``rate`` a second, as many at once."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._clock = clock
        self._tokens = rate
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + max(0.0, now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class _Buckets:
    """One :class:`_Bucket` per PID, kept while the PID has a connection open and for a second after
    (by then a bucket would be full again), so that reconnecting does not refill it."""

    def __init__(
        self, rate: float, clock: Callable[[], float], *, capacity: int = 4 * MAX_CONNECTIONS
    ) -> None:
        self._rate = rate
        self._clock = clock
        self._capacity = capacity
        self._open: dict[int, tuple[_Bucket, int]] = {}  # pid → (bucket, connections open)
        self._released: OrderedDict[int, tuple[_Bucket, float]] = OrderedDict()  # pid → (bucket, when)

    def acquire(self, pid: int) -> _Bucket:
        """``pid``'s bucket, for one more connection of it."""
        now = self._clock()
        while self._released:
            oldest, (_, at) = next(iter(self._released.items()))
            if now - at < 1.0 and len(self._released) <= self._capacity:
                break
            del self._released[oldest]
        held = self._open.get(pid)
        if held is not None:
            bucket, count = held
        else:
            released = self._released.pop(pid, None)
            bucket, count = (released[0] if released else _Bucket(self._rate, self._clock)), 0
        self._open[pid] = (bucket, count + 1)
        return bucket

    def release(self, pid: int) -> None:
        """One connection of ``pid`` ended."""
        bucket, count = self._open[pid]
        if count > 1:
            self._open[pid] = (bucket, count - 1)
            return
        del self._open[pid]
        self._released[pid] = (bucket, self._clock())

    def __len__(self) -> int:
        return len(self._open) + len(self._released)


def peer_of(pid: int, uid: int, proc: Path = Path("/proc")) -> str:
    """Who a connection's process speaks for, for the per-peer limit: its cgroup (its container, on a
    node: every process of a pod's container shares it), or its UID when that cannot be read."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return f"uid:{uid}"
    # cgroup v2: one line, "0::/path"; v1: one per hierarchy, joined (the same container throughout).
    return "cgroup:" + ";".join(line.split(":", 2)[-1] for line in text.splitlines() if line)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that connected ``sock``, from the kernel (``SO_PEERCRED``).

    The PID is as this process's PID namespace sees it; 0 when the peer lives in a namespace
    this one cannot see into.
    """
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


@dataclass(eq=False, slots=True)
class _Connection:
    """One open connection, as the shared cap sees it."""

    writer: asyncio.StreamWriter
    peer: str
    taken_at: float
    """The event loop's time of its last line taken (of its accept, before the first)."""
    evicted: bool = False
    """Closed to make room for another peer's: no longer counted."""


class HookServer:
    """Listens on ``path`` and files what hooks write into ``readings``.

    ``clock`` stamps arrivals (seconds since the epoch, the clock messages' timestamps are on);
    ``monotonic`` paces the per-process rate; ``peer`` names a connection's peer from its PID and
    UID (:func:`peer_of`). :meth:`start` creates the socket, :meth:`close`
    stops accepting, ends the open connections and removes the socket file.
    """

    def __init__(
        self,
        path: Path,
        readings: HookReadings,
        *,
        events: HookEvents | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_PER_PEER,
        rate: float = MESSAGES_PER_SECOND,
        idle_timeout: float = IDLE_TIMEOUT,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        peer: Callable[[int, int], str] = peer_of,
    ) -> None:
        self.path = path
        self.readings = readings
        self._events: HookEvents = events or _NoEvents()
        self._max_connections = max_connections
        self._max_per_peer = max_per_peer
        self._idle_timeout = idle_timeout
        self._clock = clock
        self._buckets = _Buckets(rate, monotonic)
        self._peer = peer
        self._per_peer: dict[str, int] = {}
        self._open = 0
        """Connections counted against the caps (those evicted and still closing are not)."""
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file we made
        self._writers: dict[int, asyncio.StreamWriter] = {}
        """Each PID's newest connection: where a request to it goes."""
        self._ids = itertools.count(1)
        self._asked: dict[int, tuple[int, asyncio.Future[HookAnswer]]] = {}
        """Requests written and not answered yet: id → (pid, the asker's future)."""

    @property
    def connections(self) -> int:
        """Connections open now (counted against the caps)."""
        return self._open

    async def start(self) -> None:
        """Create the socket file and start accepting; :class:`HookSocketError` says why it cannot."""
        _prepare_directory(self.path.parent)
        _remove_stale(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # bind() never follows a symlink: it fails if anything appeared at the path since.
            sock.bind(str(self.path))
            # Any process on the node may connect (0666; the directory is 0755 and ours, so nobody
            # else can swap the file). That is safe because a connection proves nothing by its
            # content: the kernel names the writer (SO_PEERCRED), and what it writes is attached to
            # that process's own GPU entries only. Pods' processes run as arbitrary UIDs.
            os.chmod(self.path, 0o666)
            info = os.lstat(self.path)
            self._identity = (info.st_dev, info.st_ino)
            self._server = await asyncio.start_unix_server(self._accept, sock=sock, limit=MAX_LINE_BYTES)
        except OSError as exc:
            sock.close()
            raise HookSocketError(f"cannot listen on {self.path}: {exc}") from None

    async def close(self) -> None:
        """Stop accepting, end every connection, remove the socket file (if it is still ours)."""
        if self._server is not None:
            self._server.close()
        # Closed, not cancelled: each reader then sees its end of file and its task ends on its own
        # (asyncio 3.11 logs a cancelled connection task as an error).
        for connection in self._connections.values():
            connection.writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) == self._identity:
            os.unlink(self.path)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            pid, uid = peer_credentials(writer.get_extra_info("socket"))
            if pid <= 0:
                self._events.refused("unknownProcess")
                return
            peer = self._peer(pid, uid)
            held = self._per_peer.get(peer, 0)
            if held >= self._max_per_peer:
                self._events.refused("peerConnections")
                return
            if self._open >= self._max_connections:
                victim = self._victim(held)
                if victim is None:
                    self._events.refused("tooManyConnections")
                    return
                self._release(victim)
                victim.evicted = True
                victim.writer.close()  # its reader sees the end and its task finishes on its own
                self._events.refused("tooManyConnections")
            task = asyncio.current_task()
            assert task is not None  # asyncio runs every connection callback in a task of its own
            connection = _Connection(writer, peer, asyncio.get_running_loop().time())
            self._connections[task] = connection
            self._per_peer[peer] = held + 1
            self._open += 1
            self.readings.opened(pid)
            bucket = self._buckets.acquire(pid)
            self._writers[pid] = writer
            try:
                await self._read(reader, connection, pid, uid, bucket)
            finally:
                if self._writers.get(pid) is writer:
                    del self._writers[pid]
                del self._connections[task]
                if not connection.evicted:
                    self._release(connection)
                self._buckets.release(pid)
                self.readings.closed(pid, self._clock())
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _victim(self, held: int) -> _Connection | None:
        """At the cap, the connection a peer holding ``held`` may take the place of: of the peer holding
        the most, if that is more than ``held + 1``, the one longest without a line taken."""
        most = max(self._per_peer.values(), default=0)
        if most <= held + 1:
            return None
        peers = {peer for peer, count in self._per_peer.items() if count == most}
        candidates = (c for c in self._connections.values() if not c.evicted and c.peer in peers)
        return min(candidates, key=lambda c: c.taken_at, default=None)

    def _release(self, connection: _Connection) -> None:
        """``connection`` no longer counts against the caps."""
        self._open -= 1
        left = self._per_peer.pop(connection.peer) - 1
        if left:
            self._per_peer[connection.peer] = left

    async def _read(
        self, reader: asyncio.StreamReader, connection: _Connection, pid: int, uid: int, bucket: _Bucket
    ) -> None:
        logged = False
        writer = connection.writer
        loop = asyncio.get_running_loop()
        while True:
            try:
                # From the last line taken, not the last line: refused ones keep nothing open.
                async with asyncio.timeout_at(connection.taken_at + self._idle_timeout):
                    line = await reader.readuntil(b"\n")
            except TimeoutError:
                self._events.refused("idle")
                return
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip():
                    self._events.refused("malformed")  # the writer left without ending its line
                return
            except asyncio.LimitOverrunError:
                self._events.refused("tooLong")
                log.info("hook connection of pid %d: a line over %d bytes; closed", pid, MAX_LINE_BYTES)
                return
            answer = self._take(line, pid, uid, bucket, quiet=logged)
            if answer is None:
                answer, logged = REFUSED, True
            elif answer == TAKEN:
                connection.taken_at = loop.time()
            writer.write(answer)
            if writer.transport.get_write_buffer_size() > MAX_UNREAD:
                self._events.refused("unread")
                return

    def _take(self, line: bytes, pid: int, uid: int, bucket: _Bucket, *, quiet: bool) -> bytes | None:
        """TAKEN or REFUSED for one line; None when refused as malformed (logged unless ``quiet``)."""
        if not bucket.take():
            self._events.refused("rate")
            return REFUSED
        try:
            message = parse_message(line)
        except MessageError as exc:
            self._events.refused("malformed")
            if not quiet:  # once a connection: a broken hook writes the same error every time
                log.info("hook connection of pid %d (uid %d): %s; dropped", pid, uid, exc)
            return None
        self.readings.put(HookReading(pid=pid, uid=uid, message=message, received_at=self._clock()))
        for answer in message.answers:
            asked = self._asked.get(answer.id)
            if asked is not None and asked[0] == pid and not asked[1].done():  # only the one asked answers
                asked[1].set_result(answer)
        self._events.accepted()
        return TAKEN

    async def ask(self, pid: int, op: str, *, wait: float = ASK_TIMEOUT) -> HookAnswer:
        """Ask ``pid``'s hook to carry out ``op`` (one of :data:`OPS`) and wait for its answer.

        Never hangs and never raises for the hook's sake: a process with no hook reading, a hook that
        announced no ``requests`` (an older one, or a job that did not opt in), one no longer connected
        or one that does not answer within ``wait`` seconds is answered here, ``refused`` with the reason.
        """
        reading = self.readings.newest(pid)
        if reading is None:
            return refusal(0, "unknownProcess: no hook reading from this process")
        if reading.message.requests is None:
            return refusal(
                0, "notSupported: this hook takes no requests (an older hook, or the job did not opt in)"
            )
        writer = self._writers.get(pid)
        if writer is None or writer.is_closing():
            return refusal(0, "notConnected: the hook has no connection open")
        rid = next(self._ids)
        future: asyncio.Future[HookAnswer] = asyncio.get_running_loop().create_future()
        self._asked[rid] = (pid, future)
        request = {"v": REQUESTS_VERSION, "id": rid, "op": op}
        writer.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")
        try:
            async with asyncio.timeout(wait):
                return await future
        except TimeoutError:
            return refusal(rid, f"noAnswer: none within {wait:g}s")
        finally:
            del self._asked[rid]


def refusal(rid: int, reason: str) -> HookAnswer:
    """A ``refused`` answer the agent gives on the hook's behalf."""
    return HookAnswer.model_validate({"id": rid, "status": "refused", "reason": reason[:256]})


def _prepare_directory(directory: Path) -> None:
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o755)
        os.chmod(directory, 0o755)  # mkdir's mode passes through the umask; connecting needs x for all
    info = directory.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise HookSocketError(f"{directory} is not a directory")
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
    if info.st_uid not in (0, os.getuid()) or writable_by_others:
        raise HookSocketError(
            f"{directory} is not this user's or root's alone (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}): another user could replace the socket; choose another path"
        )


def _remove_stale(path: Path) -> None:
    """Remove a socket file nobody listens on; refuse anything else at ``path`` (never following a link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise HookSocketError(
            f"{path} exists and is not a socket ({stat.filemode(info.st_mode)}); not removing it"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        os.unlink(path)  # left by an agent that did not stop cleanly
    else:
        raise HookSocketError(f"another process listens on {path}")
    finally:
        probe.close()

"""Sends the hook's lines to the node agent's Unix socket, without ever holding up or failing the job.

The agent learns who is writing from the socket itself (``SO_PEERCRED``, fixed at ``connect``), so
a process that forked (a data-loader worker, a ``multiprocessing`` child) must not write on the
connection it inherited: it would speak as its parent. The client notices the PID change and
connects anew.

The agent answers every line with one byte, :data:`TAKEN` or :data:`REFUSED` (over its rate, or
malformed), and closes a connection it will not serve (too many from this container, idle too
long). The client reads the answers as they come, without ever waiting for them in :meth:`send`,
so its books say what the agent kept, not only what was written: ``taken``, ``refused``, and
``lost`` (written on a connection that ended before the agent answered); ``sent`` is what the agent
read, the answered lines alone (a line written to a connection the agent closed unread is lost).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

DEFAULT_SOCKET = "/run/gpuwarden/hook.sock"
SOCKET_ENV = "GPUWARDEN_HOOK_SOCKET"
SEND_TIMEOUT_S = 0.05
"""The longest a connect or a write may hold the training loop: a local socket whose reader keeps up
takes a line at once, so only a stuck agent ever reaches it (the reading is then dropped)."""
TAKEN = b"+"
"""The agent's answer to a line it kept."""
REFUSED = b"-"
"""The agent's answer to a line it refused."""
MAX_REQUEST_BYTES = 4096
"""A request line longer than this is dropped."""
MAX_PENDING_REQUESTS = 16
"""Requests kept until the hook takes them; the agent asks one thing at a time."""
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0

log = logging.getLogger("gpuwarden.hook")


class HookClient:
    """One connection to the agent; :meth:`send` delivers a line or drops it, and never raises.

    After a failed connect the next attempt waits ``BACKOFF_MIN_S``, doubling up to ``BACKOFF_MAX_S``;
    the readings offered meanwhile are dropped (counted in ``dropped``). A connection that broke (the
    agent restarted, or closed it) is replaced at once, once, within the same :meth:`send`.

    The books: of the lines written to a connection, the agent answered ``taken`` and ``refused``
    (together :attr:`sent`), ``lost`` went with a connection that ended first, and :attr:`unanswered`
    are on the way (answered by the time of a later :meth:`send`); ``dropped`` were never written.
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        timeout_s: float = SEND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.timeout_s = timeout_s
        self.dropped = 0
        self.taken = 0
        self.refused = 0
        self.lost = 0
        self.connects = 0
        self._waiting = 0  # lines written on this connection that the agent has not answered yet
        self._clock = clock
        self._sock: socket.socket | None = None
        self._pid = os.getpid()
        self._next_attempt = 0.0
        self._backoff = BACKOFF_MIN_S
        self._said_absent = False
        self.requests: list[bytes] = []
        """Request lines the agent wrote (docs/hook.md, "Requests"), for the hook to take and answer."""
        self._request: bytearray | None = None  # a request line begun, not ended yet

    @property
    def sent(self) -> int:
        """Lines the agent read: those it answered, taken or refused."""
        return self.taken + self.refused

    @property
    def unanswered(self) -> int:
        """Lines written on the open connection that the agent has not answered yet."""
        return self._waiting

    def _close(self) -> None:
        if self._sock is not None:
            # In a forked child this closes the child's copy only; the parent's connection stays.
            self._sock.close()
            self._sock = None
        self.lost += self._waiting
        self._waiting = 0
        self._request = None

    def _read_answers(self, wait_s: float = 0.0) -> bool:
        """Count the answers that came (waiting up to ``wait_s`` for all of them); False once the
        agent has closed the connection."""
        assert self._sock is not None
        deadline = self._clock() + wait_s
        while True:
            try:
                if wait_s > 0 and self._waiting:
                    self._sock.settimeout(max(0.0, deadline - self._clock()) or None)
                    data = self._sock.recv(4096)
                else:
                    data = self._sock.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):
                return True
            except OSError:
                return False
            finally:
                self._sock.settimeout(self.timeout_s)
            if not data:
                return False
            answered = self._split(data)
            taken = answered.count(TAKEN)
            self.taken += taken
            self.refused += len(answered) - taken
            self._waiting = max(0, self._waiting - len(answered))
            if wait_s <= 0 or not self._waiting or self._clock() >= deadline:
                return True

    def _split(self, data: bytes) -> bytes:
        """The answer bytes of ``data``; the request lines in it (``{…}`` to a newline, written only
        to a hook that announced ``requests``) go to :attr:`requests`, whole, in order."""
        answers = bytearray()
        for byte in data:
            char = bytes((byte,))
            if self._request is None:
                if char == b"{":
                    self._request = bytearray(char)
                elif char in (TAKEN, REFUSED):
                    answers += char
                continue
            if char == b"\n":
                if len(self.requests) < MAX_PENDING_REQUESTS:
                    self.requests.append(bytes(self._request))
                self._request = None
            elif len(self._request) < MAX_REQUEST_BYTES:
                self._request += char
            else:
                self._request = bytearray(b"!")  # too long: dropped at its newline (not JSON)
        return bytes(answers)

    def _connect(self) -> bool:
        now = self._clock()
        if now < self._next_attempt:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            self._next_attempt = now + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            if not self._said_absent:
                log.info("gpuwarden hook: no agent at %s (%s); retrying in the background", self.path, exc)
                self._said_absent = True
            return False
        self._sock = sock
        self._backoff = BACKOFF_MIN_S
        self.connects += 1
        if self._said_absent or self.connects == 1:
            log.info("gpuwarden hook: connected to the agent at %s", self.path)
        self._said_absent = False
        return True

    def _write(self, line: bytes) -> bool:
        assert self._sock is not None
        try:
            # MSG_NOSIGNAL: a job that restored SIGPIPE's default must not die of a closed agent.
            self._sock.sendall(line, socket.MSG_NOSIGNAL)
        except OSError:
            # A timeout may leave half a line in the stream: the connection is unusable either way.
            self._close()
            return False
        self._waiting += 1
        return True

    def send(self, line: bytes) -> bool:
        """Deliver one line (newline included); ``False`` when it was dropped."""
        try:
            if os.getpid() != self._pid:
                if self._sock is not None:
                    self._sock.close()  # the parent's connection and books: not this process's
                    self._sock = None
                self._waiting = 0
                self._pid = os.getpid()
                self._next_attempt = 0.0
            if self._sock is not None and not self._read_answers():
                self._close()  # the agent closed it: what it did not answer is lost
            if self._sock is not None and self._write(line):
                return True
            if self._connect() and self._write(line):
                return True
        except Exception:  # never into the training loop, whatever happened
            log.debug("gpuwarden hook: send failed", exc_info=True)
            self._close()
        self.dropped += 1
        return False

    def close(self) -> None:
        """Wait up to ``timeout_s`` for the agent's answers, then close the connection (the agent
        keeps the last reading until it is a minute old)."""
        if self._sock is not None:
            try:
                self._read_answers(self.timeout_s)
            except Exception:  # never into the training loop
                log.debug("gpuwarden hook: reading the answers failed", exc_info=True)
        self._close()

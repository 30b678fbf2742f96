"""A stand-in for the agent's end of the hook socket in unit tests: a plain stdlib Unix socket server.

It accepts connections and reads lines, and tells each connection's peer PID from ``SO_PEERCRED``,
as the agent does. Blocking reads carry a timeout only so that a broken test fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

FAILSAFE_S = 10.0


class Connection:
    """One accepted connection: its peer's PID and the lines it wrote."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.pid, _, _ = struct.unpack("3i", creds)
        self.reader = sock.makefile("rb")

    def line(self) -> bytes:
        """The next line, newline included (b"" once the writer closed)."""
        return self.reader.readline()

    def message(self) -> dict[str, Any]:
        """The next line, parsed."""
        line = self.line()
        assert line.endswith(b"\n"), f"no whole line: {line!r}"
        parsed: dict[str, Any] = json.loads(line)
        return parsed

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class LineServer:
    """Listens on ``path`` until :meth:`close`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(FAILSAFE_S)
        self.connections: list[Connection] = []

    def accept(self) -> Connection:
        """The next connection (the client connected already: ``connect`` returns once queued)."""
        sock, _ = self.sock.accept()
        sock.settimeout(FAILSAFE_S)
        conn = Connection(sock)
        self.connections.append(conn)
        return conn

    def pending(self) -> bool:
        """Whether a connection waits to be accepted, without waiting for one."""
        self.sock.setblocking(False)
        try:
            sock, _ = self.sock.accept()
        except BlockingIOError:
            return False
        finally:
            self.sock.settimeout(FAILSAFE_S)
        self.connections.append(Connection(sock))
        return True

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.sock.close()
        os.unlink(self.path)

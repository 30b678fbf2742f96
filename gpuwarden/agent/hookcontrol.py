"""``gpuwarden snapshot PID|NAMESPACE/POD``: ask hooked processes for an allocator snapshot now, through
the agent (or ``gpuwarden watch``) that their hooks talk to.

The agent, and watch, listen beside their hook socket on a control socket of their own
(:func:`control_path`: ``<hook socket>.control``), mode 0600: only the agent's user (root on a node)
can connect, and the agent checks the peer's UID (``SO_PEERCRED``) besides. The command writes one
line, ``{"v": 1, "pid": 1234, "op": "snapshot"}`` or ``{"v": 1, "pod": "ml/train-0", "op":
"snapshot"}``, and reads one line per process asked (:class:`ControlAnswer`: the hook's answer and the
``pid``, camelCase): a pod's hooked processes as the agent's newest snapshot attributes them
(:class:`~gpuwarden.agent.hookrelay.PodProcesses`). The agent asks each hook over its own connection
(:meth:`~gpuwarden.agent.hooksocket.HookServer.ask`): a process whose hook did not opt in is never
asked, and the file is written by the job, in the job's directory, never by the agent.

On a node: ``kubectl exec -n gpuwarden <agent pod on the pod's node> -- gpuwarden snapshot
NAMESPACE/POD`` (or the PID as the node sees it: the agent's /metrics label ``pid``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import stat
import sys
from pathlib import Path

from pydantic import Field

from gpuwarden.agent.hookrelay import PodProcesses
from gpuwarden.agent.hooksocket import OPS, HookServer, peer_credentials, refusal
from gpuwarden.policy import answer_text
from gpuwarden.wire.hook import HookAnswer
from gpuwarden.wire.node import MAX_PID

CONTROL_VERSION = 1
MAX_REQUEST_BYTES = 1024


class ControlAnswer(HookAnswer):
    """One process's answer on the control socket: the hook's answer, and which process gave it
    (0: nobody, when the request itself is refused)."""

    pid: int = Field(ge=0, le=MAX_PID)


def control_path(hook_socket: Path) -> Path:
    """The control socket beside ``hook_socket``."""
    return hook_socket.with_name(hook_socket.name + ".control")


class ControlServer:
    """Serves ``gpuwarden snapshot`` on :func:`control_path` of ``hooks``' socket (see the module doc);
    ``processes`` names a pod's hooked processes."""

    def __init__(self, hooks: HookServer, processes: PodProcesses) -> None:
        self.hooks = hooks
        self.processes = processes
        self.path = control_path(hooks.path)
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen (0600); a stale socket file is replaced, anything else at the path refused."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(info.st_mode):
                raise OSError(f"{self.path} exists and is not a socket; not removing it")
            os.unlink(self.path)  # ours from a run that did not stop cleanly: the hook socket's check passed
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
            self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for answer in await self._answer(reader, writer):
                writer.write(answer.model_dump_json(by_alias=True, exclude_none=True).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> list[ControlAnswer]:
        _, uid = peer_credentials(writer.get_extra_info("socket"))
        if uid not in (0, os.getuid()):
            return [_refused("forbidden: only the agent's user may ask")]
        line = await reader.readuntil(b"\n")
        try:
            request = json.loads(line[:MAX_REQUEST_BYTES])
        except ValueError:
            return [_refused("malformed: not JSON")]
        if not isinstance(request, dict) or request.get("v") != CONTROL_VERSION:
            return [_refused(f"unsupportedVersion: this agent speaks {CONTROL_VERSION}")]
        pid, pod, op = request.get("pid"), request.get("pod"), request.get("op")
        if op not in OPS:
            return [_refused(f"malformed: expected an op of {', '.join(OPS)}")]
        if isinstance(pid, int) and 0 < pid <= MAX_PID:
            pids = [pid]
        elif isinstance(pod, str) and pod.count("/") == 1 and all(pod.split("/")):
            namespace, name = pod.split("/")
            pids = self.processes.pids(namespace, name)
            if not pids:
                return [_refused(f"noHookedProcess: no process of pod {pod} on this node has a hook")]
        else:
            return [_refused("malformed: expected a pid, or a pod as NAMESPACE/NAME")]
        answers = await asyncio.gather(*(self.hooks.ask(p, op) for p in pids))
        return [_control(p, a) for p, a in zip(pids, answers, strict=True)]


def _control(pid: int, answer: HookAnswer) -> ControlAnswer:
    return ControlAnswer.model_validate({**answer.model_dump(), "pid": pid})


def _refused(reason: str) -> ControlAnswer:
    return _control(0, refusal(0, reason))


def ask(path: Path, target: int | str, op: str, timeout: float) -> list[ControlAnswer]:
    """Ask through the control socket at ``path`` for ``target`` (a PID, or a pod as NAMESPACE/NAME);
    the agent's answers, one per process (``OSError`` if none listens)."""
    key = "pid" if isinstance(target, int) else "pod"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps({"v": CONTROL_VERSION, key: target, "op": op}).encode() + b"\n")
        with sock.makefile("rb") as lines:
            answers = [ControlAnswer.model_validate_json(line) for line in lines]
    if not answers:
        raise ValueError("the connection closed without an answer")
    return answers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``gpuwarden snapshot``."""
    from gpuwarden.agent.config import DEFAULT_HOOK_SOCKET, HOOK_SOCKET_ENV

    parser.description = (
        "Ask a hooked training process for a snapshot of its GPU allocator now (the file PyTorch's "
        "memory visualizer opens, written by the job into its own snapshot directory), through the "
        "agent or `gpuwarden watch` its hook talks to."
    )
    parser.add_argument(
        "target",
        metavar="PID|NAMESPACE/POD",
        help="a process, by its PID as this host sees it; or a pod on this node (its hooked processes)",
    )
    parser.add_argument(
        "--hook-socket",
        type=Path,
        default=Path(os.environ.get(HOOK_SOCKET_ENV) or DEFAULT_HOOK_SOCKET),
        metavar="PATH",
        help=f"the hook socket the agent or watch listens on (${HOOK_SOCKET_ENV}, else "
        f"{DEFAULT_HOOK_SOCKET}); its control socket is PATH.control",
    )
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the answer (90)")


def run(args: argparse.Namespace) -> int:
    """0 when every process asked wrote its snapshot, 1 when one refused or nobody answered, 2 for a bad
    target."""
    target: int | str = int(args.target) if args.target.isdigit() else args.target
    if isinstance(target, str) and (target.count("/") != 1 or not all(target.split("/"))):
        print(f"gpuwarden snapshot: {args.target!r}: expected a PID or NAMESPACE/POD", file=sys.stderr)
        return 2
    path = control_path(args.hook_socket)
    try:
        answers = ask(path, target, "snapshot", args.timeout)
    except (OSError, ValueError) as exc:
        print(f"gpuwarden snapshot: no answer from {path}: {exc}", file=sys.stderr)
        return 1
    for answer in answers:
        who = f"pid {answer.pid}" if answer.pid else str(target)
        print(f"{'SNAPSHOT' if answer.status == 'ok' else 'NO SNAPSHOT'} {who}: {answer_text(answer)}")
    return 0 if all(a.status == "ok" for a in answers) else 1

"""The agent's requests to a hook over a real hook socket: versions, refusals, GPU bytes by line and
snapshots, with the allocator's history played by ScriptedHistory (no GPU here), chosen explicitly.

The agent's end is a real :class:`HookServer`; the hook's a real :class:`StepHook` with its client,
driven one reading at a time in a worker thread (``send_now``), as a training loop would.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import select
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.agent.hookcontrol import ControlAnswer, ControlServer
from gpuwarden.agent.hookcontrol import ask as control_ask
from gpuwarden.agent.hookrelay import HookRelay, PodProcesses
from gpuwarden.agent.hooksocket import HookReadings, HookServer
from gpuwarden.hook import HookClient, StepHook
from gpuwarden.hook.history import (
    NO_FRAMES,
    Refused,
    ScriptedHistory,
    TorchHistory,
    block,
    segments,
    share_stacks,
)
from gpuwarden.hook.message import Reading, encode_line
from gpuwarden.local.suspicion import SuspicionResponder
from gpuwarden.policy import (
    IMMINENT_REASON,
    PROCESS_NAMESPACE,
    Finding,
    RuleKind,
    answer_text,
    process_subject,
)
from gpuwarden.policy.rules.growth.snapshot import MIN_RECORDING_S
from gpuwarden.wire.hook import HookAnswer
from gpuwarden.wire.node import GpuSample, HookSample, PodRef, ProcessSample, Snapshot

GiB = 2**30
JOB = "/work/job/train.py"
"""A file of the job's own (outside site-packages and the standard library)."""
LIBRARY = os.path.join(os.path.dirname(os.__file__), "site-packages", "torch", "nn", "modules", "linear.py")


def leak_snapshots() -> Iterator[dict[str, Any]]:
    """What the allocator holds at each reading: the job's line 35 keeps 1 GiB more each time, a
    line of its model's forward (innermost frame a library's) holds 2 GiB, and autograd's threads 1 GiB."""
    kept: list[dict[str, Any]] = []
    while True:
        yield segments(
            *kept,
            block(2 * GiB, (LIBRARY, 125), (JOB, 20)),
            block(GiB),
            block(GiB, (JOB, 40), state="inactive"),
        )
        kept.append(block(GiB, (LIBRARY, 125), (JOB, 35), (JOB, 90)))


class ServedHistory(ScriptedHistory):
    """Keeps every snapshot it played."""

    def __init__(self, snapshots: Iterator[dict[str, Any]]) -> None:
        super().__init__(snapshots)
        self.served: list[dict[str, Any]] = []

    def snapshot(self) -> dict[str, Any]:
        self.served.append(super().snapshot())
        return self.served[-1]


class Clock:
    """Time stands still within a reading: the readings' pacing lets every one through."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 108 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="gw-req-") as d:
        yield Path(d)


@pytest.fixture
async def server(socket_dir: Path) -> AsyncIterator[HookServer]:
    # A test's readings come faster than a hook's 10 a second: the rate's guard is not under test here.
    hooks = HookServer(socket_dir / "hook.sock", HookReadings(), rate=1000.0)
    await hooks.start()
    try:
        yield hooks
    finally:
        await hooks.close()


def hook_on(server: HookServer, tmp_path: Path, history: Any = None, **kw: Any) -> StepHook:
    """A hook opted in to requests (snapshots into ``tmp_path``) on ``server``'s socket."""
    return StepHook(
        memory=None,
        client=HookClient(str(server.path)),
        snapshots=tmp_path,
        history=history if history is not None else ScriptedHistory(leak_snapshots()),
        host_rss=lambda: None,
        host_limit=lambda: None,
        **kw,
    )


async def reading(hook: StepHook) -> None:
    """One reading of the hook's, on a worker thread as a training loop's would be, and the agent's
    answers to it (so that the agent has taken it)."""
    assert await asyncio.to_thread(hook.send_now)
    await asyncio.to_thread(hook.client._read_answers, 10.0)
    assert hook.client.unanswered == 0


async def answering(hook: StepHook) -> None:
    """The hook reads the agent's request at its next reading and answers in the one after (a snapshot
    once its writer has finished)."""
    await reading(hook)
    if hook.writer is not None:
        await asyncio.to_thread(hook.writer.wait, 10)
        await reading(hook)


async def ask(server: HookServer, hook: StepHook, op: str) -> HookAnswer:
    """Ask ``op`` and wait for the hook's answer."""
    asked = asyncio.create_task(server.ask(os.getpid(), op, wait=10))
    await asyncio.sleep(0)  # the request is written before the task first waits
    await answering(hook)
    return await asked


async def test_a_hook_announces_the_request_version_it_answers_only_when_the_job_opted_in(
    server: HookServer, tmp_path: Path
) -> None:
    opted = hook_on(server, tmp_path)
    await reading(opted)
    newest = server.readings.newest(os.getpid())
    assert newest is not None
    assert newest.message.requests == 1
    opted.close()
    plain = StepHook(memory=None, client=HookClient(str(server.path)), snapshots=False)
    await reading(plain)
    newest = server.readings.newest(os.getpid())
    assert newest is not None
    assert newest.message.requests is None
    answer = await server.ask(os.getpid(), "record", wait=10)
    assert (answer.status, (answer.reason or "").split(":")[0]) == ("refused", "notSupported"), answer
    await reading(plain)
    assert plain.client.requests == []  # never asked: nothing was written to it
    plain.close()


async def test_an_older_hook_is_answered_not_supported_at_once(server: HookServer) -> None:
    """A version-1 message without ``requests`` (every hook before this one): the agent asks nothing."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, str(server.path))
    await loop.sock_sendall(sock, encode_line(Reading(timestamp=1764770000.0)))
    assert await loop.sock_recv(sock, 1) == b"+"
    answer = await server.ask(os.getpid(), "snapshot", wait=10)
    assert (answer.status, (answer.reason or "").split(":")[0]) == ("refused", "notSupported"), answer
    sock.close()


async def test_recording_reports_gpu_bytes_by_the_jobs_own_line_and_the_blocks_without_frames(
    server: HookServer, tmp_path: Path
) -> None:
    clock = Clock()
    hook = hook_on(server, tmp_path, clock=clock)
    await reading(hook)
    newest = server.readings.newest(os.getpid())
    assert newest is not None
    assert newest.message.sites == []  # nothing recorded before the request
    answer = await ask(server, hook, "record")
    assert answer.status == "ok", answer
    for _ in range(2):
        clock.now += 60
        await reading(hook)
    newest = server.readings.newest(os.getpid())
    assert newest is not None
    gpu = {(s.file, s.line): s for s in newest.message.sites if s.memory == "gpu"}
    # The kept blocks by their innermost job frame (line 35, not the library's 125 or the caller's 90);
    # the inactive block is no live tensor; the frameless block is said, not dropped.
    assert set(gpu) == {(JOB, 35), (JOB, 20), (NO_FRAMES, 0)}, gpu
    leak = gpu[(JOB, 35)]
    assert leak.count >= 2
    assert leak.size_bytes == leak.count * GiB
    assert leak.growth_bytes == leak.size_bytes  # none of it was live at the start
    assert (leak.growth_bytes_per_minute or 0) > 0
    assert gpu[(NO_FRAMES, 0)].size_bytes == GiB
    assert next(s for s in newest.message.sites).file == JOB  # the most bytes first
    hook.close()


async def test_a_snapshot_is_written_in_torchs_format_and_answered_with_its_file_and_top_lines(
    server: HookServer, tmp_path: Path
) -> None:
    history = ServedHistory(leak_snapshots())
    hook = hook_on(server, tmp_path, history=history)
    await reading(hook)
    assert (await ask(server, hook, "record")).status == "ok"
    answer = await ask(server, hook, "snapshot")
    assert answer.status == "ok", answer
    assert answer.file is not None
    assert Path(answer.file).parent == tmp_path
    data = await asyncio.to_thread(Path(answer.file).read_bytes)
    assert answer.size_bytes == len(data)
    loaded = pickle.loads(data)
    assert any(loaded == served for served in history.served)  # the allocator's snapshot itself
    assert answer.sites
    assert all(s.memory == "gpu" for s in answer.sites)
    on_disk = sum(
        int(b["size"])
        for seg in loaded["segments"]
        for b in seg["blocks"]
        if b["state"] == "active_allocated" and any(f["line"] == 35 for f in b["frames"])
    )
    named = next(s for s in answer.sites if s.line == 35)
    assert named.size_bytes == on_disk
    assert [p.name for p in await asyncio.to_thread(lambda: list(tmp_path.iterdir()))] == [
        Path(answer.file).name
    ]
    hook.close()


async def test_refusals_are_answers_not_silence(server: HookServer, tmp_path: Path) -> None:
    no_cuda = hook_on(server, tmp_path, history=ScriptedHistory([], refuse="noCuda"))
    await reading(no_cuda)
    assert (await ask(server, no_cuda, "record")).reason == "noCuda"
    no_cuda.close()

    hook = hook_on(server, tmp_path / "capped", snapshot_max_files=1)
    await reading(hook)
    assert (await ask(server, hook, "record")).status == "ok"
    again = await ask(server, hook, "record")
    assert (again.status, again.reason) == ("refused", "alreadyRecording")
    assert (await ask(server, hook, "snapshot")).status == "ok"
    capped = await ask(server, hook, "snapshot")
    assert (capped.status, capped.reason) == ("refused", "capReached")
    unknown = await ask(server, hook, "format-disk")
    assert (unknown.status, (unknown.reason or "").split(":")[0]) == ("refused", "unknownOp"), unknown
    hook.close()

    small = hook_on(server, tmp_path / "small", snapshot_max_bytes=64)
    await reading(small)
    too_large = await ask(server, small, "snapshot")
    assert (too_large.status, (too_large.reason or "").split(":")[0]) == ("refused", "tooLarge"), too_large
    assert not await asyncio.to_thread((tmp_path / "small").exists)
    small.close()


async def test_a_request_of_another_version_is_refused_by_the_hook(
    server: HookServer, tmp_path: Path
) -> None:
    """A newer agent's request: the hook answers what it speaks instead of guessing."""
    hook = hook_on(server, tmp_path)
    await reading(hook)
    hook.client.requests.append(json.dumps({"v": 2, "id": 7, "op": "record"}).encode())
    assert hook._take_requests()
    assert [(a.id, a.status, a.reason) for a in hook._answers] == [
        (7, "refused", "unsupportedVersion: this hook answers version 1")
    ]
    hook.close()


async def test_a_hook_that_never_answers_is_answered_for_within_the_wait(
    server: HookServer, tmp_path: Path
) -> None:
    hook = hook_on(server, tmp_path)
    await reading(hook)  # announces requests, then reads no more
    answer = await server.ask(os.getpid(), "record", wait=0.2)
    assert (answer.status, (answer.reason or "").split(":")[0]) == ("refused", "noAnswer"), answer
    hook.close()


def test_torch_history_refuses_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from gpuwarden.hook.history import Refused

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Refused) as refused:
        TorchHistory().start(10)
    assert refused.value.reason == "noTorch"


# ----------------------------------------------------------------------------- watch's side, the CLI's


def growth(seconds_to_full: float, reason: str = "GPUMemoryLeakSuspected") -> Finding:
    """A memoryGrowth finding of this process, as watch's session hands it over."""
    return Finding(
        policy="leaks",
        rule="tensor-leak",
        kind=RuleKind("memoryGrowth"),
        reason=reason,
        namespace=PROCESS_NAMESPACE,
        pod=process_subject(os.getpid()),
        gpus=("GPU-0",),
        value=1e8,
        threshold=1e6,
        unit="bytes/s",
        started_at=1.0,
        message="allocated memory grows",
        seconds_to_full=seconds_to_full,
    )


async def settle(responder: SuspicionResponder, hook: StepHook) -> None:
    """Let the responder's questions reach the hook, and the hook's answers come back."""
    await asyncio.sleep(0)
    await reading(hook)
    if hook.writer is not None:
        await asyncio.to_thread(hook.writer.wait, 10)
    await reading(hook)
    await asyncio.gather(*responder._tasks)


async def test_watch_asks_to_record_on_a_leak_and_for_one_snapshot_once_it_is_imminent(
    server: HookServer, tmp_path: Path
) -> None:
    notes: list[str] = []
    clock = Clock()
    responder = SuspicionResponder(server, notes.append, clock=clock)
    hook = hook_on(server, tmp_path)
    await reading(hook)
    responder.observe([growth(3600)], clock())
    await settle(responder, hook)
    assert hook.lines is not None
    assert hook.lines.recording
    assert notes == [
        f"RECORDING tensor-leak pid {os.getpid()}: GPU bytes by line, from the allocator's history"
    ]
    # Imminent, but the history is too young to hold the leak's blocks: not yet.
    responder.observe([growth(600, IMMINENT_REASON)], clock() + MIN_RECORDING_S - 1)
    await settle(responder, hook)
    assert len(notes) == 1
    responder.observe([growth(600, IMMINENT_REASON)], clock() + MIN_RECORDING_S)
    await settle(responder, hook)
    responder.observe([growth(30, IMMINENT_REASON)], clock() + MIN_RECORDING_S + 60)  # one per finding
    await settle(responder, hook)
    assert len(notes) == 2, notes
    assert notes[1].startswith(f"SNAPSHOT tensor-leak pid {os.getpid()}: {tmp_path}/gpuwarden-snapshot-")
    assert "train.py:35 holds" in notes[1]
    assert len(await asyncio.to_thread(lambda: list(tmp_path.glob("*.pickle")))) == 1
    hook.close()


async def test_a_job_that_did_not_opt_in_is_never_asked_and_nothing_is_said(server: HookServer) -> None:
    notes: list[str] = []
    responder = SuspicionResponder(server, notes.append)
    plain = StepHook(memory=None, client=HookClient(str(server.path)), snapshots=False)
    await reading(plain)
    responder.observe([growth(10, IMMINENT_REASON)], 1.0)
    await settle(responder, plain)
    assert notes == []
    assert plain.client.requests == []
    plain.close()


def pod_snapshot(pid: int, namespace: str, pod: str, gpu: str = "GPU-0") -> Snapshot:
    """A snapshot as the agent's sampler annotates it: ``pid`` of ``namespace/pod`` on ``gpu``, hooked."""
    process = ProcessSample(
        pid=pid,
        pod=PodRef(namespace=namespace, name=pod),
        hook=HookSample(timestamp=1.0, allocated_bytes=GiB),
    )
    return Snapshot(timestamp=1.0, gpus=[GpuSample(uuid=gpu, index=0, processes=[process])])


async def test_the_operators_asks_are_relayed_to_the_pods_hooks_once_and_replied_on_the_next_snapshot(
    server: HookServer, tmp_path: Path
) -> None:
    processes = PodProcesses()
    relay = HookRelay(server, processes)
    hook = hook_on(server, tmp_path)
    await reading(hook)
    processes.observe(pod_snapshot(os.getpid(), "ml", "train-0"))
    ask = {"id": 41, "namespace": "ml", "pod": "train-0", "gpus": ["GPU-0"], "op": "record"}
    relay.accept([ask])
    relay.accept([ask])  # repeated by the operator until it has the reply: acted on once
    sock = hook.client._sock
    assert sock is not None
    await asyncio.to_thread(select.select, [sock], [], [], 10.0)  # the relay's request reached the hook
    await reading(hook)  # takes the request
    await reading(hook)  # answers it
    await asyncio.wait_for(relay.settled(), 10)
    [reply] = relay.drain()
    assert (reply.id, reply.namespace, reply.pod, reply.pid, reply.op, reply.status) == (
        41,
        "ml",
        "train-0",
        os.getpid(),
        "record",
        "ok",
    ), reply
    assert relay.drain() == []
    # A pod with no hooked process there (on another GPU of its, or none at all): refused, pid 0.
    relay.accept([{**ask, "id": 42, "gpus": ["GPU-1"]}, {**ask, "id": 43, "pod": "other-0"}])
    await asyncio.wait_for(relay.settled(), 10)
    assert [(r.id, r.pid, r.status, (r.reason or "").split(":")[0]) for r in relay.drain()] == [
        (42, 0, "refused", "noHookedProcess"),
        (43, 0, "refused", "noHookedProcess"),
    ]
    hook.close()
    await relay.close()


async def test_malformed_asks_are_ignored_whole(server: HookServer, caplog: pytest.LogCaptureFixture) -> None:
    relay = HookRelay(server, PodProcesses())
    relay.accept([{"id": 1, "namespace": "ml", "pod": "p", "op": "delete"}])
    relay.accept(None)  # an answer without asks
    await relay.close()
    assert relay.pending == 0
    assert "hookAsks.0.op" in caplog.text


async def snapshot_through(control: ControlServer, hook: StepHook, target: int | str) -> list[ControlAnswer]:
    """``gpuwarden snapshot TARGET``'s answers, the hook (of this process) answering the agent's request."""
    asked = asyncio.create_task(asyncio.to_thread(control_ask, control.path, target, "snapshot", 10.0))
    sock = hook.client._sock
    assert sock is not None
    # Until the agent, asked by the command, writes its request to the hook.
    await asyncio.to_thread(select.select, [sock], [], [], 10.0)
    await answering(hook)
    return await asked


async def test_gpuwarden_snapshot_asks_through_the_control_socket_by_pid_or_pod(
    server: HookServer, tmp_path: Path
) -> None:
    processes = PodProcesses()
    control = ControlServer(server, processes)
    await control.start()
    assert stat.S_IMODE(os.stat(control.path).st_mode) == 0o600
    hook = hook_on(server, tmp_path)
    await reading(hook)
    [answer] = await snapshot_through(control, hook, os.getpid())
    assert (answer.status, answer.pid) == ("ok", os.getpid()), answer
    assert answer.file is not None
    assert Path(answer.file).parent == tmp_path
    # By pod: the processes the newest snapshot attributes to it, with a hook.
    processes.observe(pod_snapshot(os.getpid(), "ml", "train-0"))
    [by_pod] = await snapshot_through(control, hook, "ml/train-0")
    assert (by_pod.status, by_pod.pid) == ("ok", os.getpid()), by_pod
    assert by_pod.file is not None
    assert by_pod.file != answer.file
    [refused] = await asyncio.to_thread(control_ask, control.path, 1, "snapshot", 10.0)
    assert (refused.status, (refused.reason or "").split(":")[0]) == ("refused", "unknownProcess")
    [nobody] = await asyncio.to_thread(control_ask, control.path, "ml/other-0", "snapshot", 10.0)
    assert (nobody.status, nobody.pid, (nobody.reason or "").split(":")[0]) == (
        "refused",
        0,
        "noHookedProcess",
    )
    hook.close()
    await control.close()
    assert not control.path.exists()


def test_gpuwarden_snapshot_says_why_it_cannot_ask(
    socket_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwarden.cli import main

    assert main(["snapshot", "trainer-0", f"--hook-socket={socket_dir}/hook.sock"]) == 2
    assert "expected a PID or NAMESPACE/POD" in capsys.readouterr().err
    assert main(["snapshot", "4242", f"--hook-socket={socket_dir}/hook.sock"]) == 1
    assert f"no answer from {socket_dir}/hook.sock.control" in capsys.readouterr().err


def test_a_snapshot_shares_equal_stacks_and_loads_to_the_same_data() -> None:
    """Pickling holds the interpreter's lock: the writer makes a leak's thousand equal stacks one object
    first, so the pickle (and the step's wait for it) is a fraction of the size."""
    made = [segments(*(block(GiB, (LIBRARY, 125), (JOB, 35)) for _ in range(1000)))]
    kept = pickle.loads(pickle.dumps(made[0]))
    before = len(pickle.dumps(made[0]))
    share_stacks(made[0])
    after = pickle.dumps(made[0])
    assert pickle.loads(after) == kept
    blocks = made[0]["segments"][0]["blocks"]
    assert all(b["frames"] is blocks[0]["frames"] for b in blocks)
    assert len(after) < before / 2


async def test_a_snapshot_without_cuda_is_refused_and_a_jobs_strings_are_shown_printable(
    server: HookServer, tmp_path: Path
) -> None:
    class NoCuda(ScriptedHistory):
        def snapshot(self) -> dict[str, Any]:
            raise Refused("noCuda")

    hook = hook_on(server, tmp_path, history=NoCuda([]))
    await reading(hook)
    answer = await ask(server, hook, "snapshot")
    assert (answer.status, answer.reason) == ("refused", "noCuda")
    hook.close()
    shown = answer_text(HookAnswer.model_validate({"id": 1, "status": "refused", "reason": "x\x1b[2Jy"}))
    assert shown == "refused: x?[2Jy"

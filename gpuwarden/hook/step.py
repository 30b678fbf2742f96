"""The hook a training loop calls: reads at most every ``interval`` seconds and sends each reading.

Two ways to drive it, either a few lines in the job::

    hook = StepHook()
    for batch in loader:
        ...
        hook.step()          # counts the step; reads when `interval` has passed

    with StepHook() as hook: # or: a background thread reads every `interval`
        for batch in loader:
            ...
            hook.step()      # optional here: only counts, so readings carry the step

Nothing it does raises into the loop: a failing reader leaves its part out of the reading (and logs
once), a reading the agent cannot take is dropped.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from gpuwarden.hook.client import HookClient
from gpuwarden.hook.device_memory import MemoryReader, TorchMemory
from gpuwarden.hook.history import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_FILES,
    AllocatorHistory,
    LineRecorder,
    Refused,
    SnapshotWriter,
    TorchHistory,
)
from gpuwarden.hook.host_memory import memory_limit_bytes, tree_rss_bytes
from gpuwarden.hook.message import (
    MAX_ANSWERS,
    MAX_SITES,
    REQUESTS_VERSION,
    Answer,
    DeviceMemory,
    Reading,
    Site,
    encode_line,
)
from gpuwarden.hook.sites import DEFAULT_FRAMES, AllocationTracker

TRACEMALLOC_ENV = "GPUWARDEN_HOOK_TRACEMALLOC"
FRAMES_ENV = "GPUWARDEN_HOOK_TRACEMALLOC_FRAMES"
SNAPSHOTS_ENV = "GPUWARDEN_HOOK_SNAPSHOTS"
"""Opts the job in to the agent's requests: ``1`` (snapshots in the working directory) or a directory."""
DEFAULT_INTERVAL_S = 5.0
"""The agent samples every second and its rules look at minutes: a reading every 5 s keeps the hook's
cost negligible and the allocated-memory series dense enough for a slope."""

CLOSE_WAIT_S = 5.0
"""At close, how long a snapshot being written may hold the job's end."""

log = logging.getLogger("gpuwarden.hook")

T = TypeVar("T")


def torch_memory_or_none() -> MemoryReader | None:
    """:class:`TorchMemory` when torch is installed; otherwise ``None``, said once in the log."""
    if importlib.util.find_spec("torch") is None:
        log.warning("gpuwarden hook: torch is not installed; sending host memory and allocation sites only")
        return None
    return TorchMemory()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_frames() -> int:
    value = os.environ.get(FRAMES_ENV, "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    if value:
        log.warning(
            "gpuwarden hook: %s=%r is no positive integer; using %d", FRAMES_ENV, value, DEFAULT_FRAMES
        )
    return DEFAULT_FRAMES


def _env_snapshots() -> Path | None:
    value = os.environ.get(SNAPSHOTS_ENV, "").strip()
    if not value or value.lower() in ("0", "false", "no", "off"):
        return None
    return Path.cwd() if value.lower() in ("1", "true", "yes", "on") else Path(value)


class StepHook:
    """Reads device memory, host RSS and its limit, and (when on) allocation sites; sends them to the agent.

    ``memory``: the allocator reader; ``None`` (the default) reads torch's when torch is installed.
    ``tracemalloc``: name the growing lines; ``None`` (the default) follows ``GPUWARDEN_HOOK_TRACEMALLOC``.
    ``frames``: the stack depth tracemalloc keeps; ``None`` follows ``GPUWARDEN_HOOK_TRACEMALLOC_FRAMES``
    (default 4).
    ``snapshots``: take the agent's requests (GPU bytes by line, snapshots; docs/hook.md, "Requests")
    and write snapshots into this directory (``True``: the working directory); ``None`` (the default)
    follows ``GPUWARDEN_HOOK_SNAPSHOTS``; ``False``: take none. ``history`` is the allocator's
    (torch's unless given), ``snapshot_max_bytes`` and ``snapshot_max_files`` bound what is written.
    ``client``, ``clock`` (monotonic, for the interval and the tracker's pacing), ``wall`` (the
    readings' timestamps), ``host_rss`` and ``host_limit`` are for tests and special setups.
    """

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        memory: MemoryReader | None = None,
        tracemalloc: bool | None = None,
        frames: int | None = None,
        client: HookClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        host_rss: Callable[[], int | None] = tree_rss_bytes,
        host_limit: Callable[[], int | None] = memory_limit_bytes,
        snapshots: Path | str | bool | None = None,
        history: AllocatorHistory | None = None,
        snapshot_max_bytes: int = DEFAULT_MAX_BYTES,
        snapshot_max_files: int = DEFAULT_MAX_FILES,
    ) -> None:
        self.interval = interval
        self.memory = memory if memory is not None else torch_memory_or_none()
        on = _env_flag(TRACEMALLOC_ENV) if tracemalloc is None else tracemalloc
        self.tracker = AllocationTracker(frames or _env_frames(), clock=clock) if on else None
        self.client = client if client is not None else HookClient()
        self.steps = 0
        self._counted = False
        self._clock = clock
        self._wall = wall
        self._host_rss = host_rss
        self._host_limit = host_limit
        self._last_read: float | None = None
        self._failed: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        if self.tracker is not None:
            self.tracker.start()
        directory = _env_snapshots() if snapshots is None else Path.cwd() if snapshots is True else snapshots
        self.lines: LineRecorder | None = None
        self.writer: SnapshotWriter | None = None
        if directory:
            self.lines = LineRecorder(history if history is not None else TorchHistory(), clock=clock)
            self.writer = SnapshotWriter(
                self.lines,
                Path(directory).resolve(),
                max_bytes=snapshot_max_bytes,
                max_files=snapshot_max_files,
                clock=clock,
            )
        self._answers: list[Answer] = []
        """Answers to the agent's requests, until a reading carrying them was delivered."""
        self._sending = threading.Lock()  # the loop's close() and the background thread

    def _part(self, name: str, read: Callable[[], T], empty: T) -> T:
        try:
            return read()
        except Exception:  # a reader's failure costs its part of the reading, never the job
            if name not in self._failed:
                log.warning("gpuwarden hook: reading %s failed; leaving it out", name, exc_info=True)
                self._failed.add(name)
            return empty

    def reading(self) -> Reading:
        """Read everything now (whatever the interval)."""
        devices: tuple[DeviceMemory, ...] = ()
        if self.memory is not None:
            devices = tuple(self._part("device memory", self.memory.read, ()))
        none: tuple[Site, ...] = ()
        sites: tuple[Site, ...] | None = None
        if self.tracker is not None:
            sites = self._part("allocation sites", self.tracker.sites, none)
        if self.lines is not None and self.lines.recording:
            gpu = self._part("GPU lines", self.lines.sites, none)
            sites = (gpu + (sites or ()))[:MAX_SITES]  # the GPU's first: they say what fills the card
        if self.writer is not None:
            self._answers.extend(self.writer.done())
        return Reading(
            timestamp=self._wall(),
            step=self.steps if self._counted else None,
            devices=devices,
            host_rss_bytes=self._part("host memory", self._host_rss, None),
            host_limit_bytes=self._part("host memory limit", self._host_limit, None),
            sites=sites,
            requests=REQUESTS_VERSION if self.lines is not None else None,
            answers=tuple(self._answers[:MAX_ANSWERS]),
        )

    def send_now(self) -> bool:
        """Read and send now; ``False`` when the reading was dropped. Never raises.

        The agent's requests that came meanwhile are then carried out; their answers go at once, in
        another reading (a snapshot's when it is written, in a later one).
        """
        with self._sending:
            try:
                sent = self._send()
                if self._take_requests():
                    sent = self._send()
                return sent
            except Exception:
                log.debug("gpuwarden hook: reading failed", exc_info=True)
                return False

    def _send(self) -> bool:
        reading = self.reading()
        sent = self.client.send(encode_line(reading))
        if sent:
            del self._answers[: len(reading.answers)]
        return sent

    def _take_requests(self) -> bool:
        """Carry out the requests the client received; whether any was answered at once."""
        requests, self.client.requests = self.client.requests, []
        answered = False
        for line in requests:
            answer = self._answer(line)
            if answer is not None:
                self._answers.append(answer)
                answered = True
        return answered

    def _answer(self, line: bytes) -> Answer | None:
        """What to answer one request line; None when it is answered later (a snapshot being written)
        or cannot be (no ``id`` to answer to)."""
        try:
            request = json.loads(line)
        except ValueError:
            return None
        if not isinstance(request, dict) or not isinstance(request.get("id"), int) or request["id"] < 0:
            return None
        rid = request["id"]
        if request.get("v") != REQUESTS_VERSION:
            return Answer(rid, "refused", f"unsupportedVersion: this hook answers version {REQUESTS_VERSION}")
        op = request.get("op")
        if self.lines is None or self.writer is None:
            return Answer(rid, "refused", "notOptedIn")
        try:
            if op == "record":
                self.lines.start()
                log.warning("gpuwarden hook: the agent suspects a leak; recording GPU allocations by line")
                return Answer(rid, "ok")
            if op == "snapshot":
                self.writer.request(rid)
                return None
            return Answer(rid, "refused", f"unknownOp: {str(op)[:64]}")
        except Refused as exc:
            return Answer(rid, "refused", exc.reason)
        except Exception as exc:  # answered, never raised into the job
            log.warning("gpuwarden hook: request %r failed", op, exc_info=True)
            return Answer(rid, "refused", f"failed: {type(exc).__name__}: {exc}")

    def step(self, step: int | None = None) -> None:
        """Count a training step (or set the count to ``step``); read and send once ``interval`` passed.

        Under ``with hook:`` the background thread reads; this only counts.
        """
        self.steps = self.steps + 1 if step is None else step
        self._counted = True
        if self._thread is not None:
            return
        now = self._clock()
        if self._last_read is not None and now - self._last_read < self.interval:
            return
        self._last_read = now
        self.send_now()

    def _run(self) -> None:
        while True:
            self.send_now()
            if self._stopping.wait(self.interval):
                return

    def __enter__(self) -> StepHook:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-hook", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background thread (if any), send a last reading, stop tracing and disconnect."""
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None
        if self.writer is not None:
            self.writer.wait(CLOSE_WAIT_S)
        self.send_now()
        if self.tracker is not None:
            self.tracker.stop()
        if self.lines is not None:
            self.lines.stop()
        self.client.close()

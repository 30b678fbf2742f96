"""GPU bytes by the job's own line, and memory snapshots, from the caching allocator's history.

Nothing here runs until the agent asks (docs/hook.md, "Requests"): a leak suspected, it sends
``record``, and the hook starts torch's allocator history
(``torch.cuda.memory._record_memory_history(stacks="python", max_entries=…)``), which from then on
keeps the Python stack of every block allocated. Each reading then groups the live blocks of
``torch.cuda.memory._snapshot()`` by the innermost frame of the job's own code (as
:class:`~gpuwarden.hook.sites.AllocationTracker` does for host objects), so a kept graph's logits
are credited to the job's line that ran the forward pass. A block with no Python frame (allocated
before recording began, or on a thread with no Python: autograd's backward threads) is reported as
such (:data:`NO_FRAMES`), never dropped.

``snapshot`` writes ``_snapshot()`` pickled, the file PyTorch's memory visualizer
(https://pytorch.org/memory_viz, or ``python -m torch.cuda._memory_viz``) opens, on a thread of its
own so that the training step never waits for the pickling or the disk.

The allocator is behind :class:`AllocatorHistory`: :class:`TorchHistory` on a real job,
:class:`ScriptedHistory` (given snapshots in torch's format) where there is no GPU, chosen
explicitly.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from gpuwarden.hook.message import MAX_ANSWER_SITES, MAX_SITES, Answer, Site
from gpuwarden.hook.sites import DEFAULT_BUDGET, CodeKinds

NO_FRAMES = "<no Python frames>"
"""The file of the blocks no Python frame allocated: before recording began, or on autograd's threads."""
DEFAULT_MAX_ENTRIES = 10_000
"""Allocator events the history keeps (the visualizer's timeline, the last few hundred steps of a
training loop): bounded, so recording holds a fixed amount of host memory however long the job runs,
and a reading or a snapshot walks a bounded list (docs/benchmarks.md, "GPU bytes by line")."""
DEFAULT_MAX_BYTES = 1 << 30
"""A snapshot file larger than this is not written (refused ``tooLarge``)."""
DEFAULT_MAX_FILES = 4
"""Snapshots one process writes at most (then refused ``capReached``)."""


class Refused(Exception):
    """A request the hook cannot carry out; ``reason`` is the answer's (``noTorch``, ``noCuda``, …)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AllocatorHistory(Protocol):
    """The caching allocator's history, as torch's ``torch.cuda.memory`` offers it."""

    def start(self, max_entries: int) -> None:
        """Start recording each block's Python stack; :class:`Refused` when it cannot."""

    def snapshot(self) -> dict[str, Any]:
        """The allocator's state now, in ``torch.cuda.memory._snapshot()``'s format."""

    def stop(self) -> None:
        """Stop recording."""


class TorchHistory:
    """torch's allocator history. Refuses without torch (``noTorch``) or before the job initialised
    CUDA (``noCuda``): the hook never creates a CUDA context."""

    def start(self, max_entries: int) -> None:
        if importlib.util.find_spec("torch") is None:
            raise Refused("noTorch")
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            raise Refused("noCuda")
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=max_entries)

    def snapshot(self) -> dict[str, Any]:
        if importlib.util.find_spec("torch") is None:
            raise Refused("noTorch")
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            raise Refused("noCuda")
        return dict(torch.cuda.memory._snapshot())

    def stop(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)


class ScriptedHistory:
    """Plays given snapshots (torch's format), the last one repeated; for tests and CI, where there is
    no GPU. ``refuse``: the reason :meth:`start` refuses with, if any."""

    def __init__(self, snapshots: Iterable[dict[str, Any]], *, refuse: str | None = None) -> None:
        self._snapshots: Iterator[dict[str, Any]] = iter(snapshots)
        self.last: dict[str, Any] = {"segments": [], "device_traces": []}
        """The snapshot played last."""
        self._refuse = refuse
        self.recording = False
        self.max_entries: int | None = None

    def start(self, max_entries: int) -> None:
        if self._refuse is not None:
            raise Refused(self._refuse)
        self.recording = True
        self.max_entries = max_entries

    def snapshot(self) -> dict[str, Any]:
        self.last = next(self._snapshots, self.last)
        return self.last

    def stop(self) -> None:
        self.recording = False


def block(size: int, *frames: tuple[str, int], state: str = "active_allocated") -> dict[str, Any]:
    """One block in torch's format, its frames innermost first (for :class:`ScriptedHistory`)."""
    return {
        "size": size,
        "requested_size": size,
        "address": 0,
        "state": state,
        "frames": [{"filename": f, "line": n, "name": "f"} for f, n in frames],
    }


def segments(*blocks: dict[str, Any]) -> dict[str, Any]:
    """A snapshot in torch's format of one segment holding ``blocks``."""
    total = sum(int(b["size"]) for b in blocks)
    return {
        "segments": [{"device": 0, "address": 0, "total_size": total, "stream": 0, "blocks": list(blocks)}],
        "device_traces": [[]],
    }


Lines = dict[tuple[str, int], tuple[int, int]]
"""(file, line) → (live bytes, live blocks)."""


def by_line(snapshot: dict[str, Any], kinds: CodeKinds) -> Lines:
    """The live (``active_allocated``) blocks of ``snapshot`` by the innermost frame of the job's code;
    without one, the outermost frame (a library's line); without any frame, :data:`NO_FRAMES`."""
    lines: Lines = {}
    for segment in snapshot.get("segments", ()):
        for b in segment.get("blocks", ()):
            if b.get("state") != "active_allocated":
                continue
            frames = b.get("frames") or ()
            key = (NO_FRAMES, 0)
            if frames:
                # torch lists a block's frames innermost first.
                frame = next((f for f in frames if kinds.kind_of(f["filename"]) == "job"), frames[-1])
                key = (str(frame["filename"]), int(frame["line"]))
            size, count = lines.get(key, (0, 0))
            lines[key] = (size + int(b["size"]), count + 1)
    return lines


class LineRecorder:
    """Records the allocator's history once asked (:meth:`start`), and reads GPU bytes by line.

    :meth:`sites` is paced like the tracker's (``budget`` of the job's time: a reading walks every live
    block), repeating its last sites between readings. A line's growth is against its bytes at the first
    reading, taken when recording began; its rate, that growth over the time since.
    """

    def __init__(
        self,
        history: AllocatorHistory,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        top: int = MAX_SITES,
        cwd: str | None = None,
        budget: float = DEFAULT_BUDGET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.history = history
        self.max_entries = max_entries
        self.top = top
        self.budget = budget
        self._clock = clock
        self._cwd = os.path.join(cwd or os.getcwd(), "")
        self._kinds = CodeKinds()
        self._lock = threading.Lock()  # the snapshot writer's thread reads through the same history
        self.recording = False
        self._baseline: Lines = {}
        self._since = 0.0
        self._due = 0.0
        self._last: tuple[Site, ...] = ()

    def start(self) -> None:
        """Start recording; :class:`Refused` when it cannot, or already records (``alreadyRecording``)."""
        if self.recording:
            raise Refused("alreadyRecording")
        self.history.start(self.max_entries)
        self.recording = True
        with self._lock:
            self._baseline = by_line(self.history.snapshot(), self._kinds)
        self._since = self._clock()
        self._due = 0.0

    def stop(self) -> None:
        """Stop recording (when this recorder started it)."""
        if self.recording:
            self.history.stop()
            self.recording = False

    def display(self, filename: str) -> str:
        """A path under the working directory, relative to it."""
        return filename[len(self._cwd) :] if filename.startswith(self._cwd) else filename

    def _rank(self, item: tuple[tuple[str, int], tuple[int, int]]) -> tuple[int, int]:
        (file, _), (size, _) = item
        kind = 0 if file == NO_FRAMES else 2 if self._kinds.kind_of(file) == "job" else 1
        return (kind, size)

    def ranked(self, lines: Lines, now: float, top: int) -> tuple[Site, ...]:
        """``lines`` as GPU sites with their growth since recording began: the job's own lines first,
        then the libraries', then :data:`NO_FRAMES` (what was live before recording began, a ballast
        or the model, lands there and says nothing of a leak), each the most bytes first."""
        minutes = max(now - self._since, 1e-9) / 60
        out = []
        for (file, line), (size, count) in sorted(lines.items(), key=self._rank, reverse=True)[:top]:
            growth = max(0, size - self._baseline.get((file, line), (0, 0))[0])
            per_minute = int(growth / minutes) if now > self._since else None
            site = Site(self.display(file), line, size, growth, count, gpu=True, growth_per_minute=per_minute)
            out.append(site)
        return tuple(out)

    def read(self) -> tuple[Lines, dict[str, Any]]:
        """The snapshot now and its lines."""
        with self._lock:
            snapshot = self.history.snapshot()
        return by_line(snapshot, self._kinds), snapshot

    def sites(self) -> tuple[Site, ...]:
        """GPU bytes by line while recording (empty otherwise); paced (see the class doc)."""
        if not self.recording:
            return ()
        start = self._clock()
        if start < self._due:
            return self._last
        lines, _ = self.read()
        self._last = self.ranked(lines, start, self.top)
        end = self._clock()
        self._due = end + (end - start) / self.budget
        return self._last


def share_stacks(snapshot: dict[str, Any]) -> None:
    """Make equal stacks one object, in place: pickle then writes each distinct stack once.

    torch gives every block and every history event its own list of frame dicts, although a leak
    repeats one stack thousands of times. Pickling holds the interpreter's lock throughout, so the
    training step waits for all of it; this pass is plain Python (the step gets its turns) and leaves
    the pickling a fraction of the work. The file loads to the same data.
    """
    stacks: dict[tuple[tuple[Any, ...], ...], list[Any]] = {}

    def shared(entry: dict[str, Any]) -> None:
        frames = entry.get("frames")
        if frames:
            key = tuple(tuple(f.items()) for f in frames)
            entry["frames"] = stacks.setdefault(key, frames)

    for segment in snapshot.get("segments", ()):
        shared(segment)
        for b in segment.get("blocks", ()):
            shared(b)
    for events in snapshot.get("device_traces", ()):
        for event in events:
            shared(event)


class SnapshotWriter:
    """Writes allocator snapshots into ``directory``, one at a time, on a thread of its own.

    At most ``max_files`` files (then ``capReached``), each at most ``max_bytes`` pickled (else
    ``tooLarge``, nothing written); one while another is being written is refused ``busy``. The file
    appears whole or not at all (written aside, then renamed). :meth:`done` hands over the answers of
    the snapshots finished since.
    """

    def __init__(
        self,
        recorder: LineRecorder,
        directory: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recorder = recorder
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.written = 0
        self.seconds: list[float] = []
        """How long each snapshot took on its thread (reading, pickling, writing)."""
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._answers: list[Answer] = []
        self._answers_lock = threading.Lock()

    def request(self, request_id: int) -> None:
        """Start writing a snapshot; :class:`Refused` (``capReached``, ``busy``) when it cannot."""
        if self.written >= self.max_files:
            raise Refused("capReached")
        if self._thread is not None and self._thread.is_alive():
            raise Refused("busy")
        self.written += 1
        number = self.written
        self._thread = threading.Thread(
            target=self._write, args=(request_id, number), name="gpuwarden-snapshot", daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the snapshot being written, if any."""
        if self._thread is not None:
            self._thread.join(timeout)

    def done(self) -> list[Answer]:
        """The answers of the snapshots finished since the last call."""
        with self._answers_lock:
            answers, self._answers = self._answers, []
        return answers

    def _write(self, request_id: int, number: int) -> None:
        start = self._clock()
        try:
            lines, snapshot = self.recorder.read()
            share_stacks(snapshot)
            data = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
            if len(data) > self.max_bytes:
                answer = Answer(request_id, "refused", f"tooLarge: {len(data)} bytes > {self.max_bytes}")
            else:
                self.directory.mkdir(parents=True, exist_ok=True)
                path = self.directory / f"gpuwarden-snapshot-{os.getpid()}-{number}.pickle"
                aside = path.with_name(path.name + ".part")
                aside.write_bytes(data)
                aside.replace(path)
                sites = self.recorder.ranked(lines, self._clock(), MAX_ANSWER_SITES)
                answer = Answer(request_id, "ok", file=str(path), size_bytes=len(data), sites=sites)
        except Refused as exc:
            answer = Answer(request_id, "refused", exc.reason)
        except Exception as exc:  # answered, never raised into the job
            answer = Answer(request_id, "refused", f"failed: {type(exc).__name__}: {exc}")
        self.seconds.append(self._clock() - start)
        with self._answers_lock:
            self._answers.append(answer)

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
import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from gpuwarden.hook.client import HookClient
from gpuwarden.hook.device_memory import MemoryReader, TorchMemory
from gpuwarden.hook.host_memory import memory_limit_bytes, tree_rss_bytes
from gpuwarden.hook.message import DeviceMemory, Reading, Site, encode_line
from gpuwarden.hook.sites import DEFAULT_FRAMES, AllocationTracker

TRACEMALLOC_ENV = "GPUWARDEN_HOOK_TRACEMALLOC"
FRAMES_ENV = "GPUWARDEN_HOOK_TRACEMALLOC_FRAMES"
DEFAULT_INTERVAL_S = 5.0
"""The agent samples every second and its rules look at minutes: a reading every 5 s keeps the hook's
cost negligible and the allocated-memory series dense enough for a slope."""

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


class StepHook:
    """Reads device memory, host RSS and its limit, and (when on) allocation sites; sends them to the agent.

    ``memory``: the allocator reader; ``None`` (the default) reads torch's when torch is installed.
    ``tracemalloc``: name the growing lines; ``None`` (the default) follows ``GPUWARDEN_HOOK_TRACEMALLOC``.
    ``frames``: the stack depth tracemalloc keeps; ``None`` follows ``GPUWARDEN_HOOK_TRACEMALLOC_FRAMES``
    (default 4).
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
        sites: tuple[Site, ...] | None = None
        if self.tracker is not None:
            none: tuple[Site, ...] = ()
            sites = self._part("allocation sites", self.tracker.sites, none)
        return Reading(
            timestamp=self._wall(),
            step=self.steps if self._counted else None,
            devices=devices,
            host_rss_bytes=self._part("host memory", self._host_rss, None),
            host_limit_bytes=self._part("host memory limit", self._host_limit, None),
            sites=sites,
        )

    def send_now(self) -> bool:
        """Read and send now; ``False`` when the reading was dropped. Never raises."""
        try:
            return self.client.send(encode_line(self.reading()))
        except Exception:
            log.debug("gpuwarden hook: reading failed", exc_info=True)
            return False

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
        self.send_now()
        if self.tracker is not None:
            self.tracker.stop()
        self.client.close()

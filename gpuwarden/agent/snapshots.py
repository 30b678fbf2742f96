"""The sampling loop and the ring of recent snapshots it fills.

:class:`Sampler` reads the backend once per ``interval`` in a worker thread (NVML calls
block, and per-process utilization costs milliseconds), stamps a :class:`Snapshot`,
lets the attributor fill in pods, keeps it in a :class:`SnapshotRing` for ``/metrics``
and hands it to the report sender. Per-process SM utilization is read at its own,
lower rate (``process_interval``) in the same worker call as the device sample it
rides on, so a snapshot carries ``sm_util`` only when it was read at that time: then 0
for a process that ran no kernel in the window (see
:func:`~gpuwarden.wire.node.merge_process_utilization`), ``None`` where the device
could not be read.

A scrape never calls the backend: the collectors read :meth:`SnapshotRing.latest`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpuwarden.agent.backend import DeviceBackend
from gpuwarden.wire.node import DeviceState, ProcessUtilization, Snapshot, merge_process_utilization

log = logging.getLogger(__name__)

ERROR_KINDS = ("sample", "process_utilization", "gpu_lost", "gpu_unknown", "attribution", "deliver")
"""What the loop counts as an error (``gpuwarden_agent_errors_total{kind}``):

- ``sample``: the backend raised while reading devices (no snapshot this tick);
- ``process_utilization``: the backend raised while reading per-process utilization;
- ``gpu_lost`` / ``gpu_unknown``: one per device sample in that state;
- ``attribution``: the attributor raised (the snapshot goes out unattributed);
- ``deliver``: handing the snapshot to the report sender raised.
"""


class SamplerEvents(Protocol):
    """What the loop reports about itself; :class:`gpuwarden.agent.metrics.AgentMetrics` implements it."""

    def sampled(self, seconds: float) -> None:
        """One device sample took ``seconds`` (wall clock, in the worker thread)."""

    def error(self, kind: str) -> None:
        """Count one error of ``kind`` (one of :data:`ERROR_KINDS`)."""


class Attributor(Protocol):
    """Fills in pods; the PodAttributor (kubelet + /proc) and ScenarioAttributor implement it."""

    async def refresh(self) -> None:
        """Re-read allocations from their source."""

    def annotate(self, snapshot: Snapshot) -> Snapshot:
        """Return the snapshot with pods, process owners and pod host memory filled in."""


class _NoEvents:
    def sampled(self, seconds: float) -> None:
        pass

    def error(self, kind: str) -> None:
        pass


RING_SECONDS = 300.0
"""How much recent history the agent and ``gpuwarden watch`` keep in memory, whatever the sampling
interval (:meth:`SnapshotRing.lasting`)."""


class SnapshotRing:
    """The last ``capacity`` snapshots, oldest first, and the latest per-process utilization.

    Written and read on the event loop only, so it needs no lock.
    """

    @classmethod
    def lasting(cls, interval: float, seconds: float = RING_SECONDS) -> SnapshotRing:
        """A ring holding ``seconds`` of snapshots taken every ``interval`` seconds (at least one)."""
        return cls(capacity=max(1, int(seconds / interval)))

    def __init__(self, capacity: int = 300, *, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError("a snapshot ring needs room for at least one snapshot")
        self._ring: deque[Snapshot] = deque(maxlen=capacity)
        self.process_utilization: ProcessUtilization = {}
        """The last per-process reading, by device key then PID; kept between the lower-rate reads."""
        self.first_sample = asyncio.Event()
        """Set once the first snapshot is in."""
        self._clock = clock
        self._appended_at: float | None = None

    def __len__(self) -> int:
        return len(self._ring)

    def append(self, snapshot: Snapshot) -> None:
        """Keep a new snapshot; the oldest falls out when the ring is full."""
        self._ring.append(snapshot)
        self._appended_at = self._clock()
        self.first_sample.set()

    def latest(self) -> Snapshot | None:
        """The newest snapshot, or ``None`` before the first sample."""
        return self._ring[-1] if self._ring else None

    def recent(self) -> list[Snapshot]:
        """Every snapshot held, oldest first."""
        return list(self._ring)

    def record_process_utilization(self, utilization: ProcessUtilization) -> None:
        """Remember a per-process reading until the next one (the collectors show it in between)."""
        self.process_utilization = utilization

    @property
    def ready(self) -> bool:
        """Whether at least one snapshot was taken."""
        return bool(self._ring)

    def age(self) -> float | None:
        """Seconds (the ring's monotonic clock) since the newest snapshot came in; None before one."""
        return None if self._appended_at is None else self._clock() - self._appended_at


@dataclass(frozen=True, slots=True)
class _Tick:
    snapshot: Snapshot
    utilization: ProcessUtilization | None


class Sampler:
    """Samples ``backend`` every ``interval`` seconds into ``ring``.

    ``annotate`` is the attributor's; ``deliver`` the report sender's ``submit`` (it must
    not block). ``clock`` stamps snapshots (seconds since the epoch); the schedule itself
    follows the event loop's clock, so tests can run it on fake time.
    """

    def __init__(
        self,
        backend: DeviceBackend,
        ring: SnapshotRing,
        *,
        interval: float = 1.0,
        process_interval: float = 10.0,
        annotate: Callable[[Snapshot], Snapshot] | None = None,
        deliver: Callable[[Snapshot], None] | None = None,
        events: SamplerEvents | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval <= 0 or process_interval <= 0:
            raise ValueError("sampling intervals must be positive")
        self.backend = backend
        self.ring = ring
        self.interval = interval
        self.process_interval = process_interval
        self._annotate = annotate
        self._deliver = deliver
        self._events: SamplerEvents = events or _NoEvents()
        self._clock = clock

    def sample_once(self, *, with_processes: bool) -> _Tick:
        """Read the backend once (blocking: call it off the event loop)."""
        now = self._clock()
        started = time.perf_counter()
        gpus = self.backend.sample_devices(now)
        utilization: ProcessUtilization | None = None
        if with_processes:
            try:
                utilization = self.backend.sample_process_utilization(now)
            except Exception:
                log.exception("reading per-process utilization failed")
                self._events.error("process_utilization")
            else:
                gpus = merge_process_utilization(gpus, utilization)
        self._events.sampled(time.perf_counter() - started)
        for gpu in gpus:
            if gpu.state is DeviceState.LOST:
                self._events.error("gpu_lost")
            elif gpu.state is DeviceState.UNKNOWN:
                self._events.error("gpu_unknown")
        return _Tick(Snapshot(timestamp=now, gpus=gpus), utilization)

    async def step(self, *, with_processes: bool) -> Snapshot | None:
        """One tick: sample in a worker thread, attribute, keep, deliver. ``None`` if sampling failed."""
        try:
            tick = await asyncio.to_thread(self.sample_once, with_processes=with_processes)
        except Exception:
            log.exception("sampling the devices failed")
            self._events.error("sample")
            return None
        snapshot = tick.snapshot
        if tick.utilization is not None:
            self.ring.record_process_utilization(tick.utilization)
        if self._annotate is not None:
            try:
                snapshot = self._annotate(snapshot)
            except Exception:
                # Unattributed readings are still true readings: keep them rather than drop the tick.
                log.exception("attributing the snapshot to pods failed")
                self._events.error("attribution")
        self.ring.append(snapshot)
        if self._deliver is not None:
            try:
                self._deliver(snapshot)
            except Exception:
                log.exception("handing the snapshot to the report sender failed")
                self._events.error("deliver")
        return snapshot

    async def run(self) -> None:
        """Sample forever on a fixed schedule; a slow tick skips the ticks it overran, never bunches up."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        next_processes = next_tick
        while True:
            with_processes = loop.time() >= next_processes
            if with_processes:
                missed = int((loop.time() - next_processes) // self.process_interval)
                next_processes += self.process_interval * (missed + 1)
            await self.step(with_processes=with_processes)
            next_tick += self.interval
            late = loop.time() - next_tick
            if late > 0:
                next_tick += self.interval * (int(late // self.interval) + 1)
            await asyncio.sleep(next_tick - loop.time())

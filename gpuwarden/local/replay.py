"""Scripted replays on scenario time: the same findings at any ``--speed``, on any host.

A scenario is sampled at its own instants, one sample per ``--interval`` of scenario time from
its start, never skipped or bunched: what the engine sees does not depend on how fast the host
is. The wall clock only paces the display (:class:`Pacer`): the loop sleeps while it is ahead of
``speed`` scenario seconds per wall second; a host that cannot keep up plays slower, says so
once, and finds the same things at the same scenario times. ``demo`` plays its
:class:`~gpuwarden.local.demo.ScenarioRun` this way; ``watch --scenario`` runs the agent's
sampler this way (:class:`ScenarioSampler`), hooks and ``/metrics`` included.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

from gpuwarden.agent.backend import DeviceBackend
from gpuwarden.agent.snapshots import Sampler, SamplerEvents, SnapshotRing
from gpuwarden.wire.node import Snapshot

PACE_AHEAD = 0.05
"""The loop runs at most this far (wall seconds) ahead of the paced schedule before it sleeps."""
YIELD_EVERY = 50
"""Behind or unpaced, the loop still yields to the event loop this often, so /metrics answers."""
BEHIND_NOTE = 1.0
"""Wall seconds behind the paced schedule before the replay says that it plays slower than asked."""


class Pacer:
    """Holds a replay to ``speed`` scenario seconds per wall second (None: as fast as it goes).

    It only ever sleeps: a replay behind its schedule plays on at the host's pace, and the first
    time it is :data:`BEHIND_NOTE` behind, ``note`` says so.
    """

    def __init__(
        self,
        speed: float | None,
        note: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.speed = speed
        self._note = note
        self._clock = clock
        self._started = clock()
        self._noted = False

    async def wait(self, t: float, i: int) -> None:
        """Before the ``i``-th step's successor, at scenario second ``t``: sleep while ahead of it."""
        if self.speed is None:
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            return
        ahead = self._started + t / self.speed - self._clock()
        if ahead > PACE_AHEAD:
            await asyncio.sleep(ahead)
            return
        if -ahead > BEHIND_NOTE and not self._noted and self._note is not None:
            self._noted = True
            played = t / max(self._clock() - self._started, 1e-9)
            self._note(
                f"note: this host plays the scenario at {played:.0f}x, not {self.speed:g}x; every sample "
                "is still taken at its scenario time, so the findings are the same, later"
            )
        if i % YIELD_EVERY == 0:
            await asyncio.sleep(0)


class ScenarioClock:
    """Scenario time as epoch seconds: what the replay last set it to (a sample's instant)."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class ScenarioSampler(Sampler):
    """The agent's sampler on scenario time: sample ``i`` at ``start + i * interval`` of ``clock``,
    per-process utilization every ``process_interval`` of it, paced by a :class:`Pacer`."""

    def __init__(
        self,
        backend: DeviceBackend,
        ring: SnapshotRing,
        *,
        clock: ScenarioClock,
        speed: float,
        interval: float = 1.0,
        process_interval: float = 10.0,
        annotate: Callable[[Snapshot], Snapshot] | None = None,
        deliver: Callable[[Snapshot], None] | None = None,
        events: SamplerEvents | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            backend,
            ring,
            interval=interval,
            process_interval=process_interval,
            annotate=annotate,
            deliver=deliver,
            events=events,
            clock=clock,
        )
        self.scenario_clock = clock
        self.speed = speed
        self._note = note

    async def run(self) -> None:
        """Sample until cancelled (each step hands the event loop its turn, so a stop comes between
        two samples, never after a skipped one)."""
        start = self.scenario_clock.now
        pacer = Pacer(self.speed, self._note)
        next_processes = 0.0
        for i in itertools.count():
            t = i * self.interval
            self.scenario_clock.now = start + t
            with_processes = t >= next_processes
            if with_processes:
                next_processes = t + self.process_interval
            await self.step(with_processes=with_processes)
            await pacer.wait(t + self.interval, i)

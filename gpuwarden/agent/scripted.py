"""The scripted backend: a scenario (:mod:`gpuwarden.sim`) played behind the same
:class:`~gpuwarden.agent.backend.DeviceBackend` as NVML, and its pods in place of the kubelet's.

The agent uses it only when told to (``--backend scripted --scenario FILE``), for demos and
end-to-end tests; local mode plays it too. The only module of the agent that imports the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gpuwarden.agent.backend import BackendError
from gpuwarden.sim.scenario import Scenario, ScenarioError, load_scenario
from gpuwarden.wire.node import GpuSample, ProcessUtilization, Snapshot


class ScriptedBackend:
    """A :class:`DeviceBackend` that plays a scenario in real time from ``origin`` (epoch seconds).

    ``origin`` defaults to the moment :meth:`open` is called, so ``t = now - origin``.
    """

    name = "scripted"

    def __init__(
        self, scenario: Scenario, *, origin: float | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.scenario = scenario
        self.origin = origin
        self._clock = clock
        self._sampled_at: float | None = None
        """Scenario time of the previous device sample: XIDs after it ride the next one."""

    @classmethod
    def load(cls, source: str) -> ScriptedBackend:
        """The backend of a scenario file, or a packaged one by name; :class:`BackendError` says
        why the file cannot be played."""
        try:
            return cls(load_scenario(source))
        except ScenarioError as exc:
            raise BackendError(str(exc)) from None

    def open(self) -> None:
        """Fix the origin if none was given."""
        if self.origin is None:
            self.origin = self._clock()

    def scenario_time(self, now: float) -> float:
        """Scenario time at epoch ``now``."""
        if self.origin is None:
            raise BackendError("ScriptedBackend used before open()")
        return max(0.0, now - self.origin)

    def sample_devices(self, now: float) -> list[GpuSample]:
        """The scenario's GPUs at ``now - origin``, with the XIDs raised since the previous call."""
        t = self.scenario_time(now)
        since = -1.0 if self._sampled_at is None else self._sampled_at
        self._sampled_at = t
        assert self.origin is not None  # scenario_time() checked it
        return self.scenario.gpu_samples(t, xids_since=since, origin=self.origin)

    def sample_process_utilization(self, now: float) -> ProcessUtilization:
        """The scenario's per-process utilization at ``now - origin``."""
        return self.scenario.process_utilization(self.scenario_time(now))

    def close(self) -> None:
        """Nothing to release."""


class ScenarioAttributor:
    """The pod attribution of a scenario, with the same ``refresh``/``annotate`` as the PodAttributor.

    There is no kubelet behind a scripted backend, so the scenario's pods stand in for
    the PodResources answer and its processes for /proc.
    """

    def __init__(self, backend: ScriptedBackend) -> None:
        self._backend = backend

    async def refresh(self) -> None:
        """Nothing to fetch: the scenario already knows every pod."""

    def annotate(self, snapshot: Snapshot) -> Snapshot:
        """Attribute the snapshot's GPUs and processes to the scenario's pods at the snapshot's time."""
        return self._backend.scenario.annotate(snapshot, self._backend.scenario_time(snapshot.timestamp))

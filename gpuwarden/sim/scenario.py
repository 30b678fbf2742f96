"""Scripted GPUs: a scenario played as a node's readings, processes and pods at any scenario time.

A scenario is a pure function of scenario time ``t`` (seconds since it started): the
live agent plays it in real time (``--backend scripted --scenario FILE``, through
:mod:`gpuwarden.agent.scripted`), and the demo and tests call :meth:`Scenario.gpu_samples` /
:meth:`Scenario.snapshot` at any ``t`` without sleeping. Noise is drawn from a hash of (seed,
GPU, signal, whole second), so the same file and ``t`` always give the same reading, in any
order and in any process. The file format is :mod:`gpuwarden.sim.spec`'s.

One thing is played forward instead: a served Deployment's requests (``service:``), whose queues
depend on every request before; :meth:`Scenario.service_metrics` must be asked at times that
never go back.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpuwarden.sim.replica import ReplicaMetrics
from gpuwarden.sim.scenarios import PACKAGED as PACKAGED  # re-exported: the names load_scenario takes
from gpuwarden.sim.signals import Signal, gauss
from gpuwarden.sim.spec import Ecc, GpuSpec, HealthEvent, MigSpec, ScenarioSpec, Throttle, Xid
from gpuwarden.sim.workloads import Deployment, ScenarioPod, ScenarioProcess, Service
from gpuwarden.wire.base import first_error
from gpuwarden.wire.node import (
    DeviceState,
    GpuHealth,
    GpuSample,
    PodHostMemory,
    PodRef,
    ProcessSample,
    ProcessUtilization,
    Snapshot,
    XidEvent,
    device_key,
    merge_process_utilization,
)

DEFAULT_ORIGIN = 1_800_000_000.0
"""The epoch :meth:`Scenario.snapshot` places ``t = 0`` at unless told otherwise (January 2027)."""


class ScenarioError(ValueError):
    """A scenario file that cannot be read; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class _Gpu:
    spec: GpuSpec
    index: int
    utilization: Signal
    memory: Signal
    sm_active: Signal | None
    health_ats: tuple[float, ...]
    health: tuple[str, ...]
    xids: tuple[Xid, ...] = ()
    ecc: tuple[Ecc, ...] = ()
    throttle: tuple[Throttle, ...] = ()
    migs: tuple[tuple[MigSpec, Signal], ...] = ()
    """Its MIG devices, each with its SM activity."""

    def lost(self, t: float) -> bool:
        i = bisect_right(self.health_ats, t) - 1
        return i >= 0 and self.health[i] == "lost"

    def xids_between(self, since: float, t: float, origin: float) -> list[XidEvent]:
        """The XIDs raised in ``(since, t]``, stamped ``origin`` + their ``at``."""
        return [XidEvent(code=x.code, timestamp=origin + x.at) for x in self.xids if since < x.at <= t]

    def health_at(self, t: float) -> GpuHealth:
        """The memory-error and clock-event readings at ``t`` (no XIDs)."""
        ecc = _latest(self.ecc, t)
        throttle = _latest(self.throttle, t)
        uncorrected = ecc.uncorrected if ecc is not None else 0
        return GpuHealth(
            ecc_uncorrected_aggregate=uncorrected,
            remapped_rows_uncorrectable=ecc.remapped_rows if ecc is not None else 0,
            row_remap_pending=ecc.remap_pending if ecc is not None else False,
            row_remap_failed=ecc.remap_failed if ecc is not None else False,
            clock_event_reasons=list(throttle.reasons) if throttle is not None else [],
        )


def _latest(pieces: tuple[Any, ...], t: float) -> Any:
    """The last of ``pieces`` (sorted by ``at``) at or before ``t``, or None."""
    i = bisect_right([p.at for p in pieces], t) - 1
    return pieces[i] if i >= 0 else None


# Derived GPM readings as shares of utilization: "utilization" counts time with any kernel
# running, SM activity is always lower, occupancy and tensor/DRAM activity lower still.
_SM_ACTIVE_SHARE = 0.85
_OCCUPANCY_SHARE = 0.45
_TENSOR_SHARE = 0.6
_DRAM_SHARE = 0.35
_IDLE_CLOCK_MHZ = 345
_BOOST_CLOCK_MHZ = 1980


class Scenario:
    """A loaded scenario: readings, processes and pods at any scenario time ``t``."""

    def __init__(self, spec: ScenarioSpec, source: str = "<memory>") -> None:
        self.spec = spec
        self.source = source
        self.name = spec.name
        self.duration = spec.duration
        seed = spec.seed
        self._gpus: list[_Gpu] = []
        for position, g in enumerate(spec.gpus):
            pieces = sorted(g.health, key=lambda e: e.at)
            events = [e for e in pieces if isinstance(e, HealthEvent)]
            self._gpus.append(
                _Gpu(
                    spec=g,
                    index=g.index if g.index is not None else position,
                    utilization=Signal.build(seed, f"{g.uuid}/utilization", g.utilization, 0.0, 100.0),
                    memory=Signal.build(seed, f"{g.uuid}/memory", g.memory, 0.0, g.memory_total),
                    sm_active=None
                    if g.sm_active is None
                    else Signal.build(seed, f"{g.uuid}/smActive", g.sm_active, 0.0, 100.0),
                    health_ats=tuple(e.at for e in events),
                    health=tuple(e.kind for e in events),
                    xids=tuple(e for e in pieces if isinstance(e, Xid)),
                    ecc=tuple(e for e in pieces if isinstance(e, Ecc)),
                    throttle=tuple(e for e in pieces if isinstance(e, Throttle)),
                    migs=tuple(
                        (m, Signal.build(seed, f"{m.uuid}/smActive", m.sm_active, 0.0, 100.0)) for m in g.mig
                    ),
                )
            )
        self.deployments = [Deployment(d, seed) for d in spec.deployments]
        self.services = [Service(d, d.spec.service, seed) for d in self.deployments if d.spec.service]
        """The served Deployments' requests (those with ``service:``), in file order."""
        self._replica_gpus = {uuid: (d, i) for d in self.deployments for i, uuid in enumerate(d.spec.gpus)}
        self.pods: list[ScenarioPod] = []
        for p in spec.pods:
            ref = PodRef(namespace=p.namespace, name=p.name, container=p.container, claim=p.claim)
            self.pods.append(
                ScenarioPod(
                    ref=ref,
                    labels=dict(p.labels),
                    annotations=dict(p.annotations),
                    gpus=tuple(p.gpus),
                    processes=tuple(
                        ScenarioProcess(
                            pid=proc.pid,
                            command=proc.command,
                            gpu=proc.gpu or p.gpus[0],
                            share=proc.share,
                            pod=ref,
                            kernels=proc.kernels,
                        )
                        for proc in p.processes
                    ),
                    start=p.from_,
                    end=p.until,
                    host_memory=None
                    if p.host_memory is None
                    else Signal.build(seed, f"{p.namespace}/{p.name}/host", p.host_memory, 0.0, 2.0**62),
                )
            )

    def pods_at(self, t: float) -> list[ScenarioPod]:
        """The pods that exist at scenario time ``t``, the Deployments' replicas included."""
        return [p for p in self.pods if p.active(t)] + [
            pod for d in self.deployments for pod in self._replica_pods(d, t)
        ]

    def _replica_pods(self, d: Deployment, t: float) -> list[ScenarioPod]:
        out = []
        spec = d.spec
        for i, uuid in enumerate(spec.gpus[: d.replicas(t)]):
            since = d.since(i, t)
            if since is None:
                continue
            pod = d.pods.get((i, since))
            if pod is None:
                ref = PodRef(namespace=spec.namespace, name=d.pod_name(i), container=spec.container)
                labels = {**spec.labels, "pod-template-hash": d.template_hash}
                process = ScenarioProcess(spec.pid + i, spec.command, uuid, 1.0, ref)
                pod = d.pods[i, since] = ScenarioPod(ref, labels, {}, (uuid,), (process,), since, None, None)
            out.append(pod)
        return out

    def service_metrics(self, t: float) -> list[tuple[PodRef, ReplicaMetrics]]:
        """What each serving replica of a served Deployment exports at ``t`` (vLLM's metrics, from
        :mod:`gpuwarden.sim.replica`'s model), every request up to ``t`` played; replicas still
        loading their model export nothing yet. Played forward: ``t`` must never go back."""
        out = []
        for service in self.services:
            spec = service.deployment.spec
            for index, metrics in service.metrics(t):
                ref = PodRef(
                    namespace=spec.namespace,
                    name=service.deployment.pod_name(index),
                    container=spec.container,
                )
                out.append((ref, metrics))
        return out

    def scale(self, namespace: str, name: str, replicas: int, t: float) -> bool:
        """Set a Deployment's replicas from scenario time ``t`` on (local mode's simulated target).

        Replicas beyond its GPUs stay unscheduled (no pod). Returns False when the scenario has
        no such Deployment. Times must not go back: a scenario is replayed forward.
        """
        for d in self.deployments:
            if (d.spec.namespace, d.spec.name) == (namespace, name):
                if replicas != d.replicas(t):
                    d.changes.append((t, max(0, replicas)))
                return True
        return False

    def _load(self, gpu: _Gpu, t: float) -> tuple[float, float]:
        """A GPU's (utilization, memory used) at ``t``: its replica's, if a Deployment placed one on it."""
        placed = self._replica_gpus.get(gpu.spec.uuid)
        if placed is not None:
            got = placed[0].replica_load(placed[1], t)
            if got is not None:
                return got
        return gpu.utilization(t), gpu.memory(t)

    def _processes_on(self, uuid: str, t: float) -> list[ScenarioProcess]:
        return [proc for pod in self.pods_at(t) for proc in pod.processes if proc.gpu == uuid]

    def gpu_samples(
        self, t: float, *, xids_since: float | None = None, origin: float = DEFAULT_ORIGIN
    ) -> list[GpuSample]:
        """Every GPU at scenario time ``t``, as the NVML backend would read it (no pods, no sm_util).

        With ``xids_since``, each GPU's health carries the XIDs raised in ``(xids_since, t]``
        (what NVML's event thread delivered since the previous sample), stamped ``origin + at``.
        """
        out = []
        for gpu in self._gpus:
            out.append(self._gpu_sample(gpu, t, xids_since, origin))
            out.extend(self._mig_sample(gpu, mig, sm, t) for mig, sm in gpu.migs)
        return out

    def _mig_sample(self, gpu: _Gpu, mig: MigSpec, sm_active: Signal, t: float) -> GpuSample:
        """A MIG device of ``gpu`` as NVML reads it: its memory and GPM's SM activity (Hopper and
        later), its processes; no utilization."""
        spec = gpu.spec
        if gpu.lost(t):
            return GpuSample(
                uuid=spec.uuid, index=gpu.index, model=spec.model, mig_id=mig.uuid, state=DeviceState.LOST
            )
        return GpuSample(
            uuid=spec.uuid,
            index=gpu.index,
            model=spec.model,
            mig_id=mig.uuid,
            memory_total_bytes=round(mig.memory_total),
            processes=[ProcessSample(pid=p.pid, command=p.command) for p in self._processes_on(mig.uuid, t)],
            sm_active=sm_active(t) if spec.gpm else None,
        )

    def _gpu_sample(self, gpu: _Gpu, t: float, xids_since: float | None, origin: float) -> GpuSample:
        spec = gpu.spec
        xids = gpu.xids_between(xids_since, t, origin) if xids_since is not None else []
        if gpu.lost(t):
            return GpuSample(
                uuid=spec.uuid,
                index=gpu.index,
                model=spec.model,
                state=DeviceState.LOST,
                health=GpuHealth(xids=xids) if xids else None,
            )
        health = gpu.health_at(t)
        util, used = self._load(gpu, t)
        procs = self._processes_on(spec.uuid, t)
        shares = sum(p.share for p in procs)
        attributable = max(0.0, used - spec.reserved_memory)
        sm = gpu.sm_active(t) if gpu.sm_active is not None else util * _SM_ACTIVE_SHARE
        gpm = spec.gpm  # without GPM (pre-Hopper) these readings are absent, not zero
        jitter = gauss(self.spec.seed, f"{spec.uuid}/temperature", math.floor(t))
        return GpuSample(
            uuid=spec.uuid,
            index=gpu.index,
            model=spec.model,
            utilization_gpu=util,
            memory_used_bytes=round(used),
            memory_total_bytes=round(spec.memory_total),
            temperature_c=round(32.0 + 0.4 * util + 0.5 * jitter, 1),
            power_watts=round(spec.idle_watts + (spec.max_watts - spec.idle_watts) * util / 100.0, 1),
            sm_clock_mhz=round(_IDLE_CLOCK_MHZ + (_BOOST_CLOCK_MHZ - _IDLE_CLOCK_MHZ) * min(1.0, util / 20)),
            ecc_uncorrected=health.ecc_uncorrected_aggregate,
            health=health.model_copy(update={"xids": xids}),
            processes=[
                ProcessSample(
                    pid=p.pid,
                    used_memory_bytes=round(attributable * p.share / shares),
                    command=p.command,
                )
                for p in procs
            ],
            sm_active=sm if gpm else None,
            sm_occupancy=util * _OCCUPANCY_SHARE if gpm else None,
            tensor_active=util * _TENSOR_SHARE if gpm else None,
            dram_active=util * _DRAM_SHARE if gpm else None,
        )

    def process_utilization(self, t: float) -> ProcessUtilization:
        """Per-process SM utilization at ``t``: the GPU's utilization split by the shares of the
        processes that run kernels; those that run none are not listed (as NVML lists them)."""
        out: ProcessUtilization = {}
        for gpu in self._gpus:
            if gpu.lost(t) or not gpu.spec.process_utilization:
                continue
            procs = [p for p in self._processes_on(gpu.spec.uuid, t) if p.kernels]
            shares = sum(p.share for p in procs)
            util = self._load(gpu, t)[0]
            out[gpu.spec.uuid] = {p.pid: util * p.share / shares for p in procs}
        return out

    def annotate(self, snapshot: Snapshot, t: float) -> Snapshot:
        """Fill in pods, process owners and pod host memory as the kubelet and /proc would at ``t``."""
        pods = self.pods_at(t)
        owners = {proc.pid: pod.ref for pod in pods for proc in pod.processes}
        gpus = []
        for sample in snapshot.gpus:
            key = device_key(sample)
            allocated = [pod.ref for pod in pods if key in pod.gpus]
            processes = [p.model_copy(update={"pod": owners.get(p.pid)}) for p in sample.processes]
            gpus.append(sample.model_copy(update={"pods": allocated, "processes": processes}))
        host = [
            PodHostMemory(namespace=p.ref.namespace, name=p.ref.name, memory_bytes=round(p.host_memory(t)))
            for p in pods
            if p.host_memory is not None
        ]
        return snapshot.model_copy(update={"gpus": gpus, "pod_host_memory": host})

    def snapshot(self, t: float, *, origin: float = DEFAULT_ORIGIN) -> Snapshot:
        """The fully attributed snapshot at ``t``, per-process utilization included, stamped ``origin + t``.

        What the demo plays through the engine, compressed: no sleeping, no agent.
        """
        gpus = merge_process_utilization(self.gpu_samples(t), self.process_utilization(t))
        return self.annotate(Snapshot(timestamp=origin + t, gpus=gpus), t)


def packaged_scenario(name: str) -> Path:
    """The path of a scenario shipped with gpuwarden (``demo``, ``e2e-fast``)."""
    if name not in PACKAGED:
        raise ScenarioError(f"no packaged scenario {name!r}; packaged: {', '.join(PACKAGED)}")
    return Path(str(resources.files("gpuwarden.sim") / "scenarios" / f"{name}.yaml"))


def load_scenario(source: str | Path) -> Scenario:
    """Load a scenario from a file path, or by name if it is one of :data:`PACKAGED`."""
    path = Path(source)
    if not path.exists() and str(source) in PACKAGED:
        path = packaged_scenario(str(source))
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{source}: not valid YAML: {exc}") from None
    return parse_scenario(data, source=str(path))


def parse_scenario(data: Any, *, source: str = "<memory>") -> Scenario:
    """Validate a scenario already read into Python objects; :class:`ScenarioError` names the field."""
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {first_error(exc, top='(top level)')}") from None
    return Scenario(spec, source)

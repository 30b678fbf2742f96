"""Scripted GPUs: a scenario file played behind the same :class:`DeviceBackend` as NVML.

A scenario is a pure function of scenario time ``t`` (seconds since it started): the
live agent plays it in real time (``--backend scripted --scenario FILE``), and the demo
and tests call :meth:`Scenario.gpu_samples` / :meth:`Scenario.snapshot` at any ``t``
without sleeping. Noise is drawn from a hash of (seed, GPU, signal, whole second), so the
same file and ``t`` always give the same reading, in any order and in any process.

The file format (YAML, camelCase; durations as in policies, ``10s``/``5m``; sizes as
Kubernetes quantities, ``6Gi``; rates as ``200Mi/m``)::

    name: demo
    duration: 30m
    seed: 7
    gpus:
      - uuid: GPU-…
        model: NVIDIA H200
        memoryTotal: 143771Mi
        gpm: true                  # whether smActive & co. are reported (Hopper+)
        utilization:               # percent; a list of pieces, each from its `at` on
          - {kind: idle, level: 3, noise: 1, spikeEvery: 7m, spikeFor: 20s, spikeLevel: 30}
        memory:                    # bytes used on the device
          - {kind: staircase, start: 2Gi, step: 30Gi, every: 15s, steps: 4}
          - {kind: leak, at: 1m, rate: 200Mi/m, noise: 4Mi, max: 139Gi}
        health:                    # optional
          - {kind: lost, at: 20m}
          - {kind: recover, at: 22m}
          - {kind: xid, at: 20m, code: 79}
          - {kind: ecc, at: 25m, uncorrected: 2, remapPending: true}
          - {kind: throttle, at: 26m, reasons: [hwThermalSlowdown]}
    pods:
      - namespace: research
        name: notebook-0
        container: notebook
        labels: {app: notebook}
        gpus: [GPU-…]
        processes:
          - {pid: 4242, command: python train.py}
          - {pid: 4243, command: python idle.py, kernels: false}  # holds memory, runs nothing
        from: 0s                   # optional window in which the pod exists
        until: 10m

Pieces: ``idle`` (level, noise, optional spikes), ``leak`` (start, rate, noise, max),
``staircase`` (start, step, every, steps: steps then a plateau), ``sawtooth`` (low, high,
period), ``saturated`` (level, default 98). ``start`` may be left out to continue from
where the previous piece was. Health pieces: ``lost`` and ``recover`` take the GPU off the
bus and back; ``xid`` raises one XID at ``at`` (what NVML's event thread would deliver; no
XID can be injected on a real GPU); ``ecc`` sets the memory-error readings from ``at`` on;
``throttle`` sets the clock event reasons from ``at`` on (``reasons: []`` clears them). See
docs/agent.md for the derived readings (GPM, power, clocks).

Per-process utilization is the GPU's utilization split by ``share`` among the processes
that run kernels; one with ``kernels: false`` is left out of the per-process reading, as
NVML leaves out a process that ran no kernel (the agent then reads it as 0%). A GPU with
``processUtilization: false`` has no per-process reading at all (as on a MIG device):
its processes' utilization is unknown.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from bisect import bisect_right
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from gpuwarden.policy.units import parse_duration, parse_quantity, parse_rate
from gpuwarden.sim.scenarios import PACKAGED as PACKAGED  # re-exported: the names load_scenario takes
from gpuwarden.wire.base import first_error
from gpuwarden.wire.node import (
    ClockEventReason,
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


# -- file format --------------------------------------------------------------------------------


def _seconds(value: Any) -> Any:
    return parse_duration(value) if isinstance(value, str) else value


def _amount(value: Any) -> Any:
    return parse_quantity(value) if isinstance(value, str) else value


def _per_second(value: Any) -> Any:
    # A plain number is "units per minute", the way people state leaks.
    if isinstance(value, str):
        return parse_rate(value)
    return value / 60 if isinstance(value, int | float) and not isinstance(value, bool) else value


Seconds = Annotated[float, BeforeValidator(_seconds), Field(ge=0)]
Amount = Annotated[float, BeforeValidator(_amount), Field(ge=0)]
PerSecond = Annotated[float, BeforeValidator(_per_second)]


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class _Piece(_Spec):
    at: Seconds = 0.0
    noise: Amount = 0.0
    """Standard deviation of the noise added to the piece's value."""

    def base(self, tau: float, start: float) -> float:
        """The noise-free value ``tau`` seconds into the piece, given where the previous one ended."""
        raise NotImplementedError


class Idle(_Piece):
    """A flat level with noise and, optionally, a brief spike every ``spike_every``."""

    kind: Literal["idle"]
    level: Amount
    spike_every: Seconds | None = None
    spike_for: Seconds = 10.0
    spike_level: Amount | None = None

    def base(self, tau: float, start: float) -> float:
        """The level, or the spike level in the last ``spike_for`` seconds of each period."""
        spiking = (
            self.spike_every is not None
            and self.spike_level is not None
            and tau % self.spike_every >= self.spike_every - self.spike_for
        )
        return self.spike_level if spiking and self.spike_level is not None else self.level


class Leak(_Piece):
    """Steady growth at ``rate`` (a ``200Mi/m`` string, or a number per minute) up to ``max``."""

    kind: Literal["leak"]
    start: Amount | None = None
    rate: PerSecond
    max: Amount | None = None

    def base(self, tau: float, start: float) -> float:
        """Linear from the start, capped."""
        value = (self.start if self.start is not None else start) + self.rate * tau
        return value if self.max is None else min(value, self.max)


class Staircase(_Piece):
    """A caching allocator: ``steps`` jumps of ``step``, one every ``every``, then a plateau."""

    kind: Literal["staircase"]
    start: Amount | None = None
    step: Amount
    every: Annotated[float, BeforeValidator(_seconds), Field(gt=0)]
    steps: int = Field(ge=1)

    def base(self, tau: float, start: float) -> float:
        """``start`` plus the steps taken so far (the first one at ``tau = 0``)."""
        taken = min(self.steps, math.floor(tau / self.every) + 1)
        return (self.start if self.start is not None else start) + self.step * taken


class Sawtooth(_Piece):
    """A ramp from ``low`` to ``high`` over ``period``, then back to ``low``."""

    kind: Literal["sawtooth"]
    low: Amount
    high: Amount
    period: Annotated[float, BeforeValidator(_seconds), Field(gt=0)]

    def base(self, tau: float, start: float) -> float:
        """Linear within each period."""
        return self.low + (self.high - self.low) * ((tau % self.period) / self.period)


class Saturated(_Piece):
    """A busy device: a high level (98 by default) with a little noise."""

    kind: Literal["saturated"]
    level: Amount = 98.0
    noise: Amount = 1.0

    def base(self, tau: float, start: float) -> float:
        """The level."""
        return self.level


class Ramp(_Piece):
    """A straight line from where the previous piece ended (or ``start``) to ``to`` in ``over``; then flat."""

    kind: Literal["ramp"]
    start: Amount | None = None
    to: Amount
    over: Annotated[float, BeforeValidator(_seconds), Field(gt=0)]

    def base(self, tau: float, start: float) -> float:
        """Linear for ``over`` seconds, then ``to``."""
        begin = self.start if self.start is not None else start
        return begin + (self.to - begin) * min(1.0, tau / self.over)


Piece = Annotated[Idle | Leak | Staircase | Sawtooth | Saturated | Ramp, Field(discriminator="kind")]


class HealthEvent(_Spec):
    """``lost``: the GPU falls off the bus at ``at``; ``recover``: it is back."""

    kind: Literal["lost", "recover"]
    at: Seconds


class Xid(_Spec):
    """One XID raised at ``at`` (it rides the first sample at or after it)."""

    kind: Literal["xid"]
    at: Seconds
    code: int = Field(ge=1, le=2**32 - 1)


class Ecc(_Spec):
    """The GPU's memory-error readings from ``at`` on (until the next ``ecc``)."""

    kind: Literal["ecc"]
    at: Seconds
    uncorrected: int = Field(default=0, ge=0)
    """Uncorrected ECC errors: the volatile count, and as many more over the card's life."""
    remapped_rows: int = Field(default=0, ge=0)
    """Rows remapped for uncorrectable errors."""
    remap_pending: bool = False
    remap_failed: bool = False


class Throttle(_Spec):
    """The clock event reasons from ``at`` on (until the next ``throttle``; ``[]`` clears them)."""

    kind: Literal["throttle"]
    at: Seconds
    reasons: list[ClockEventReason] = Field(max_length=16)


HealthPiece = Annotated[HealthEvent | Xid | Ecc | Throttle, Field(discriminator="kind")]


class GpuSpec(_Spec):
    """One scripted GPU."""

    uuid: str = Field(min_length=1, max_length=128)
    index: int | None = Field(default=None, ge=0)
    model: str = "NVIDIA H200"
    memory_total: Amount
    gpm: bool = True
    reserved_memory: Amount = float(512 * 2**20)
    """Device memory used by the driver and CUDA contexts, not attributed to any process."""
    idle_watts: float = Field(default=90.0, ge=0)
    max_watts: float = Field(default=700.0, ge=0)
    utilization: list[Piece] = Field(min_length=1)
    memory: list[Piece] = Field(min_length=1)
    sm_active: list[Piece] | None = None
    """If left out, SM activity is derived from utilization (see docs/agent.md)."""
    health: list[HealthPiece] = Field(default_factory=list)
    process_utilization: bool = True
    """Whether per-process utilization can be read (False: as on a MIG device, no reading at all)."""


class ProcessSpec(_Spec):
    """One process of a pod, holding a CUDA context on ``gpu`` (the pod's first GPU by default)."""

    pid: int = Field(ge=1)
    command: str = Field(default="", max_length=4096)
    gpu: str | None = None
    share: float = Field(default=1.0, gt=0)
    """This process's share of the GPU's memory (above the reserved part) and utilization."""
    kernels: bool = True
    """Whether it launches kernels; False: it holds its memory and context and computes nothing."""


class PodSpec(_Spec):
    """One pod: what the kubelet allocated it and which processes it runs."""

    namespace: str = Field(min_length=1, max_length=253)
    name: str = Field(min_length=1, max_length=253)
    container: str = Field(default="", max_length=253)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    gpus: list[str] = Field(default_factory=list)
    processes: list[ProcessSpec] = Field(default_factory=list)
    from_: Seconds = Field(default=0.0, alias="from")
    until: Seconds | None = None
    host_memory: list[Piece] | None = None
    """The pod's host (CPU) memory over time, reported as ``podHostMemory``."""


class DeploymentSpec(_Spec):
    """A Deployment whose replicas share one load: replica ``i`` is a pod on ``gpus[i]``.

    ``load`` is in replica percent (100: one replica fully busy), split evenly over the
    replicas that serve; a new replica serves ``startup`` after it appears, loading its
    model until then (utilization near 0; memory in :data:`_REPLICA_LOADING_SHARDS` equal steps up
    to ``memory``, as a server copies its weights shard by shard and takes its cache at once).
    """

    namespace: str = Field(min_length=1, max_length=253)
    name: str = Field(min_length=1, max_length=200)
    container: str = Field(default="server", max_length=253)
    labels: dict[str, str] = Field(default_factory=dict)
    gpus: list[str] = Field(min_length=1)
    replicas: int = Field(default=1, ge=0)
    startup: Seconds = 90.0
    load: list[Piece] = Field(min_length=1)
    memory: Amount
    command: str = Field(default="", max_length=4096)
    pid: int = Field(ge=1)
    """The first replica's process id; replica ``i`` runs ``pid + i``."""


class ScenarioSpec(_Spec):
    """A whole scenario file."""

    name: str = Field(min_length=1)
    description: str = ""
    duration: Seconds
    seed: int = 0
    gpus: list[GpuSpec] = Field(min_length=1, max_length=64)
    pods: list[PodSpec] = Field(default_factory=list)
    deployments: list[DeploymentSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> ScenarioSpec:
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError("gpus: two GPUs share a uuid")
        pids: set[int] = set()
        for pod in self.pods:
            for uuid in pod.gpus:
                if uuid not in uuids:
                    raise ValueError(f"pods: {pod.namespace}/{pod.name} is allocated {uuid}, not a GPU here")
            for proc in pod.processes:
                if proc.pid in pids:
                    raise ValueError(f"pods: pid {proc.pid} appears twice")
                pids.add(proc.pid)
                runs_on = proc.gpu or (pod.gpus[0] if pod.gpus else None)
                if runs_on is None or runs_on not in pod.gpus:
                    where = f"{pod.namespace}/{pod.name}"
                    raise ValueError(f"pods: {where} pid {proc.pid} must run on one of the pod's gpus")
        allocated = {uuid for pod in self.pods for uuid in pod.gpus}
        for d in self.deployments:
            where = f"deployments: {d.namespace}/{d.name}"
            for uuid in d.gpus:
                if uuid not in uuids:
                    raise ValueError(f"{where} places replicas on {uuid}, not a GPU here")
                if uuid in allocated:
                    raise ValueError(f"{where}: {uuid} is already allocated to a pod or a Deployment")
                allocated.add(uuid)
            if d.replicas > len(d.gpus):
                raise ValueError(f"{where}: {d.replicas} replicas need as many gpus")
            theirs = set(range(d.pid, d.pid + len(d.gpus)))
            if pids & theirs:
                raise ValueError(f"{where}: pids {d.pid}.. overlap another process's")
            pids.update(theirs)
            if d.load[0].at != 0 or [p.at for p in d.load] != sorted(p.at for p in d.load):
                raise ValueError(f"{where} load: pieces must start at 0 and go forward")
        for spec in self.gpus:
            for label, pieces in (("utilization", spec.utilization), ("memory", spec.memory)):
                ats = [p.at for p in pieces]
                if ats[0] != 0 or ats != sorted(ats):
                    raise ValueError(f"gpus: {spec.uuid} {label}: pieces must start at 0 and go forward")
        return self


# -- evaluation ---------------------------------------------------------------------------------


def _gauss(seed: int, key: str, bucket: int) -> float:
    """A standard normal draw that depends only on its arguments (not on call order or process)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{bucket}".encode(), digest_size=16).digest()
    a, b = struct.unpack("<QQ", digest)
    u1 = (a + 1) / 2.0**64  # in (0, 1]: log() is safe
    u2 = b / 2.0**64
    draw = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return max(-3.0, min(3.0, draw))  # three sigma: noise, not outliers


@dataclass(frozen=True, slots=True)
class _Signal:
    """A list of pieces resolved into (start time, piece, value carried in) and evaluated at ``t``."""

    seed: int
    key: str
    ats: tuple[float, ...]
    pieces: tuple[_Piece, ...]
    carried: tuple[float, ...]
    low: float
    high: float

    @classmethod
    def build(cls, seed: int, key: str, pieces: list[Any], low: float, high: float) -> _Signal:
        # What each piece continues from when it has no `start`: where the one before ended.
        carried = [0.0]
        for before, piece in itertools.pairwise(pieces):
            carried.append(before.base(piece.at - before.at, carried[-1]))
        return cls(seed, key, tuple(p.at for p in pieces), tuple(pieces), tuple(carried), low, high)

    def __call__(self, t: float) -> float:
        i = max(0, bisect_right(self.ats, t) - 1)
        piece = self.pieces[i]
        value = piece.base(t - piece.at, self.carried[i])
        if piece.noise:
            value += piece.noise * _gauss(self.seed, self.key, math.floor(t))
        return min(self.high, max(self.low, value))


@dataclass(frozen=True, slots=True)
class ScenarioProcess:
    """One scripted process, resolved: which GPU it runs on and which pod owns it."""

    pid: int
    command: str
    gpu: str
    share: float
    pod: PodRef
    kernels: bool = True


@dataclass(frozen=True, slots=True)
class ScenarioPod:
    """One scripted pod, with what the demo's selectors need (labels, annotations)."""

    ref: PodRef
    labels: dict[str, str]
    annotations: dict[str, str]
    gpus: tuple[str, ...]
    processes: tuple[ScenarioProcess, ...]
    start: float
    end: float | None
    host_memory: _Signal | None

    def active(self, t: float) -> bool:
        """Whether the pod exists at scenario time ``t``."""
        return self.start <= t and (self.end is None or t < self.end)


@dataclass(frozen=True, slots=True)
class _Gpu:
    spec: GpuSpec
    index: int
    utilization: _Signal
    memory: _Signal
    sm_active: _Signal | None
    health_ats: tuple[float, ...]
    health: tuple[str, ...]
    xids: tuple[Xid, ...] = ()
    ecc: tuple[Ecc, ...] = ()
    throttle: tuple[Throttle, ...] = ()

    def lost(self, t: float) -> bool:
        i = bisect_right(self.health_ats, t) - 1
        return i >= 0 and self.health[i] == "lost"

    def xids_between(self, since: float, t: float, origin: float) -> list[XidEvent]:
        """The XIDs raised in ``(since, t]``, stamped ``origin`` + their ``at``."""
        return [XidEvent(code=x.code, timestamp=origin + x.at) for x in self.xids if since < x.at <= t]

    def readings(self, t: float) -> GpuHealth:
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


_REPLICA_LOADING_UTILIZATION = 2.0
"""A replica loading its model: a trickle of kernels (weight conversion, warm-up), nothing served."""
_REPLICA_LOADING_SHARDS = 8
"""The steps a replica's memory takes while it loads (the first as it appears)."""


class _Deployment:
    """A Deployment's replicas over time: each count it was scaled to, and when (:meth:`Scenario.scale`)."""

    def __init__(self, spec: DeploymentSpec, seed: int) -> None:
        self.spec = spec
        self.load = _Signal.build(seed, f"{spec.namespace}/{spec.name}/load", spec.load, 0.0, 1e9)
        # The replicas the file starts with are up already: they appeared a start-up time before t = 0.
        self.changes: list[tuple[float, int]] = [(-spec.startup, spec.replicas)]
        digest = hashlib.blake2b(f"{seed}/{spec.namespace}/{spec.name}".encode(), digest_size=8).hexdigest()
        self.template_hash = "".join(_POD_NAME_CHARS[int(c, 16)] for c in digest[:9])
        self.pods: dict[tuple[int, float], ScenarioPod] = {}
        """Replica pods by (index, when it appeared): read at every sample, built once."""

    def replicas(self, t: float) -> int:
        i = bisect_right([at for at, _ in self.changes], t) - 1
        return self.changes[max(0, i)][1]

    def since(self, index: int, t: float) -> float | None:
        """When replica ``index`` (0-based) last appeared at or before ``t``; None if it does not exist."""
        if self.replicas(t) <= index:
            return None
        since = self.changes[0][0]
        count = 0
        for at, replicas in self.changes:
            if at > t:
                break
            if count <= index < replicas:
                since = at
            count = replicas
        return since

    def serving(self, t: float) -> int:
        n = min(self.replicas(t), len(self.spec.gpus))
        starts = (self.since(i, t) for i in range(n))
        return sum(1 for since in starts if since is not None and t - since >= self.spec.startup)

    def pod_name(self, index: int) -> str:
        suffix = hashlib.blake2b(f"{self.template_hash}/{index}".encode(), digest_size=5).digest()
        return f"{self.spec.name}-{self.template_hash}-{''.join(_POD_NAME_CHARS[b % 27] for b in suffix)}"

    def readings(self, index: int, t: float) -> tuple[float, float] | None:
        """Replica ``index``'s (utilization, memory used) at ``t``; None when it does not exist."""
        since = self.since(index, t)
        if since is None:
            return None
        age = t - since
        if age < self.spec.startup:
            shards = math.floor(age / self.spec.startup * _REPLICA_LOADING_SHARDS) + 1
            return _REPLICA_LOADING_UTILIZATION, self.spec.memory * shards / _REPLICA_LOADING_SHARDS
        return min(100.0, self.load(t) / max(1, self.serving(t))), self.spec.memory


_POD_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"
"""The alphabet of generated Kubernetes name suffixes (no vowels, no look-alikes)."""

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
                    utilization=_Signal.build(seed, f"{g.uuid}/utilization", g.utilization, 0.0, 100.0),
                    memory=_Signal.build(seed, f"{g.uuid}/memory", g.memory, 0.0, g.memory_total),
                    sm_active=None
                    if g.sm_active is None
                    else _Signal.build(seed, f"{g.uuid}/smActive", g.sm_active, 0.0, 100.0),
                    health_ats=tuple(e.at for e in events),
                    health=tuple(e.kind for e in events),
                    xids=tuple(e for e in pieces if isinstance(e, Xid)),
                    ecc=tuple(e for e in pieces if isinstance(e, Ecc)),
                    throttle=tuple(e for e in pieces if isinstance(e, Throttle)),
                )
            )
        self.deployments = [_Deployment(d, seed) for d in spec.deployments]
        self._replica_gpus = {uuid: (d, i) for d in self.deployments for i, uuid in enumerate(d.spec.gpus)}
        self.pods: list[ScenarioPod] = []
        for p in spec.pods:
            ref = PodRef(namespace=p.namespace, name=p.name, container=p.container)
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
                    else _Signal.build(seed, f"{p.namespace}/{p.name}/host", p.host_memory, 0.0, 2.0**62),
                )
            )

    def pods_at(self, t: float) -> list[ScenarioPod]:
        """The pods that exist at scenario time ``t``, the Deployments' replicas included."""
        return [p for p in self.pods if p.active(t)] + [
            pod for d in self.deployments for pod in self._replica_pods(d, t)
        ]

    def _replica_pods(self, d: _Deployment, t: float) -> list[ScenarioPod]:
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

    def _readings(self, gpu: _Gpu, t: float) -> tuple[float, float]:
        """A GPU's (utilization, memory used) at ``t``: its replica's, if a Deployment placed one on it."""
        placed = self._replica_gpus.get(gpu.spec.uuid)
        if placed is not None:
            got = placed[0].readings(placed[1], t)
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
        return [self._gpu_sample(gpu, t, xids_since, origin) for gpu in self._gpus]

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
        health = gpu.readings(t)
        util, used = self._readings(gpu, t)
        procs = self._processes_on(spec.uuid, t)
        shares = sum(p.share for p in procs)
        attributable = max(0.0, used - spec.reserved_memory)
        sm = gpu.sm_active(t) if gpu.sm_active is not None else util * _SM_ACTIVE_SHARE
        gpm = spec.gpm  # without GPM (pre-Hopper) these readings are absent, not zero
        jitter = _gauss(self.spec.seed, f"{spec.uuid}/temperature", math.floor(t))
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
            util = self._readings(gpu, t)[0]
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

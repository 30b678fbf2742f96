"""The scenario file format: what a scenario file may say, validated with the field's name.

YAML, camelCase; durations as in policies, ``10s``/``5m``; sizes as Kubernetes quantities,
``6Gi``; rates as ``200Mi/m``::

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
        mig:                       # optional: MIG mode, its MIG devices listed beside the GPU
          - {uuid: MIG-…, memoryTotal: 35Gi, smActive: [{kind: idle, level: 70}]}
    pods:
      - namespace: research
        name: notebook-0
        container: notebook
        labels: {app: notebook}
        gpus: [GPU-…]              # GPUs or MIG devices, by uuid
        claim: shared-gpu          # optional: the DRA ResourceClaim it holds them through
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

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from gpuwarden.units import parse_duration, parse_quantity, parse_rate
from gpuwarden.wire.node import DNS_SUBDOMAIN, ClockEventReason


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


class PieceSpec(_Spec):
    """One piece of a signal (utilization, memory, a load): its shape from ``at`` on, plus noise."""

    at: Seconds = 0.0
    noise: Amount = 0.0
    """Standard deviation of the noise added to the piece's value."""

    def base(self, tau: float, start: float) -> float:
        """The noise-free value ``tau`` seconds into the piece, given where the previous one ended."""
        raise NotImplementedError


class Idle(PieceSpec):
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


class Leak(PieceSpec):
    """Steady growth at ``rate`` (a ``200Mi/m`` string, or a number per minute) up to ``max``."""

    kind: Literal["leak"]
    start: Amount | None = None
    rate: PerSecond
    max: Amount | None = None

    def base(self, tau: float, start: float) -> float:
        """Linear from the start, capped."""
        value = (self.start if self.start is not None else start) + self.rate * tau
        return value if self.max is None else min(value, self.max)


class Staircase(PieceSpec):
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


class Sawtooth(PieceSpec):
    """A ramp from ``low`` to ``high`` over ``period``, then back to ``low``."""

    kind: Literal["sawtooth"]
    low: Amount
    high: Amount
    period: Annotated[float, BeforeValidator(_seconds), Field(gt=0)]

    def base(self, tau: float, start: float) -> float:
        """Linear within each period."""
        return self.low + (self.high - self.low) * ((tau % self.period) / self.period)


class Saturated(PieceSpec):
    """A busy device: a high level (98 by default) with a little noise."""

    kind: Literal["saturated"]
    level: Amount = 98.0
    noise: Amount = 1.0

    def base(self, tau: float, start: float) -> float:
        """The level."""
        return self.level


class Ramp(PieceSpec):
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


class MigSpec(_Spec):
    """One MIG device of a GPU in MIG mode: its memory and its SM activity (GPM's); NVML gives a MIG
    device neither a utilization nor a per-process reading."""

    uuid: str = Field(min_length=1, max_length=128)
    memory_total: Amount
    sm_active: list[Piece] = Field(min_length=1)


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
    mig: list[MigSpec] = Field(default_factory=list, max_length=7)
    """Its MIG devices, if it is in MIG mode: each listed beside the GPU, as NVML lists them; pods
    are allocated them by their ``uuid``."""


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
    claim: str | None = Field(default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """The ResourceClaim through which it holds its GPUs, when DRA allocated them (pods naming the
    same GPU and claim share it)."""
    processes: list[ProcessSpec] = Field(default_factory=list)
    from_: Seconds = Field(default=0.0, alias="from")
    until: Seconds | None = None
    host_memory: list[Piece] | None = None
    """The pod's host (CPU) memory over time, reported as ``podHostMemory``."""


class ServiceSpec(_Spec):
    """A Deployment's replicas as inference servers (:mod:`gpuwarden.sim.replica`'s model, one per
    serving replica): the Deployment's ``load`` is then also its request rate, 100 being what one
    replica serves with a full batch, spread round-robin over the replicas that serve. What they
    export (vLLM's metrics) is :meth:`~gpuwarden.sim.scenario.Scenario.service_metrics`'s.
    """

    max_batch: int = Field(default=16, ge=1, le=1024)
    prefill: Seconds = 0.1
    """Time to first token of a request served alone."""
    token_time: Seconds = 0.02
    """Time between output tokens of a request served alone."""
    batch_slowdown: float = Field(default=0.6, ge=0, le=10)
    mean_prompt_tokens: int = Field(default=512, ge=1, le=65536)
    mean_output_tokens: int = Field(default=128, ge=1, le=65536)
    """The requests' mean output length that ``load`` is counted in: at 100, one replica's full
    batch of requests this long."""
    output_tokens: list[Piece] | None = None
    """The requests' mean output length over time (default: ``meanOutputTokens`` throughout). Longer
    answers at the same request rate fill the batches and the queue; the GPU readings, which follow
    ``load``, do not show it, as a memory-bound decode keeps a GPU as busy with 10 sequences as with 16."""
    token_spread: float = Field(default=0.5, ge=0, le=3)
    """Sigma of the log-normal that each request's token counts are drawn from."""


class DeploymentSpec(_Spec):
    """A Deployment whose replicas share one load: replica ``i`` is a pod on ``gpus[i]``.

    ``load`` is in replica percent (100: one replica fully busy), split evenly over the
    replicas that serve; a new replica serves ``startup`` after it appears, loading its
    model until then (utilization near 0; memory in
    :data:`~gpuwarden.sim.workloads.REPLICA_LOADING_SHARDS` equal steps up to ``memory``, as a
    server copies its weights shard by shard and takes its cache at once).
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
    service: ServiceSpec | None = None
    """Its replicas serve requests, queue them and export vLLM's metrics; None: GPU readings only."""


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
        devices = uuids + [m.uuid for g in self.gpus for m in g.mig]
        if len(set(devices)) != len(devices):
            raise ValueError("gpus: two GPUs or MIG devices share a uuid")
        for g in self.gpus:
            if sum(m.memory_total for m in g.mig) > g.memory_total:
                raise ValueError(f"gpus: {g.uuid} mig: its MIG devices' memory is more than the GPU's")
        pids: set[int] = set()
        for pod in self.pods:
            for uuid in pod.gpus:
                if uuid not in devices:
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
            output = d.service.output_tokens if d.service is not None else None
            if output and (output[0].at != 0 or [p.at for p in output] != sorted(p.at for p in output)):
                raise ValueError(f"{where} service.outputTokens: pieces must start at 0 and go forward")
        for spec in self.gpus:
            for label, pieces in (("utilization", spec.utilization), ("memory", spec.memory)):
                ats = [p.at for p in pieces]
                if ats[0] != 0 or ats != sorted(ats):
                    raise ValueError(f"gpus: {spec.uuid} {label}: pieces must start at 0 and go forward")
        return self

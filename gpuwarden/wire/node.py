"""The NodeReport wire schema: what an agent sends the operator, validated on both ends.

One schema, versioned by ``schemaVersion``. The agent builds these models and
serialises them with ``model_dump_json(by_alias=True)``; the operator parses a
body with :func:`parse_report`, which raises :class:`ReportError` naming the
offending field. Field names on the wire are camelCase, as in the Kubernetes API.

A report batches the snapshots sampled since the last one that was delivered,
oldest first, so a replay after an outage arrives as a few large, in-order reports.

The operator parses strictly (JSON types as declared: ``1.0`` or ``"1"`` is no integer) and
every number is bounded: floats are finite, integers below what any GPU or node reads, so no
value of a valid report can overflow a conversion further down (float(), Prometheus' text
format). Timestamps are bounded by the operator's clock, not here (the agent has its own).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from gpuwarden.wire.base import MAX_COUNT, MAX_TIMESTAMP, Bytes, WireModel, first_error, parse_strict
from gpuwarden.wire.scrape import MAX_TARGETS, ServiceSample

SCHEMA_VERSION = 8
"""The ``schemaVersion`` this build sends; bumped on any change an older operator would refuse."""

ACCEPTED_SCHEMA_VERSIONS = frozenset({1, 2, 3, 4, 5, 6, 7, 8})
"""What the operator accepts: version 2 added ``GpuSample.health``, version 3 ``ProcessSample.hook``,
version 4 ``PodRef.claim``, version 5 ``HookSample.host_limit_bytes``, version 6 ``Snapshot.services``
(the pods' own metrics, :mod:`gpuwarden.wire.scrape`), version 7 ``AllocationSite.memory`` and
``growth_bytes_per_minute`` (GPU bytes by line); an older report lacks them.
Upgrade the operator before the agents (an older operator refuses a newer version by its number)."""

MAX_SNAPSHOTS_PER_REPORT = 3600
"""A report carries at most an hour of 1 s snapshots; replays are split into several reports."""

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
"""A Kubernetes object name (RFC 1123 subdomain): what a ResourceClaim's name may be."""
MAX_PID = 2**31 - 1
MAX_WATTS = 100_000.0
MAX_MHZ = 100_000
MAX_LINE = 2**31 - 1
MAX_DEVICES = 4096
"""GPU indexes (and MIG instances) per node."""


class DeviceState(enum.StrEnum):
    """Whether a GPU's readings can be trusted. Anything but ``ok`` means the numbers are absent, not zero."""

    OK = "ok"
    LOST = "lost"  # fell off the bus / NVML_ERROR_GPU_IS_LOST
    UNKNOWN = "unknown"  # NVML answered with an error we could not classify


class ClockEventReason(enum.StrEnum):
    """Why the GPU's clocks are held below their maximum (nvmlDeviceGetCurrentClocksEventReasons)."""

    GPU_IDLE = "gpuIdle"
    APPLICATIONS_CLOCKS_SETTING = "applicationsClocksSetting"
    SW_POWER_CAP = "swPowerCap"
    HW_SLOWDOWN = "hwSlowdown"
    SYNC_BOOST = "syncBoost"
    SW_THERMAL_SLOWDOWN = "swThermalSlowdown"
    HW_THERMAL_SLOWDOWN = "hwThermalSlowdown"
    HW_POWER_BRAKE_SLOWDOWN = "hwPowerBrakeSlowdown"
    DISPLAY_CLOCK_SETTING = "displayClockSetting"


class XidEvent(WireModel):
    """One XID the driver raised on a GPU (an NVML XidCriticalError event)."""

    code: int = Field(ge=0, le=2**32 - 1)
    timestamp: float = Field(gt=0, le=MAX_TIMESTAMP)
    """Seconds since the Unix epoch, when the agent received the event."""


class GpuHealth(WireModel):
    """A GPU's health beside its readings (schema version 2). ``None`` means not supported or not read.

    Device-wide: on the GPU's own entry, never on a MIG device's.
    """

    xids: list[XidEvent] = Field(default_factory=list, max_length=256)
    """XIDs received since the previous snapshot (each rides exactly one snapshot), oldest first."""
    ecc_uncorrected_aggregate: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """Uncorrected ECC errors over the GPU's life (the volatile count is ``GpuSample.ecc_uncorrected``)."""
    retired_pages_double_bit: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """Pages retired for double-bit ECC errors (before Ampere; row remapping replaced it)."""
    retired_pages_pending: bool | None = None
    """A page retirement waits for the next GPU reset (before Ampere)."""
    remapped_rows_uncorrectable: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """Memory rows remapped for uncorrectable errors (Ampere and later)."""
    row_remap_pending: bool | None = None
    """A row remapping waits for the next GPU reset."""
    row_remap_failed: bool | None = None
    """A row remapping failed at some point: the memory cannot heal itself."""
    clock_event_reasons: list[ClockEventReason] | None = Field(default=None, max_length=16)
    """Why the clocks are held down right now; empty when nothing holds them."""


class PodRef(WireModel):
    """A container (or a whole pod when ``container`` is empty) on this node."""

    namespace: str = Field(min_length=1, max_length=253)
    name: str = Field(min_length=1, max_length=253)
    container: str = Field(default="", max_length=253)
    claim: str | None = Field(default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """The ResourceClaim (in the pod's namespace) through which it holds this GPU, when DRA allocated it."""


Percent = Annotated[float, Field(ge=0, le=100)]


class AllocationSite(WireModel):
    """A line of the training code whose host allocations grew between the hook's tracemalloc snapshots.

    Credited to the innermost frame outside the standard library and site-packages, so a tensor kept
    alive by ``losses.append(loss)`` is named by that line, not by torch's internals.
    """

    file: str = Field(min_length=1, max_length=1024)
    line: int = Field(ge=0, le=MAX_LINE)
    size_bytes: Bytes
    """What the blocks allocated at this line hold now."""
    growth_bytes: Bytes
    """How much that grew since the hook's first snapshot (only growing lines are sent)."""
    count: int = Field(ge=0, le=MAX_COUNT)
    """Live blocks allocated at this line."""
    memory: Literal["gpu"] | None = None
    """``gpu``: the GPU bytes of the blocks the caching allocator's history credits to this line
    (schema version 7; recorded only after a leak was suspected); None: host objects (tracemalloc)."""
    growth_bytes_per_minute: Bytes | None = None
    """``gpu`` lines: how fast they grew since recording began (schema version 7)."""


MAX_ANSWER_SITES = 3
MAX_HOOK_REPLIES = 16
"""Replies a snapshot carries: the operator asks at most as many at a time (:data:`MAX_HOOK_ASKS`)."""
MAX_HOOK_ASKS = 16
"""Requests an answer carries: the hooks of a node's pods under suspicion, at most this many at a time."""
HOOK_OPS = ("record", "snapshot")
"""What may be asked of a hook (docs/hook.md, "Requests"): start the allocator's history, write a snapshot."""

HookOp = Literal["record", "snapshot"]


class HookAnswerBody(WireModel):
    """What a hook answers to one request: the hook's own answer (:class:`gpuwarden.wire.hook.HookAnswer`)
    and the agent's relay of it to the operator (:class:`HookReply`) both carry it."""

    status: Literal["ok", "refused"]
    reason: str | None = Field(default=None, max_length=256)
    file: str | None = Field(default=None, min_length=1, max_length=1024)
    """``snapshot``: the file the hook wrote, as the job sees it (the agent never opens it)."""
    size_bytes: Bytes | None = None
    sites: list[AllocationSite] = Field(default_factory=list, max_length=MAX_ANSWER_SITES)
    """``snapshot``: its top GPU lines."""


class HookAsk(WireModel):
    """One request of the operator's to the hooks of a pod's processes on some of its GPUs (the
    ``hookAsks`` of its answer to a report): relayed by the agent to each hooked process there."""

    id: int = Field(ge=1, le=MAX_COUNT)
    """The operator's; each process's reply carries it back (:class:`HookReply`)."""
    namespace: str = Field(min_length=1, max_length=253)
    pod: str = Field(min_length=1, max_length=253)
    gpus: list[str] = Field(default_factory=list, max_length=64)
    """The GPUs (UUIDs, a MIG device's own) whose processes are asked; empty: every GPU of the pod."""
    op: HookOp


class HookAsks(WireModel):
    """The ``hookAsks`` of the operator's answer to a report (absent: nothing to ask), as one field so
    that a refusal names it."""

    hook_asks: list[HookAsk] = Field(default_factory=list, max_length=MAX_HOOK_ASKS)


class HookReply(HookAnswerBody):
    """A hooked process's answer to a :class:`HookAsk`, relayed by its node's agent (schema version 8).
    A process that could not be asked (none hooked, or not taking requests) is answered ``refused`` by
    the agent, with ``pid`` 0."""

    id: int = Field(ge=1, le=MAX_COUNT)
    namespace: str = Field(min_length=1, max_length=253)
    pod: str = Field(min_length=1, max_length=253)
    pid: int = Field(ge=0, le=MAX_PID)
    op: HookOp


class HookSample(WireModel):
    """What the training-side hook (:mod:`gpuwarden.hook`) last told the agent about one process on one GPU.

    Schema version 3. The agent attaches it to the process's entry on the GPU the allocator numbers
    belong to; ``host_rss_bytes`` and ``sites`` are the process's, repeated on each of its GPUs.
    ``None`` means the hook did not read it (no torch, tracemalloc off).
    """

    timestamp: float = Field(gt=0, le=MAX_TIMESTAMP)
    """When the hook read these (seconds since the epoch); the agent attaches none older than a minute."""
    step: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """The training step the hook counted, when it counts steps."""
    allocated_bytes: Bytes | None = None
    """torch.cuda.memory_allocated: what live tensors hold. Grows under a leak, not under caching."""
    reserved_bytes: Bytes | None = None
    """torch.cuda.memory_reserved: what the caching allocator holds from the driver (about NVML's figure)."""
    max_allocated_bytes: Bytes | None = None
    """torch.cuda.max_memory_allocated: the peak since the process started (or the hook reset it)."""
    host_rss_bytes: Bytes | None = None
    """Resident host memory of the process and its children (the data-loader workers)."""
    host_limit_bytes: Bytes | None = None
    """The memory limit the process runs under: its cgroup's, else the node's memory (schema version 5)."""
    sites: list[AllocationSite] = Field(default_factory=list, max_length=16)
    """The lines whose allocations grew, in the hook's order: the job's own lines first (tracemalloc on)."""


class ProcessSample(WireModel):
    """One process with a CUDA context on a GPU."""

    pid: int = Field(ge=0, le=MAX_PID)
    used_memory_bytes: Bytes | None = None
    sm_util: Percent | None = None
    """Per-process SM utilization (nvmlDeviceGetProcessUtilization); sampled less often, so often None."""
    command: str = Field(default="", max_length=4096)
    pod: PodRef | None = None
    """The container this process runs in, from /proc/<pid>/cgroup; None for host processes."""
    hook: HookSample | None = None
    """What the process's training hook reported (schema version 3); None without a hook."""


class GpuSample(WireModel):
    """One GPU (or MIG device) at one instant. ``None`` means not supported or not read, never zero."""

    uuid: str = Field(min_length=1, max_length=128)
    index: int = Field(ge=0, le=MAX_DEVICES)
    model: str = Field(default="", max_length=256)
    mig_id: str | None = Field(default=None, max_length=128)
    """The MIG device UUID when this entry is a MIG instance; ``uuid`` is then the parent GPU's."""
    state: DeviceState = DeviceState.OK

    utilization_gpu: Percent | None = None
    """NVML utilization.gpu: the share of time any kernel ran. A trickle of tiny kernels reads near 100."""
    sm_active: Percent | None = None
    """GPM SM activity (Hopper and later): the share of SM cycles doing work. The signal that means work."""
    sm_occupancy: Percent | None = None
    tensor_active: Percent | None = None
    dram_active: Percent | None = None
    memory_used_bytes: Bytes | None = None
    memory_total_bytes: Bytes | None = None
    temperature_c: float | None = Field(default=None, ge=-273.15, le=1000.0)
    power_watts: float | None = Field(default=None, ge=0, le=MAX_WATTS)
    sm_clock_mhz: int | None = Field(default=None, ge=0, le=MAX_MHZ)
    ecc_uncorrected: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    health: GpuHealth | None = None
    """XIDs, memory errors and clock events (schema version 2)."""

    pods: list[PodRef] = Field(default_factory=list, max_length=64)
    """Pods the kubelet allocated this device to (PodResources). Several under time-slicing."""
    processes: list[ProcessSample] = Field(default_factory=list, max_length=1024)


class PodHostMemory(WireModel):
    """Host (CPU) memory of one pod from its cgroup's memory.current."""

    namespace: str = Field(min_length=1, max_length=253)
    name: str = Field(min_length=1, max_length=253)
    memory_bytes: Bytes


class Snapshot(WireModel):
    """Every GPU of the node at one instant."""

    timestamp: float = Field(gt=0, le=MAX_TIMESTAMP)
    """Seconds since the Unix epoch, taken by the agent when the sample was read.

    The operator keeps only those within its skew bounds of its own clock (see
    :mod:`gpuwarden.operator.endpoints.reports`); this bound only keeps the number a plausible time.
    """
    gpus: list[GpuSample] = Field(max_length=64)
    pod_host_memory: list[PodHostMemory] = Field(default_factory=list, max_length=1024)
    services: list[ServiceSample] | None = Field(default=None, max_length=MAX_TARGETS)
    """The pods' metrics the agent scraped since the previous snapshot (schema version 6; the operator's
    plan says which, :class:`~gpuwarden.wire.scrape.ScrapePlan`); None, and not sent, when none."""
    hook_replies: list[HookReply] | None = Field(default=None, max_length=MAX_HOOK_REPLIES)
    """The hooks' answers to the operator's asks since the previous snapshot (schema version 8); None,
    and not sent, when none."""


class NodeReport(WireModel):
    """A batch of snapshots from one node's agent."""

    schema_version: int = Field(ge=0, le=MAX_COUNT)
    node: str = Field(min_length=1, max_length=253)
    agent_id: str = Field(min_length=1, max_length=128)
    """Random per agent process; with ``seq`` it lets the operator drop duplicates after a retry."""
    seq: int = Field(ge=0, le=MAX_COUNT)
    """Increases by one per report an agent process builds."""
    snapshots: list[Snapshot] = Field(min_length=1, max_length=MAX_SNAPSHOTS_PER_REPORT)


REFUSALS = ("future", "past", "foreignPod", "unknownPod", "tooManyGpus", "tooManyPods", "notPlanned")
"""Why the operator leaves readings (and XIDs, pods on a GPU, pods' scrapes) of an accepted report
unstored (its answer's ``refused``): a timestamp ahead of its clock by more than its skew, or older
than its retention; a pod the API places on another node than the reporting one, or does not know; a GPU
past the node's or a pod's bound, or a pod past a GPU's; a pod's scrape, or a metric of one, that the
node's scrape plan did not ask for (docs/operator.md, "Bounds")."""


class ReportError(ValueError):
    """A report body that is not a valid NodeReport; the message names the field."""


def parse_report(body: bytes | str) -> NodeReport:
    """Parse a JSON body strictly (see the module doc); raise :class:`ReportError` naming the field."""
    return check_versions(parse_strict(NodeReport, body, ReportError))


def check_versions(report: NodeReport) -> NodeReport:
    """``report``, if it sends nothing its ``schemaVersion`` lacks (or an unknown version): else a
    :class:`ReportError` naming the field. Reads attributes only (:mod:`gpuwarden.wire.fast` too)."""
    if report.schema_version not in ACCEPTED_SCHEMA_VERSIONS:
        speaks = ", ".join(str(v) for v in sorted(ACCEPTED_SCHEMA_VERSIONS))
        raise ReportError(
            f"schemaVersion: {report.schema_version} is not supported; this operator speaks {speaks}"
        )
    if report.schema_version < 2 and any(g.health is not None for s in report.snapshots for g in s.gpus):
        raise ReportError("health: not part of schemaVersion 1 (send schemaVersion 2)")
    if report.schema_version < 3 and any(
        p.hook is not None for s in report.snapshots for g in s.gpus for p in g.processes
    ):
        raise ReportError(f"hook: not part of schemaVersion {report.schema_version} (send schemaVersion 3)")
    if report.schema_version < 4 and any(
        ref.claim is not None
        for s in report.snapshots
        for g in s.gpus
        for ref in (*g.pods, *(p.pod for p in g.processes if p.pod is not None))
    ):
        raise ReportError(f"claim: not part of schemaVersion {report.schema_version} (send schemaVersion 4)")
    if report.schema_version < 5 and any(
        p.hook is not None and p.hook.host_limit_bytes is not None
        for s in report.snapshots
        for g in s.gpus
        for p in g.processes
    ):
        v = report.schema_version
        raise ReportError(f"hostLimitBytes: not part of schemaVersion {v} (send schemaVersion 5)")
    if report.schema_version < 6 and any(s.services for s in report.snapshots):
        v = report.schema_version
        raise ReportError(f"services: not part of schemaVersion {v} (send schemaVersion 6)")
    if report.schema_version < 7 and any(
        site.memory is not None or site.growth_bytes_per_minute is not None
        for s in report.snapshots
        for g in s.gpus
        for p in g.processes
        if p.hook is not None
        for site in p.hook.sites
    ):
        v = report.schema_version
        raise ReportError(f"sites: GPU lines are not part of schemaVersion {v} (send schemaVersion 7)")
    if report.schema_version < 8 and any(s.hook_replies for s in report.snapshots):
        v = report.schema_version
        raise ReportError(f"hookReplies: not part of schemaVersion {v} (send schemaVersion 8)")
    return report


class AsksError(ValueError):
    """An answer's ``hookAsks`` that is not a valid :class:`HookAsks`; the message names the field."""


def parse_asks(value: Any) -> list[HookAsk]:
    """The asks of an answer's decoded ``hookAsks`` (None: none), strictly; :class:`AsksError` names
    the field."""
    if value is None:
        return []
    try:
        return HookAsks.model_validate({"hookAsks": value}, strict=True, by_name=False).hook_asks
    except ValidationError as exc:
        raise AsksError(first_error(exc, top="hookAsks")) from None


def dump_asks(asks: list[HookAsk]) -> str:
    """``asks`` as the answer's ``hookAsks`` value (JSON, camelCase)."""
    return "[" + ",".join(a.model_dump_json(by_alias=True) for a in asks) + "]"


def dump_report(report: NodeReport) -> bytes:
    """Serialise a report for the wire (camelCase, no ``None`` fields)."""
    return report.model_dump_json(by_alias=True, exclude_none=True).encode()


ProcessUtilization = dict[str, dict[int, float]]
"""Per-process SM utilization (percent) by device key (see :func:`device_key`), then by PID.

A device is a key only when its reading succeeded; its PIDs are those that ran a kernel in
the window (NVML lists no other), so an empty dict is a good reading: nothing ran. A device
that is not a key was not read (unsupported, as on MIG devices; failed; lost).
"""


def device_key(sample: GpuSample) -> str:
    """The identity of one sampled device: the MIG device's UUID, or the GPU's when not MIG."""
    return sample.mig_id or sample.uuid


def merge_process_utilization(gpus: list[GpuSample], utilization: ProcessUtilization) -> list[GpuSample]:
    """Set ``sm_util`` on each process of the devices a per-process reading covers.

    On a device the reading covers, a process it does not list ran no kernel in the window:
    its ``sm_util`` is 0, not unknown (a process that holds memory and computes nothing,
    beside a busy one, is the waste to find). Processes of a device the reading does not
    cover keep ``None``: no data.
    """
    out = []
    for gpu in gpus:
        by_pid = utilization.get(device_key(gpu))
        if by_pid is None or not gpu.processes:
            out.append(gpu)
            continue
        processes = [p.model_copy(update={"sm_util": by_pid.get(p.pid, 0.0)}) for p in gpu.processes]
        out.append(gpu.model_copy(update={"processes": processes}))
    return out

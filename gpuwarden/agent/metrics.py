"""Prometheus metrics of the agent, built from the latest snapshot at each scrape.

One collector per concern on a dedicated registry: :class:`DeviceCollector` (per GPU),
:class:`ProcessCollector` (per process and per pod's host memory), :class:`HealthCollector`
(GPU health states) and the agent's own (:class:`AgentMetrics`, with the XID counts,
:class:`AgentCollector`, the report sender's :class:`SenderMetrics`, the hook channel's
:class:`HookMetrics` and the pods' scrapes' :class:`ScrapeMetrics`). A scrape reads
:meth:`SnapshotRing.latest` and never calls NVML; every series is rebuilt from that
snapshot, so a pod's series vanish with the first snapshot it is no longer in.

Conventions: utilizations are ratios 0..1 (``_ratio``), sizes in bytes, power in watts,
temperature in celsius, clocks in hertz, counters end in ``_total``. A reading the
device did not give (not supported, GPU lost) has no series at all, never a zero;
``gpuwarden_gpu_up`` says why, with its ``state`` label.

Device series carry the GPU's labels (``uuid``, ``index``, ``model``, ``mig_id``) and
the pod's (``namespace``, ``pod``, ``container``), empty when the kubelet allocated
the device to no pod. A GPU shared by several pods (time-slicing) has one series per
pod, each with the whole device's reading: don't ``sum`` them across pods.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwarden import __version__
from gpuwarden.agent.attribution import PodResourcesState, SlicesState, UnresolvedReason
from gpuwarden.agent.health import CLOCK_EVENT_BITS
from gpuwarden.agent.hooksocket import REFUSALS as HOOK_REFUSALS
from gpuwarden.agent.hooksocket import HookReadings
from gpuwarden.agent.scrape import REFUSALS as SCRAPE_REFUSALS
from gpuwarden.agent.scrape import RESULTS as SCRAPE_RESULTS
from gpuwarden.agent.snapshots import ERROR_KINDS, SnapshotRing
from gpuwarden.wire.node import REFUSALS, DeviceState, GpuSample, PodRef, Snapshot, device_key

GPU_LABELS = ("uuid", "index", "model", "mig_id")
POD_LABELS = ("namespace", "pod", "container")

SAMPLE_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""From 100 µs (one GPU without per-process utilization) to 1 s (something is wrong)."""

SCRAPE_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
"""From a small page on the node's own network (5 ms) to the longest timeout."""

DROP_REASONS = ("buffer_full", "rejected")
"""``buffer_full``: pushed out by newer snapshots; ``rejected``: in a report the operator refused (4xx)."""

ERROR_REASONS = (
    "connection",  # refused, reset, DNS, a TLS handshake that failed: the operator is away
    "tls",  # the operator's certificate is not trusted (--operator-ca-file, --operator-server-name)
    "timeout",
    "token",  # the ServiceAccount token file could not be read
    "unauthorized",  # 401/403
    "throttled",  # 429
    "server_error",  # 5xx, 408
    "too_large",  # 413: the report was split
    "misdirected",  # 421: another operator replica owns this node; followed
    "rejected",  # another 4xx: the report was dropped
    "unexpected_status",  # 1xx/3xx: a misrouted URL
)
"""Why a POST did not deliver its report (``gpuwarden_agent_report_errors_total{reason}``)."""


@dataclass(frozen=True, slots=True)
class _Gauge:
    """A GpuSample field exported as a gauge, with the factor that brings it to base units."""

    name: str
    help: str
    field: str
    scale: float = 1.0


_DEVICE_GAUGES = (
    _Gauge(
        "gpuwarden_gpu_utilization_ratio",
        "Share of time a kernel ran (NVML utilization.gpu).",
        "utilization_gpu",
        0.01,
    ),
    _Gauge(
        "gpuwarden_gpu_sm_active_ratio",
        "Share of SM cycles doing work (GPM, Hopper and later).",
        "sm_active",
        0.01,
    ),
    _Gauge("gpuwarden_gpu_sm_occupancy_ratio", "Active warps over the SMs' maximum.", "sm_occupancy", 0.01),
    _Gauge(
        "gpuwarden_gpu_tensor_active_ratio",
        "Share of time tensor cores were busy (GPM).",
        "tensor_active",
        0.01,
    ),
    _Gauge(
        "gpuwarden_gpu_dram_active_ratio", "DRAM bandwidth used over its maximum (GPM).", "dram_active", 0.01
    ),
    _Gauge("gpuwarden_gpu_memory_used_bytes", "Device memory in use.", "memory_used_bytes"),
    _Gauge("gpuwarden_gpu_memory_total_bytes", "Device memory in all.", "memory_total_bytes"),
    _Gauge("gpuwarden_gpu_temperature_celsius", "GPU die temperature.", "temperature_c"),
    _Gauge("gpuwarden_gpu_power_watts", "Power draw.", "power_watts"),
    _Gauge("gpuwarden_gpu_sm_clock_hertz", "SM clock.", "sm_clock_mhz", 1e6),
)


def _gpu_labels(gpu: GpuSample) -> list[str]:
    return [gpu.uuid, str(gpu.index), gpu.model, gpu.mig_id or ""]


def _pod_labels(pod: PodRef | None) -> list[str]:
    return ["", "", ""] if pod is None else [pod.namespace, pod.name, pod.container]


class DeviceCollector(Collector):
    """Per-GPU (and per-MIG-device) gauges from the latest snapshot."""

    def __init__(self, ring: SnapshotRing) -> None:
        self._ring = ring

    def _families(self) -> tuple[GaugeMetricFamily, list[GaugeMetricFamily], CounterMetricFamily]:
        labels = [*GPU_LABELS, *POD_LABELS]
        up = GaugeMetricFamily(
            "gpuwarden_gpu_up",
            "1 if the GPU's readings can be trusted; 0 if it is lost or unreadable, as the state label says.",
            labels=[*labels, "state"],
        )
        gauges = [GaugeMetricFamily(g.name, g.help, labels=labels) for g in _DEVICE_GAUGES]
        ecc = CounterMetricFamily(
            "gpuwarden_gpu_ecc_uncorrected_errors",
            "Uncorrected ECC errors since the driver loaded (volatile).",
            labels=labels,
        )
        return up, gauges, ecc

    def describe(self) -> Iterable[Metric]:
        """The families this collector yields (so registering it does not collect)."""
        up, gauges, ecc = self._families()
        return [up, *gauges, ecc]

    def collect(self) -> Iterable[Metric]:
        """Build every device series from the latest snapshot."""
        up, gauges, ecc = self._families()
        snapshot = self._ring.latest()
        for gpu in snapshot.gpus if snapshot is not None else ():
            base = _gpu_labels(gpu)
            pods: list[PodRef | None] = [*gpu.pods] or [None]
            for pod in pods:
                labels = base + _pod_labels(pod)
                up.add_metric([*labels, gpu.state.value], 1.0 if gpu.state is DeviceState.OK else 0.0)
                for family, gauge in zip(gauges, _DEVICE_GAUGES, strict=True):
                    value = getattr(gpu, gauge.field)
                    if value is not None:
                        family.add_metric(labels, value * gauge.scale)
                if gpu.ecc_uncorrected is not None:
                    ecc.add_metric(labels, gpu.ecc_uncorrected)
        return [up, *gauges, ecc]


class ProcessCollector(Collector):
    """Per-process GPU memory and SM utilization, and per-pod host memory, from the latest snapshot.

    A process whose training hook spoke (``ProcessSample.hook``) also has its allocator's allocated
    and reserved memory on that GPU.

    Per-process SM utilization is read at a lower rate than devices; between two reads
    the last one is shown, for processes still present.
    """

    def __init__(self, ring: SnapshotRing) -> None:
        self._ring = ring

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        labels = [*GPU_LABELS, "pid", *POD_LABELS]
        memory = GaugeMetricFamily(
            "gpuwarden_process_gpu_memory_used_bytes", "GPU memory used by one process.", labels=labels
        )
        allocated = GaugeMetricFamily(
            "gpuwarden_process_gpu_memory_allocated_bytes",
            "GPU memory live tensors of one process hold (its training hook's torch.cuda.memory_allocated).",
            labels=labels,
        )
        reserved = GaugeMetricFamily(
            "gpuwarden_process_gpu_memory_reserved_bytes",
            "GPU memory the caching allocator of one process holds (its training hook's "
            "torch.cuda.memory_reserved).",
            labels=labels,
        )
        sm = GaugeMetricFamily(
            "gpuwarden_process_sm_utilization_ratio",
            "Share of SM time one process used (NVML process utilization, read at a lower rate).",
            labels=labels,
        )
        host = GaugeMetricFamily(
            "gpuwarden_pod_host_memory_bytes",
            "Host (CPU) memory of a pod, from its cgroup's memory.current.",
            labels=["namespace", "pod"],
        )
        return memory, sm, host, allocated, reserved

    def describe(self) -> Iterable[Metric]:
        """The families this collector yields."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        """Build every process and pod series from the latest snapshot."""
        families = self._families()
        memory, sm, host, allocated, reserved = families
        snapshot = self._ring.latest()
        if snapshot is None:
            return list(families)
        last = self._ring.process_utilization
        for gpu in snapshot.gpus:
            base = _gpu_labels(gpu)
            # The last reading of this device, if it had one: a process it does not list ran no kernel.
            earlier = last.get(device_key(gpu))
            for proc in gpu.processes:
                labels = [*base, str(proc.pid), *_pod_labels(proc.pod)]
                if proc.used_memory_bytes is not None:
                    memory.add_metric(labels, proc.used_memory_bytes)
                util = proc.sm_util
                if util is None and earlier is not None:
                    util = earlier.get(proc.pid, 0.0)
                if util is not None:
                    sm.add_metric(labels, util / 100.0)
                hook = proc.hook
                if hook is not None and hook.allocated_bytes is not None:
                    allocated.add_metric(labels, hook.allocated_bytes)
                if hook is not None and hook.reserved_bytes is not None:
                    reserved.add_metric(labels, hook.reserved_bytes)
        for pod in snapshot.pod_host_memory:
            host.add_metric([pod.namespace, pod.name], pod.memory_bytes)
        return list(families)


class HealthCollector(Collector):
    """Health states of every GPU in the latest snapshot."""

    def __init__(self, ring: SnapshotRing) -> None:
        self._ring = ring

    def _families(
        self,
    ) -> tuple[
        GaugeMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        labels = [*GPU_LABELS, *POD_LABELS]
        return (
            GaugeMetricFamily(
                "gpuwarden_gpu_clock_event_active",
                "1 while the reason holds the GPU's clocks down (NVML clock event reasons), else 0.",
                labels=[*labels, "reason"],
            ),
            CounterMetricFamily(
                "gpuwarden_gpu_ecc_uncorrected_aggregate_errors",
                "Uncorrected ECC errors over the GPU's life (aggregate).",
                labels=labels,
            ),
            GaugeMetricFamily(
                "gpuwarden_gpu_retired_pages",
                "Device memory pages retired (before Ampere), by cause.",
                labels=[*labels, "cause"],
            ),
            GaugeMetricFamily(
                "gpuwarden_gpu_remapped_rows",
                "Device memory rows remapped (Ampere and later), by cause.",
                labels=[*labels, "cause"],
            ),
            GaugeMetricFamily(
                "gpuwarden_gpu_memory_repair_pending",
                "1 while a page retirement or row remapping waits for a GPU reset, else 0.",
                labels=[*labels, "mechanism"],
            ),
            GaugeMetricFamily(
                "gpuwarden_gpu_row_remap_failed",
                "1 if a row remapping ever failed on the GPU (its memory cannot heal itself), else 0.",
                labels=labels,
            ),
        )

    def describe(self) -> Iterable[Metric]:
        """The families this collector yields."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        """Build every health series from the latest snapshot."""
        clock, aggregate, retired, remapped, pending, failed = self._families()
        snapshot = self._ring.latest()
        for gpu in snapshot.gpus if snapshot is not None else ():
            health = gpu.health
            if health is None:
                continue
            pods: list[PodRef | None] = [*gpu.pods] or [None]
            for pod in pods:
                labels = _gpu_labels(gpu) + _pod_labels(pod)
                if health.clock_event_reasons is not None:
                    active = set(health.clock_event_reasons)
                    for _, reason in CLOCK_EVENT_BITS:
                        clock.add_metric([*labels, reason.value], 1.0 if reason in active else 0.0)
                if health.ecc_uncorrected_aggregate is not None:
                    aggregate.add_metric(labels, health.ecc_uncorrected_aggregate)
                if health.retired_pages_double_bit is not None:
                    retired.add_metric([*labels, "double_bit_ecc"], health.retired_pages_double_bit)
                if health.retired_pages_pending is not None:
                    pending.add_metric([*labels, "page_retirement"], float(health.retired_pages_pending))
                if health.remapped_rows_uncorrectable is not None:
                    remapped.add_metric([*labels, "uncorrectable"], health.remapped_rows_uncorrectable)
                if health.row_remap_pending is not None:
                    pending.add_metric([*labels, "row_remap"], float(health.row_remap_pending))
                if health.row_remap_failed is not None:
                    failed.add_metric(labels, float(health.row_remap_failed))
        return [clock, aggregate, retired, remapped, pending, failed]


class AgentMetrics:
    """The agent's own counters and histogram; implements :class:`gpuwarden.agent.snapshots.SamplerEvents`.

    Every error kind is created at 0, so a rate() over it works before the first error. The XID
    counter lives here rather than in a collector: XIDs are events, each in one snapshot only,
    so they are counted as snapshots pass (:meth:`count_xids`), not rebuilt from the latest.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "gpuwarden_agent_errors",
            "Errors of the agent's sampling loop, by kind (see docs/agent.md).",
            ["kind"],
            registry=registry,
        )
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)
        self.samples = Counter("gpuwarden_agent_samples", "Device samples taken.", registry=registry)
        self.sample_duration = Histogram(
            "gpuwarden_agent_sample_duration_seconds",
            "Time to read every device once (per-process utilization included when read).",
            buckets=SAMPLE_DURATION_BUCKETS,
            registry=registry,
        )
        self.xids = Counter(
            "gpuwarden_gpu_xid_errors",
            "XID errors the NVIDIA driver raised on a GPU since the agent started, by XID code.",
            ["uuid", "index", "model", "xid"],
            registry=registry,
        )

    def sampled(self, seconds: float) -> None:
        """Record one device sample's duration."""
        self.samples.inc()
        self.sample_duration.observe(seconds)

    def error(self, kind: str) -> None:
        """Count one error of ``kind``."""
        self.errors.labels(kind=kind).inc()

    def count_xids(self, snapshot: Snapshot) -> None:
        """Count the XIDs a snapshot carries (call it once per snapshot, as it is taken)."""
        for gpu in snapshot.gpus:
            if gpu.health is not None:
                for xid in gpu.health.xids:
                    self.xids.labels(gpu.uuid, str(gpu.index), gpu.model, str(xid.code)).inc()


class HookMetrics:
    """The hook channel's counters and gauge; implements :class:`gpuwarden.agent.hooksocket.HookEvents`.

    Registered only with ``--hook-socket``; every refusal reason is created at 0.
    """

    def __init__(
        self, registry: CollectorRegistry, readings: HookReadings, clock: Callable[[], float]
    ) -> None:
        self.messages = Counter(
            "gpuwarden_agent_hook_messages",
            "Training hook messages parsed and kept (the newest per process is attached to its samples).",
            registry=registry,
        )
        self.refusals = _by_reason(
            "gpuwarden_agent_hook_refused",
            "Training hook messages or connections refused, by reason (see docs/agent.md).",
            HOOK_REFUSALS,
            registry,
        )
        processes = Gauge(
            "gpuwarden_agent_hook_processes",
            "Processes whose training hook sent a message in the last minute.",
            registry=registry,
        )
        processes.set_function(lambda: len(readings.fresh(clock())))

    def accepted(self) -> None:
        """Count one message kept."""
        self.messages.inc()

    def refused(self, reason: str) -> None:
        """Count one refusal for ``reason``."""
        self.refusals.labels(reason=reason).inc()


class AgentCollector(Collector):
    """What the agent is and when it last sampled."""

    def __init__(self, ring: SnapshotRing, *, backend: str, node: str) -> None:
        self._ring = ring
        self._backend = backend
        self._node = node

    def collect(self) -> Iterator[Metric]:
        """The info series and the last sample's time."""
        info = GaugeMetricFamily(
            "gpuwarden_agent_info",
            "The agent's version, backend and node.",
            labels=["version", "backend", "node"],
        )
        info.add_metric([__version__, self._backend, self._node], 1.0)
        yield info
        last = GaugeMetricFamily(
            "gpuwarden_agent_last_sample_timestamp_seconds",
            "When the latest snapshot was taken (seconds since the epoch); absent before the first.",
        )
        snapshot = self._ring.latest()
        if snapshot is not None:
            last.add_metric([], snapshot.timestamp)
        yield last


class StateCollector(Collector):
    """A source's state as one series per state of ``states``, the current one 1, the others 0."""

    def __init__(
        self, name: str, documentation: str, states: type[enum.StrEnum], current: Callable[[], enum.StrEnum]
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._states = states
        self._current = current

    def collect(self) -> Iterator[Metric]:
        """Every state, 1 for the current one."""
        family = GaugeMetricFamily(self._name, self._documentation, labels=["state"])
        current = self._current()
        for state in self._states:
            family.add_metric([state.value], 1.0 if state is current else 0.0)
        yield family


class PodResourcesCollector(StateCollector):
    """The kubelet's PodResources API as the attributor last found it: one series per state, the
    current one 1 (alert on ``gpuwarden_agent_pod_resources_state{state="ok"} == 0``: GPUs are then
    attributed from the last answer, or not at all)."""

    def __init__(self, state: Callable[[], PodResourcesState]) -> None:
        super().__init__(
            "gpuwarden_agent_pod_resources_state",
            "The kubelet PodResources API's state at the last attribution refresh (1: current).",
            PodResourcesState,
            state,
        )


class DraMetrics:
    """DRA attribution's instruments: devices that could not be resolved, and the ResourceSlice watch."""

    def __init__(self, registry: CollectorRegistry, slices_state: Callable[[], SlicesState] | None) -> None:
        self.unresolved = _by_reason(
            "gpuwarden_agent_dra_unresolved_devices",
            "DRA-allocated devices of the watched drivers that could not be resolved to a GPU, counted "
            "when one first fails (again after it resolved in between); each is also logged.",
            [reason.value for reason in UnresolvedReason],
            registry,
        )
        if slices_state is not None:
            registry.register(
                StateCollector(
                    "gpuwarden_agent_dra_resource_slices_state",
                    "The node's ResourceSlice watch (resource.k8s.io/v1): not_listed, synced, not_served "
                    "(the API server serves no resource.k8s.io/v1) or error (1: current).",
                    SlicesState,
                    slices_state,
                )
            )

    def count_unresolved(self, reason: UnresolvedReason) -> None:
        """One more device that could not be resolved, for ``reason``."""
        self.unresolved.labels(reason.value).inc()


class SenderMetrics:
    """The report sender's instruments (:class:`gpuwarden.agent.sender.ReportSender`).

    Every reason is created at 0, so a rate() over it works before the first drop or error.
    """

    def __init__(self, registry: CollectorRegistry, *, buffer_limit: int) -> None:
        self.buffered = Gauge(
            "gpuwarden_agent_report_buffer_snapshots",
            "Snapshots waiting to be delivered to the operator.",
            registry=registry,
        )
        limit = Gauge(
            "gpuwarden_agent_report_buffer_limit",
            "Snapshots the report buffer holds before dropping the oldest.",
            registry=registry,
        )
        limit.set(buffer_limit)
        self.dropped = _by_reason(
            "gpuwarden_agent_report_dropped_snapshots_total",
            "Snapshots never delivered, by reason.",
            DROP_REASONS,
            registry,
        )
        self.sent = Counter(
            "gpuwarden_agent_reports_sent_total",
            "Reports the operator accepted.",
            registry=registry,
        )
        self.errors = _by_reason(
            "gpuwarden_agent_report_errors_total",
            "Report POSTs that did not deliver, by reason.",
            ERROR_REASONS,
            registry,
        )
        self.refused = _by_reason(
            "gpuwarden_agent_report_refused_readings_total",
            "Readings of delivered reports the operator did not store, by its reason.",
            REFUSALS,
            registry,
        )


class ScrapeMetrics:
    """The pods' scrapes' instruments; implements :class:`gpuwarden.agent.scrape.ScrapeEvents`.

    Every result and reason is created at 0, so a rate() over them works before the first scrape.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.scrapes = _by_reason(
            "gpuwarden_agent_service_scrapes",
            "Scrapes of the pods' own metrics endpoints (the operator's plan), by result (docs/agent.md).",
            SCRAPE_RESULTS,
            registry,
            label="result",
        )
        self.duration = Histogram(
            "gpuwarden_agent_service_scrape_duration_seconds",
            "Time one scrape took, from its request to its page compacted (or its failure).",
            buckets=SCRAPE_DURATION_BUCKETS,
            registry=registry,
        )
        self.refusals = _by_reason(
            "gpuwarden_agent_service_targets_refused",
            "Targets of the operator's scrape plan not scraped (counted once per change), or plans refused.",
            SCRAPE_REFUSALS,
            registry,
        )
        self.planned = Gauge(
            "gpuwarden_agent_service_targets",
            "Pods of the operator's scrape plan this agent scrapes.",
            registry=registry,
        )

    def scraped(self, result: str, seconds: float) -> None:
        """Count one scrape's result and its duration."""
        self.scrapes.labels(result).inc()
        self.duration.observe(seconds)

    def refused(self, reason: str) -> None:
        """Count one refused target (or plan)."""
        self.refusals.labels(reason=reason).inc()

    def targets(self, count: int) -> None:
        """The pods now scraped."""
        self.planned.set(count)


def _by_reason(
    name: str,
    documentation: str,
    reasons: Iterable[str],
    registry: CollectorRegistry,
    *,
    label: str = "reason",
) -> Counter:
    """A counter labelled ``label`` (``reason``), each of ``reasons`` created at 0."""
    counter = Counter(name, documentation, [label], registry=registry)
    for reason in reasons:
        counter.labels(reason)
    return counter


def build_registry(ring: SnapshotRing, *, backend: str, node: str) -> tuple[CollectorRegistry, AgentMetrics]:
    """A fresh registry with every agent collector on it, and the agent's own instruments."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(DeviceCollector(ring))
    registry.register(ProcessCollector(ring))
    registry.register(HealthCollector(ring))
    registry.register(AgentCollector(ring, backend=backend, node=node))
    return registry, AgentMetrics(registry)

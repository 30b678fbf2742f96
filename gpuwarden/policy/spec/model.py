"""The typed model of a GPUMonitorPolicy spec (v1alpha1), as the engine sees it.

Plain frozen dataclasses; durations are seconds (float), byte sizes are ints,
percentages are floats in 0..100. ``parse_spec`` (in :mod:`gpuwarden.policy.parse`)
builds them from the CRD's camelCase dict and raises ``SpecError`` naming the field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gpuwarden.policy.xids import CRITICAL_XIDS


class Signal(enum.StrEnum):
    """Which utilization reading a utilization rule compares against its threshold."""

    AUTO = "auto"  # smActive where the GPU reports it (GPM, Hopper+), else gpuUtil
    SM_ACTIVE = "smActive"
    GPU_UTIL = "gpuUtil"


@dataclass(frozen=True, slots=True)
class LabelRequirement:
    """One matchExpressions entry of a LabelSelector."""

    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A Kubernetes LabelSelector; an empty one selects every pod of the namespace."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[LabelRequirement, ...] = ()


@dataclass(frozen=True, slots=True)
class UtilizationFloor:
    """Fires when a pod's GPUs stay below ``percent`` for ``for_seconds`` (idle or wasted GPUs)."""

    name: str
    percent: float
    for_seconds: float
    signal: Signal = Signal.AUTO
    noise_floor: float = 0.0
    """Readings at or below this count as 0 (monitoring chatter)."""
    power_threshold_watts: float | None = None
    """If set, a GPU drawing at least this much power is treated as busy and never idle."""
    hysteresis: float = 5.0
    """Percentage points past the threshold the value must go before a finding clears."""


@dataclass(frozen=True, slots=True)
class UtilizationCeiling:
    """Fires when a pod's GPUs stay above ``percent`` for ``for_seconds`` (saturation)."""

    name: str
    percent: float
    for_seconds: float
    signal: Signal = Signal.AUTO
    hysteresis: float = 5.0


@dataclass(frozen=True, slots=True)
class MemoryCeiling:
    """Fires when GPU memory used stays above a share of the card or an absolute size."""

    name: str
    for_seconds: float
    percent: float | None = None
    bytes: int | None = None
    hysteresis: float = 2.0
    """Percent of the card (or of ``bytes``) below the threshold needed to clear."""


class MemorySource(enum.StrEnum):
    """Which memory a memoryGrowth rule watches (see :mod:`gpuwarden.policy.rules.growth`)."""

    AUTO = "auto"  # allocated where the subject's samples carry the hook's allocated bytes, else device
    DEVICE = "device"  # NVML's used memory (the subject's processes' on a shared GPU)
    ALLOCATED = "allocated"  # the hook's torch.cuda.memory_allocated: live tensors
    RESERVED = "reserved"  # the hook's torch.cuda.memory_reserved: the caching allocator's pool
    HOST = "host"  # the hook's hostRssBytes: the pod's hooked processes and their workers


@dataclass(frozen=True, slots=True)
class MemoryGrowth:
    """Fires when memory grows steadily (a leak): robust slope above ``rate``, fit >= ``min_fit``."""

    name: str
    rate_bytes_per_second: float
    window_seconds: float
    min_fit: float
    for_seconds: float = 0.0
    memory: MemorySource = MemorySource.AUTO


class AnomalyMetric(enum.StrEnum):
    """Which reading an anomaly rule watches."""

    UTILIZATION = "utilization"  # smActive where the GPU reports it, else gpuUtil (as signal: auto)
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Fires on sudden deviations from a GPU's usual readings: robust z-score over a rolling window."""

    name: str
    metric: AnomalyMetric
    window_seconds: float
    threshold: float
    """The robust z-score (|x - median| / (1.4826 MAD)) a reading must pass to deviate."""
    min_deviation: float
    """The least deviation that counts: percentage points (utilization) or percent of the card (memory)."""


class Throttling(enum.StrEnum):
    """A class of clock event reasons a gpuHealth rule can count
    (see :mod:`gpuwarden.policy.rules.gpu_health`)."""

    THERMAL = "thermal"  # swThermalSlowdown, hwThermalSlowdown
    POWER = "power"  # swPowerCap, hwPowerBrakeSlowdown
    HW_SLOWDOWN = "hwSlowdown"


@dataclass(frozen=True, slots=True)
class GpuHealthRule:
    """Fires while one of a pod's GPUs is broken: lost, a counted XID, memory errors, or long throttling."""

    name: str
    xids: tuple[int, ...] = CRITICAL_XIDS
    """XID codes that count; each keeps the finding up for ``clear_after_seconds``."""
    gpu_lost: bool = True
    """A GPU off the bus counts, for as long as it is."""
    memory_errors: bool = True
    """A new uncorrected ECC error counts for ``clear_after_seconds``; a failed or pending memory repair
    (row remapping, page retirement) for as long as the GPU reports it."""
    throttling: tuple[Throttling, ...] = ()
    """Clock event classes that count once they held without a break for ``for_seconds``."""
    for_seconds: float = 300.0
    clear_after_seconds: float = 600.0


class Server(enum.StrEnum):
    """An inference server whose metric names a service rule's preset knows
    (:mod:`gpuwarden.policy.spec.servers`)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRITON = "triton"
    TGI = "tgi"  # Hugging Face text-generation-inference: archived upstream, its names frozen


class Latency(enum.StrEnum):
    """Which latency a requestLatency rule reads from its server's preset."""

    END_TO_END = "endToEnd"  # from the request's arrival to its last token
    TIME_TO_FIRST_TOKEN = "timeToFirstToken"
    INTER_TOKEN = "interToken"  # between consecutive output tokens of a request


class QueueScope(enum.StrEnum):
    """How a requestQueue rule counts waiting requests."""

    REPLICA = "replica"  # the workload's: waiting requests summed over the policy's pods / pods reporting
    POD = "pod"  # each pod's own queue


class GaugeUnit(enum.StrEnum):
    """What a kvCacheUsage rule's own ``metric`` reads in (a preset knows its server's)."""

    RATIO = "ratio"  # 0..1, as vLLM's and SGLang's
    PERCENT = "percent"  # 0..100


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """Fires when a percentile of a latency histogram over ``window`` stays above ``threshold_seconds``
    for ``for_seconds`` (see :mod:`gpuwarden.policy.rules.latency`).

    After :func:`~gpuwarden.policy.parse.parse_spec`, ``metric`` or ``server`` is set (the policy's
    ``serviceMetrics.server`` fills in a rule that names neither)."""

    name: str
    percentile: int
    """50, 90, 95 or 99."""
    threshold_seconds: float
    window_seconds: float = 300.0
    for_seconds: float = 120.0
    latency: Latency = Latency.END_TO_END
    server: Server | None = None
    metric: str | None = None
    """A histogram by its base name (without ``_bucket``), in seconds; wins over ``server``."""
    hysteresis: float = 10.0
    """Percent of the threshold the percentile must fall below it before a finding clears."""


@dataclass(frozen=True, slots=True)
class RequestQueue:
    """Fires when waiting requests per replica (or per pod) stay above ``limit`` for ``for_seconds``
    (see :mod:`gpuwarden.policy.rules.queue`)."""

    name: str
    limit: float
    for_seconds: float = 60.0
    per: QueueScope = QueueScope.REPLICA
    server: Server | None = None
    metric: str | None = None
    """A gauge of waiting requests (summed over its label sets); wins over ``server``."""
    hysteresis: float = 10.0
    """Percent of the limit the queue must fall below it before a finding clears."""


@dataclass(frozen=True, slots=True)
class KvCacheUsage:
    """Fires when a pod's KV cache stays fuller than ``percent`` for ``for_seconds``
    (see :mod:`gpuwarden.policy.rules.kv_cache`)."""

    name: str
    percent: float
    for_seconds: float = 120.0
    server: Server | None = None
    metric: str | None = None
    """A gauge of KV-cache usage (the fullest of its label sets); wins over ``server``."""
    unit: GaugeUnit = GaugeUnit.RATIO
    """What ``metric`` reads in; a preset knows its own."""
    hysteresis: float = 5.0
    """Percentage points below ``percent`` the usage must fall before a finding clears."""


ServiceRule = RequestLatency | RequestQueue | KvCacheUsage
"""The rule kinds that read the pods' own metrics (the :class:`ServiceStore`), not their GPUs'."""

Rule = (
    UtilizationFloor
    | UtilizationCeiling
    | MemoryCeiling
    | MemoryGrowth
    | GpuHealthRule
    | Anomaly
    | RequestLatency
    | RequestQueue
    | KvCacheUsage
)


@dataclass(frozen=True, slots=True)
class ScaleTargetRef:
    """What to scale: any resource with a /scale subresource, in the policy's namespace."""

    api_version: str
    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class ScaleDirection:
    """HPA-like behaviour for one direction (scale up or down)."""

    stabilization_seconds: float
    step_replicas: int | None = None
    step_percent: float | None = None
    cooldown_seconds: float = 0.0


BUCKET_SECONDS = 60.0
"""The forecast's time step: minutes, as replicas take minutes to start."""

MAX_STEPS = 60
"""The furthest a forecast looks ahead, in buckets (an hour): longer start-up times are clamped to it.
Here, not in :mod:`gpuwarden.policy.scaling.forecast`, because the parser bounds ``horizon`` by it."""


class ForecastLoad(enum.StrEnum):
    """What a scale forecast forecasts."""

    UTILIZATION = "utilization"  # the pods' summed GPU utilization, percent
    REQUESTS = "requests"  # the pods' summed rate of requests served, per second


@dataclass(frozen=True, slots=True)
class ScaleForecast:
    """spec.actions.scale.forecast, with the thresholds it compares against resolved from the rules.

    Utilization load: ``ceiling_*`` come from the first utilizationCeiling rule in scaleUpOn,
    ``floor_*`` from the first utilizationFloor rule in scaleDownOn (none: the forecast never holds a
    scale-down back). Requests load: the ceiling is ``requestsPerReplica`` (``ceiling_rule`` the first
    rule in scaleUpOn, which the forecast speaks beside), and there is no floor.
    """

    ceiling_rule: str
    ceiling_percent: float
    """The per-replica ceiling in the load's unit: percent, or requests per second."""
    signal: Signal
    """The ceiling rule's signal: the utilization reading the load is summed from."""
    floor_rule: str | None = None
    floor_percent: float | None = None
    horizon_seconds: float | None = None
    """How far ahead to look; None: the workload's observed replica start-up time."""
    max_uncertainty: float = 20.0
    """The widest 80% interval the forecast may act on: percentage points of per-replica utilization,
    or (requests load) percent of the ceiling."""
    load: ForecastLoad = ForecastLoad.UTILIZATION
    request_metrics: tuple[str, ...] = ()
    """Requests load: the counters (or latency histograms, by their count) a pod's rate is read
    from, the first it exports."""

    @property
    def widest(self) -> float:
        """:attr:`max_uncertainty` in the load's unit."""
        if self.load is ForecastLoad.REQUESTS:
            return self.max_uncertainty / 100 * self.ceiling_percent
        return self.max_uncertainty


@dataclass(frozen=True, slots=True)
class ScaleAction:
    """spec.actions.scale."""

    target_ref: ScaleTargetRef
    min_replicas: int
    max_replicas: int
    scale_up_on: tuple[str, ...]
    scale_down_on: tuple[str, ...]
    scale_up: ScaleDirection
    scale_down: ScaleDirection
    scale_up_min_pods: int | None = 1
    """How many pods must violate a scaleUpOn rule; ``None`` with ``scale_up_min_pods_percent`` set."""
    scale_up_min_pods_percent: float | None = None
    dry_run: bool = False
    forecast: ScaleForecast | None = None


@dataclass(frozen=True, slots=True)
class Actions:
    """spec.actions."""

    events: bool = True
    renotify_seconds: float = 3600.0
    scale: ScaleAction | None = None


@dataclass(frozen=True, slots=True)
class ServiceMetricsSource:
    """spec.serviceMetrics: where the node agents scrape the selected pods' own Prometheus metrics.

    Port and path: these when set; else the pod's ``prometheus.io/port`` / ``prometheus.io/path``
    annotations; else its container port named ``metrics`` and ``/metrics``.
    """

    port: int | None = None
    path: str | None = None
    scheme: str = "http"
    """``http`` or ``https`` (the agent does not verify a pod's certificate: it scrapes by IP)."""
    interval_seconds: float | None = None
    """How often to scrape; None: the policy's evaluationInterval."""
    server: Server | None = None
    """The preset of the service rules that name neither ``server`` nor ``metric``."""


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A whole GPUMonitorPolicy spec."""

    selector: LabelSelector
    rules: tuple[Rule, ...]
    evaluation_interval_seconds: float = 10.0
    actions: Actions = field(default_factory=Actions)
    service_metrics: ServiceMetricsSource | None = None
    """spec.serviceMetrics; None: scraped (when a service rule needs it) by the pods' annotations."""

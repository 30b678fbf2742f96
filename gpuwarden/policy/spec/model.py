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


Rule = UtilizationFloor | UtilizationCeiling | MemoryCeiling | MemoryGrowth | GpuHealthRule | Anomaly


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


@dataclass(frozen=True, slots=True)
class ScaleForecast:
    """spec.actions.scale.forecast, with the thresholds it compares against resolved from the rules.

    ``ceiling_*`` come from the first utilizationCeiling rule in scaleUpOn, ``floor_*`` from the
    first utilizationFloor rule in scaleDownOn (none: the forecast never holds a scale-down back).
    """

    ceiling_rule: str
    ceiling_percent: float
    signal: Signal
    """The ceiling rule's signal: the utilization reading the load is summed from."""
    floor_rule: str | None = None
    floor_percent: float | None = None
    horizon_seconds: float | None = None
    """How far ahead to look; None: the workload's observed replica start-up time."""
    max_uncertainty: float = 20.0
    """The widest 80% interval (percentage points of per-replica utilization) the forecast may act on."""


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
class PolicySpec:
    """A whole GPUMonitorPolicy spec."""

    selector: LabelSelector
    rules: tuple[Rule, ...]
    evaluation_interval_seconds: float = 10.0
    actions: Actions = field(default_factory=Actions)

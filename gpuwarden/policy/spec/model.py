"""The typed model of a GPUMonitorPolicy spec (v1alpha1), as the engine sees it.

Plain frozen dataclasses; durations are seconds (float), byte sizes are ints,
percentages are floats in 0..100. ``parse_spec`` (in :mod:`gpuwarden.policy.parse`)
builds them from the CRD's camelCase dict and raises ``SpecError`` naming the field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


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


class Scheme(enum.StrEnum):
    """How the pods' own metrics are scraped (serviceMetrics.scheme)."""

    HTTP = "http"
    HTTPS = "https"


class Server(enum.StrEnum):
    """An inference server whose metric names a service rule's preset knows
    (:mod:`gpuwarden.policy.spec.servers`)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRITON = "triton"
    TGI = "tgi"  # Hugging Face text-generation-inference: archived upstream, its names frozen


class Rule(Protocol):
    """What the engine, the scale decision and the operator read of any rule. Each rule kind's module
    (:mod:`gpuwarden.policy.rules`) holds its spec's frozen dataclass, and its record in the registry
    (``RULE_TYPES``) says the rest: the spec names no kind."""

    @property
    def name(self) -> str:
        """The rule's name, unique in its policy (a DNS label)."""


class ServiceRule(Rule, Protocol):
    """A rule of a kind that reads the pods' own metrics (its record's ``metric`` is set): where it
    reads them. After :func:`~gpuwarden.policy.parse.parse_spec`, ``metric`` or ``server`` is set (the
    policy's ``serviceMetrics.server`` fills in a rule that names neither)."""

    @property
    def server(self) -> Server | None:
        """The inference server whose preset names its metric (:mod:`gpuwarden.policy.spec.servers`)."""

    @property
    def metric(self) -> str | None:
        """A metric by its name; wins over ``server``."""


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

    Utilization load: ``ceiling_*`` come from the first rule in scaleUpOn whose kind has a utilization
    ceiling, ``floor_*`` from the first in scaleDownOn whose kind has a floor (their records'
    ``forecast_ceiling`` and ``forecast_floor``; no floor: the forecast never holds a
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


class ReclaimMethod(enum.StrEnum):
    """What ``actions.reclaim`` does to an idle workload (docs/reclaim.md)."""

    SCALE_TO_ZERO = "ScaleToZero"  # Deployment, StatefulSet, LeaderWorkerSet: spec.replicas 0
    SUSPEND = "Suspend"  # Job, JobSet, RayCluster: spec.suspend; a Kueue Workload: spec.active false
    ANNOTATE = "Annotate"  # only mark the workload


@dataclass(frozen=True, slots=True)
class ReclaimAction:
    """spec.actions.reclaim: give an idle workload's GPUs back, after a warning and a grace period."""

    rules: tuple[str, ...]
    """The rules (utilizationFloor; idleGpus with Annotate) whose findings on every pod of a workload
    make it idle."""
    method: ReclaimMethod
    grace_seconds: float = 600.0
    max_per_hour: int = 5
    """Reclaims by this policy in any trailing hour; the next waits (the circuit breaker)."""
    dry_run: bool = True


@dataclass(frozen=True, slots=True)
class Actions:
    """spec.actions."""

    events: bool = True
    renotify_seconds: float = 3600.0
    scale: ScaleAction | None = None
    reclaim: ReclaimAction | None = None


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

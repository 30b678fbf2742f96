"""gpuwarden.policy: the policy engine. Pure: no I/O, no clock (``now`` is passed in), deterministic.

Feed samples into a :class:`SeriesStore` (:func:`points_from_report` attributes a
node report's readings to pods), keep one :class:`PolicyEvaluator` per policy,
and call :meth:`PolicyEvaluator.evaluate` with the pods and ``now``: it returns
an :class:`Evaluation` with the findings' transitions.

This module is the one surface the operator and local mode import (``make lint`` checks it); what
is not in ``__all__`` is the engine's own. Inside, by job:

- ``parse``: a GPUMonitorPolicy's spec checked and typed, with the messages users read.
- ``spec/``: the policy spec's model (``model``: what any rule is, not the kinds), the field
  readers behind every parser message (``fields``), label selectors, the inference servers' metric
  names (``servers``).
- ``store/``: what the engine remembers: readings per pod (``series``), GPU health records
  (``health``), the pods' own metrics as scraped (``service``), and how node reports become
  readings (``intake``).
- ``rules/``: one module per rule kind (its spec's class, parser, evaluator, kind and
  :class:`RuleType`), the registry of them (:data:`RULE_TYPES`), and their shared vocabulary
  (``common``).
- ``scaling/``: the scale decision (``decider``) and its load forecast (``predictive``, ``forecast``).
- ``reclaim``: which workloads are idle, the warning and grace period, the circuit breaker.
- ``engine``, ``findings`` (what is open and what changed), ``stats`` (robust line fits),
  ``humanize`` (numbers and times for messages), ``xids`` (the XID catalogue).

Imports point down only: the engine and the parser on top, then findings, scaling, rules, and at
the bottom store and spec, which know nothing of each other.
"""

from gpuwarden.policy.engine import (
    SNOOZE_PREFIX,
    Evaluation,
    PodView,
    PolicyEvaluator,
    evaluate_rule,
    horizon_seconds,
    rule_kind,
    snoozed_until,
)
from gpuwarden.policy.findings import (
    Finding,
    FindingKey,
    FindingState,
    FindingTracker,
    FindingTransition,
    Resolution,
    Transition,
)
from gpuwarden.policy.humanize import approx_duration, format_bytes, format_count, format_latency
from gpuwarden.policy.parse import API_VERSION, KIND, SpecError, parse_policy_object, parse_spec
from gpuwarden.policy.reclaim import (
    BREAKER_WINDOW_SECONDS,
    CircuitBreaker,
    Idle,
    ReclaimPlanner,
    ReclaimStep,
    ReclaimStepKind,
    WorkloadRef,
    idle_workloads,
    recently_active,
)
from gpuwarden.policy.rules import RULE_TYPES, RuleType, rule_type, service_metric_names, spec_warnings
from gpuwarden.policy.rules.anomaly import Pattern
from gpuwarden.policy.rules.common import Outcome, RuleKind, WindowParams
from gpuwarden.policy.rules.gpu_health import Problem, gpu_name, gpu_problems
from gpuwarden.policy.rules.growth import (
    HOST_IMMINENT_REASON,
    IMMINENT_REASON,
    answer_text,
    site_text,
    snapshot_before,
    snapshot_due,
)
from gpuwarden.policy.scaling.decider import (
    ActiveFinding,
    Blocker,
    Direction,
    ScaleDecider,
    ScaleDecision,
    ScaleStep,
    StepKind,
    scale_step,
)
from gpuwarden.policy.scaling.predictive import WorkloadLoad
from gpuwarden.policy.spec.model import (
    LabelSelector,
    PolicySpec,
    ReclaimAction,
    ReclaimMethod,
    ScaleAction,
    ScaleTargetRef,
    Server,
    ServiceMetricsSource,
)
from gpuwarden.policy.spec.selector import selector_matches
from gpuwarden.policy.store.health import Admission, GpuRecord, HealthStore, Incident, IncidentKind
from gpuwarden.policy.store.intake import (
    PROCESS_NAMESPACE,
    pods_of,
    points_from_processes,
    points_from_report,
    points_from_snapshot,
    process_subject,
    service_scrape,
)
from gpuwarden.policy.store.series import (
    BYTES_PER_POINT,
    GAP_RECORD_SECONDS,
    Column,
    PodId,
    Point,
    SeriesKey,
    SeriesStore,
    StoreStats,
    UtilizationSource,
    Window,
)
from gpuwarden.policy.store.service import Histogram, ServiceScrape, ServiceStore
from gpuwarden.policy.xids import CRITICAL_XIDS, describe_xid

__all__ = [
    "API_VERSION",
    "BREAKER_WINDOW_SECONDS",
    "BYTES_PER_POINT",
    "CRITICAL_XIDS",
    "GAP_RECORD_SECONDS",
    "HOST_IMMINENT_REASON",
    "IMMINENT_REASON",
    "KIND",
    "PROCESS_NAMESPACE",
    "RULE_TYPES",
    "SNOOZE_PREFIX",
    "ActiveFinding",
    "Admission",
    "Blocker",
    "CircuitBreaker",
    "Column",
    "Direction",
    "Evaluation",
    "Finding",
    "FindingKey",
    "FindingState",
    "FindingTracker",
    "FindingTransition",
    "GpuRecord",
    "HealthStore",
    "Histogram",
    "Idle",
    "Incident",
    "IncidentKind",
    "LabelSelector",
    "Outcome",
    "Pattern",
    "PodId",
    "PodView",
    "Point",
    "PolicyEvaluator",
    "PolicySpec",
    "Problem",
    "ReclaimAction",
    "ReclaimMethod",
    "ReclaimPlanner",
    "ReclaimStep",
    "ReclaimStepKind",
    "Resolution",
    "RuleKind",
    "RuleType",
    "ScaleAction",
    "ScaleDecider",
    "ScaleDecision",
    "ScaleStep",
    "ScaleTargetRef",
    "SeriesKey",
    "SeriesStore",
    "Server",
    "ServiceMetricsSource",
    "ServiceScrape",
    "ServiceStore",
    "SpecError",
    "StepKind",
    "StoreStats",
    "Transition",
    "UtilizationSource",
    "Window",
    "WindowParams",
    "WorkloadLoad",
    "WorkloadRef",
    "answer_text",
    "approx_duration",
    "describe_xid",
    "evaluate_rule",
    "format_bytes",
    "format_count",
    "format_latency",
    "gpu_name",
    "gpu_problems",
    "horizon_seconds",
    "idle_workloads",
    "parse_policy_object",
    "parse_spec",
    "pods_of",
    "points_from_processes",
    "points_from_report",
    "points_from_snapshot",
    "process_subject",
    "recently_active",
    "rule_kind",
    "rule_type",
    "scale_step",
    "selector_matches",
    "service_metric_names",
    "service_scrape",
    "site_text",
    "snapshot_before",
    "snapshot_due",
    "snoozed_until",
    "spec_warnings",
]

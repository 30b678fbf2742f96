"""gpuwarden.policy.rules: the rule kinds, one module each, and :data:`RULE_TYPES`, the list of them.

Each kind's module holds its spec's class, its parser, its evaluator, its kind (``KIND``) and its
:class:`RuleType` (what the parser, the engine, the operator's status and Events, and local mode's
plot need to know of it); ``common`` holds what they share (:class:`Outcome`, :class:`RuleKind`,
:class:`WindowParams`, the evaluator's contract :data:`~gpuwarden.policy.rules.common.Judge` and
its :class:`~gpuwarden.policy.rules.common.JudgeContext`, windows and coverage); ``activity`` the
GPUs' activity the utilization kinds read; ``throttling`` the throttling beside their verdicts;
``service`` what the kinds that read the pods' own metrics share. A kind's module imports these,
never another kind's (``tests/unit/policy/rules/test_registry.py`` holds it).

Others in the policy engine import this package (the registry) and ``common``; a kind's own module
only for what is that kind's alone (e.g. anomaly's ``Pattern``). Adding a kind: docs/policy.md,
"Adding a rule kind".
"""

from typing import Any, cast

from gpuwarden.policy.rules import (
    anomaly,
    gpu_health,
    growth,
    idle_gpus,
    kv_cache,
    latency,
    memory_ceiling,
    queue,
    utilization,
)
from gpuwarden.policy.rules.common import Memo, RuleKind, RuleType, Services
from gpuwarden.policy.spec.model import PolicySpec, Rule, ServiceRule
from gpuwarden.policy.spec.servers import Metric

__all__ = [
    "RULE_TYPES",
    "Memo",
    "RuleType",
    "Services",
    "rule_metric",
    "rule_type",
    "service_metric_names",
    "service_rule",
    "spec_warnings",
    "type_of",
]

RULE_TYPES: tuple[RuleType[Any, Any], ...] = (
    utilization.FLOOR_TYPE,
    utilization.CEILING_TYPE,
    idle_gpus.RULE_TYPE,
    memory_ceiling.RULE_TYPE,
    growth.RULE_TYPE,
    gpu_health.RULE_TYPE,
    anomaly.RULE_TYPE,
    latency.RULE_TYPE,
    queue.RULE_TYPE,
    kv_cache.RULE_TYPE,
)
"""Every rule kind, in the order the CRD and the parser's messages list them."""

_BY_KIND = {t.kind: t for t in RULE_TYPES}
_BY_MODEL = {t.model: t for t in RULE_TYPES}


def rule_type(kind: RuleKind) -> RuleType[Any, Any]:
    """The record of a kind."""
    return _BY_KIND[kind]


def type_of(rule: Rule) -> RuleType[Any, Any]:
    """The record of a rule's kind, by its spec's class."""
    return _BY_MODEL[type(rule)]


def rule_metric(rule: Rule) -> Metric | str | None:
    """The metric a rule reads of the pods' own (or why its server has none); None for a rule of the GPUs."""
    read = type_of(rule).metric
    return None if read is None else read(rule)


def service_rule(rule: Rule) -> ServiceRule | None:
    """The rule as one that reads the pods' own metrics (its kind's record has a ``metric``), else None."""
    return cast(ServiceRule, rule) if type_of(rule).metric is not None else None


def service_metric_names(spec: PolicySpec) -> frozenset[str]:
    """The Prometheus metric names, as exposed (histograms by base name), that the spec's rules read:
    what the agents keep of the pods' scrapes. Empty when no rule reads the pods' own metrics.

    With a scale forecast of requests, also what its rate is read from (the servers' counters of
    requests served).
    """
    names: set[str] = set()
    for rule in spec.rules:
        metric = rule_metric(rule)
        if isinstance(metric, Metric):
            names.update(metric.names)
    scale = spec.actions.scale
    if scale is not None and scale.forecast is not None:
        names.update(scale.forecast.request_metrics)
    return frozenset(names)


def spec_warnings(spec: PolicySpec) -> tuple[str, ...]:
    """What is legal in the spec but most likely a mistake, in words for the policy's ``Ready``
    message: a ``percent`` above 0 and under 1 (``percent`` is 0 to 100: ``0.2`` meant as 20% is 0.2%)."""
    warnings = []
    for rule in spec.rules:
        percent = getattr(rule, "percent", None)
        if isinstance(percent, int | float) and 0 < percent < 1:
            warnings.append(
                f"rule {rule.name}: percent {percent:g} means {percent:g}%, not {percent * 100:g}% "
                "(percent is 0 to 100)"
            )
    return tuple(warnings)

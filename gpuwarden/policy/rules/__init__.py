"""gpuwarden.policy.rules: the rule kinds, one module each, and :data:`RULE_TYPES`, the list of them.

Each kind's module holds its parser, its evaluator and its :class:`RuleType` (what the parser, the
engine, the operator's status and Events, and local mode's plot need to know of it); ``common`` holds
what they share (:class:`Outcome`, :class:`RuleKind`, :class:`WindowParams`, windows and coverage);
``serving`` what the kinds that read the pods' own metrics share (requestLatency, requestQueue,
kvCacheUsage: ``latency``, ``queue``, ``kv_cache``).

Others in the policy engine import this package (the registry) and ``common``; a kind's own module
only for what is that kind's alone (e.g. anomaly's ``Pattern``). Adding a kind: docs/policy.md,
"Adding a rule kind".
"""

from typing import Any

from gpuwarden.policy.rules import (
    anomaly,
    gpu_health,
    growth,
    kv_cache,
    latency,
    memory_ceiling,
    queue,
    utilization,
)
from gpuwarden.policy.rules.common import Memo, RuleKind, RuleType, Services

__all__ = ["RULE_TYPES", "Memo", "RuleType", "Services", "rule_type", "type_of"]

RULE_TYPES: tuple[RuleType[Any], ...] = (
    utilization.FLOOR_TYPE,
    utilization.CEILING_TYPE,
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


def rule_type(kind: RuleKind) -> RuleType[Any]:
    """The record of a kind."""
    return _BY_KIND[kind]


def type_of(rule: object) -> RuleType[Any]:
    """The record of a rule's kind, by its spec's class."""
    return _BY_MODEL[type(rule)]

"""kvCacheUsage: how full a pod's KV cache is, above a percent.

- **Value.** The pod's KV-cache gauge (the rule's ``metric``, or its server's: ``vllm:kv_cache_usage_perc``,
  ``vllm:gpu_cache_usage_perc`` before vLLM 0.10, ``sglang:token_usage``) from its newest fresh scrape,
  as a percent (vLLM's and SGLang's read 0..1; a ``metric`` of one's own says its ``unit``); of several
  label sets (models), the fullest.
- **Holds** above ``percent``, for ``for`` before the finding starts; **clears** at or below
  ``percent - hysteresis``. A full KV cache makes the server preempt or queue requests: the first sign
  a replica is out of room before its latency shows it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.rules.common import (
    Outcome,
    RuleKind,
    RuleType,
    Services,
    WindowParams,
    on_services,
    percent,
    unknown,
)
from gpuwarden.policy.rules.service import SERVER, SHORT_OF_REPLICAS, metric_field, metric_of, parse_source
from gpuwarden.policy.spec.model import Server
from gpuwarden.policy.spec.schema import Body, Check, Choice, Duration, Number
from gpuwarden.policy.spec.servers import Metric, source_metric
from gpuwarden.policy.store.series import PodId

KIND = RuleKind("kvCacheUsage")
"""Its kind: its key under ``spec.rules[]``."""


class GaugeUnit(enum.StrEnum):
    """What a kvCacheUsage rule's own ``metric`` reads in (a preset knows its server's)."""

    RATIO = "ratio"  # 0..1, as vLLM's and SGLang's
    PERCENT = "percent"  # 0..100


@dataclass(frozen=True, slots=True)
class KvCacheUsage:
    """Fires when a pod's KV cache stays fuller than ``percent`` for ``for_seconds`` (see the module doc)."""

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


UNIT = "percent"


PERCENT = Number(
    "percent",
    "The usage in percent (0-100) the KV cache must stay at or below.",
    minimum=0,
    maximum=100,
    required=True,
)
FOR = Duration(
    "for",
    "How long the usage must stay above percent, judged at every evaluation, before the violation"
    " starts (a duration such as 2m).",
    default="2m",
)
METRIC = metric_field("A gauge of KV-cache usage (see unit).")
UNIT_FIELD = Choice(
    "unit",
    "What metric reads in: ratio (0 to 1, as vLLM's and SGLang's) or percent (0 to 100). A server's"
    " preset knows its own.",
    choices=GaugeUnit,
    default=GaugeUnit.RATIO,
)
HYSTERESIS = Number(
    "hysteresis",
    "Percentage points the usage must fall below percent before an active violation clears (0 to 50).",
    minimum=0,
    maximum=50,
    default=5,
)
BODY = Body(
    "Fires when the pod's KV cache stays fuller than percent for the duration `for`: the pod's own"
    " gauge (its server's, or metric), scraped by the node agent (spec.serviceMetrics); of several"
    " label sets (models), the fullest. A full KV cache makes the server preempt or queue requests.",
    (PERCENT, FOR, SERVER, METRIC, UNIT_FIELD, HYSTERESIS),
    # The parser refuses the same through the presets (kv_cache_metric: no such gauge).
    (
        Check(
            "has(self.metric) || !has(self.server) || self.server in ['vllm', 'sglang']",
            "Triton and TGI export no KV-cache usage of their own; name a gauge with metric",
            ".server",
        ),
    ),
)


def parse_kv_cache(name: str, obj: Mapping[str, Any], path: str) -> KvCacheUsage:
    """A kvCacheUsage rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    server, metric = parse_source(obj, path, METRIC)
    return KvCacheUsage(
        name=name,
        percent=PERCENT.read(obj, path),
        for_seconds=FOR.read(obj, path),
        server=server,
        metric=metric,
        unit=UNIT_FIELD.read(obj, path),
        hysteresis=HYSTERESIS.read(obj, path),
    )


def kv_cache_metric(rule: KvCacheUsage) -> Metric | str:
    """The KV-cache gauge a kvCacheUsage rule reads (scaled to percent), or why its server has none."""
    scale = 100.0 if rule.unit is GaugeUnit.RATIO else 1.0
    return source_metric(rule, lambda preset: preset.kv_cache, scale)


def kv_cache_message(o: Outcome) -> str:
    """``KV cache 96% full, limit 90%``."""
    return f"KV cache {percent(o.value or 0.0)} full, limit {percent(o.threshold)}"


def evaluate_kv_cache(
    rule: KvCacheUsage, pod: PodId, now: float, params: WindowParams, services: Services | None
) -> Outcome:
    """Judge a kvCacheUsage rule for one pod (see the module doc)."""
    kind = KIND
    nothing = unknown(rule.name, kind, pod, rule.percent, UNIT)
    if services is None:
        return nothing
    metric = metric_of(kv_cache_metric(rule))
    found = services.store.gauge(pod, metric.names, now, params.stale_after_seconds)
    if found is None or not found[1]:
        return nothing
    name, values = found
    value = max(values) * metric.scale
    holds = value > rule.percent
    clears = not holds and value <= rule.percent - rule.hysteresis
    return Outcome(
        rule.name,
        kind,
        pod,
        value,
        rule.percent,
        UNIT,
        holds=holds,
        clears=clears,
        window_seconds=rule.for_seconds,
        signal=name,
        describe=kv_cache_message,
    )


RULE_TYPE = RuleType(
    kind=KIND,
    model=KvCacheUsage,
    parse=parse_kv_cache,
    body=BODY,
    evaluate=on_services(evaluate_kv_cache),
    # It reads the newest scrape; the last few tell the pod's scrape interval (its staleness).
    reach=lambda rule: max(rule.for_seconds, 60.0),
    window=None,
    reason="KVCacheFull",
    meaning="its KV cache is nearly full: requests get preempted or queued; it may need more replicas",
    per_gpu=False,
    colour="tab:olive",
    utilization=True,  # local mode's plot draws it on the utilization panel: it speaks of load
    hold=lambda rule: rule.for_seconds,
    metric=kv_cache_metric,
    up_only=SHORT_OF_REPLICAS,
)

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

from collections.abc import Mapping
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
from gpuwarden.policy.rules.serving import metric_of, parse_source
from gpuwarden.policy.spec.fields import check_fields, duration, member, number, value_or
from gpuwarden.policy.spec.model import GaugeUnit, KvCacheUsage
from gpuwarden.policy.spec.servers import kv_cache_metric
from gpuwarden.policy.store.series import PodId

UNIT = "percent"

DEFAULTS: Mapping[str, Any] = {"for": "2m", "unit": "ratio", "hysteresis": 5}


def parse_kv_cache(name: str, obj: Mapping[str, Any], path: str) -> KvCacheUsage:
    """A kvCacheUsage rule's body (``path`` is its own)."""
    check_fields(obj, path, ("percent", "for", "server", "metric", "unit", "hysteresis"), ("percent",))
    server, metric = parse_source(obj, path)
    return KvCacheUsage(
        name=name,
        percent=number(obj, "percent", path, None, 0, 100),
        for_seconds=duration(obj, "for", path, DEFAULTS["for"]),
        server=server,
        metric=metric,
        unit=member(GaugeUnit, value_or(obj, "unit", DEFAULTS["unit"]), f"{path}.unit"),
        hysteresis=number(obj, "hysteresis", path, DEFAULTS["hysteresis"], 0, 50),
    )


def kv_cache_message(o: Outcome) -> str:
    """``KV cache 96% full, limit 90%``."""
    return f"KV cache {percent(o.value or 0.0)} full, limit {percent(o.threshold)}"


def evaluate_kv_cache(
    rule: KvCacheUsage, pod: PodId, now: float, params: WindowParams, services: Services | None
) -> Outcome:
    """Judge a kvCacheUsage rule for one pod (see the module doc)."""
    kind = RuleKind.KV_CACHE_USAGE
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
    kind=RuleKind.KV_CACHE_USAGE,
    model=KvCacheUsage,
    parse=parse_kv_cache,
    defaults=DEFAULTS,
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
)

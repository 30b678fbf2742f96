"""The inference servers' presets, and which metric names a policy asks the agents to keep."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwarden.policy import (
    PolicySpec,
    Server,
    ServiceMetricsSource,
    SpecError,
    parse_spec,
    service_metric_names,
)
from gpuwarden.policy.rules.kv_cache import GaugeUnit, KvCacheUsage, kv_cache_metric
from gpuwarden.policy.rules.latency import RequestLatency, latency_metric
from gpuwarden.policy.rules.queue import RequestQueue, queue_metric
from gpuwarden.policy.rules.utilization import UtilizationFloor
from gpuwarden.policy.spec.model import LabelSelector
from gpuwarden.policy.spec.servers import PRESETS, Latency, Metric


def spec(*rules: Any) -> PolicySpec:
    return PolicySpec(selector=LabelSelector(), rules=rules)


def test_a_policy_of_gpu_rules_asks_for_no_metric() -> None:
    assert service_metric_names(spec(UtilizationFloor("idle", 10, 300))) == frozenset()


def test_names_of_a_vllm_policy_include_the_older_names() -> None:
    names = service_metric_names(
        spec(
            RequestLatency("slow", 99, 2.0, server=Server.VLLM),
            RequestLatency("itl", 90, 0.1, latency=Latency.INTER_TOKEN, server=Server.VLLM),
            RequestQueue("queue", 5, server=Server.VLLM),
            KvCacheUsage("kv", 90, server=Server.VLLM),
        )
    )
    assert names == {
        "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    }


def test_a_metric_by_name_wins_over_the_server() -> None:
    rule = RequestQueue("queue", 5, server=Server.VLLM, metric="my_queue_depth")
    assert service_metric_names(spec(rule)) == {"my_queue_depth"}
    assert queue_metric(rule) == Metric(("my_queue_depth",))


def test_kv_cache_presets_and_units_scale_to_percent() -> None:
    assert kv_cache_metric(KvCacheUsage("kv", 90, server=Server.SGLANG)) == Metric(
        ("sglang:token_usage",), 100.0
    )
    assert kv_cache_metric(KvCacheUsage("kv", 90, metric="kv", unit=GaugeUnit.PERCENT)) == Metric(
        ("kv",), 1.0
    )
    assert kv_cache_metric(KvCacheUsage("kv", 90, metric="kv")) == Metric(("kv",), 100.0)


def test_triton_gives_ttft_in_milliseconds_and_no_end_to_end_percentile() -> None:
    ttft = latency_metric(
        RequestLatency("t", 99, 1.0, latency=Latency.TIME_TO_FIRST_TOKEN, server=Server.TRITON)
    )
    assert ttft == Metric(("nv_inference_first_response_histogram_ms",), 0.001)
    e2e = latency_metric(RequestLatency("t", 99, 1.0, server=Server.TRITON))
    assert isinstance(e2e, str)
    assert "a mean, not a percentile" in e2e
    assert service_metric_names(spec(RequestLatency("t", 99, 1.0, server=Server.TRITON))) == frozenset()


@pytest.mark.parametrize("server", list(Server))
def test_every_preset_names_every_latency(server: Server) -> None:
    assert set(PRESETS[server].latency) == set(Latency)
    assert PRESETS[server].requests


def test_service_metrics_parse_with_defaults() -> None:
    parsed = parse_spec(
        {
            "selector": {},
            "serviceMetrics": {"port": 8000, "path": "/metrics", "interval": "15s", "server": "vllm"},
            "rules": [{"name": "idle", "utilizationFloor": {"percent": 10}}],
        }
    )
    assert parsed.service_metrics == ServiceMetricsSource(
        port=8000, path="/metrics", scheme="http", interval_seconds=15.0, server=Server.VLLM
    )
    plain = parse_spec(
        {
            "selector": {},
            "serviceMetrics": {},
            "rules": [{"name": "idle", "utilizationFloor": {"percent": 10}}],
        }
    )
    assert plain.service_metrics == ServiceMetricsSource()


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"port": 0}, "spec.serviceMetrics.port", "out of range"),
        ({"path": "metrics"}, "spec.serviceMetrics.path", "not a URL path"),
        ({"path": "/m?x=1"}, "spec.serviceMetrics.path", "not a URL path"),
        ({"scheme": "ftp"}, "spec.serviceMetrics.scheme", "not one of http, https"),
        ({"interval": "500ms"}, "spec.serviceMetrics.interval", "too short"),
        ({"server": "vllm2"}, "spec.serviceMetrics.server", "not one of vllm, sglang, triton, tgi"),
        ({"prot": 1}, "spec.serviceMetrics.prot", "did you mean"),
    ],
)
def test_bad_service_metrics_are_refused_naming_the_field(
    body: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(
            {
                "selector": {},
                "serviceMetrics": body,
                "rules": [{"name": "i", "utilizationFloor": {"percent": 1}}],
            }
        )
    assert err.value.field == field
    assert words in err.value.reason

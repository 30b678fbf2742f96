"""The forecast with ``load: requests``: what it reads (the pods' counters of requests served), its
ceiling (requestsPerReplica) and what the parser asks of it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gpuwarden.policy import (
    PodId,
    PodView,
    PolicyEvaluator,
    SeriesStore,
    ServiceScrape,
    ServiceStore,
    SpecError,
    parse_spec,
    service_metric_names,
)
from gpuwarden.policy.rules.common import Services, WindowParams
from gpuwarden.policy.scaling.predictive import Predictor, View, WorkloadLoad, request_load
from gpuwarden.policy.spec.model import BUCKET_SECONDS, ForecastLoad

T0 = 1_750_000_020.0 - (1_750_000_020.0 % BUCKET_SECONDS)
SUCCESS = "vllm:request_success_total"


def policy(forecast: dict[str, Any], down_on: list[str] | None = None) -> dict[str, Any]:
    return {
        "selector": {},
        "serviceMetrics": {"server": "vllm"},
        "rules": [
            {"name": "slow", "requestLatency": {"percentile": 99, "threshold": "2s"}},
            {"name": "idle", "utilizationFloor": {"percent": 10}},
        ],
        "actions": {
            "scale": {
                "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"},
                "maxReplicas": 8,
                "scaleUpOn": ["slow"],
                "scaleDownOn": down_on if down_on is not None else ["idle"],
                "forecast": forecast,
            }
        },
    }


def test_a_requests_forecast_reads_the_servers_counter_then_the_histogram_count() -> None:
    spec = parse_spec(policy({"load": "requests", "requestsPerReplica": 4}))
    assert spec.actions.scale is not None
    forecast = spec.actions.scale.forecast
    assert forecast is not None
    assert forecast.load is ForecastLoad.REQUESTS
    assert forecast.ceiling_percent == 4
    assert forecast.request_metrics == (SUCCESS, "vllm:e2e_request_latency_seconds")
    assert forecast.floor_percent is None  # it never holds a scale-down back
    assert SUCCESS in service_metric_names(spec)


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (policy({"load": "requests"}), "spec.actions.scale.forecast.requestsPerReplica", "required"),
        (
            policy({"requestsPerReplica": 4}),
            "spec.actions.scale.forecast.requestsPerReplica",
            "load: requests only",
        ),
        (
            policy({"load": "requests", "requestsPerReplica": 0}),
            "spec.actions.scale.forecast.requestsPerReplica",
            "above 0",
        ),
        (policy({"load": "tokens"}), "spec.actions.scale.forecast.load", "not one of utilization, requests"),
        (policy({}), "spec.actions.scale.forecast", "needs a utilizationCeiling rule in scaleUpOn"),
        (
            policy({"load": "requests", "requestsPerReplica": 4}, down_on=["slow"]),
            "spec.actions.scale.scaleDownOn[0]",
            "also in scaleUpOn",
        ),
    ],
)
def test_bad_forecasts_are_refused_naming_the_field(spec: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.field == field
    assert words in err.value.reason


def test_a_service_rule_cannot_scale_down() -> None:
    spec = policy({"load": "requests", "requestsPerReplica": 4})
    spec["rules"].append({"name": "queue", "requestQueue": {"limit": 5}})
    spec["actions"]["scale"]["scaleDownOn"] = ["queue"]
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.field == "spec.actions.scale.scaleDownOn[0]"
    assert "can only scale up" in err.value.reason


def test_the_load_is_the_sum_of_the_pods_request_rates() -> None:
    store = ServiceStore(retention_seconds=3600)
    pods = (PodId("ns", "a"), PodId("ns", "b"), PodId("ns", "quiet"))
    for k in range(7):  # a: 3/s, b: 1/s (restarted once), quiet: none
        t = T0 + 10 * k
        store.record(pods[0], ServiceScrape(at=t, counters={SUCCESS: 30.0 * k}))
        store.record(pods[1], ServiceScrape(at=t, counters={SUCCESS: 10.0 * (k if k < 3 else k - 3)}))
        store.record(pods[2], ServiceScrape(at=t, counters={SUCCESS: 5.0}))
    spec = parse_spec(policy({"load": "requests", "requestsPerReplica": 4}))
    assert spec.actions.scale is not None
    forecast = spec.actions.scale.forecast
    assert forecast is not None
    load = request_load(Services(store, pods), forecast, T0 + 60, 10.0, WindowParams())
    assert load is not None
    assert load.total == pytest.approx(3 + (10 * 2 + 10 * 3) / 60)
    assert (load.serving, load.pods) == (2, 3)
    assert request_load(Services(store, ()), forecast, T0, 10.0, WindowParams()) is None


def test_a_rising_request_rate_is_forecast_past_requests_per_replica() -> None:
    spec = parse_spec(policy({"load": "requests", "requestsPerReplica": 4, "horizon": "3m"}))
    assert spec.actions.scale is not None
    forecast = spec.actions.scale.forecast
    assert forecast is not None
    p = Predictor()
    rng = random.Random(3)
    t = T0
    rates = [6 + rng.gauss(0, 0.1) for _ in range(20)] + [6 + 0.4 * k for k in range(1, 5)]
    for i, rate in enumerate(rates):
        for j in range(6):
            t = T0 + i * BUCKET_SECONDS + j * 10
            p.observe(WorkloadLoad(rate, 2, 2), t)
    verdict = p.verdict(forecast, 2, t)
    assert verdict.view is View.UP, verdict
    assert rates[-1] / 2 < 4  # 3.8/s per replica now; past 4 within the horizon
    assert verdict.summary(forecast) == "forecast above requestsPerReplica (4/s) in 3m"
    assert "requests/s per replica (80% interval" in verdict.detail(forecast.load)


def test_the_engine_samples_the_request_load() -> None:
    spec = parse_spec(policy({"load": "requests", "requestsPerReplica": 4}))
    store = ServiceStore(retention_seconds=3600)
    for k in range(7):
        store.record(PodId("ns", "a"), ServiceScrape(at=T0 + 10 * k, counters={SUCCESS: 20.0 * k}))
    evaluation = PolicyEvaluator("ns/llm", spec).evaluate(
        [PodView("ns", "a")], SeriesStore(retention_seconds=600, max_points=10), T0 + 60, services=store
    )
    assert evaluation.load is not None
    assert evaluation.load.total == pytest.approx(2.0)
    assert (evaluation.load.serving, evaluation.load.pods) == (1, 1)

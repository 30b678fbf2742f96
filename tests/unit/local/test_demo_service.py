"""The demo's inference Deployment as servers (its scenario's ``service:``): latency that rises when
its replicas saturate, which its GPUs do not show, and falls back once a replica is added.

The scenario is played forward as the demo plays it (``Scenario.service_metrics`` every 10 s of
scenario time) and scaled by hand where the demo's policy would scale it; P99 latency is read from
the exported histograms as Prometheus's ``histogram_quantile`` over a minute's increase reads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from gpuwarden.sim.replica import E2E_LATENCY, REQUESTS_WAITING, CumulativeHistogram
from gpuwarden.sim.scenario import ScenarioError, load_scenario, parse_scenario

NAMESPACE, NAME = "inference", "llm-server"
FORECAST_SCALE_UP = 15 * 60 + 10
"""When the demo's forecast scales the Deployment 2 -> 3 ahead of the ramp (test_demo.py holds it)."""
STEP = 10


def quantile(q: float, before: CumulativeHistogram, after: CumulativeHistogram) -> float | None:
    """``histogram_quantile(q, increase(...))`` between two scrapes: linear inside the bucket."""
    counts = [b - a for a, b in zip(before.counts, after.counts, strict=True)]
    total = counts[-1]
    if total <= 0:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound, count in zip(after.bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        below, lower = count, bound
    return lower


def played(scale_at: dict[int, int], until: int) -> Iterator[tuple[int, list[float], list[float], float]]:
    """Every STEP: (t, each serving replica's P99 over the last minute, its waiting requests, the
    busiest of the Deployment's GPUs' utilization)."""
    scenario = load_scenario("demo")
    gpus = set(scenario.deployments[0].spec.gpus)
    seen: dict[str, list[tuple[int, CumulativeHistogram]]] = {}
    for t in range(0, until + 1, STEP):
        if t in scale_at:
            assert scenario.scale(NAMESPACE, NAME, scale_at[t], t)
        p99s, waiting = [], []
        for ref, metrics in scenario.service_metrics(t):
            history = seen.setdefault(ref.name, [])
            history.append((t, metrics.histograms[E2E_LATENCY]))
            older = [h for at, h in history if at <= t - 60]
            if older:
                p99 = quantile(0.99, older[-1], metrics.histograms[E2E_LATENCY])
                if p99 is not None:
                    p99s.append(p99)
            waiting.append(metrics.gauges[REQUESTS_WAITING])
        busiest = max(g.utilization_gpu or 0.0 for g in scenario.gpu_samples(t) if g.uuid in gpus)
        yield t, p99s, waiting, busiest


def test_longer_answers_queue_on_three_replicas_while_their_gpus_stay_below_the_ceiling() -> None:
    steps = {
        t: (p99s, waiting, busiest) for t, p99s, waiting, busiest in played({FORECAST_SCALE_UP: 3}, 23 * 60)
    }
    # Three replicas serving, 64-token answers: P99 near 5 s, nothing waits.
    p99s, waiting, _ = steps[18 * 60]
    assert len(p99s) == 3
    assert max(p99s) < 7
    assert sum(waiting) == 0
    # Answers of 88 tokens from 19m at the same rate: a queue, and P99 past 10 s by 22m.
    p99s, waiting, _ = steps[22 * 60]
    assert min(p99s) > 10
    assert min(waiting) > 10
    # The GPUs follow the request rate, not the answers' length: once three serve, they stay below
    # the demo's 95% ceiling, and its hysteresis.
    assert max(busiest for t, (_, _, busiest) in steps.items() if t >= 17 * 60) < 90


def test_a_fourth_replica_drains_the_queue_and_latency_falls_back() -> None:
    steps = {
        t: (p99s, waiting) for t, p99s, waiting, _ in played({FORECAST_SCALE_UP: 3, 22 * 60: 4}, 27 * 60)
    }
    p99s, waiting = steps[23 * 60]
    assert len(p99s) == 3, "the fourth replica loads its model for 90 s first"
    assert min(waiting) > 10
    p99s, waiting = steps[26 * 60]
    assert len(p99s) == 4
    assert max(p99s) < 10
    assert sum(waiting) == 0
    p99s, _ = steps[27 * 60]
    assert max(p99s) < 7


def test_the_same_scenario_scaled_the_same_way_serves_the_same_requests() -> None:
    first = list(played({FORECAST_SCALE_UP: 3}, 20 * 60))
    again = list(played({FORECAST_SCALE_UP: 3}, 20 * 60))
    assert first == again


def test_replicas_export_only_once_serving_and_time_only_goes_forward() -> None:
    scenario = load_scenario("demo")
    assert len(scenario.service_metrics(0)) == 2
    scenario.scale(NAMESPACE, NAME, 3, 60)
    assert len(scenario.service_metrics(100)) == 2, "the third loads its model until 150 s"
    assert len(scenario.service_metrics(150)) == 3
    with pytest.raises(ValueError, match="backwards"):
        scenario.service_metrics(140)


def test_output_tokens_must_start_at_zero() -> None:
    data = load_scenario("demo").spec.model_dump(by_alias=True, exclude_none=True)
    service = data["deployments"][0]["service"]
    service["outputTokens"] = [{"kind": "idle", "level": 64, "at": 60}]
    with pytest.raises(ScenarioError, match=r"service\.outputTokens: pieces must start at 0"):
        parse_scenario(data)

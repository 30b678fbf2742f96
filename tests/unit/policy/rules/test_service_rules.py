"""requestLatency, requestQueue and kvCacheUsage: judged on the pods' own scrapes, through the engine."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpuwarden.policy import (
    Histogram,
    PodId,
    PodView,
    PolicyEvaluator,
    SeriesStore,
    ServiceScrape,
    ServiceStore,
    SpecError,
    Transition,
    parse_spec,
)
from gpuwarden.policy.rules.common import Services, WindowParams
from gpuwarden.policy.rules.kv_cache import KvCacheUsage, evaluate_kv_cache
from gpuwarden.policy.rules.latency import RequestLatency, evaluate_latency
from gpuwarden.policy.rules.queue import QueueScope, RequestQueue, evaluate_queue
from gpuwarden.policy.spec.model import Server
from gpuwarden.units import format_duration

T0 = 1_750_000_000.0
PARAMS = WindowParams()
A = PodId("ns", "llm-a")
B = PodId("ns", "llm-b")
E2E = "vllm:e2e_request_latency_seconds"
BOUNDS = (0.5, 1.0, 2.0, 5.0, 10.0, math.inf)
SLOW = RequestLatency("slow", 99, 2.0, window_seconds=60, for_seconds=30, server=Server.VLLM)


class Replica:
    """A pod's vLLM metrics as scraped every 10 s: requests land in one bucket per spell."""

    def __init__(self, store: ServiceStore, pod: PodId) -> None:
        self.store, self.pod = store, pod
        self.counts = [0.0] * len(BOUNDS)
        self.t = T0

    def serve(
        self, seconds: int, per_scrape: int, bucket: int, gauges: dict[str, tuple[float, ...]] | None = None
    ) -> float:
        for _ in range(seconds // 10):
            self.t += 10
            for i in range(bucket, len(BOUNDS)):
                self.counts[i] += per_scrape
            histograms = {E2E: Histogram(BOUNDS, tuple(self.counts), 0.0)}
            self.store.record(self.pod, ServiceScrape(at=self.t, histograms=histograms, gauges=gauges or {}))
        return self.t


def services(store: ServiceStore, *pods: PodId) -> Services:
    return Services(store, pods or (A,))


def test_p99_above_the_threshold_holds_and_says_so() -> None:
    store = ServiceStore(retention_seconds=3600)
    a = Replica(store, A)
    a.serve(60, 10, bucket=1)  # a minute of requests at 0.5-1 s
    now = a.serve(60, 10, bucket=3)  # then a minute at 2-5 s
    out = evaluate_latency(SLOW, A, now, PARAMS, services(store))
    assert out.holds
    assert out.value == pytest.approx(2 + 3 * 0.99)
    assert out.message == "P99 latency 4.97s over 1m above 2s (60 requests)"


def test_clears_only_below_the_threshold_less_hysteresis() -> None:
    store = ServiceStore(retention_seconds=3600)
    a = Replica(store, A)
    now = a.serve(120, 10, bucket=2)  # 1-2 s: P99 1.99 s, below 2 s but above 1.8 s
    out = evaluate_latency(SLOW, A, now, PARAMS, services(store))
    assert not out.holds
    assert not out.clears
    now = a.serve(60, 10, bucket=1)
    out = evaluate_latency(SLOW, A, now, PARAMS, services(store))
    assert out.clears
    assert out.message == "P99 latency 995ms over 1m at or below 2s (60 requests)"


def test_no_requests_no_value_and_a_new_pod_does_not_hold() -> None:
    store = ServiceStore(retention_seconds=3600)
    a = Replica(store, A)
    now = a.serve(30, 10, bucket=4)  # slow, but scraped for 30 s of a 1 m window
    young = evaluate_latency(SLOW, A, now, PARAMS, services(store))
    assert young.value is not None
    assert not young.holds
    now = a.serve(120, 0, bucket=0)  # no requests for two minutes
    idle = evaluate_latency(SLOW, A, now, PARAMS, services(store))
    assert idle.value is None
    assert (idle.holds, idle.clears) == (False, False)
    assert evaluate_latency(SLOW, A, now + 61, PARAMS, services(store)).value is None  # stale
    assert evaluate_latency(SLOW, A, now, PARAMS, None).value is None


def test_queue_per_replica_and_per_pod() -> None:
    store = ServiceStore(retention_seconds=3600)
    a, b = Replica(store, A), Replica(store, B)
    a.serve(10, 0, 0, {"vllm:num_requests_waiting": (9.0, 3.0)})  # two models: 12 waiting
    now = b.serve(10, 0, 0, {"vllm:num_requests_waiting": (2.0,)})
    replica = RequestQueue("queue", 5, server=Server.VLLM)
    out = evaluate_queue(replica, B, now, PARAMS, services(store, A, B), None)
    assert out.holds
    assert out.value == 7
    assert out.message == "7 waiting requests per replica across 2 pods (this pod 2), limit 5"
    pod = RequestQueue("queue", 5, per=QueueScope.POD, server=Server.VLLM)
    own = evaluate_queue(pod, B, now, PARAMS, services(store, A, B), None)
    assert own.clears
    assert own.message == "2 waiting requests, limit 5"


def test_kv_cache_reads_the_older_vllm_name_as_percent() -> None:
    store = ServiceStore(retention_seconds=3600)
    now = Replica(store, A).serve(10, 0, 0, {"vllm:gpu_cache_usage_perc": (0.96, 0.5)})
    out = evaluate_kv_cache(KvCacheUsage("kv", 90, server=Server.VLLM), A, now, PARAMS, services(store))
    assert out.holds
    assert out.value == pytest.approx(96)
    assert out.signal == "vllm:gpu_cache_usage_perc"
    assert out.message == "KV cache 96% full, limit 90%"


def policy(**rule: Any) -> dict[str, Any]:
    return {"selector": {}, "serviceMetrics": {"server": "vllm"}, "rules": [{"name": "r", **rule}]}


def test_the_engine_holds_for_for_then_starts_and_resolves() -> None:
    spec = parse_spec(
        policy(requestLatency={"percentile": 99, "threshold": "2s", "window": "1m", "for": "30s"})
    )
    evaluator = PolicyEvaluator("ns/llm", spec)
    store = ServiceStore(retention_seconds=3600)
    a = Replica(store, A)
    a.serve(60, 10, bucket=1)
    series = SeriesStore(retention_seconds=3600, max_points=100)
    views = [PodView("ns", "llm-a")]
    started = []
    for _ in range(12):  # slow requests for two minutes, judged every 10 s
        now = a.serve(10, 10, bucket=4)
        started += [
            t
            for t in evaluator.evaluate(views, series, now, services=store).transitions
            if t.transition is Transition.STARTED
        ]
    assert len(started) == 1
    assert started[0].finding.reason == "RequestLatencyHigh"
    assert started[0].finding.message.startswith("P99 latency")
    resolved = []
    for _ in range(12):
        now = a.serve(10, 10, bucket=0)
        resolved += [
            t
            for t in evaluator.evaluate(views, series, now, services=store).transitions
            if t.transition is Transition.RESOLVED
        ]
    assert len(resolved) == 1


def latency_run(failed: set[int], evaluations: int = 18) -> list[tuple[float, Transition, str]]:
    """A 1-minute P99 rule with ``for: 30s`` on slow requests, judged every 10 s; the scrapes numbered
    in ``failed`` time out (a ``/metrics`` slower than the agent's timeout)."""
    spec = parse_spec(
        {
            **policy(requestLatency={"percentile": 99, "threshold": "2s", "window": "1m", "for": "30s"}),
            "actions": {"renotifyInterval": "1m"},
        }
    )
    evaluator = PolicyEvaluator("ns/llm", spec)
    store = ServiceStore(retention_seconds=3600)
    a = Replica(store, A)
    a.serve(60, 10, bucket=1)
    series = SeriesStore(retention_seconds=3600, max_points=100)
    seen = []
    for i in range(evaluations):
        if i in failed:
            a.t += 10
            store.record(A, ServiceScrape(at=a.t, error="Timeout"))
            now = a.t
        else:
            now = a.serve(10, 10, bucket=4)
        for t in evaluator.evaluate([PodView("ns", "llm-a")], series, now, services=store).transitions:
            seen.append((now - T0, t.transition, t.finding.message))
    return seen


def test_a_failed_scrape_does_not_restart_the_for_clock() -> None:
    # Slow from t=70 on, `for: 30s`: the finding starts at t=100. Two scrapes time out at t=100 and
    # 110 (a /metrics slower than the agent's timeout): before, that restarted the clock and the
    # finding came at t=150, and a server that timed out once per `for` was never judged. Now the clock
    # runs through a gap of up to a minute: it starts at the first judged evaluation after, t=120.
    def started(failed: set[int]) -> list[float]:
        return [at for at, t, _ in latency_run(failed) if t is Transition.STARTED]

    assert started(set()) == [100.0]
    assert started({3, 4}) == [120.0]
    # six in a row (t=100 to 150, and t=160 has one scrape in its window): past a minute, a new clock
    assert started({3, 4, 5, 6, 7, 8}) == [200.0]


def test_a_reminder_while_the_scrapes_fail_says_how_old_its_figure_is_and_why() -> None:
    # Judged until t=200; every scrape from t=210 on times out.
    seen = latency_run(set(range(14, 30)), evaluations=30)
    reminders = [(at, message) for at, t, message in seen if t is Transition.RENOTIFY]
    assert [at for at, _ in reminders] == [160.0, 220.0, 280.0, 340.0]
    assert "not judged" not in reminders[0][1]
    for at, message in reminders[1:]:
        assert message.startswith("P99 latency 9.95s over 1m above 2s (60 requests); not judged for ")
        assert message.endswith(f"{format_duration(at - 200)}: its newest scrape failed (Timeout)")


def burst_findings(for_: str, slow_seconds: int) -> list[tuple[float, float]]:
    """When a 1-minute P99 rule's findings start and end (seconds from the slowdown's start) for
    ``slow_seconds`` of slow requests inside fast ones, scraped and judged every 10 s."""
    spec = parse_spec(
        policy(requestLatency={"percentile": 99, "threshold": "2s", "window": "1m", "for": for_})
    )
    evaluator = PolicyEvaluator("ns/llm", spec)
    store = ServiceStore(retention_seconds=3600)
    a = Replica(store, A)
    began = a.serve(120, 10, bucket=1)  # two minutes of fast requests first
    series = SeriesStore(retention_seconds=3600, max_points=100)
    spans: list[tuple[float, float]] = []
    for i in range(48):
        now = a.serve(10, 10, bucket=4 if i * 10 < slow_seconds else 1)
        for t in evaluator.evaluate([PodView("ns", "llm-a")], series, now, services=store).transitions:
            if t.transition is Transition.STARTED:
                spans.append((now - began, math.inf))
            elif t.transition is Transition.RESOLVED:
                spans[-1] = (spans[-1][0], now - began)
    return spans


def test_a_burst_holds_for_its_length_and_the_window_so_for_past_the_window_lets_it_pass() -> None:
    # docs/policy.md, "Choosing window and for against bursts": the figures it gives are these.
    # The slow scrapes come at 10, 20 and 30 s; the window holds one of them until 80 s.
    assert burst_findings("30s", slow_seconds=30) == [(40.0, 90.0)]
    # `for` 1m30s: a burst fires once it lasts `for - window` and a scrape interval, 40 s here
    assert burst_findings("1m30s", slow_seconds=30) == []
    assert burst_findings("1m30s", slow_seconds=40) == []
    assert burst_findings("1m30s", slow_seconds=50) == [(100.0, 110.0)]
    assert burst_findings("1m30s", slow_seconds=120) == [(100.0, 180.0)]


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (
            {"selector": {}, "rules": [{"name": "r", "requestQueue": {"limit": 5}}]},
            "spec.rules[0].requestQueue",
            "names no metric",
        ),
        (
            policy(requestLatency={"percentile": 99, "threshold": "2s", "server": "triton"}),
            "spec.rules[0].requestLatency.latency",
            "a mean, not a percentile",
        ),
        (
            {
                "selector": {},
                "serviceMetrics": {"server": "tgi"},
                "rules": [{"name": "r", "kvCacheUsage": {"percent": 90}}],
            },
            "spec.rules[0].kvCacheUsage.server",
            "TGI exports no KV-cache usage",
        ),
        (
            policy(requestLatency={"percentile": 98, "threshold": "2s"}),
            "spec.rules[0].requestLatency.percentile",
            "not one of 50, 90, 95, 99",
        ),
        (policy(requestLatency={"percentile": 99}), "spec.rules[0].requestLatency.threshold", "required"),
        (
            policy(requestLatency={"percentile": 99, "threshold": 2}),
            "spec.rules[0].requestLatency.threshold",
            "duration string",
        ),
        (
            policy(requestQueue={"limit": 5, "metric": "my queue"}),
            "spec.rules[0].requestQueue.metric",
            "not a Prometheus metric name",
        ),
        (
            policy(requestLatency={"percentile": 99, "threshold": "1s", "metric": "x_bucket"}),
            "spec.rules[0].requestLatency.metric",
            "base name (x)",
        ),
        (
            policy(kvCacheUsage={"percent": 90, "unit": "fraction"}),
            "spec.rules[0].kvCacheUsage.unit",
            "not one of ratio, percent",
        ),
        (
            {
                **policy(requestLatency={"percentile": 99, "threshold": "1s", "window": "5s"}),
                "evaluationInterval": "10s",
            },
            "spec.rules[0].requestLatency.window",
            "shorter than evaluationInterval",
        ),
    ],
)
def test_bad_service_rules_are_refused_naming_the_field(spec: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.field == field
    assert words in err.value.reason


def test_the_policy_server_fills_in_and_a_rule_s_own_wins() -> None:
    spec = parse_spec(
        {
            "selector": {},
            "serviceMetrics": {"server": "vllm"},
            "rules": [
                {"name": "a", "requestLatency": {"percentile": 95, "threshold": "500ms"}},
                {"name": "b", "requestQueue": {"limit": 4, "server": "sglang"}},
                {"name": "c", "kvCacheUsage": {"percent": 90, "metric": "my_kv", "unit": "percent"}},
            ],
        }
    )
    a, b, c = spec.rules
    assert a == RequestLatency("a", 95, 0.5, server=Server.VLLM)
    assert b == RequestQueue("b", 4, server=Server.SGLANG)
    assert isinstance(c, KvCacheUsage)
    assert c.server is None  # its own metric: the policy's server is not its
    assert c.metric == "my_kv"

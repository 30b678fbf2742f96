"""compact(): a page from real prometheus_client instruments, parsed and kept to the names asked for."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gpuwarden.agent.scrape.compact import ScrapeFailed, compact
from gpuwarden.wire.scrape import MAX_BUCKETS, MAX_GAUGE_VALUES, ScrapeFailure

LATENCY = "vllm:e2e_request_latency_seconds"
WAITING = "vllm:num_requests_waiting"
SUCCESS = "vllm:request_success_total"
BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0)


def vllm_page() -> str:
    """What a vLLM server with two models exposes, from real prometheus_client instruments."""
    registry = CollectorRegistry()
    latency = Histogram(LATENCY, "e2e", ["model_name"], buckets=BOUNDS, registry=registry)
    waiting = Gauge(WAITING, "waiting", ["model_name"], registry=registry)
    success = Counter("vllm:request_success", "done", ["model_name", "finished_reason"], registry=registry)
    other = Gauge("vllm:gpu_cache_usage_perc", "not asked for", registry=registry)
    for value in (0.2, 0.4, 0.9, 1.2, 3.0):
        latency.labels("llama").observe(value)
    for value in (0.1, 12.0):
        latency.labels("mistral").observe(value)
    waiting.labels("llama").set(3)
    waiting.labels("mistral").set(5)
    success.labels("llama", "stop").inc(4)
    success.labels("llama", "length").inc(1)
    success.labels("mistral", "stop").inc(2)
    other.set(0.5)
    return generate_latest(registry).decode()


def test_a_histogram_is_summed_over_its_label_sets_and_keeps_its_inf_bucket() -> None:
    found = compact(vllm_page(), "text/plain; version=0.0.4; charset=utf-8", [LATENCY])
    (histogram,) = found.histograms
    assert histogram.name == LATENCY
    assert histogram.bounds == list(BOUNDS)
    # 0.2 | 0.4 | 0.9 | 1.2 | 3.0 for llama, 0.1 | 12.0 for mistral, cumulative and summed
    assert histogram.counts == [2, 3, 3, 4, 5, 5, 5, 6, 6]
    assert histogram.count == 7
    assert histogram.sum == pytest.approx(0.2 + 0.4 + 0.9 + 1.2 + 3.0 + 0.1 + 12.0)
    assert found.counters == []
    assert found.gauges == []


def test_openmetrics_is_read_when_the_content_type_says_so() -> None:
    page = (
        "# TYPE latency_seconds histogram\n"
        'latency_seconds_bucket{m="a",le="1.0"} 1\nlatency_seconds_bucket{m="a",le="+Inf"} 2\n'
        'latency_seconds_count{m="a"} 2\nlatency_seconds_sum{m="a"} 2.5\n'
        "# TYPE done counter\ndone_total 3\ndone_created 1.7e9\n# EOF\n"
    )
    found = compact(page, "application/openmetrics-text; version=1.0.0", ["latency_seconds", "done_total"])
    (histogram,) = found.histograms
    assert (histogram.bounds, histogram.counts, histogram.count, histogram.sum) == ([1.0], [1.0], 2.0, 2.5)
    assert [(c.name, c.value) for c in found.counters] == [("done_total", 3.0)]


def test_counters_are_summed_and_gauges_kept_per_label_set_and_nothing_else() -> None:
    found = compact(vllm_page(), "text/plain", [SUCCESS, WAITING, "vllm:not_there"])
    assert [(c.name, c.value) for c in found.counters] == [(SUCCESS, 7.0)]
    assert [(g.name, sorted(g.values)) for g in found.gauges] == [(WAITING, [3.0, 5.0])]
    assert found.histograms == []


def test_a_counter_asked_for_without_its_total_matches_and_keeps_that_name() -> None:
    page = '# TYPE nv_inference_request_success counter\nnv_inference_request_success{model="a"} 5\n'
    found = compact(page, "text/plain", ["nv_inference_request_success"])
    assert [(c.name, c.value) for c in found.counters] == [("nv_inference_request_success", 5.0)]


def test_an_untyped_total_is_a_counter_and_an_untyped_value_a_gauge() -> None:
    page = 'jobs_total{a="1"} 2\njobs_total{a="2"} 3\nqueue 4\n'
    found = compact(page, "", ["jobs_total", "queue"])
    assert [(c.name, c.value) for c in found.counters] == [("jobs_total", 5.0)]
    assert [(g.name, g.values) for g in found.gauges] == [("queue", [4.0])]


def test_a_gauge_keeps_its_first_label_sets_only() -> None:
    page = "# TYPE q gauge\n" + "".join(f'q{{i="{i}"}} {i}\n' for i in range(40))
    (gauge,) = compact(page, "text/plain", ["q"]).gauges
    assert gauge.values == [float(i) for i in range(MAX_GAUGE_VALUES)]


def test_values_that_are_no_readings_are_left_out() -> None:
    page = '# TYPE q gauge\nq{i="a"} NaN\nq{i="b"} +Inf\nq{i="c"} 1\n# TYPE c counter\nc_total NaN\n'
    found = compact(page, "text/plain", ["q", "c_total"])
    assert [(g.name, g.values) for g in found.gauges] == [("q", [1.0])]
    assert found.counters == []


def test_a_histogram_with_decreasing_buckets_or_without_inf_is_no_histogram() -> None:
    decreasing = '# TYPE h histogram\nh_bucket{le="1"} 5\nh_bucket{le="2"} 3\n' + (
        'h_bucket{le="+Inf"} 5\nh_sum 1\nh_count 5\n'
    )
    no_inf = '# TYPE h histogram\nh_bucket{le="1"} 5\nh_sum 1\nh_count 5\n'
    assert compact(decreasing, "text/plain", ["h"]).histograms == []
    assert compact(no_inf, "text/plain", ["h"]).histograms == []


def test_label_sets_with_other_bounds_are_summed_at_the_bounds_they_share() -> None:
    page = (
        "# TYPE h histogram\n"
        'h_bucket{m="a",le="1"} 1\nh_bucket{m="a",le="2"} 2\nh_bucket{m="a",le="+Inf"} 3\nh_sum{m="a"} 4\n'
        'h_bucket{m="b",le="2"} 5\nh_bucket{m="b",le="+Inf"} 6\nh_sum{m="b"} 7\n'
    )
    (histogram,) = compact(page, "text/plain", ["h"]).histograms
    assert (histogram.bounds, histogram.counts, histogram.count, histogram.sum) == ([2.0], [7.0], 9.0, 11.0)


def test_a_histogram_of_many_buckets_keeps_evenly_spaced_ones_and_stays_cumulative() -> None:
    registry = CollectorRegistry()
    buckets = [i / 10 for i in range(1, 201)]
    histogram = Histogram("h", "many", buckets=buckets, registry=registry)
    for i in range(1000):
        histogram.observe(i / 50)
    (kept,) = compact(generate_latest(registry).decode(), "text/plain", ["h"]).histograms
    assert len(kept.bounds) == MAX_BUCKETS
    assert kept.bounds[-1] == 20.0
    assert kept.count == 1000
    assert all(a <= b for a, b in zip(kept.counts, kept.counts[1:], strict=False))
    # Each kept bound holds its true cumulative count: observations i/50 <= bound.
    for bound, count in zip(kept.bounds, kept.counts, strict=True):
        assert count == sum(1 for i in range(1000) if i / 50 <= bound + 1e-9)
    assert not any(math.isinf(b) for b in kept.bounds)


@pytest.mark.parametrize(
    ("text", "content_type"),
    [
        ("<html><body>Welcome to nginx!</body></html>", "text/plain"),
        ("hello world\n", "text/plain"),
        ('{"status": "ok"}', "text/plain"),
        ("# TYPE x gauge\nx 1\n", "text/html; charset=utf-8"),
        ('{"status": "ok"}', "application/json"),
        ("x 1\n", "application/openmetrics-text"),  # OpenMetrics ends with # EOF
    ],
)
def test_a_page_that_is_not_prometheus_is_refused(text: str, content_type: str) -> None:
    with pytest.raises(ScrapeFailed) as failed:
        compact(text, content_type, ["x"])
    assert failed.value.reason is ScrapeFailure.NOT_PROMETHEUS

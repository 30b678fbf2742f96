"""The ServiceStore's bookkeeping: what it keeps of each pod's scrapes, and for how long."""

from __future__ import annotations

import math

import pytest

from gpuwarden.policy import Histogram, PodId, ServiceScrape, ServiceStore
from gpuwarden.policy.store.service import histogram_quantile, scrape_bytes

POD = PodId("ns", "llm-0")
OTHER = PodId("ns", "llm-1")


def scrape(at: float, waiting: float = 0.0) -> ServiceScrape:
    return ServiceScrape(
        at=at,
        histograms={"vllm:e2e_request_latency_seconds": Histogram((1.0, math.inf), (at, at), at)},
        counters={"vllm:request_success_total": at},
        gauges={"vllm:num_requests_waiting": (waiting,)},
    )


def test_records_in_order_and_ignores_a_scrape_not_newer_than_the_newest() -> None:
    store = ServiceStore(retention_seconds=600)
    store.record(POD, scrape(10))
    store.record(POD, scrape(20))
    store.record(POD, scrape(20, waiting=9))  # a report repeated
    store.record(POD, scrape(15))  # overtaken
    assert [s.at for s in store.scrapes(POD)] == [10, 20]
    assert store.scrapes(POD)[-1].gauges["vllm:num_requests_waiting"] == (0.0,)
    assert len(store) == 2


def test_a_failed_scrape_is_kept_with_its_reason() -> None:
    store = ServiceStore(retention_seconds=600)
    store.record(POD, scrape(10))
    store.record(POD, ServiceScrape(at=20, error="Timeout"))
    assert store.scrapes(POD)[-1].error == "Timeout"
    assert store.scrapes(POD)[-1].histograms == {}


def test_prune_drops_scrapes_past_retention_and_pods_left_empty() -> None:
    store = ServiceStore(retention_seconds=100)
    for t in (0, 50, 100, 150):
        store.record(POD, scrape(t))
    store.record(OTHER, scrape(10))
    store.prune(now=160)
    assert [s.at for s in store.scrapes(POD)] == [100, 150]
    assert store.pods() == [POD]
    assert store.scrapes(OTHER) == ()


def test_retention_follows_its_owner() -> None:
    store = ServiceStore(retention_seconds=100)
    store.record(POD, scrape(0))
    store.retention_seconds = 1000
    store.prune(now=500)
    assert len(store) == 1


def test_forget_pod_drops_everything_of_it() -> None:
    store = ServiceStore(retention_seconds=600)
    store.record(POD, scrape(10))
    store.record(OTHER, scrape(10))
    store.forget_pod(POD)
    store.forget_pod(PodId("ns", "never-seen"))
    assert store.pods() == [OTHER]


def test_a_pod_keeps_at_most_max_scrapes() -> None:
    store = ServiceStore(retention_seconds=10_000, max_scrapes=4)
    for t in range(10):
        store.record(POD, scrape(t))
    assert [s.at for s in store.scrapes(POD)] == [6, 7, 8, 9]


def test_a_pod_keeps_at_most_max_pod_bytes_its_oldest_dropped_and_counted() -> None:
    size = scrape_bytes(scrape(0))
    store = ServiceStore(retention_seconds=10_000, max_pod_bytes=5 * size, max_bytes=100 * size)
    for t in range(40):
        store.record(POD, scrape(t))
        assert store.nbytes <= 5 * size
    kept = [s.at for s in store.scrapes(POD)]
    assert kept == list(range(40 - len(kept), 40))  # the newest, in order
    assert store.dropped == 40 - len(kept)
    assert store.nbytes == sum(map(scrape_bytes, store.scrapes(POD)))
    store.forget_pod(POD)
    assert store.nbytes == 0


def test_past_the_bound_in_all_only_the_pods_above_an_equal_share_lose_scrapes() -> None:
    size = scrape_bytes(scrape(0))
    store = ServiceStore(retention_seconds=10_000, max_pod_bytes=40 * size, max_bytes=40 * size)
    for t in range(3):
        store.record(OTHER, scrape(t))  # a quiet pod, well within a share
    for t in range(1000):
        store.record(POD, scrape(t))  # a flood
        assert store.nbytes <= 40 * size
    assert [s.at for s in store.scrapes(OTHER)] == [0, 1, 2]
    assert store.scrapes(POD)[-1].at == 999
    assert store.dropped == 1000 - len(store.scrapes(POD))
    store.prune(now=20_000)  # everything past the retention
    assert (store.nbytes, len(store)) == (0, 0)


def test_rejects_a_store_that_could_keep_nothing() -> None:
    with pytest.raises(ValueError, match="retention_seconds must be > 0"):
        ServiceStore(retention_seconds=0)
    with pytest.raises(ValueError, match="retention_seconds must be > 0"):
        ServiceStore(retention_seconds=60, max_scrapes=1)


# --- queries ---------------------------------------------------------------------------------------

BOUNDS = (0.5, 1.0, 2.0, 5.0, math.inf)
LATENCY = "vllm:e2e_request_latency_seconds"


def hist(counts: tuple[float, ...], total: float = 0.0) -> Histogram:
    return Histogram(BOUNDS, counts, total)


def latency_store(*points: tuple[float, tuple[float, ...]]) -> ServiceStore:
    store = ServiceStore(retention_seconds=3600)
    for at, counts in points:
        store.record(POD, ServiceScrape(at=at, histograms={LATENCY: hist(counts, sum(counts))}))
    return store


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        (0.5, (0, 10, 20, 20, 20), 1.0),  # the rank (10) at a bucket's top: its bound
        (0.75, (0, 10, 20, 20, 20), 1.5),  # half way into (1, 2]
        (0.99, (0, 10, 20, 20, 20), 1.98),
        (0.1, (10, 10, 10, 10, 10), 0.05),  # the first bucket interpolates from 0
        (0.99, (0, 0, 0, 0, 10), 5.0),  # the +Inf bucket answers the highest finite bound
        (0.99, (0, 0, 0, 9, 10), 5.0),
        (0.5, (0, 0, 0, 0, 0), None),  # no requests: no value
    ],
)
def test_histogram_quantile_as_prometheus_computes_it(
    q: float, counts: tuple[float, ...], expected: float | None
) -> None:
    got = histogram_quantile(q, hist(counts))
    assert got == (None if expected is None else pytest.approx(expected))


def test_histogram_quantile_needs_a_finite_bound_and_the_inf_bucket() -> None:
    assert histogram_quantile(0.5, Histogram((math.inf,), (5.0,), 1.0)) is None
    assert histogram_quantile(0.5, Histogram((1.0, 2.0), (5.0, 5.0), 1.0)) is None
    assert histogram_quantile(0.5, Histogram((-1.0, 1.0, math.inf), (4.0, 4.0, 4.0), 0.0)) == -1.0


def test_window_increase_reads_only_the_window() -> None:
    # 10 slow requests long ago; in the last 60 s, 20 requests all between 0.5 s and 1 s.
    store = latency_store(
        (0, (0, 0, 0, 0, 0)),
        (100, (0, 0, 0, 10, 10)),
        (130, (0, 10, 10, 20, 20)),
        (160, (0, 20, 20, 30, 30)),
    )
    inc = store.increase(POD, [LATENCY], 60, now=165, stale_after=60)
    assert inc is not None
    assert inc.histogram is not None
    assert inc.histogram.counts == (0, 20, 20, 20, 20)
    assert inc.seconds == 60
    assert inc.rate == pytest.approx(20 / 60)
    assert histogram_quantile(0.99, inc.histogram) == pytest.approx(0.5 + 0.5 * 0.99)
    # The whole history, with the 10 slow ones (between 0 and 100).
    whole = store.increase(POD, [LATENCY], 600, now=165, stale_after=60)
    assert whole is not None
    assert whole.histogram is not None
    assert whole.histogram.counts[-1] == 30


def test_a_reset_counts_from_zero_as_rate_does() -> None:
    # The server restarted between 20 and 30: its counts fell; the 3 after the restart still count.
    store = latency_store(
        (10, (0, 5, 5, 5, 5)), (20, (0, 8, 8, 8, 8)), (30, (0, 0, 3, 3, 3)), (40, (0, 1, 6, 6, 6))
    )
    inc = store.increase(POD, [LATENCY], 60, now=40, stale_after=60)
    assert inc is not None
    assert inc.histogram is not None
    assert inc.histogram.counts == (0, 3 + 0 + 1, 3 + 3 + 3, 3 + 3 + 3, 3 + 3 + 3)


def test_a_counter_reset_and_a_rate() -> None:
    store = ServiceStore(retention_seconds=3600)
    for at, value in ((0, 100.0), (10, 110.0), (20, 5.0), (30, 15.0)):
        store.record(POD, ServiceScrape(at=at, counters={"vllm:request_success_total": value}))
    inc = store.increase(POD, ["vllm:request_success_total"], 30, now=30, stale_after=60)
    assert inc is not None
    assert inc.value == 10 + 5 + 10
    assert inc.rate == pytest.approx(25 / 30)


def test_a_changed_bucket_layout_starts_over() -> None:
    store = latency_store((0, (0, 1, 1, 1, 1)), (10, (0, 2, 2, 2, 2)))
    store.record(POD, ServiceScrape(at=20, histograms={LATENCY: Histogram((1.0, math.inf), (4.0, 4.0), 2.0)}))
    inc = store.increase(POD, [LATENCY], 60, now=20, stale_after=60)
    assert inc is not None
    assert inc.histogram == Histogram((1.0, math.inf), (4.0, 4.0), 2.0)


def test_nothing_to_judge_when_stale_failed_or_alone() -> None:
    store = latency_store((0, (0, 1, 1, 1, 1)), (10, (0, 2, 2, 2, 2)))
    assert store.increase(POD, [LATENCY], 60, now=10 + 61, stale_after=60) is None  # stale
    assert store.increase(POD, [LATENCY], 5, now=10, stale_after=60) is None  # one scrape in the window
    assert store.increase(POD, ["other"], 60, now=10, stale_after=60) is None
    assert store.increase(OTHER, [LATENCY], 60, now=10, stale_after=60) is None
    store.record(POD, ServiceScrape(at=20, error="Timeout"))
    assert store.increase(POD, [LATENCY], 60, now=20, stale_after=60) is None
    newest = store.newest(POD, 20)
    assert newest is not None
    assert newest.error == "Timeout"


def test_a_slow_scraper_is_not_stale_within_three_of_its_intervals() -> None:
    store = ServiceStore(retention_seconds=3600)
    for at in (0, 120, 240):
        store.record(POD, ServiceScrape(at=at, gauges={"q": (1.0,)}))
    assert store.gauge(POD, ["q"], now=240 + 300, stale_after=60) == ("q", (1.0,))
    assert store.gauge(POD, ["q"], now=240 + 361, stale_after=60) is None


def test_queries_are_as_of_now_and_take_the_first_name_exported() -> None:
    store = ServiceStore(retention_seconds=3600)
    store.record(POD, ServiceScrape(at=10, gauges={"vllm:gpu_cache_usage_perc": (0.5,)}))
    store.record(POD, ServiceScrape(at=20, gauges={"vllm:gpu_cache_usage_perc": (0.9, 0.7)}))
    names = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
    assert store.gauge(POD, names, now=25, stale_after=60) == ("vllm:gpu_cache_usage_perc", (0.9, 0.7))
    assert store.gauge(POD, names, now=15, stale_after=60) == ("vllm:gpu_cache_usage_perc", (0.5,))
    assert store.gauge(POD, names, now=5, stale_after=60) is None

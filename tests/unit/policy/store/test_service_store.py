"""The ServiceStore's bookkeeping: what it keeps of each pod's scrapes, and for how long."""

from __future__ import annotations

import math

import pytest

from gpuwarden.policy import Histogram, PodId, ServiceScrape, ServiceStore

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


def test_rejects_a_store_that_could_keep_nothing() -> None:
    with pytest.raises(ValueError, match="retention_seconds must be > 0"):
        ServiceStore(retention_seconds=0)
    with pytest.raises(ValueError, match="retention_seconds must be > 0"):
        ServiceStore(retention_seconds=60, max_scrapes=1)

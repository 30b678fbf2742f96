"""The Event poster against an API server model that keeps Events by name (looptime: the backoffs
take no real time). Its point: an Event the API server stored while failing to say so (etcd stalled:
the write lands after the request's 500/504 or timeout) is not stored a second time by the retry.
"""

from __future__ import annotations

import asyncio

import pytest
from event_store_support import EventStore
from prometheus_client import CollectorRegistry

from gpuwarden.operator.kube.events import EventPoster, event_body
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.resources import ObjectRef

T0 = 1_800_000_000.0
POD = ObjectRef("v1", "Pod", "ns", "p", "pod-uid")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def metrics() -> OperatorMetrics:
    return OperatorMetrics()


def dropped(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("gpuwarden_operator_events_dropped_total", {"reason": reason})
    assert value is not None
    return value


async def posted(poster: EventPoster, *reasons: str) -> None:
    """Queue one Event a reason, run the worker until the queue is empty."""
    for reason in reasons:
        await poster.post(POD, "Warning", reason, f"about {reason}")
    task = asyncio.create_task(poster.run())
    try:
        await asyncio.wait_for(poster.drain(), timeout=600)
    finally:
        task.cancel()


@pytest.mark.looptime
async def test_an_event_stored_while_its_answer_was_lost_is_stored_once(metrics: OperatorMetrics) -> None:
    api = EventStore("stored_then_504")
    poster = EventPoster(api, instance="op-0", dropped=metrics.events_dropped)  # type: ignore[arg-type]
    await posted(poster, "GPUUnderutilized")
    assert api.attempts == 2  # retried: the 504 did not say it was stored...
    assert api.reasons() == ["GPUUnderutilized"]  # ...and the retry, under the same name, added nothing
    assert all(dropped(metrics.registry, r) == 0 for r in ("queue_full", "expired", "refused"))


@pytest.mark.looptime
async def test_while_the_api_server_is_away_events_wait_and_then_go_in_order(
    metrics: OperatorMetrics,
) -> None:
    api = EventStore("unreachable", "unreachable", "unreachable", "unreachable")
    poster = EventPoster(api, instance="op-0", dropped=metrics.events_dropped)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    start = loop.time()
    await posted(poster, "A", "B", "C")
    assert api.reasons() == ["A", "B", "C"]
    assert loop.time() - start == pytest.approx(1 + 2 + 4 + 8)  # backed off, doubling
    assert poster.pending == 0


@pytest.mark.looptime
async def test_backoff_is_capped(metrics: OperatorMetrics) -> None:
    api = EventStore(*["unreachable"] * 8)
    poster = EventPoster(api, instance="op-0", dropped=metrics.events_dropped, backoff_cap=30)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    start = loop.time()
    await posted(poster, "A")
    assert loop.time() - start == pytest.approx(1 + 2 + 4 + 8 + 16 + 30 + 30 + 30)


@pytest.mark.looptime
async def test_a_refused_event_is_dropped_counted_and_the_next_goes(metrics: OperatorMetrics) -> None:
    api = EventStore("forbidden")
    poster = EventPoster(api, instance="op-0", dropped=metrics.events_dropped)  # type: ignore[arg-type]
    await posted(poster, "A", "B")
    assert api.reasons() == ["B"]
    assert dropped(metrics.registry, "refused") == 1


@pytest.mark.looptime
async def test_the_queue_is_bounded_the_oldest_go_first(metrics: OperatorMetrics) -> None:
    api = EventStore()
    poster = EventPoster(api, instance="op-0", dropped=metrics.events_dropped, limit=2)  # type: ignore[arg-type]
    await posted(poster, "A", "B", "C")
    assert api.reasons() == ["B", "C"]
    assert dropped(metrics.registry, "queue_full") == 1


@pytest.mark.looptime
async def test_an_event_not_posted_within_max_age_is_dropped(metrics: OperatorMetrics) -> None:
    clock = Clock()
    api = EventStore("unreachable")
    poster = EventPoster(api, instance="op-0", dropped=metrics.events_dropped, max_age=60, clock=clock)  # type: ignore[arg-type]
    await poster.post(POD, "Warning", "A", "old")
    clock.now += 61  # an hour-long outage, shortened
    await posted(poster, "B")
    assert api.reasons() == ["B"]
    assert dropped(metrics.registry, "expired") == 1


def test_the_event_names_its_object_by_uid_and_has_a_name_of_its_own() -> None:
    first = event_body(POD, "Warning", "GPUUnderutilized", "m", instance="op-0", now=T0 + 0.25)
    second = event_body(POD, "Warning", "GPUUnderutilized", "m", instance="op-0", now=T0 + 0.25)
    assert first["metadata"]["name"].startswith("p.")
    assert first["metadata"]["name"] != second["metadata"]["name"]
    assert first["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "ns",
        "name": "p",
        "uid": "pod-uid",
    }
    assert (first["reportingComponent"], first["reportingInstance"]) == ("gpuwarden-operator", "op-0")
    assert first["eventTime"] == "2027-01-15T08:00:00.250000Z"
    assert first["lastTimestamp"] == "2027-01-15T08:00:00Z"
    assert first["count"] == 1
    long = event_body(ObjectRef("v1", "Pod", "ns", "x" * 253), "Normal", "R", "m" * 5000, instance="", now=T0)
    assert len(long["metadata"]["name"]) == 253
    assert len(long["message"]) == 1024

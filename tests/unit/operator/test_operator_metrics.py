"""The operator's metrics: pre-created counters, per-pod GPU series that go stale and go away."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from gpuwarden.operator.metrics import REJECT_REASONS, OperatorMetrics, make_metrics_app
from gpuwarden.policy.store.series import Point, SeriesKey
from gpuwarden.wire.node import REFUSALS

T0 = 1_800_000_000.0


def test_rejection_reasons_read_zero_before_the_first() -> None:
    metrics = OperatorMetrics()
    for reason in REJECT_REASONS:
        assert (
            metrics.registry.get_sample_value("gpuwarden_operator_reports_rejected_total", {"reason": reason})
            == 0
        )
    for reason in REFUSALS:
        assert (
            metrics.registry.get_sample_value("gpuwarden_operator_points_refused_total", {"reason": reason})
            == 0
        )


def test_pod_gpu_series_from_the_newest_points() -> None:
    clock = [T0]
    metrics = OperatorMetrics()
    metrics.watch_pods(stale_after=60, clock=lambda: clock[0])
    key = SeriesKey("ns", "p", "GPU-1")
    metrics.latest.update(key, Point(t=T0 - 2, gpu_util=10, mem_used=5.0, mem_total=80.0))
    metrics.latest.update(key, Point(t=T0 - 1, gpu_util=40, sm_active=None, mem_used=6.0, mem_total=80.0))
    metrics.latest.update(key, Point(t=T0 - 5, gpu_util=99))  # older: ignored
    labels = {"namespace": "ns", "pod": "p", "gpu": "GPU-1"}
    get = metrics.registry.get_sample_value
    assert get("gpuwarden_pod_gpu_utilization_percent", labels) == 40
    assert get("gpuwarden_pod_gpu_memory_used_bytes", labels) == 6
    assert get("gpuwarden_pod_gpu_memory_total_bytes", labels) == 80
    assert get("gpuwarden_pod_gpu_sm_active_percent", labels) is None  # not read is absent, never 0
    clock[0] += 120
    assert get("gpuwarden_pod_gpu_utilization_percent", labels) is None  # stale
    assert len(metrics.latest) == 0


def test_a_deleted_pod_disappears_at_once() -> None:
    metrics = OperatorMetrics()
    metrics.watch_pods(clock=lambda: T0)
    metrics.latest.update(SeriesKey("ns", "p", "GPU-1"), Point(t=T0, gpu_util=1))
    metrics.latest.forget_pod("ns", "p")
    labels = {"namespace": "ns", "pod": "p", "gpu": "GPU-1"}
    assert metrics.registry.get_sample_value("gpuwarden_pod_gpu_utilization_percent", labels) is None


def test_findings_gauge_drops_rules_no_longer_counted() -> None:
    metrics = OperatorMetrics()
    metrics.set_findings("ns", "pol", {"idle": 2, "oom": 1}, ())
    metrics.set_findings("ns", "pol", {"idle": 1}, {"idle", "oom"})
    get = metrics.registry.get_sample_value
    assert get("gpuwarden_operator_findings", {"namespace": "ns", "policy": "pol", "rule": "idle"}) == 1
    assert get("gpuwarden_operator_findings", {"namespace": "ns", "policy": "pol", "rule": "oom"}) is None


async def test_endpoints() -> None:
    ready = [False]
    metrics = OperatorMetrics()
    async with TestClient(TestServer(make_metrics_app(metrics, lambda: ready[0]))) as client:
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        ready[0] = True
        assert (await client.get("/readyz")).status == 200
        rsp = await client.get("/metrics")
        assert rsp.status == 200
        assert "gpuwarden_operator_reports_total 0.0" in await rsp.text()


async def test_an_exposition_that_fails_fails_readiness_until_it_works_again() -> None:
    """Issue 19 (2): a scrape answering 500 while /readyz said 200, so nothing noticed."""
    metrics = OperatorMetrics()
    metrics.watch_pods(clock=lambda: T0)
    async with TestClient(TestServer(make_metrics_app(metrics, lambda: True))) as client:
        assert (await client.get("/readyz")).status == 200
        # Past the wire's bounds (which no report can cross) a reading would break the exposition.
        metrics.latest.update(SeriesKey("ns", "p", "GPU-1"), Point(t=1e308, gpu_util=1))
        rsp = await client.get("/metrics")
        assert rsp.status == 500
        assert "OverflowError" in await rsp.text()
        assert (await client.get("/readyz")).status == 503
        assert (await client.get("/healthz")).status == 200
        metrics.latest.forget_pod("ns", "p")
        assert (await client.get("/readyz")).status == 200
        assert (await client.get("/metrics")).status == 200

"""The operator's metrics: pre-created counters, per-pod GPU series that go stale and go away, the
active findings' series, the scale decisions."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from gpuwarden.operator.metrics import (
    REJECT_REASONS,
    OperatorMetrics,
    ScaleDecisionsCollector,
    make_metrics_app,
)
from gpuwarden.policy.findings import Finding
from gpuwarden.policy.rules import growth, utilization
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


def finding(
    rule: str, pod: str, reason: str, *, started_at: float = T0, to_full: float | None = None
) -> Finding:
    kind = growth.KIND if to_full is not None else utilization.FLOOR_KIND
    return Finding(
        policy="ns/pol", rule=rule, kind=kind, reason=reason, namespace="ns", pod=pod, gpus=("GPU-1",),
        value=3.0, threshold=20.0, unit="percent", started_at=started_at, message="", seconds_to_full=to_full,
    )  # fmt: skip


def test_findings_series_follow_the_active_findings() -> None:
    metrics = OperatorMetrics()
    get = metrics.registry.get_sample_value
    idle_a = finding("idle", "a", "GPUUnderutilized", started_at=T0 - 60)
    leak = finding("leak", "b", "GPUMemoryLeak", to_full=1800.0)
    metrics.set_findings("ns", "pol", [idle_a, finding("idle", "c", "GPUUnderutilized"), leak])
    counts = {"namespace": "ns", "policy": "pol"}
    assert get("gpuwarden_operator_findings", {**counts, "rule": "idle"}) == 2
    assert get("gpuwarden_operator_findings", {**counts, "rule": "leak"}) == 1
    started = {"namespace": "ns", "pod": "a", "policy": "pol", "rule": "idle", "reason": "GPUUnderutilized"}
    assert get("gpuwarden_finding_started_timestamp_seconds", started) == T0 - 60
    to_full = {"namespace": "ns", "pod": "b", "policy": "pol", "rule": "leak"}
    assert get("gpuwarden_finding_time_to_full_seconds", to_full) == 1800.0
    # Only a finding that projects a time to full has one.
    assert get("gpuwarden_finding_time_to_full_seconds", {**to_full, "pod": "a", "rule": "idle"}) is None

    # The leak resolved, one idle pod recovered: their series go, the count follows.
    metrics.set_findings("ns", "pol", [idle_a])
    assert get("gpuwarden_operator_findings", {**counts, "rule": "idle"}) == 1
    assert get("gpuwarden_operator_findings", {**counts, "rule": "leak"}) is None
    assert get("gpuwarden_finding_time_to_full_seconds", to_full) is None
    assert get("gpuwarden_finding_started_timestamp_seconds", {**started, "pod": "c"}) is None
    metrics.set_findings("ns", "pol", ())  # the policy stopped
    assert get("gpuwarden_finding_started_timestamp_seconds", started) is None
    assert "gpuwarden_operator_findings{" not in metrics.exposition().decode()


def test_scale_decisions_are_read_from_the_scaler_at_scrape_time() -> None:
    metrics = OperatorMetrics()
    counts = {("ns", "pol", "ScaledUp"): 2, ("ns", "pol", "ScaledDown"): 0}
    metrics.registry.register(ScaleDecisionsCollector(lambda: counts))
    get = metrics.registry.get_sample_value
    labels = {"namespace": "ns", "policy": "pol"}
    assert get("gpuwarden_policy_scale_decisions_total", {**labels, "reason": "ScaledUp"}) == 2
    assert get("gpuwarden_policy_scale_decisions_total", {**labels, "reason": "ScaledDown"}) == 0


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

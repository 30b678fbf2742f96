"""The operator's own metrics, the per-pod GPU series, and the aiohttp app serving them.

Everything lives in one dedicated :class:`CollectorRegistry` per operator (tests
never depend on import order). Counters with labels are pre-created, so they
read 0 before the first rejection. Per-pod GPU series come from the newest
point of each (namespace, pod, GPU) the agents reported; a series older than
``stale_after`` seconds, or of a deleted pod, is not exported, so it disappears
with its pod. These are what prometheus-adapter or KEDA scale on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from gpuwarden.policy import Finding, Point, SeriesKey, SeriesStore
from gpuwarden.wire.node import REFUSALS
from gpuwarden.wire.verdicts import VERDICT_REFUSALS

EVENT_DROP_REASONS = ("queue_full", "expired", "refused")
"""Why the Event poster gave an Event up: its queue was full, it waited too long, the API refused it."""

logger = logging.getLogger(__name__)

__all__ = [
    "REJECT_REASONS",
    "DesiredReplicasCollector",
    "LatestReadings",
    "OperatorMetrics",
    "ScaleDecisionsCollector",
    "make_metrics_app",
]

REJECT_REASONS = (
    "unauthenticated",  # 401: no token, or not a valid token for our audience
    "forbidden",  # 403: another ServiceAccount, or a token bound to another node
    "too_large",  # 413
    "invalid",  # 400: bad JSON, schema or version
    "rate_limited",  # 429
    "standby",  # 503: this replica does not act (peering)
    "unavailable",  # 503: TokenReview could not be made
    "not_owner",  # 421: sharded mode, another replica owns the node
    "internal",  # 500: a bug; nothing of the report is recorded as seen, so its retry is taken
)


class LatestReadings:
    """The newest reading of every (namespace, pod, GPU), for the per-pod GPU gauges."""

    def __init__(self) -> None:
        self._by_pod: dict[tuple[str, str], dict[str, Point]] = {}

    def update(self, key: SeriesKey, point: Point) -> None:
        """Remember ``point`` if it is newer than what is known for ``key``."""
        gpus = self._by_pod.get((key.namespace, key.pod))
        if gpus is None:
            gpus = self._by_pod[(key.namespace, key.pod)] = {}
        known = gpus.get(key.gpu)
        if known is None or point.t > known.t:
            gpus[key.gpu] = point  # never changed once made: kept as is, no copy

    def forget_pod(self, namespace: str, pod: str) -> None:
        """Drop a deleted pod's readings."""
        self._by_pod.pop((namespace, pod), None)

    def fresh(self, since: float) -> Iterator[tuple[SeriesKey, Point]]:
        """Readings taken at or after ``since``; older pods' entries are dropped on the way."""
        for (namespace, pod), gpus in list(self._by_pod.items()):
            kept = False
            for gpu, reading in gpus.items():
                if reading.t >= since:
                    kept = True
                    yield SeriesKey(namespace, pod, gpu), reading
            if not kept:
                del self._by_pod[(namespace, pod)]

    def __len__(self) -> int:
        return sum(len(g) for g in self._by_pod.values())


class _PodGpuCollector(Collector):
    """``gpuwarden_pod_gpu_*{namespace,pod,gpu}`` from the newest readings."""

    def __init__(self, latest: LatestReadings, stale_after: float, clock: Callable[[], float]) -> None:
        self._latest = latest
        self._stale_after = stale_after
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        labels = ["namespace", "pod", "gpu"]
        util = GaugeMetricFamily(
            "gpuwarden_pod_gpu_utilization_percent",
            "NVML utilization.gpu of a GPU allocated to the pod (its share on a shared GPU), percent.",
            labels=labels,
        )
        sm = GaugeMetricFamily(
            "gpuwarden_pod_gpu_sm_active_percent",
            "SM activity (GPM, Hopper and newer) of a GPU allocated to the pod, percent.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "gpuwarden_pod_gpu_memory_used_bytes", "GPU memory the pod uses on the GPU, bytes.", labels=labels
        )
        total = GaugeMetricFamily(
            "gpuwarden_pod_gpu_memory_total_bytes",
            "Total memory of the GPU (or MIG instance), bytes.",
            labels=labels,
        )
        for key, r in self._latest.fresh(self._clock() - self._stale_after):
            values = [key.namespace, key.pod, key.gpu]
            for family, value in (
                (util, r.gpu_util),
                (sm, r.sm_active),
                (used, r.mem_used),
                (total, r.mem_total),
            ):
                if value is not None:  # absent means not read, never zero
                    family.add_metric(values, value, timestamp=r.t)
        return [util, sm, used, total]


class _FindingsCollector(Collector):
    """The active findings of every policy this replica evaluates, read at scrape time.

    ``gpuwarden_operator_findings{namespace,policy,rule}`` counts them per rule; one
    ``gpuwarden_finding_started_timestamp_seconds`` per finding names its pod and reason (the
    dashboards count them by reason, and show each one's age); a growth finding that projects when
    the memory is full adds ``gpuwarden_finding_time_to_full_seconds``. A series per active
    finding, no more: a resolved finding's go with it.
    """

    def __init__(self, findings: Mapping[tuple[str, str], tuple[Finding, ...]]) -> None:
        self._findings = findings

    def collect(self) -> Iterable[Metric]:
        counts = GaugeMetricFamily(
            "gpuwarden_operator_findings",
            "Active violations by policy and rule.",
            labels=["namespace", "policy", "rule"],
        )
        started = GaugeMetricFamily(
            "gpuwarden_finding_started_timestamp_seconds",
            "When an active finding started (Unix seconds), by its pod, policy, rule and reason.",
            labels=["namespace", "pod", "policy", "rule", "reason"],
        )
        to_full = GaugeMetricFamily(
            "gpuwarden_finding_time_to_full_seconds",
            "A growing-memory finding's projected seconds until the memory it watches is full "
            "(the card, or the container's limit), as of its policy's last evaluation.",
            labels=["namespace", "pod", "policy", "rule"],
        )
        for (namespace, policy), findings in sorted(self._findings.items()):
            per_rule: dict[str, int] = {}
            for f in findings:
                per_rule[f.rule] = per_rule.get(f.rule, 0) + 1
                started.add_metric([namespace, f.pod, policy, f.rule, f.reason], f.started_at)
                if f.seconds_to_full is not None:
                    to_full.add_metric([namespace, f.pod, policy, f.rule], f.seconds_to_full)
            for rule, count in sorted(per_rule.items()):
                counts.add_metric([namespace, policy, rule], count)
        return [counts, started, to_full]


STATE_GAUGES = {
    "gpuwarden_operator_active": "1 while this replica acts (peering), else 0.",
    "gpuwarden_operator_tokenreviews": (
        "TokenReviews sent since start (the rest were answered from the cache)."
    ),
    "gpuwarden_operator_policies": "Policies this replica evaluates.",
    "gpuwarden_operator_retention_seconds": "Seconds of readings kept.",
    "gpuwarden_operator_shard_members": "Sharded mode: live replicas in this replica's view (0 otherwise).",
    "gpuwarden_operator_series": "Pod-GPU series held in memory.",
    "gpuwarden_operator_series_points": "Readings held in memory, over all series.",
    "gpuwarden_operator_series_bytes": "Bytes the series windows hold.",
    "gpuwarden_operator_points_ignored": (
        "Readings not stored: not newer than their series' latest (retries, overlaps), since start."
    ),
    "gpuwarden_operator_service_scrape_bytes": (
        "Bytes the pods' kept scrapes hold (an estimate), over all pods."
    ),
    "gpuwarden_operator_service_scrapes_dropped": (
        "Pods' scrapes dropped before their retention for the store's bounds (per pod, in all), since start."
    ),
}
"""The gauges read from the operator's state at scrape time, and their help."""


class _StateCollector(Collector):
    """Gauges read from the operator's state at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, STATE_GAUGES[name], value=v) for name, v in self._read().items()]


class OperatorMetrics:
    """The operator's metrics in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reports = Counter(
            "gpuwarden_operator_reports",
            "Node reports received (accepted = received - rejected).",
            registry=r,
        )
        self.rejected = Counter(
            "gpuwarden_operator_reports_rejected", "Node reports refused, by reason.", ["reason"], registry=r
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.duplicates = Counter(
            "gpuwarden_operator_reports_duplicate",
            "Node reports received again (same agent and sequence number) and ignored.",
            registry=r,
        )
        self.points = Counter(
            "gpuwarden_operator_points", "GPU readings stored from accepted reports.", registry=r
        )
        self.refused = Counter(
            "gpuwarden_operator_points_refused",
            "GPU readings of accepted reports not stored, by reason (each answer says how many).",
            ["reason"],
            registry=r,
        )
        for reason in REFUSALS:
            self.refused.labels(reason)
        self.evaluation_seconds = Histogram(
            "gpuwarden_operator_evaluation_duration_seconds",
            "Time one evaluation of one policy takes (rules, events, status).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.evaluation_delay = Histogram(
            "gpuwarden_operator_evaluation_delay_seconds",
            "How late an evaluation finished after it was due (a busy event loop shows here).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self._findings: dict[tuple[str, str], tuple[Finding, ...]] = {}
        r.register(_FindingsCollector(self._findings))
        self.events = Counter(
            "gpuwarden_operator_events",
            "Kubernetes Events emitted, by type and reason.",
            ["type", "reason"],
            registry=r,
        )
        self.events_dropped = Counter(
            "gpuwarden_operator_events_dropped",
            "Events never posted, by reason: the queue was full, they waited too long, the API refused them.",
            ["reason"],
            registry=r,
        )
        for reason in EVENT_DROP_REASONS:
            self.events_dropped.labels(reason)
        self.status_writes = Counter(
            "gpuwarden_operator_status_writes",
            "Policy status patches sent (unchanged status is not written).",
            registry=r,
        )
        self.verdicts_sent = Counter(
            "gpuwarden_operator_verdicts_sent",
            "Sharded mode: verdict reports sent to policies' owners, by result (ok, failed).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "failed"):
            self.verdicts_sent.labels(result)
        self.verdict_bytes_sent = Counter(
            "gpuwarden_operator_verdict_bytes_sent",
            "Sharded mode: bytes of verdict report bodies sent (gzip), the verdict traffic.",
            registry=r,
        )
        self.verdicts_received = Counter(
            "gpuwarden_operator_verdicts_received",
            "Sharded mode: verdict reports received from other shards, by result (ok, refused).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "refused"):
            self.verdicts_received.labels(result)
        self.verdicts_refused = Counter(
            "gpuwarden_operator_verdicts_refused",
            "Sharded mode: received verdict reports, or pods' verdicts in them, not kept, by reason.",
            ["reason"],
            registry=r,
        )
        for reason in VERDICT_REFUSALS:
            self.verdicts_refused.labels(reason)
        self.latest = LatestReadings()

    def watch_pods(self, *, stale_after: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        """Export the per-pod GPU series from :attr:`latest`."""
        self.registry.register(_PodGpuCollector(self.latest, stale_after, clock))

    def watch_state(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Export gauges computed at scrape time by ``read`` (name -> value; each named in
        :data:`STATE_GAUGES`)."""
        self.registry.register(_StateCollector(read))

    def set_findings(self, namespace: str, policy: str, active: Iterable[Finding]) -> None:
        """The policy's active findings after an evaluation (none: it stopped, or stands aside);
        what is no longer active goes from every findings series at once."""
        kept = tuple(active)
        if kept:
            self._findings[(namespace, policy)] = kept
        else:
            self._findings.pop((namespace, policy), None)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


def store_gauges(store: SeriesStore) -> dict[str, float]:
    """The series store's size, for :meth:`OperatorMetrics.watch_state`."""
    stats = store.stats()
    return {
        "gpuwarden_operator_series": stats.series,
        "gpuwarden_operator_series_points": stats.points,
        "gpuwarden_operator_series_bytes": stats.nbytes,
        "gpuwarden_operator_points_ignored": stats.ignored,
    }


class _Exposition:
    """The exposition, remembering whether the last one failed (so that readiness can say so)."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        self._metrics = metrics
        self.failing: str | None = None
        """Why the last exposition failed; None while it works."""

    def render(self) -> bytes | None:
        try:
            body = self._metrics.exposition()
        except Exception as exc:
            self.failed(exc)
            return None
        self.failing = None
        return body

    def failed(self, exc: Exception) -> None:
        # Nothing a report carries can get here (the wire bounds every value and timestamp);
        # if a bug does, the scrape fails and so does readiness, instead of a silent blind spot.
        logger.exception("The metrics exposition failed.")
        self.failing = f"{type(exc).__name__}: {exc}"


def make_metrics_app(metrics: OperatorMetrics, ready: Callable[[], bool]) -> web.Application:
    """``/metrics``, ``/healthz`` (the event loop answers) and ``/readyz`` (``ready()``, and the
    exposition works: after a failed scrape, readiness renders it again until it succeeds)."""
    exposition = _Exposition(metrics)
    # prometheus_client's handler, as the agent's and the simulated server's: the format the scraper
    # asks for, gzipped when it accepts that.
    handler = make_aiohttp_handler(metrics.registry)

    async def serve_metrics(request: web.Request) -> web.StreamResponse:
        try:
            response = await handler(request)
        except Exception as exc:
            exposition.failed(exc)
            return web.Response(status=500, text=f"the metrics exposition failed: {exposition.failing}\n")
        exposition.failing = None
        return response

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if not ready():
            return web.Response(status=503, text="starting\n")
        if exposition.failing is not None and exposition.render() is None:
            return web.Response(status=503, text=f"the metrics exposition fails: {exposition.failing}\n")
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


class DesiredReplicasCollector(Collector):
    """``gpuwarden_policy_desired_replicas{namespace,policy}``, read from the scaler at scrape time.

    ``desired(now)`` is the scaler's ``desired_replicas``: a policy that stops being reconciled
    (deleted, or now evaluated by another replica) drops out of it after a few of its intervals,
    so a stale value never keeps driving an HPA.
    """

    def __init__(
        self, desired: Callable[[float], Mapping[Any, int]], clock: Callable[[], float] = time.time
    ) -> None:
        self._desired = desired
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        """One sample per recently reconciled policy."""
        family = GaugeMetricFamily(
            "gpuwarden_policy_desired_replicas",
            "Replicas the policy wants its scale target to have (also in dryRun): feed it to an HPA or KEDA.",
            labels=["namespace", "policy"],
        )
        # Keys are the operator's PolicyKeys (namespace, name); sorted, so scrapes read alike.
        for key, desired in sorted(self._desired(self._clock()).items(), key=lambda kv: str(kv[0])):
            family.add_metric([key.namespace, key.name], desired)
        return [family]


class ScaleDecisionsCollector(Collector):
    """``gpuwarden_policy_scale_decisions_total{namespace,policy,reason}``, read from the scaler at
    scrape time: its ``decisions()``, the changes made or (dryRun) announced by their Events' reason."""

    def __init__(self, decisions: Callable[[], Mapping[tuple[str, str, str], int]]) -> None:
        self._decisions = decisions

    def collect(self) -> Iterable[Metric]:
        """One sample per policy and reason (each reads 0 from the policy's first reconcile)."""
        family = CounterMetricFamily(
            "gpuwarden_policy_scale_decisions",
            "Scale changes made (ScaledUp, ScaledDown) or, in dryRun, announced (WouldScaleUp, "
            "WouldScaleDown), by policy and reason.",
            labels=["namespace", "policy", "reason"],
        )
        for (namespace, policy, reason), count in sorted(self._decisions().items()):
            family.add_metric([namespace, policy, reason], count)
        return [family]

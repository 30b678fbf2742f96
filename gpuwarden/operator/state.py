"""The operator's single state object (``memo.operator.state``): series, running policies, ingestion.

Kopf owns what it watches (pods and policies, in its indexes and in the bodies
it hands to handlers); everything the operator adds lives here, created once at
startup by :func:`gpuwarden.operator.composition.build_operator` (the composition root):
the records kept here (the series store the agents' reports fill and the GPUs' health,
the pod index's view, the store retention each running policy needs, the running policies'
:class:`~gpuwarden.operator.pacing.PolicySchedule`) and the collaborators built there (API
client, clock, metrics, leadership, TokenReview, rate limiter, ingest, Event poster).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwarden.accounting import Bound
from gpuwarden.operator.accounting import AccountingBook
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints import MAX_FUTURE_SKEW, Intake, NodeRateLimiter, ReportBook, ReportIngest
from gpuwarden.operator.kube import EventPoster, KubeApi, TokenAuthenticator
from gpuwarden.operator.metrics import OperatorMetrics, store_gauges
from gpuwarden.operator.pacing import Pacing, PolicySchedule
from gpuwarden.operator.resources import PodRecord, PolicyKey
from gpuwarden.operator.scrape import ServicePod, ServicePolicy, plan_node
from gpuwarden.operator.sharding import Leadership, VerdictBoard, VerdictIngest, VerdictSender
from gpuwarden.policy import (
    Admission,
    HealthStore,
    PodId,
    Point,
    SeriesKey,
    SeriesStore,
    ServiceScrape,
    ServiceStore,
    points_from_snapshot,
    service_scrape,
)
from gpuwarden.wire.node import NodeReport
from gpuwarden.wire.scrape import ScrapeFailure, ScrapeTarget, ServiceSample, dump_plan
from gpuwarden.wire.verdicts import VerdictReport

__all__ = [
    "MAX_GPUS_PER_POD",
    "MAX_REPORT_AGE",
    "MAX_RETENTION",
    "MIN_RETENTION",
    "PRUNE_SECONDS",
    "OperatorState",
]

MIN_RETENTION = 600.0
"""Seconds of readings kept even when no policy needs them (a replay may land before the policies load)."""
MAX_RETENTION = 6 * 3600.0
"""Seconds of readings kept at most, whatever a policy asks for (memory: 24 B a reading)."""
MAX_POINTS = int(MAX_RETENTION)
"""Readings kept per series at most: 6 h at the agents' 1 s sampling."""
PRUNE_SECONDS = 60.0
"""How often series and GPU health records that stopped receiving readings are aged out
(:meth:`OperatorState.prune`)."""
MAX_GPUS_PER_POD = 64
"""GPU series a pod may have (8 GPUs of 7 MIG devices each is 56): the rest of its readings are refused."""
MAX_REPORT_AGE = MAX_RETENTION
"""Readings older than this (by the operator's clock) are refused: no window could use them."""

_OUT_OF_SCOPE = "out_of_scope"
"""A pod of a namespace not watched: its readings are dropped without a word (not a refusal)."""


@dataclass(eq=False)
class OperatorState:
    """Everything the operator keeps between handler calls; one per process, in ``memo.operator``.

    Built by :func:`gpuwarden.operator.composition.build_operator`, which also plugs in the ingest.
    """

    config: OperatorConfig
    api: KubeApi
    metrics: OperatorMetrics
    events: EventPoster
    """Posts the policies' Events in the background (:class:`Services` runs it)."""
    leadership: Leadership
    """Whether this replica acts now, and on what: peering (not sharded: a shard of one, which owns
    every node and policy), or in sharded mode (``--shards``) its :class:`Sharding`, by the ring."""
    verdict_sender: VerdictSender
    """Sharded mode: sends this shard's verdicts on the policies owned elsewhere to their owners."""
    authenticator: TokenAuthenticator
    limiter: NodeRateLimiter
    clock: Callable[[], float] = time.time
    """Wall time, epoch seconds: the operator's one clock (the composition root's), read by the
    evaluation loops and the pruning."""
    store: SeriesStore = field(
        default_factory=lambda: SeriesStore(retention_seconds=MIN_RETENTION, max_points=MAX_POINTS)
    )
    health: HealthStore = field(default_factory=lambda: HealthStore(retention_seconds=MIN_RETENTION))
    """The GPUs' health (gpuHealth rules, throttling, the node view), kept as long as the series."""
    services: ServiceStore = field(default_factory=lambda: ServiceStore(retention_seconds=MIN_RETENTION))
    """The pods' own metrics as the agents scraped them (the service rules), kept as long as the series."""
    book: ReportBook = field(default_factory=ReportBook)
    schedule: PolicySchedule = field(default_factory=PolicySchedule)
    """The running evaluation daemons' pacing."""
    pod_nodes: Mapping[tuple[str, str], Collection[str]] = field(default_factory=dict)
    """GPU pods by (namespace, name) -> the node they run on: Kopf's ``gpu_pod_nodes`` index."""
    pod_grants: Mapping[tuple[str, str], Collection[Bound]] = field(default_factory=dict)
    """What each scheduled GPU pod may be billed for (GPUs, start): Kopf's ``gpu_pod_grants`` index."""
    pods: Mapping[str, Iterable[PodRecord]] = field(default_factory=dict)
    """GPU pods by namespace -> their records: Kopf's ``gpu_pods`` index (bound at startup)."""
    service_pods: Mapping[str, Iterable[ServicePod]] = field(default_factory=dict)
    """GPU pods by node -> their endpoints' records: Kopf's ``service_pods`` index (bound at startup)."""
    service_policies: Mapping[str, Iterable[ServicePolicy]] = field(default_factory=dict)
    """Policies whose rules read the pods' own metrics, by namespace: Kopf's ``service_policies`` index."""
    pods_synced: bool = False
    """Whether ``pod_nodes`` holds every pod (Kopf listed them); until then unknown pods are let in."""
    horizons: dict[PolicyKey, float] = field(default_factory=dict)
    """The store retention each running policy needs."""
    started: bool = False
    """True once the servers listen (``/readyz``)."""
    verdicts: VerdictBoard = field(default_factory=VerdictBoard)
    """Sharded mode: the per-pod verdicts other shards sent on the policies owned here."""
    verdict_ingest: VerdictIngest | None = None
    """Sharded mode: ``POST /v1/verdicts``, the other shards' verdicts (the operator's own
    ServiceAccount only); plugged in by the composition root (it nudges through :meth:`verdicts_arrived`)."""
    accounting: AccountingBook | None = None
    """GPU time per workload, fed by :meth:`accept` with what the store took; plugged in by the
    composition root."""
    ingest: ReportIngest = field(init=False)
    """The ingest endpoint's core; plugged in by the composition root (it stores through :meth:`accept`)."""

    def gauges(self) -> dict[str, float]:
        """The state's own gauges, read at each scrape."""
        return {
            **store_gauges(self.store),
            "gpuwarden_operator_active": self.leadership.active,
            "gpuwarden_operator_tokenreviews": self.authenticator.reviews,
            "gpuwarden_operator_policies": len(self.schedule),
            "gpuwarden_operator_retention_seconds": self.store.retention_seconds,
            "gpuwarden_operator_service_scrape_bytes": self.services.nbytes,
            "gpuwarden_operator_service_scrapes_dropped": self.services.dropped,
            "gpuwarden_operator_shard_members": self.leadership.members(),
        }

    # -- ingestion --

    def knows_node(self, node: str) -> bool:
        """Whether a GPU pod runs on ``node`` (the pod index) or its agent reported lately: a new token
        claiming it is reviewed on that node's own budget (:class:`TokenAuthenticator`)."""
        return node in self.book or node in self.service_pods

    def in_scope(self, namespace: str) -> bool:
        """Whether pods of ``namespace`` are watched (their readings are worth keeping)."""
        return self.config.clusterwide or namespace in self.config.namespaces

    def accept(self, report: NodeReport, node: str, now: float) -> Intake:
        """Store the readings of ``report`` from the agent of ``node``, received at ``now`` (our clock).

        Readings of unwatched namespaces are dropped; refused, and counted by reason: those
        of a snapshot more than :data:`MAX_FUTURE_SKEW` ahead of ``now`` or more than
        :data:`MAX_REPORT_AGE` behind it, those of a pod that the pod index places on
        another node or (once it is synced) does not know, those of a GPU the health store
        has no room for on ``node`` and those of a pod's GPUs past :data:`MAX_GPUS_PER_POD`
        (``tooManyGpus``). The policies of the namespaces that got readings are woken.

        The GPUs' health of every timely snapshot goes into the health store as ``node``'s, whatever
        the namespaces (the node view needs all); a pod goes on a GPU there only when it would
        be let in here (so a node cannot put another node's pod on its GPUs), and an XID is held
        to the same bounds as the snapshots. So is each pod's scrape (``Snapshot.services``), stored
        in the service store when its pod's readings would be and ``node``'s scrape plan names that
        pod (by uid), with the metric names the plan asks of it alone (``notPlanned``: a scrape, or
        a metric of one, no plan asked for).
        """
        add, update = self.store.add, self.metrics.latest.update
        intake = Intake()
        refused = intake.refused
        namespaces: set[str] = set()
        earliest, latest = now - MAX_REPORT_AGE, now + MAX_FUTURE_SKEW
        # A report's GPUs mostly share a few pods: judge each pod, and each new series, once per report.
        verdicts: dict[tuple[str, str], str | None] = {}
        series: dict[SeriesKey, bool] = {}
        asked: list[Mapping[PodId, ScrapeTarget]] = []  # the node's plan, once a scrape needs it

        def admit(pod: PodId) -> bool:
            key = (pod.namespace, pod.name)
            if key not in verdicts:
                verdicts[key] = self._pod_verdict(node, key)
            return verdicts[key] is None

        admission = Admission(admit=admit, earliest=earliest, latest=latest, refused=refused)
        refused_devices = admission.devices
        for snapshot in report.snapshots:
            t = snapshot.timestamp
            untimely = "future" if t > latest else "past" if t < earliest else None
            # The readings the store took, by device: the accounting's share of the snapshot.
            taken: dict[str, dict[tuple[str, str], Point]] | None = None
            if untimely is None:
                # A GPU's health, too, keeps only what is newer than its latest: nothing from the future.
                self.health.observe(snapshot, node=node, admission=admission)
                if self.accounting is not None:
                    taken = {}
            if snapshot.services:
                self._accept_services(snapshot.services, node, admission, verdicts, asked)
            for key, point in points_from_snapshot(snapshot):
                pod = (key.namespace, key.pod)
                if pod in verdicts:
                    verdict = verdicts[pod]
                else:
                    verdict = verdicts[pod] = self._pod_verdict(node, pod)
                if verdict == _OUT_OF_SCOPE:
                    continue
                reason = untimely or verdict
                if reason is None and refused_devices and key.gpu in refused_devices:
                    reason = "tooManyGpus"
                if reason is None:
                    room = series.get(key)
                    if room is None:
                        room = series[key] = self._room_for(key)
                    if not room:
                        reason = "tooManyGpus"
                if reason is not None:
                    refused[reason] = refused.get(reason, 0) + 1
                    continue
                update(key, point)
                if add(key, point):
                    intake.stored += 1
                    namespaces.add(key.namespace)
                    if taken is not None:
                        readings = taken.get(key.gpu)
                        if readings is None:
                            taken[key.gpu] = {pod: point}
                        else:
                            readings[pod] = point
            if taken is not None and self.accounting is not None:
                self.accounting.observe(node, snapshot, taken, bound=self._grant)
        if namespaces:
            self.schedule.nudge_data(namespaces)
        return intake

    def _accept_services(
        self,
        samples: Iterable[ServiceSample],
        node: str,
        admission: Admission,
        verdicts: dict[tuple[str, str], str | None],
        asked: list[Mapping[PodId, ScrapeTarget]],
    ) -> None:
        """Store the pods' scrapes of a snapshot, held to the readings' bounds: each its own time
        within the skew and the retention, each of a pod the pod index places on the reporting node,
        and of a pod (and its metrics) that the node's plan (computed once a report, in ``asked``)
        names."""
        for sample in samples:
            at, pod = sample.at, (sample.namespace, sample.name)
            if pod not in verdicts:
                verdicts[pod] = self._pod_verdict(node, pod)
            verdict = verdicts[pod]
            if verdict == _OUT_OF_SCOPE:
                continue
            reason = "future" if at > admission.latest else "past" if at < admission.earliest else verdict
            if reason is not None:
                admission.refuse(reason)
                continue
            if not asked:
                asked.append(self._planned(node))
            target = asked[0].get(PodId(*pod))
            if target is None or target.uid != sample.uid:
                admission.refuse("notPlanned")
                continue
            names = frozenset(target.metrics)
            scrape = service_scrape(sample, names)
            kept = len(scrape.histograms) + len(scrape.counters) + len(scrape.gauges)
            sent = len(sample.histograms) + len(sample.counters) + len(sample.gauges)
            if sent > kept:
                admission.refuse("notPlanned", sent - kept)
            self.services.record(PodId(*pod), scrape)

    def _planned(self, node: str) -> Mapping[PodId, ScrapeTarget]:
        """The pods ``node``'s scrape plan names, now: the only ones whose scrapes are kept."""
        if not self.service_policies:
            return {}
        plan = plan_node(self.service_pods.get(node, ()), self.service_policies).plan
        return {PodId(t.namespace, t.name): t for t in plan.targets}

    def _grant(self, pod: tuple[str, str]) -> Bound | None:
        """What the API says ``pod`` may be billed for; None while the pod index does not know it."""
        for grant in self.pod_grants.get(pod, ()):
            return grant
        return None

    def _room_for(self, key: SeriesKey) -> bool:
        """Whether ``key``'s series exists, or its pod has fewer than :data:`MAX_GPUS_PER_POD` GPUs."""
        return self.store.window(key) is not None or (
            len(self.store.series_of(key.namespace, key.pod)) < MAX_GPUS_PER_POD
        )

    def _pod_verdict(self, node: str, pod: tuple[str, str]) -> str | None:
        """None when ``node``'s agent may report for ``pod``; else why not (or that it is out of scope)."""
        if not self.in_scope(pod[0]):
            return _OUT_OF_SCOPE
        where = self.pod_nodes.get(pod)
        if not where:
            # Before the index is synced (the operator just started, the agents replay their
            # buffers) a pod it does not know yet is not held against the report.
            return "unknownPod" if self.pods_synced else None
        return None if node in where else "foreignPod"

    def verdicts_arrived(self, report: VerdictReport) -> None:
        """Another shard's verdicts on a policy owned here arrived: its daemon may evaluate."""
        self.schedule.nudge_policy_data(report.namespace, report.policy)

    def scrape_plan(self, node: str) -> str | None:
        """The JSON of ``node``'s scrape plan (:mod:`gpuwarden.operator.scrape`) for the answer to its
        report, None when it has nothing to scrape. A selected pod with no port gets a ``NoPort`` scrape
        (once, until another outcome or the retention replaces it): its policies' condition says so."""
        if not self.service_policies:
            return None  # no policy reads the pods' metrics: the common case, at no cost
        planned = plan_node(self.service_pods.get(node, ()), self.service_policies)
        for pod in planned.no_port:
            kept = self.services.scrapes(pod)
            if not kept or kept[-1].error != ScrapeFailure.NO_PORT:
                self.services.record(pod, ServiceScrape(at=self.clock(), error=ScrapeFailure.NO_PORT.value))
        return dump_plan(planned.plan) if planned.plan.targets else None

    def forget_pod(self, namespace: str, name: str) -> None:
        """A pod was deleted: drop its series and its per-pod metrics."""
        self.store.forget_pod(namespace, name)
        self.health.forget_pod(namespace, name)
        self.services.forget_pod(PodId(namespace, name))
        self.metrics.latest.forget_pod(namespace, name)

    async def prune(self) -> None:
        """Forever, every :data:`PRUNE_SECONDS`: drop readings past the retention from series that
        stopped receiving any, and such series once empty; the same for the GPUs' health records
        (:class:`Services` runs it).

        ``add`` ages out a series' old readings only as new ones arrive; without this, a series
        that gets none is kept for ever: a pod whose last report landed after its deletion
        (bench/soak.py counted ~1 in 60 replaced pods), a GPU no longer reported for a pod.
        """
        while True:
            await asyncio.sleep(PRUNE_SECONDS)
            now = self.clock()
            self.store.prune(now)
            self.health.prune(now)
            self.services.prune(now)

    # -- policies --

    def open_policy(self, key: PolicyKey, uid: str = "") -> Pacing:
        """A policy's daemon starts (``uid``: the policy object's)."""
        return self.schedule.open(key.namespace, key.name, uid)

    def close_policy(self, key: PolicyKey, pacing: Pacing | None = None) -> None:
        """A policy's daemon ends (policy deleted, operator paused or exiting)."""
        self.schedule.close(key.namespace, key.name, pacing)
        if (key.namespace, key.name) not in self.schedule:
            self.set_horizon(key, None)

    def end_policy(self, uid: str) -> None:
        """The policy object ``uid`` was deleted: its daemon returns (handlers.py: no finalizer, so
        Kopf does not stop it)."""
        self.schedule.end(uid)

    def nudge_policy(self, key: PolicyKey) -> None:
        """A policy's spec changed: its daemon re-reads it now."""
        self.schedule.nudge_spec(key.namespace, key.name)

    def set_horizon(self, key: PolicyKey, seconds: float | None) -> None:
        """Record how much history a policy needs; the store keeps the most any policy needs."""
        if seconds is None:
            self.horizons.pop(key, None)
        else:
            self.horizons[key] = seconds
        wanted = max(self.horizons.values(), default=MIN_RETENTION)
        self.store.retention_seconds = min(MAX_RETENTION, max(MIN_RETENTION, wanted))
        self.health.retention_seconds = self.store.retention_seconds
        self.services.retention_seconds = self.store.retention_seconds

    def runs_policy(self, namespace: str, name: str) -> bool:
        """Whether the policy's daemon runs here (it is a policy that exists, in a watched namespace)."""
        return (namespace, name) in self.schedule

    def running_policies(self) -> Iterable[PolicyKey]:
        """Policies whose daemons run here."""
        return [PolicyKey(ns, name) for ns, name in self.schedule.running()]

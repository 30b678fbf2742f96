"""What of an agent's report is let in: the admission rules of ``POST /v1/reports``; the node's scrape plan.

:class:`ReportAdmission` is the collaborator the ingest endpoint (:mod:`gpuwarden.operator.endpoints`)
holds: built by the composition root over the operator's records (:mod:`gpuwarden.operator.state`),
it stores what a report may add and counts what it refuses, by reason; the endpoint's docstring lists
the reasons an agent reads in its answer. It also computes the scrape plan that answer carries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwarden.accounting import Bound
from gpuwarden.operator.accounting import AccountingBook
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.metrics import LatestReadings
from gpuwarden.operator.scrape import plan_node
from gpuwarden.operator.state import MAX_RETENTION, OperatorState
from gpuwarden.operator.suspicion import HookAsks
from gpuwarden.policy import (
    Admission,
    PodId,
    Point,
    SeriesKey,
    ServiceScrape,
    points_from_snapshot,
    service_scrape,
)
from gpuwarden.wire.node import NodeReport
from gpuwarden.wire.scrape import ScrapeFailure, ScrapeTarget, ServiceSample, dump_plan

__all__ = ["MAX_FUTURE_SKEW", "MAX_GPUS_PER_POD", "MAX_REPORT_AGE", "Admitted", "ReportAdmission"]

MAX_FUTURE_SKEW = 30.0
"""Seconds a snapshot may be ahead of the operator's clock (NTP keeps nodes within milliseconds).

A series keeps only points newer than its latest, so a reading from the future hides the
real ones that follow it until the clock catches up: at most this long.
"""
MAX_REPORT_AGE = MAX_RETENTION
"""Readings older than this (by the operator's clock) are refused: no window could use them."""
MAX_GPUS_PER_POD = 64
"""GPU series a pod may have (8 GPUs of 7 MIG devices each is 56): the rest of its readings are refused."""

_OUT_OF_SCOPE = "out_of_scope"
"""A pod of a namespace not watched: its readings are dropped without a word (not a refusal)."""


@dataclass(slots=True)
class Admitted:
    """What became of an accepted report's readings."""

    stored: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Readings not stored, by reason (one of :data:`~gpuwarden.wire.node.REFUSALS`)."""


class ReportAdmission:
    """Lets an agent's readings into the records (:meth:`accept`); plans its node's scrapes (:meth:`plan`).

    ``records``: the stores it fills and the Kopf indexes it checks pods against; ``latest``: the
    per-pod GPU gauges' newest readings; ``accounting``: GPU time per workload, fed with what the
    store took; ``asks``: the asks to the node's hooks, which the snapshots' ``hookReplies`` answer
    and the answer carries (:meth:`hook_asks`); ``clock``: the operator's (a ``NoPort`` scrape's time).
    """

    def __init__(
        self,
        config: OperatorConfig,
        records: OperatorState,
        *,
        latest: LatestReadings,
        accounting: AccountingBook,
        asks: HookAsks,
        clock: Callable[[], float],
    ) -> None:
        self._clusterwide = config.clusterwide
        self._namespaces = config.namespaces
        self._records = records
        self._latest = latest
        self.accounting = accounting
        """GPU time per workload, fed with what the store took."""
        self._asks = asks
        self._clock = clock

    def accept(self, report: NodeReport, node: str, now: float) -> Admitted:
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
        records = self._records
        add, update, health = records.store.add, self._latest.update, records.health
        intake = Admitted()
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
                health.observe(snapshot, node=node, admission=admission)
                taken = {}
            if snapshot.services:
                self._accept_services(snapshot.services, node, admission, verdicts, asked)
            if snapshot.hook_replies:
                # Answers to this replica's own asks of this node (ids it keeps): timely or not.
                self._asks.replied(node, snapshot.hook_replies)
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
            if taken is not None:
                self.accounting.observe(node, snapshot, taken, bound=self._grant)
        if namespaces:
            records.schedule.nudge_data(namespaces)
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
            self._records.services.record(PodId(*pod), scrape)

    def _planned(self, node: str) -> Mapping[PodId, ScrapeTarget]:
        """The pods ``node``'s scrape plan names, now: the only ones whose scrapes are kept."""
        records = self._records
        if not records.service_policies:
            return {}
        plan = plan_node(records.service_pods.get(node, ()), records.service_policies).plan
        return {PodId(t.namespace, t.name): t for t in plan.targets}

    def _grant(self, pod: tuple[str, str]) -> Bound | None:
        """What the API says ``pod`` may be billed for; None while the pod index does not know it."""
        for grant in self._records.pod_grants.get(pod, ()):
            return grant
        return None

    def _room_for(self, key: SeriesKey) -> bool:
        """Whether ``key``'s series exists, or its pod has fewer than :data:`MAX_GPUS_PER_POD` GPUs."""
        store = self._records.store
        return store.window(key) is not None or (
            len(store.series_of(key.namespace, key.pod)) < MAX_GPUS_PER_POD
        )

    def _pod_verdict(self, node: str, pod: tuple[str, str]) -> str | None:
        """None when ``node``'s agent may report for ``pod``; else why not (or that it is out of scope)."""
        if not (self._clusterwide or pod[0] in self._namespaces):
            return _OUT_OF_SCOPE
        where = self._records.pod_nodes.get(pod)
        if not where:
            # Before the index is synced (the operator just started, the agents replay their
            # buffers) a pod it does not know yet is not held against the report.
            return "unknownPod" if self._records.pods_synced else None
        return None if node in where else "foreignPod"

    def hook_asks(self, node: str) -> str | None:
        """The asks waiting for ``node``'s hooks, as the JSON of the answer's ``hookAsks``; None: none."""
        return self._asks.for_node(node)

    def plan(self, node: str) -> str | None:
        """The JSON of ``node``'s scrape plan (:mod:`gpuwarden.operator.scrape`) for the answer to its
        report, None when it has nothing to scrape. A selected pod with no port gets a ``NoPort`` scrape
        (once, until another outcome or the retention replaces it): its policies' condition says so."""
        records = self._records
        if not records.service_policies:
            return None  # no policy reads the pods' metrics: the common case, at no cost
        planned = plan_node(records.service_pods.get(node, ()), records.service_policies)
        services = records.services
        for pod in planned.no_port:
            kept = services.scrapes(pod)
            if not kept or kept[-1].error != ScrapeFailure.NO_PORT:
                services.record(pod, ServiceScrape(at=self._clock(), error=ScrapeFailure.NO_PORT.value))
        return dump_plan(planned.plan) if planned.plan.targets else None

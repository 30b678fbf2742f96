"""The operator's records (``memo.operator.state``): series, GPU health, the pods' scrapes, the Kopf indexes'
views, the running policies' pacing and the retention they need.

Kopf owns what it watches (pods and policies, in its indexes and in the bodies it hands to handlers);
what the operator adds is kept here, created once at startup by
:func:`gpuwarden.operator.composition.build_operator` (the composition root), which hands it to the
parts that read or fill it: the admission of the agents' reports (:mod:`gpuwarden.operator.admission`),
the policies' runners, the node view, the pruning. Records only: the collaborators (API client,
clock, metrics, leadership or sharding, the endpoints) are given to each part by the composition root.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwarden.accounting import Bound
from gpuwarden.operator.pacing import Pacing, PolicySchedule
from gpuwarden.operator.resources import PodRecord, PolicyKey
from gpuwarden.operator.scrape import ServicePod, ServicePolicy
from gpuwarden.policy import HealthStore, PodId, SeriesStore, ServiceStore

__all__ = ["MAX_POINTS", "MAX_RETENTION", "MIN_RETENTION", "PRUNE_SECONDS", "OperatorState"]

MIN_RETENTION = 600.0
"""Seconds of readings kept even when no policy needs them (a replay may land before the policies load)."""
MAX_RETENTION = 6 * 3600.0
"""Seconds of readings kept at most, whatever a policy asks for (memory: 24 B a reading)."""
MAX_POINTS = int(MAX_RETENTION)
"""Readings kept per series at most: 6 h at the agents' 1 s sampling."""
PRUNE_SECONDS = 60.0
"""How often series and GPU health records that stopped receiving readings are aged out
(:meth:`OperatorState.prune`)."""


@dataclass(eq=False)
class OperatorState:
    """What the operator keeps between handler calls; one per process, in ``memo.operator``."""

    store: SeriesStore = field(
        default_factory=lambda: SeriesStore(retention_seconds=MIN_RETENTION, max_points=MAX_POINTS)
    )
    health: HealthStore = field(default_factory=lambda: HealthStore(retention_seconds=MIN_RETENTION))
    """The GPUs' health (gpuHealth rules, throttling, the node view), kept as long as the series."""
    services: ServiceStore = field(default_factory=lambda: ServiceStore(retention_seconds=MIN_RETENTION))
    """The pods' own metrics as the agents scraped them (the service rules), kept as long as the series."""
    schedule: PolicySchedule = field(default_factory=PolicySchedule)
    """The running evaluation daemons' pacing."""
    horizons: dict[PolicyKey, float] = field(default_factory=dict)
    """The store retention each running policy needs."""
    pod_nodes: Mapping[tuple[str, str], Collection[str]] = field(default_factory=dict)
    """GPU pods by (namespace, name) -> the node they run on: Kopf's ``gpu_pod_nodes`` index."""
    pod_grants: Mapping[tuple[str, str], Collection[Bound]] = field(default_factory=dict)
    """What each scheduled GPU pod may be billed for (GPUs, start): Kopf's ``gpu_pod_grants`` index."""
    pods: Mapping[str, Iterable[PodRecord]] = field(default_factory=dict)
    """GPU pods by namespace -> their records: Kopf's ``gpu_pods`` index."""
    service_pods: Mapping[str, Iterable[ServicePod]] = field(default_factory=dict)
    """GPU pods by node -> their endpoints' records: Kopf's ``service_pods`` index."""
    service_policies: Mapping[str, Iterable[ServicePolicy]] = field(default_factory=dict)
    """Policies whose rules read the pods' own metrics, by namespace: Kopf's ``service_policies`` index."""
    pods_synced: bool = False
    """Whether ``pod_nodes`` holds every pod (Kopf listed them); until then unknown pods are let in."""

    # The indexes exist only once Kopf runs (its startup handlers get them): bound then, by name.

    def forget_pod(self, namespace: str, name: str) -> None:
        """A pod was deleted: drop its series, its GPUs' claims and its scrapes."""
        self.store.forget_pod(namespace, name)
        self.health.forget_pod(namespace, name)
        self.services.forget_pod(PodId(namespace, name))

    def prune(self, now: float) -> None:
        """Drop readings past the retention from series that stopped receiving any, and such series once
        empty; the same for the GPUs' health records and the scrapes (every :data:`PRUNE_SECONDS`).

        ``add`` ages out a series' old readings only as new ones arrive; without this, a series
        that gets none is kept for ever: a pod whose last report landed after its deletion
        (bench/soak.py counted ~1 in 60 replaced pods), a GPU no longer reported for a pod.
        """
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
        """Record how much history a policy needs; the stores keep the most any policy needs."""
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

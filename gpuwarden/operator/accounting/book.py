"""The operator's accounting: the ledger fed from intake, its totals labelled by workload, as counters.

:class:`AccountingBook` is what the ingest calls (:meth:`~AccountingBook.devices` once per timely
snapshot, :meth:`~AccountingBook.observe` for each reading the series store took) and what
``/metrics`` collects (:meth:`~AccountingBook.collect`). :meth:`~AccountingBook.run`, one of the
operator's background tasks, resolves new pods to their workloads and retires the pods that went
silent.

The counters, GPU-seconds (and the idle part's price), labelled ``namespace``, ``workload_kind``,
``workload``, ``group``, ``gpu_model``: each is the sum over that workload's pods of the ledger's
totals, those of live pods and those retired into the workload's row. A pod is exported once its
workload is known (its first seconds wait for that read, they are not lost); a pod none of whose
GPUs has been read for :data:`RETIRE_SECONDS` is retired (its totals stay in its workload's row);
a new row reads 0 for the longest scrape interval (``--accounting-scrape-interval``) before its
totals, since PromQL's ``increase()`` takes a series' first value as its baseline, not as an increase;
a row that has not grown for :data:`EXPIRE_SECONDS` and has no live pod is dropped, so finished
workloads do not stay in ``/metrics`` for ever. A row's exported value never decreases (floating
sums in another order could make it dip by a rounding error, which Prometheus would read as a
counter reset).

Restarts and handovers (docs/accounting.md): a counter belongs to one process. A new process starts
its counters from zero, which PromQL's ``increase()`` and ``rate()`` read as a reset; in sharded
mode only the replica that owns a node gets its reports (the others answer 421), so a pod's time is
counted by one replica at a time, and ``sum by (...)`` over the replicas adds the old owner's
frozen rows to the new owner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwarden.accounting import Bound, Device, Ledger, Pod, Usage, devices_of
from gpuwarden.operator.accounting.owners import OwnerResolver, Unresolved, Workload
from gpuwarden.operator.accounting.settings import AccountingSettings
from gpuwarden.policy import Point
from gpuwarden.wire.node import Snapshot

__all__ = ["EXPIRE_SECONDS", "LABELS", "MAX_GPUS_PER_NODE", "RETIRE_SECONDS", "AccountingBook"]

logger = logging.getLogger(__name__)

LABELS = ("namespace", "workload_kind", "workload", "group", "gpu_model")
RETIRE_SECONDS = 600.0
"""A pod none of whose GPUs was read for this long has gone (or moved to another shard): its totals
join its workload's row. Longer than an agent's buffered outage is likely to be replayed in."""
EXPIRE_SECONDS = 3600.0
"""A row that did not grow for this long is no longer exported (many scrapes have read its last value)."""
MAX_GPUS_PER_NODE = 32
"""GPUs counted per node, by UUID (the health store keeps as many: ``tooManyGpus`` past them)."""
MAX_MODEL_CHARS = 64
"""A GPU model name is kept to this many characters (NVML's are under 40: ``NVIDIA H100 80GB HBM3``)."""
SWEEP_SECONDS = 60.0
"""How often silent pods are retired, stale rows dropped, and unresolved pods tried again."""

Row = tuple[str, str, str, str, str]
"""The label values of one counter row, in :data:`LABELS` order."""


@dataclass(slots=True)
class _Exported:
    value: Usage
    grown_at: float
    since: float
    """When the row was first exported (it reads 0 for the settings' scrape interval from then)."""


class AccountingBook(Collector):
    """The ledger, the pods' workloads, and the counters (see the module doc)."""

    def __init__(
        self, settings: AccountingSettings, resolver: OwnerResolver, clock: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.ledger = Ledger(idle_floor=settings.idle_floor)
        self._resolver = resolver
        self._clock = clock
        self._gpus: dict[str, dict[str, str]] = {}
        """Each node's GPUs by UUID: the model each was first reported with."""
        self._free_since: dict[tuple[str, str], float] = {}
        self._workloads: dict[tuple[str, str], Workload] = {}
        self._unresolved: set[tuple[str, str]] = set()
        self._retired: dict[Row, Usage] = {}
        self._exported: dict[Row, _Exported] = {}
        self._wake = asyncio.Event()

    # -- intake --

    def observe(
        self,
        node: str,
        snapshot: Snapshot,
        readings: Mapping[str, Mapping[Pod, Point]],
        *,
        bound: Callable[[Pod], Bound | None] | None = None,
    ) -> None:
        """Account for a timely snapshot of ``node``: its devices, with the readings the series store
        took by device id (``readings``); ``bound``: what the API says a pod was allocated.

        Only the node's first :data:`MAX_GPUS_PER_NODE` GPUs by UUID are counted, each under the model
        it was first reported with: what a node says cannot grow the rows.
        """
        gpus = self._gpus.get(node)
        if gpus is None:
            gpus = self._gpus[node] = {}
        devices = devices_of(snapshot)
        changed: dict[str, Device | None] | None = None
        for device_id, device in devices.items():
            model = gpus.get(device.gpu)
            if model == device.model:
                continue
            if changed is None:
                changed = {}
            if model is None:
                if len(gpus) >= MAX_GPUS_PER_NODE:
                    changed[device_id] = None
                    continue
                model = gpus[device.gpu] = device.model[:MAX_MODEL_CHARS]
            changed[device_id] = device._replace(model=model)
        if changed:
            for device_id, replaced in changed.items():
                if replaced is None:
                    del devices[device_id]
                else:
                    devices[device_id] = replaced
        self.ledger.observe(node, snapshot.timestamp, devices, readings, bound=bound, until=self._clock())
        for points in readings.values():
            for pod in points:
                if pod not in self._workloads and pod not in self._unresolved:
                    self._unresolved.add(pod)
                    self._wake.set()

    # -- background --

    async def run(self) -> None:
        """Forever: resolve new pods' workloads as they come; every :data:`SWEEP_SECONDS`, retire
        silent pods and drop stale rows."""
        swept = self._clock()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=SWEEP_SECONDS)
            self._wake.clear()
            await self.resolve_pending()
            if self._clock() - swept >= SWEEP_SECONDS:
                swept = self._clock()
                self.sweep()

    async def resolve_pending(self) -> None:
        """Resolve the workloads of the pods seen without one; those the API cannot answer now wait."""
        for pod in sorted(self._unresolved):
            try:
                workload = await self._resolver.workload(*pod)
            except Unresolved as exc:
                logger.info("Accounting: %s; trying again in %gs.", exc, SWEEP_SECONDS)
                return
            self._unresolved.discard(pod)
            if self.ledger.knows(*pod):  # not retired meanwhile
                self._workloads[pod] = workload

    def sweep(self) -> None:
        """Retire the pods silent for :data:`RETIRE_SECONDS`; drop rows stale for :data:`EXPIRE_SECONDS`."""
        now = self._clock()
        for pod in self.ledger.silent_pods(before=now - RETIRE_SECONDS):
            self.retire(*pod)
        read = self.ledger.forget_devices(before=now - RETIRE_SECONDS)
        for node, gpus in list(self._gpus.items()):
            for uuid in [u for u in gpus if (node, u) not in read]:
                del gpus[uuid]
            if not gpus:
                del self._gpus[node]
        self.rows()  # brings the rows' growth times up to date before judging them stale
        # A row with a live pod stays, grown or not: dropped, it would come back lower (its retired
        # pods' seconds gone), which Prometheus would take for a reset and count again.
        live = {
            (namespace, w.kind, w.name, w.group, model)
            for (namespace, pod), w in self._workloads.items()
            for model in self.ledger.pod_totals(namespace, pod)
        }
        stale = [r for r, e in self._exported.items() if e.grown_at < now - EXPIRE_SECONDS and r not in live]
        for row in stale:
            del self._exported[row]
            self._retired.pop(row, None)

    def retire(self, namespace: str, pod: str) -> None:
        """Fold a pod's totals into its workload's row and forget it (deleted, silent, moved away).

        A pod whose workload was never resolved is accounted to itself (kind ``Pod``): its API
        object is gone by now.
        """
        workload = self._workloads.pop((namespace, pod), None) or Workload("Pod", pod)
        self._unresolved.discard((namespace, pod))
        for model, usage in self.ledger.forget(namespace, pod).items():
            row = (namespace, workload.kind, workload.name, workload.group, model)
            kept = self._retired.get(row)
            if kept is None:
                kept = self._retired[row] = Usage()
            kept.add(usage)

    # -- export --

    def rows(self) -> dict[Row, Usage]:
        """Each row's exported totals now: 0 for the settings' scrape interval after the row first
        appears (Prometheus then keeps a 0 before its seconds), then its totals, never below what was
        exported before."""
        now = self._clock()
        sums = {row: Usage(u.allocated, u.used, u.idle, u.unknown) for row, u in self._retired.items()}
        for pod, workload in self._workloads.items():
            for model, usage in self.ledger.pod_totals(*pod).items():
                row = (pod[0], workload.kind, workload.name, workload.group, model)
                total = sums.get(row)
                if total is None:
                    total = sums[row] = Usage()
                total.add(usage)
        out: dict[Row, Usage] = {}
        for row, total in sums.items():
            seen = self._exported.get(row)
            if seen is None:
                seen = self._exported[row] = _Exported(Usage(), now, now)
            if now - seen.since >= self.settings.scrape_interval:
                last = seen.value
                grown = Usage(
                    max(last.allocated, total.allocated),
                    max(last.used, total.used),
                    max(last.idle, total.idle),
                )
                if grown != last:
                    seen.value, seen.grown_at = grown, now
            out[row] = seen.value
        return out

    def collect(self) -> Iterator[Metric]:
        """The counters (see the module doc)."""
        allocated = CounterMetricFamily(
            "gpuwarden_gpu_allocated_seconds",
            "GPU-seconds allocated to the workload's pods: a GPU held alone in full (a MIG slice its share), "
            "a shared one what the pod used plus an even part of what nobody used.",
            labels=LABELS,
        )
        used = CounterMetricFamily(
            "gpuwarden_gpu_used_seconds",
            "GPU-seconds of work: SM activity (else utilization) times the time, whole GPUs.",
            labels=LABELS,
        )
        idle = CounterMetricFamily(
            "gpuwarden_gpu_idle_seconds",
            f"GPU-seconds allocated while under {self.settings.idle_floor:g}% active.",
            labels=LABELS,
        )
        prices = self.settings.prices
        cost = (
            CounterMetricFamily(
                "gpuwarden_gpu_idle_cost",
                "What the idle GPU-seconds cost, at the configured price of a GPU-hour of the model.",
                labels=LABELS,
            )
            if prices
            else None
        )
        free = CounterMetricFamily(
            "gpuwarden_gpu_unallocated_seconds",
            "GPU-seconds of the node's GPUs that no pod held (a MIG slice counts its share).",
            labels=("node", "gpu_model"),
        )
        now = self._clock()
        for (node, model), usage in sorted(self.ledger.unallocated().items()):
            since = self._free_since.setdefault((node, model), now)
            free.add_metric(
                [node, model], usage.allocated if now - since >= self.settings.scrape_interval else 0.0
            )
        for row, usage in sorted(self.rows().items()):
            values = list(row)
            allocated.add_metric(values, usage.allocated)
            used.add_metric(values, usage.used)
            idle.add_metric(values, usage.idle)
            price = prices.get(row[4])
            if cost is not None and price is not None:
                cost.add_metric(values, usage.idle / 3600.0 * price)
        yield allocated
        yield used
        yield idle
        yield free
        for name, field, what in (
            (
                "allocated",
                "allocated",
                "GPU-seconds allocated to the node's pods (the workloads' counters, by node).",
            ),
            ("used", "used", "GPU-seconds of work of the node's pods (the workloads' counters, by node)."),
            ("idle", "idle", "Idle GPU-seconds of the node's pods (the workloads' counters, by node)."),
        ):
            family = CounterMetricFamily(
                f"gpuwarden_node_gpu_{name}_seconds", what, labels=("node", "gpu_model")
            )
            for (node, model), usage in sorted(self.ledger.nodes().items()):
                since = self._free_since.setdefault((node, model), now)
                shown = getattr(usage, field) if now - since >= self.settings.scrape_interval else 0.0
                family.add_metric([node, model], shown)
            yield family
        if cost is not None:
            yield cost
            per_hour = GaugeMetricFamily(
                "gpuwarden_gpu_price_per_hour",
                "The configured price of a GPU-hour of the model (gpuwarden report's costs).",
                labels=("gpu_model",),
            )
            for model, value in sorted(prices.items()):
                per_hour.add_metric([model], value)
            yield per_hour
        # Each live pod's workload, so that a pod's own series (an inference server's token counters)
        # can be summed by workload: one series a live GPU pod.
        workloads = GaugeMetricFamily(
            "gpuwarden_pod_workload_info",
            "The workload a GPU pod is accounted to (1 while the pod is counted).",
            labels=("namespace", "pod", "workload_kind", "workload", "group"),
        )
        for (namespace, pod), w in sorted(self._workloads.items()):
            workloads.add_metric([namespace, pod, w.kind, w.name, w.group], 1.0)
        yield workloads

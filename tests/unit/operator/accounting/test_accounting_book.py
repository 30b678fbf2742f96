"""The operator's accounting book: readings in, counters out, as /metrics exposes them."""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.accounting import Bound
from gpuwarden.kubetime import format_time
from gpuwarden.operator.accounting import AccountingBook, AccountingSettings, OwnerResolver, pod_grant
from gpuwarden.operator.accounting.book import EXPIRE_SECONDS, MAX_GPUS_PER_NODE, RETIRE_SECONDS
from gpuwarden.operator.accounting.grants import CLAIMED_GPUS
from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.kube import ApiError
from gpuwarden.policy import Point
from gpuwarden.wire.node import GpuSample, NodeReport, PodRef, Snapshot

H200 = "NVIDIA H200"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Api:
    def __init__(self, objects: Mapping[str, dict[str, Any]]) -> None:
        self.objects = objects

    async def get(self, path: str) -> dict[str, Any]:
        if path not in self.objects:
            raise ApiError(404, "not found")
        return self.objects[path]


def pod(name: str, team: str, owner: tuple[str, str, str] | None = None) -> tuple[str, dict[str, Any]]:
    meta: dict[str, Any] = {"labels": {"team": team}}
    if owner:
        meta["ownerReferences"] = [
            {"apiVersion": owner[0], "kind": owner[1], "name": owner[2], "controller": True}
        ]
    return f"/api/v1/namespaces/ml/pods/{name}", {"metadata": meta}


API = Api(
    dict(
        [
            pod("web-1", "search", ("apps/v1", "Deployment", "web")),
            pod("web-2", "search", ("apps/v1", "Deployment", "web")),
            pod("nb", "research"),
        ]
    )
)


def book(clock: Clock, **settings: Any) -> AccountingBook:
    """A book whose new rows show their seconds at once, unless ``scrape_interval`` says otherwise."""
    settings.setdefault("scrape_interval", 0.0)
    return AccountingBook(
        AccountingSettings(group_label="team", **settings), OwnerResolver(API, group_label="team"), clock
    )


def snapshot(t: float, gpus: Mapping[str, tuple[str, ...]], util: float = 0.0, model: str = H200) -> Snapshot:
    """One snapshot of GPUs (by UUID) allocated to pods of ``ml`` (by name), each at ``util``."""
    return Snapshot(
        timestamp=t,
        gpus=[
            GpuSample(
                uuid=uuid,
                index=i,
                model=model,
                utilization_gpu=util,
                pods=[PodRef(namespace="ml", name=name) for name in pods],
            )
            for i, (uuid, pods) in enumerate(gpus.items())
        ],
    )


def feed(accounting: AccountingBook, name: str, gpu: str, start: float, seconds: int, util: float) -> None:
    for i in range(seconds + 1):
        t = start + i
        point = Point(t, gpu_util=util)
        accounting.observe("n1", snapshot(t, {gpu: (name,)}, util), {gpu: {("ml", name): point}})


def scrape(
    accounting: AccountingBook, *, every: bool = False
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The workloads' counters (``every``: the nodes' too) as /metrics has them."""
    registry = CollectorRegistry()
    registry.register(accounting)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.endswith("_total") and (every or "workload" in s.labels)
    }


def labels(kind: str, name: str, group: str) -> tuple[tuple[str, str], ...]:
    values = {"namespace": "ml", "workload_kind": kind, "workload": name, "group": group, "gpu_model": H200}
    return tuple(sorted(values.items()))


async def test_pods_are_summed_by_workload_and_exported_once_resolved() -> None:
    clock = Clock()
    accounting = book(clock, prices={H200: 3.6})
    feed(accounting, "web-1", "GPU-1", clock.now, 100, 50.0)
    feed(accounting, "web-2", "GPU-2", clock.now, 100, 1.0)
    feed(accounting, "nb", "GPU-3", clock.now, 3600, 2.0)
    assert scrape(accounting) == {}  # nobody resolved yet: held back, not lost
    await accounting.resolve_pending()
    got = scrape(accounting)
    web, nb = labels("Deployment", "web", "search"), labels("Pod", "nb", "research")
    assert got[("gpuwarden_gpu_allocated_seconds_total", web)] == pytest.approx(200.0)
    assert got[("gpuwarden_gpu_used_seconds_total", web)] == pytest.approx(51.0)
    assert got[("gpuwarden_gpu_idle_seconds_total", web)] == pytest.approx(99.0)  # 100 s at 1%: 99 unused
    assert got[("gpuwarden_gpu_idle_cost_total", nb)] == pytest.approx(3.6 * 0.98)  # an hour at 2%


async def test_no_cost_without_a_price_and_a_retired_pod_stays_in_its_workload_row() -> None:
    clock = Clock()
    accounting = book(clock)
    feed(accounting, "web-1", "GPU-1", clock.now, 100, 50.0)
    await accounting.resolve_pending()
    before = scrape(accounting)
    assert not any(name == "gpuwarden_gpu_idle_cost_total" for name, _ in before)
    clock.now += RETIRE_SECONDS + 200
    accounting.sweep()
    assert accounting.ledger.pods() == []
    assert scrape(accounting) == before
    clock.now += EXPIRE_SECONDS + 1
    accounting.sweep()
    assert scrape(accounting) == {}


async def test_a_new_row_reads_zero_for_a_scrape_interval_then_its_whole_seconds() -> None:
    # Prometheus' increase() takes a series' first value as its baseline: a row that appeared with
    # its first 100 s would lose them. Read at 0 for the longest scrape interval, it loses nothing.
    clock = Clock()
    accounting = book(clock, scrape_interval=30.0)
    feed(accounting, "web-1", "GPU-1", clock.now, 100, 50.0)
    await accounting.resolve_pending()
    web = ("gpuwarden_gpu_allocated_seconds_total", labels("Deployment", "web", "search"))
    assert scrape(accounting)[web] == 0.0
    clock.now += 29.9
    assert scrape(accounting)[web] == 0.0
    clock.now += 0.1
    assert scrape(accounting)[web] == pytest.approx(100.0)
    # A second pod of the workload joins a row already shown: its seconds count at once.
    feed(accounting, "web-2", "GPU-2", clock.now, 10, 50.0)
    await accounting.resolve_pending()
    assert scrape(accounting)[web] == pytest.approx(110.0)


async def test_counters_never_decrease_when_pods_retire() -> None:
    clock = Clock()
    accounting = book(clock)
    # Many pods of one workload with awkward fractions: folding them in another order must not dip.
    for i in range(1, 3):
        for t in range(50):
            at = clock.now + t * 0.1 * i
            util = (t * 7 % 10) * 3.3
            pod = f"web-{i}"
            accounting.observe(
                "n1",
                snapshot(at, {f"GPU-{i}": (pod,)}, util),
                {f"GPU-{i}": {("ml", pod): Point(at, gpu_util=util)}},
            )
    await accounting.resolve_pending()
    first = scrape(accounting)
    accounting.retire("ml", "web-2")
    accounting.retire("ml", "web-1")
    second = scrape(accounting)
    assert all(second[k] >= v for k, v in first.items())


def test_promtool_accepts_the_counters() -> None:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing (Debian: apt-get install prometheus)")
    clock = Clock()
    accounting = book(clock, prices={H200: 2.0})
    feed(accounting, "web-1", "GPU-1", clock.now, 10, 50.0)
    asyncio.run(accounting.resolve_pending())
    registry = CollectorRegistry()
    registry.register(accounting)
    done = subprocess.run(
        [path, "check", "metrics"], input=generate_latest(registry), capture_output=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_ingest_feeds_the_ledger_what_the_store_takes_once() -> None:
    now = 1_800_000_000.0
    admission = build_operator(OperatorConfig(), clock=lambda: now).ingest.admission

    def report(seq: int, times: list[float]) -> NodeReport:
        snapshots = [
            Snapshot(
                timestamp=t,
                gpus=[
                    GpuSample(
                        uuid="GPU-1",
                        index=0,
                        model=H200,
                        utilization_gpu=50.0,
                        pods=[PodRef(namespace="ml", name="a")],
                    )
                ],
            )
            for t in times
        ]
        return NodeReport(schema_version=5, node="n1", agent_id="x", seq=seq, snapshots=snapshots)

    admission.accept(report(1, [now - 3, now - 2, now - 1]), "n1", now)
    # A replay of readings already taken, and one from the future (refused by the store): nothing more.
    admission.accept(report(2, [now - 3, now - 2, now + 60]), "n1", now)
    totals = admission.accounting.ledger.pod_totals("ml", "a")[H200]
    assert totals.allocated == pytest.approx(2.0)
    assert totals.used == pytest.approx(1.0)


async def test_a_handover_counts_each_reading_on_one_replica_and_the_sum_over_replicas_is_the_whole() -> None:
    # Sharded mode: the node's reports go to the replica owning it; at 300 s the ring gives it to
    # another. The old owner's row freezes (and stays after the pod is retired there), the new
    # owner's starts from zero; `sum by (...)` over the replicas is the pod's whole time, less the one
    # interval that opens the new owner's account.
    clock = Clock()
    start = clock.now
    old, new, alone = book(clock), book(clock), book(clock)
    feed(old, "web-1", "GPU-1", start, 300, 40.0)
    feed(new, "web-1", "GPU-1", start + 301, 299, 40.0)
    feed(alone, "web-1", "GPU-1", start, 600, 40.0)
    for accounting in (old, new, alone):
        await accounting.resolve_pending()
    clock.now = start + 600 + RETIRE_SECONDS + 1
    old.sweep()
    assert old.ledger.pods() == []
    web = labels("Deployment", "web", "search")
    key = ("gpuwarden_gpu_allocated_seconds_total", web)
    assert scrape(old)[key] + scrape(new)[key] == pytest.approx(scrape(alone)[key] - 1.0)


async def test_a_gpu_keeps_the_model_it_was_first_reported_with_and_a_node_counts_at_most_its_gpus() -> None:
    # A node naming a new model in every snapshot, and a new GPU in every one: the rows stay bounded.
    clock = Clock()
    accounting = book(clock)
    for i in range(1000):
        t = clock.now + i
        gpus = {"GPU-1": ("web-1",), f"GPU-x{i}": ("web-1",)}
        readings = {gpu: {("ml", "web-1"): Point(t, gpu_util=50.0)} for gpu in gpus}
        accounting.observe("n1", snapshot(t, gpus, 50.0, model=f"H200 flood {i}"), readings)
    await accounting.resolve_pending()
    rows = [labels for name, labels in scrape(accounting) if name == "gpuwarden_gpu_allocated_seconds_total"]
    assert len(rows) <= MAX_GPUS_PER_NODE
    models = {dict(r)["gpu_model"] for r in rows}
    assert "H200 flood 0" in models
    assert "H200 flood 999" not in models


async def test_gpus_no_pod_holds_are_exported_as_unallocated_per_node_and_model() -> None:
    clock = Clock()
    accounting = book(clock)
    for i in range(11):
        t = clock.now + i
        accounting.observe(
            "n1",
            snapshot(t, {"GPU-1": ("web-1",), "GPU-2": ()}),
            {"GPU-1": {("ml", "web-1"): Point(t, gpu_util=50.0)}},
        )
    got = scrape(accounting, every=True)
    free = ("gpuwarden_gpu_unallocated_seconds_total", (("gpu_model", H200), ("node", "n1")))
    assert got[free] == pytest.approx(10.0)
    node = (("gpu_model", H200), ("node", "n1"))
    assert got[("gpuwarden_node_gpu_allocated_seconds_total", node)] == pytest.approx(10.0)
    assert got[("gpuwarden_node_gpu_used_seconds_total", node)] == pytest.approx(5.0)


def test_a_node_cannot_bill_its_one_gpu_pod_for_32_gpus_six_hours_back() -> None:
    # Issue 45: gpu-node-2 reported its pod other-0 (one GPU, 30 s old) on 32 GPUs, a snapshot every
    # 4.5 s over the 6 h the ingest accepts. The pod is billed at most one GPU for its 30 s.
    now = 1_800_000_000.0
    operator = build_operator(OperatorConfig(), clock=lambda: now)
    state, admission = operator.state, operator.ingest.admission
    pod = ("ml", "other-0")
    spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    state.pod_nodes = {pod: ["gpu-node-2"]}
    state.pod_grants = {pod: [pod_grant(spec, {"startTime": format_time(now - 30)}, {})]}
    state.pods_synced = True
    gpus = {f"GPU-{i}": ("other-0",) for i in range(32)}
    # The first and last 20 minutes of the six hours (all of it takes seconds; the edges are the point).
    times = [now - 6 * 3600 + 4.5 * i for i in range(267)] + [now - 1200 + 4.5 * i for i in range(267)]
    for seq, start in enumerate(range(0, len(times), 500)):
        snapshots = [snapshot(t, gpus, 90.0) for t in times[start : start + 500]]
        admission.accept(
            NodeReport(schema_version=5, node="gpu-node-2", agent_id="x", seq=seq, snapshots=snapshots),
            "gpu-node-2",
            now,
        )
    billed = sum(u.allocated for u in admission.accounting.ledger.pod_totals(*pod).values())
    assert 0 < billed <= 1 * 30.0
    assert admission.accounting.ledger.refused > 0


def test_a_pods_grant_is_its_containers_gpus_from_its_start() -> None:
    spec = {
        "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}}],
        "containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4"}}},
            {"resources": {"requests": {"nvidia.com/mig-1g.18gb": "1"}}},
        ],
    }
    created = {"creationTimestamp": "2026-12-06T09:59:00Z"}
    assert pod_grant(spec, {"startTime": "2026-12-06T10:00:00Z"}, created) == Bound(2.0, 1796551200.0)
    assert pod_grant(spec, {}, created).start == 1796551140.0  # until the kubelet says when it started
    one = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    assert pod_grant(one, {}, {}).start == math.inf
    claimed = pod_grant({"containers": [{}], "resourceClaims": [{"name": "gpu"}]}, {}, {})
    assert claimed.gpus == CLAIMED_GPUS

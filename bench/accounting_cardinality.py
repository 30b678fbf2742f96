"""Benchmark of accounting's cost: series on /metrics, exposition size and scrape time, memory, per reading.

Not a test: it prints figures for docs/accounting.md and docs/benchmarks.md. It fills the operator's
:class:`~gpuwarden.operator.accounting.AccountingBook` (the ledger behind the counters) with a minute
of 1 s readings, every pod on one H200, for ``--pods`` pods grouped into workloads of
``--pods-per-workload`` (1: every pod bare, its own workload, the worst case), each resolved through
the real :class:`~gpuwarden.operator.accounting.OwnerResolver` against an in-memory API, and with a
price set (four counters a row), then scrapes it as ``/metrics`` does. Then the cost on the ingest
path, side by side in one run: the same 8-GPU node reports (one snapshot each, ``--pods`` / 8
nodes) through two operators' :meth:`~gpuwarden.operator.admission.ReportAdmission.accept` (parsing
aside: the series store, admission, and the book), one with its accounting book and one with a book
that bills nothing,
alternating which goes first.

    .venv/bin/python bench/accounting_cardinality.py                # 10,000 pods, 8 a workload, then bare
    .venv/bin/python bench/accounting_cardinality.py --pods 1000    # a quick look

Times are CPU seconds of this process (``time.process_time``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import tracemalloc
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from gpuwarden.operator.accounting import AccountingBook, AccountingSettings, OwnerResolver
from gpuwarden.operator.admission import ReportAdmission
from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.kube import ApiError
from gpuwarden.policy import Point
from gpuwarden.wire.node import SCHEMA_VERSION, GpuSample, NodeReport, PodRef, Snapshot

H200 = "NVIDIA H200"


class Api:
    """Pods owned by ReplicaSets of Deployments (or bare), answered from memory."""

    def __init__(self, per_workload: int) -> None:
        self.per_workload = per_workload

    async def get(self, path: str) -> dict[str, Any]:
        parts = path.strip("/").split("/")
        kind, name = parts[-2], parts[-1]
        if kind == "pods":
            index = int(name.rpartition("-")[2])
            meta: dict[str, Any] = {"labels": {"team": f"team-{index // self.per_workload % 20}"}}
            if self.per_workload > 1:
                rs = f"rs-{index // self.per_workload}"
                meta["ownerReferences"] = [
                    {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs, "controller": True}
                ]
            return {"metadata": meta}
        if kind == "replicasets":
            deployment = name.replace("rs-", "deploy-")
            refs = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment, "controller": True}]
            return {"metadata": {"ownerReferences": refs}}
        raise ApiError(404, "not found")


def fill(book: AccountingBook, pods: int, seconds: int, t0: float) -> None:
    """``seconds`` snapshots 1 s apart of nodes of 8 GPUs, pod ``i`` alone on ``GPU-i``."""
    nodes = [
        (
            f"node-{n}",
            [
                GpuSample(
                    uuid=f"GPU-{i}", index=i % 8, model=H200, pods=[PodRef(namespace="ml", name=f"pod-{i}")]
                )
                for i in range(n * 8, min(pods, n * 8 + 8))
            ],
        )
        for n in range((pods + 7) // 8)
    ]
    for s in range(seconds):
        t = t0 + s
        for node, gpus in nodes:
            # Built without validation: the snapshot's parsing is the ingest's cost, not the book's.
            snapshot = Snapshot.model_construct(timestamp=t, gpus=gpus)
            readings = {
                gpu.uuid: {("ml", gpu.pods[0].name): Point(t, gpu_util=float((gpu.index + s) % 100))}
                for gpu in gpus
            }
            book.observe(node, snapshot, readings)
    asyncio.run(book.resolve_pending())


def run(pods: int, per_workload: int, seconds: int) -> dict[str, float]:
    """One case's figures (see the module doc)."""
    clock = [1_000_000.0]

    def new_book() -> AccountingBook:
        return AccountingBook(
            # Rows past their first scrape interval: the figures they export for the rest of their life.
            AccountingSettings(group_label="team", prices={H200: 3.5}, scrape_interval=0.0),
            OwnerResolver(Api(per_workload), group_label="team"),
            lambda: clock[0],
        )

    # Memory first, under tracemalloc (which slows every allocation): what the book holds per pod.
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held_book = new_book()
    fill(held_book, pods, 3, clock[0])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del held_book
    book = new_book()
    start = time.process_time()
    fill(book, pods, seconds, clock[0])
    observe = time.process_time() - start
    clock[0] += seconds
    registry = CollectorRegistry()
    registry.register(book)
    start = time.process_time()
    scrapes = 5
    for _ in range(scrapes):
        text = generate_latest(registry)
    scrape = (time.process_time() - start) / scrapes
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return {
        "rows": len(book.rows()),
        "series": series,
        "bytes": len(text),
        "scrape_ms": scrape * 1000,
        "memory_bytes_per_pod": held / pods,
        "observe_us": observe / (pods * seconds) * 1e6,
    }


def node_report(node: int, seq: int, t: float) -> NodeReport:
    """Node ``node``'s report of one snapshot at ``t``: 8 H200s, one pod each."""
    gpus = [
        GpuSample(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model=H200,
            utilization_gpu=float((node + i + seq) % 100),
            sm_active=float((node + i + seq) % 80),
            memory_used_bytes=8 * 2**30,
            memory_total_bytes=144 * 2**30,
            pods=[PodRef(namespace="ml", name=f"pod-{node * 8 + i}")],
        )
        for i in range(8)
    ]
    return NodeReport(
        schema_version=SCHEMA_VERSION,
        node=f"node-{node}",
        agent_id="bench",
        seq=seq,
        snapshots=[Snapshot(timestamp=t, gpus=gpus)],
    )


class Unbilled:
    """An accounting book that bills nothing: the ingest's cost without accounting's own."""

    def observe(self, *_: Any, **__: Any) -> None:
        pass


def ingest_cost(nodes: int, seconds: int) -> dict[str, float]:
    """CPU µs per report through ``ReportAdmission.accept``, with the accounting book and with one that
    bills nothing (the admission still gathers what the store took for it)."""
    t0 = 1_800_000_000.0
    clock = [t0]
    states: dict[str, ReportAdmission] = {}
    for name in ("with", "without"):
        admission = build_operator(OperatorConfig(), clock=lambda: clock[0]).ingest.admission
        if name == "without":
            admission.accounting = Unbilled()  # type: ignore[assignment]
        states[name] = admission
    spent = dict.fromkeys(states, 0.0)
    for s in range(seconds):
        batch = [node_report(n, s + 1, t0 + s) for n in range(nodes)]
        clock[0] = t0 + s + 0.5
        for name in ("with", "without") if s % 2 else ("without", "with"):
            accept = states[name].accept
            start = time.process_time()
            for report in batch:
                accept(report, report.node, clock[0])
            spent[name] += time.process_time() - start
    accounting = states["with"].accounting
    assert len(accounting.ledger.pods()) == nodes * 8  # every pod counted: the path was taken
    return {name: spent[name] / (nodes * seconds) * 1e6 for name in spent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--pods-per-workload", type=int, nargs="+", default=[8, 1])
    parser.add_argument(
        "--seconds", type=int, default=60, help="readings per pod, 1 s apart, timed (%(default)s)"
    )
    parser.add_argument(
        "--ingest-seconds", type=int, default=10, help="seconds of node reports through accept (%(default)s)"
    )
    args = parser.parse_args()
    print(
        f"{args.pods:,} pods on one H200 each, {args.seconds} snapshots each, a price set (4 counters a row)"
    )
    print(
        "| pods a workload | workloads (rows) | series on /metrics | series a pod | exposition "
        "| scrape (CPU) | book memory a pod | CPU a reading (with its snapshot's share) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for per in args.pods_per_workload:
        got = run(args.pods, per, args.seconds)
        print(
            f"| {per} | {got['rows']:,.0f} | {got['series']:,.0f} | {got['series'] / args.pods:.2f} | "
            f"{got['bytes'] / 1024:,.0f} KiB | {got['scrape_ms']:.0f} ms | "
            f"{got['memory_bytes_per_pod']:.0f} B | "
            f"{got['observe_us']:.2f} µs |"
        )

    nodes = max(1, args.pods // 8)
    cost = ingest_cost(nodes, args.ingest_seconds)
    print(f"\n{nodes:,} nodes of 8 GPUs, {args.ingest_seconds} reports each through ReportAdmission.accept")
    print("| CPU a report, without accounting | with | accounting's share |")
    print("|---|---|---|")
    extra = cost["with"] - cost["without"]
    share = 100 * extra / cost["without"]
    print(f"| {cost['without']:.0f} µs | {cost['with']:.0f} µs | +{extra:.0f} µs ({share:.0f}%) |")


if __name__ == "__main__":
    main()

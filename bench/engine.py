"""Benchmark of the policy engine: memory per tracked series, ingest rate, evaluations per second.

Not a test: it prints figures for docs/benchmarks.md. The default run is the
sizing case the operator is held to: 10,000 pod-GPU series, 1 s samples, a
policy with all four rule kinds, the longest a 30-minute memoryGrowth window.

    .venv/bin/python bench/engine.py                      # 10,000 series (about 3 minutes)
    .venv/bin/python bench/engine.py --series 1000        # a quick look
    .venv/bin/python bench/engine.py --gpus-per-pod 8     # 1,250 pods of 8 GPUs

Times are CPU seconds of this (single-threaded) process, from
``time.process_time``: what one core spends, and steadier than wall time on a
shared machine. Steady-state evaluation also shows wall time.

Phases:

1. **Memory.** A sample of series is filled with 1,800 points under
   ``tracemalloc`` (exact bytes per series), then every series is filled to
   1,800 points and again to the retention the policy needs (``horizon_seconds``)
   while the process's resident memory is read from ``/proc/self/status``.
2. **Ingest.** ``SeriesStore.add`` per point, and a node report of 8 GPUs for
   1 snapshot through ``points_from_report`` into the store, per report.
3. **Evaluation.** One cold evaluation (every memoryGrowth fit computed), then
   steady state: 10 s of new samples for every series, one evaluation, 18 times
   (two 90 s growth buckets), as the operator does at ``evaluationInterval: 10s``.
   Then each rule kind alone, per series.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

from gpuwarden.policy import (
    PodId,
    PodView,
    Point,
    PolicyEvaluator,
    SeriesKey,
    SeriesStore,
    WindowParams,
    evaluate_rule,
    horizon_seconds,
    points_from_report,
)
from gpuwarden.policy.rules.growth import GrowthCache, MemoryGrowth
from gpuwarden.policy.rules.memory_ceiling import MemoryCeiling
from gpuwarden.policy.rules.utilization import UtilizationCeiling, UtilizationFloor
from gpuwarden.policy.spec.model import LabelSelector, PolicySpec
from gpuwarden.wire.node import SCHEMA_VERSION, GpuSample, NodeReport, PodRef, Snapshot

T0 = 1_749_999_960.0
GI = 2**30
MI = 2**20
CARD = 141 * GI
SPEC = PolicySpec(
    selector=LabelSelector(match_labels=(("app", "llm"),)),
    rules=(
        UtilizationFloor(name="idle-gpu", percent=20, for_seconds=300),
        UtilizationCeiling(name="saturated", percent=95, for_seconds=120),
        MemoryCeiling(name="near-oom", for_seconds=60, percent=90),
        MemoryGrowth(name="leak", rate_bytes_per_second=100 * MI / 60, window_seconds=1800, min_fit=0.8),
    ),
)
Pattern = Callable[[random.Random, int], Point]


def _idle(rng: random.Random, i: int) -> Point:
    return Point(
        T0 + i,
        gpu_util=rng.uniform(0, 8),
        sm_active=rng.uniform(0, 4),
        mem_used=20 * GI,
        mem_total=CARD,
        power_w=rng.uniform(60, 80),
    )


def _busy(rng: random.Random, i: int) -> Point:
    return Point(
        T0 + i,
        gpu_util=rng.uniform(80, 100),
        sm_active=rng.uniform(50, 80),
        mem_used=60 * GI + rng.gauss(0, 200 * MI),
        mem_total=CARD,
        power_w=rng.uniform(400, 600),
    )


def _hot(rng: random.Random, i: int) -> Point:
    return Point(
        T0 + i,
        gpu_util=100.0,
        sm_active=rng.uniform(96, 100),
        mem_used=0.95 * CARD,
        mem_total=CARD,
        power_w=680.0,
    )


def _leak(rng: random.Random, i: int) -> Point:
    return Point(
        T0 + i,
        gpu_util=rng.uniform(30, 60),
        sm_active=rng.uniform(20, 40),
        mem_used=10 * GI + 3 * MI * i + rng.gauss(0, 300 * MI),
        mem_total=CARD,
        power_w=300.0,
    )


def _sawtooth(rng: random.Random, i: int) -> Point:
    return Point(
        T0 + i,
        gpu_util=rng.uniform(30, 60),
        sm_active=rng.uniform(20, 40),
        mem_used=10 * GI + (i % 300) * 30 * MI,
        mem_total=CARD,
        power_w=300.0,
    )


PATTERNS: tuple[Pattern, ...] = (_idle, _busy, _busy, _busy, _hot, _leak, _sawtooth, _busy)
VARIANTS = 4  # pre-generated noisy copies per pattern, shared by series (timestamps are shared anyway)


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pregenerate(points: int) -> list[list[Point]]:
    rng = random.Random(1)
    return [[pattern(rng, i) for i in range(points)] for pattern in PATTERNS for _ in range(VARIANTS)]


def keys_for(series: int, gpus_per_pod: int) -> list[SeriesKey]:
    return [SeriesKey("bench", f"pod-{n // gpus_per_pod:05d}", f"GPU-{n:05d}") for n in range(series)]


def fill(store: SeriesStore, keys: Sequence[SeriesKey], tracks: list[list[Point]], lo: int, hi: int) -> float:
    """Add points ``[lo, hi)`` of each key's track, time-major as reports arrive; return seconds taken."""
    chosen = [tracks[n % len(tracks)] for n in range(len(keys))]
    add = store.add
    start = time.process_time()
    for i in range(lo, hi):
        for key, track in zip(keys, chosen, strict=True):
            add(key, track[i])
    return time.process_time() - start


def measure_memory_exact(points: int) -> float:
    """Bytes per series by tracemalloc, over a sample of 200 series of ``points`` points."""
    sample = 200
    tracks = pregenerate(points)
    keys = keys_for(sample, 1)
    gc.collect()
    tracemalloc.start()
    store = SeriesStore(retention_seconds=points, max_points=points)
    before = tracemalloc.get_traced_memory()[0]
    fill(store, keys, tracks, 0, points)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / sample


def measure_report_ingest(reports: int = 2000) -> float:
    """Node reports (8 GPUs, 1 snapshot, one pod per GPU) per second through intake into a store."""
    store = SeriesStore(retention_seconds=600, max_points=600)
    built = []
    for r in range(reports):
        gpus = [
            GpuSample(
                uuid=f"GPU-{g}",
                index=g,
                utilization_gpu=50.0,
                sm_active=30.0,
                memory_used_bytes=10 * GI,
                memory_total_bytes=CARD,
                power_watts=300.0,
                pods=[PodRef(namespace="bench", name=f"pod-{g}")],
            )
            for g in range(8)
        ]
        snapshots = [Snapshot(timestamp=T0 + r, gpus=gpus)]
        built.append(
            NodeReport(schema_version=SCHEMA_VERSION, node="n", agent_id="a", seq=r, snapshots=snapshots)
        )
    start = time.process_time()
    for report in built:
        store.extend(points_from_report(report))
    return reports / (time.process_time() - start)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--series", type=int, default=10_000, help="pod-GPU series tracked")
    parser.add_argument("--gpus-per-pod", type=int, default=1)
    parser.add_argument("--steady", type=int, default=18, help="steady-state evaluations, 10 s apart")
    args = parser.parse_args(argv)

    window_points = 1800
    horizon = int(horizon_seconds(SPEC))
    n = args.series
    print(f"python {sys.version.split()[0]}; {n:,} series, {args.gpus_per_pod} GPU(s) per pod")
    print(f"policy: 4 rules, longest window 30m; store retention {horizon} s (horizon_seconds), 1 s samples")

    exact = measure_memory_exact(window_points)
    print(
        f"memory, tracemalloc, 200 series x {window_points} points: {exact / 1024:.1f} KiB per series"
        f" ({exact / window_points:.1f} B per point)"
    )

    tracks = pregenerate(horizon + 10 * (args.steady + 1))
    # The bench's own inputs (~70,000 Points, reused by every series) live all run long; freezing
    # them keeps them out of the cyclic GC's full passes, which the engine's own objects are not.
    gc.freeze()
    keys = keys_for(n, args.gpus_per_pod)
    store = SeriesStore(retention_seconds=horizon, max_points=horizon)
    gc.collect()
    rss0 = rss_bytes()
    took = fill(store, keys, tracks, 0, window_points)
    gc.collect()
    grown = rss_bytes() - rss0
    stats = store.stats()
    print(
        f"memory, RSS, {n:,} series x {window_points} points: {grown / 2**20:.0f} MiB,"
        f" {grown / n / 1024:.1f} KiB per series; getsizeof {stats.nbytes / n / 1024:.1f} KiB per series"
    )
    print(
        f"ingest, SeriesStore.add: {stats.points / took / 1e6:.2f} M points/s,"
        f" {took / stats.points * 1e6:.2f} µs each"
    )
    fill(store, keys, tracks, window_points, horizon)
    gc.collect()
    grown = rss_bytes() - rss0
    print(
        f"memory, RSS, {n:,} series x {horizon} points (the horizon): {grown / 2**20:.0f} MiB,"
        f" {grown / n / 1024:.1f} KiB per series"
    )
    print(f"ingest, 8-GPU node reports through points_from_report: {measure_report_ingest():,.0f} reports/s")

    pods = sorted({PodId(k.namespace, k.pod) for k in keys})
    views = [PodView(p.namespace, p.name, {"app": "llm"}) for p in pods]
    evaluator = PolicyEvaluator("bench/policy", SPEC, namespace="bench")
    now = T0 + horizon - 1
    start = time.process_time()
    result = evaluator.evaluate(views, store, now)
    cold = time.process_time() - start
    print(
        f"evaluation, cold (every growth fit): {cold:.2f} s,"
        f" {len(pods):,} pods, {len(result.active):,} findings"
    )

    steady = []
    wall = []
    t = horizon
    for _ in range(args.steady):
        fill(store, keys, tracks, t, t + 10)
        t += 10
        now = T0 + t - 1
        start, start_wall = time.process_time(), time.perf_counter()
        evaluator.evaluate(views, store, now)
        steady.append(time.process_time() - start)
        wall.append(time.perf_counter() - start_wall)
    mean = statistics.fmean(steady)
    print(
        f"evaluation, steady state every 10 s: CPU mean {mean:.3f} s,"
        f" median {statistics.median(steady):.3f} s, max {max(steady):.3f} s"
        f" (wall median {statistics.median(wall):.3f} s)"
    )
    print(
        f"  = {1 / mean:.2f} evaluations/s of {n:,} series, {n / mean:,.0f} series/s,"
        f" {mean / n * 1e6:.0f} µs per series"
    )

    params = WindowParams()
    series = {p: store.series_of(p.namespace, p.name) for p in pods}
    for rule in SPEC.rules:
        cache = GrowthCache()
        for rounds in (1, 2):  # growth: the second round hits the memo, as evaluations between buckets do
            start = time.process_time()
            for p in pods:
                evaluate_rule(rule, p, series[p], now, params, cache)
            each = (time.process_time() - start) / len(keys) * 1e6
            if rounds == 1 or isinstance(rule, MemoryGrowth):
                label = " (memoized)" if rounds == 2 else ""
                print(f"rule {type(rule).__name__}{label}: {each:.1f} µs per series")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Soak: a simulated fleet at 1,000 reports a second, with churning pods, for an hour (by default);
the operator's resident memory and open file descriptors every minute, and their slopes.

Not a test: a benchmark, recorded in docs/benchmarks.md. The server is what bench/ingest.py runs
(the operator's real ingest app, series store, Event poster and one evaluation loop per policy;
the API server replaced: TokenReviews answered locally, Events and status writes counted), in its
own process pinned to one CPU; the load is bench/ingest.py's (nodes of 8 GPUs, each sending one
1-snapshot report a second in the agent's wire format) from the other CPUs.

Pods churn as a Job's do: each lives ``--pod-lifetime`` (10 min; the pods' phases spread evenly,
so ~13 a second are replaced at the default size), then another of a new name takes its GPU: the
policies see the new one (findings of the gone pod resolve, ``PodGone``), and ``--deletion-lag``
later the server forgets the old one as the operator's pod-deletion handler does
(:meth:`Operator.forget_pod`). A report that lands after that (the load running late) leaves
an orphan series, which the store's pruning drops once past the retention: they are counted. The
store starts in its steady state: each pod's series pre-filled for its age, at most the retention
(10 min).

Every ``--sample-every`` seconds: the server's RSS (``/proc/<pid>/status`` VmRSS) and where it lives
(``/proc/<pid>/smaps``: glibc's heap, other anonymous mappings, the rest), the allocator's own
account (``--allocator``: by default jemalloc's, as the operator image runs: bytes live, in active
pages, resident, mapped and retained; with pymalloc its arenas now, at most and reclaimed, the bytes in
live blocks, free blocks and unused pools, Python's allocated blocks and glibc's ``mallinfo2``), the
collector's runs and seconds per generation, open file descriptors (``/proc/<pid>/fd``), with what it
holds (series, readings) and what it did (reports, Events, status writes). At the end, the
least-squares slope of RSS and of fds over the samples after ``--settle`` minutes, and of RSS and its
parts over the second half of the run, per hour, printed as JSON.

    .venv/bin/python bench/soak.py                    # 1 h
    .venv/bin/python bench/soak.py --minutes 10       # what docs/benchmarks.md reports

To find what grows: ``--count-objects`` (live objects by type, and the untracked ones by holder),
``--count-garbage`` (the cyclic garbage by type, collected each minute) or ``--tracemalloc``
(allocation sites; slows the server several times). Each changes what it measures: not for the
figures.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import heapq
import json
import multiprocessing as mp
import os
import re
import resource
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections import Counter, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import allocators
from aiohttp import web
from ingest import (
    GPUS,
    BenchApi,
    Bodies,
    Layout,
    Template,
    fetch_stats,
    policy_body,
    reading,
    serve_until_stopped,
    start_load,
)

from gpuwarden.operator.composition import Operator, build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints.reports import make_ingest_app
from gpuwarden.operator.memory import GlibcHeap, pace_collector
from gpuwarden.operator.policies.runner import PolicyRunner
from gpuwarden.operator.resources import PodRecord, PolicyKey
from gpuwarden.operator.state import MIN_RETENTION
from gpuwarden.policy.engine import PodView
from gpuwarden.policy.store.series import Point, SeriesKey

GOLDEN = 0.6180339887498949
"""Spreads the pods' phases evenly over a lifetime (the golden-ratio sequence)."""


@dataclass(frozen=True)
class ChurningLayout(Layout):
    """bench/ingest.py's fleet, each GPU's pod replaced every ``lifetime`` seconds: the layout as
    of time ``at`` (epoch seconds; ``origin`` is the run's, shared by every process)."""

    lifetime: float = 600.0
    origin: float = 0.0
    at: float = 0.0

    def phase(self, node: int, gpu: int) -> float:
        return ((node * GPUS + gpu) * GOLDEN % 1.0) * self.lifetime

    def generation(self, node: int, gpu: int, t: float) -> int:
        return int((t - self.origin + self.phase(node, gpu)) // self.lifetime)

    def born(self, node: int, gpu: int, t: float) -> float:
        """When the pod on that GPU at ``t`` started."""
        return self.origin - self.phase(node, gpu) + self.generation(node, gpu, t) * self.lifetime

    def pod(self, node: int, gpu: int) -> str:
        return f"job-{node}-{gpu}-{self.generation(node, gpu, self.at)}"


class ChurningBodies(Bodies):
    """A node's report names the pods on its GPUs now: its template is rebuilt when one changes."""

    layout: ChurningLayout

    def __init__(self, layout: ChurningLayout) -> None:
        super().__init__(layout)
        self._built: dict[int, tuple[tuple[int, ...], Template]] = {}

    def __call__(self, node: int, seq: int, t: float) -> bytes:
        generations = tuple(self.layout.generation(node, gpu, t) for gpu in range(GPUS))
        built = self._built.get(node)
        if built is None or built[0] != generations:
            built = self._built[node] = (generations, Template(replace(self.layout, at=t), node))
        return built[1].body(seq, t)


# -- the server ---------------------------------------------------------------------------------


class Fleet:
    """The pods the server's policies see, replaced as they churn (what Kopf's pod index and the
    pod-deletion handler do in the operator)."""

    def __init__(self, operator: Operator, layout: ChurningLayout) -> None:
        self.operator = operator
        self.state = operator.state
        self.layout = layout
        self.pods: dict[str, list[PodRecord]] = {}
        self._slots: dict[tuple[int, int], int] = {}
        self._due: list[tuple[float, int, int]] = []
        self.deleting: deque[tuple[float, str, str]] = deque()
        """Replaced pods whose deletion has not reached the operator yet: (when it will, namespace, name)."""
        self.replaced = 0
        now = time.time()
        for node in range(layout.nodes):
            ns = layout.namespace(node)
            for gpu in range(GPUS):
                records = self.pods.setdefault(ns, [])
                self._slots[node, gpu] = len(records)
                records.append(self._record(node, gpu, now))
                heapq.heappush(self._due, (layout.born(node, gpu, now) + layout.lifetime, node, gpu))

    def _record(self, node: int, gpu: int, t: float) -> PodRecord:
        ns, name = self.layout.namespace(node), replace(self.layout, at=t).pod(node, gpu)
        return PodRecord(PodView(ns, name, {"gpu": "yes"}), f"uid-{name}")

    def prefill(self, history: float, now: float) -> int:
        """Each pod's readings since it started (at most ``history`` seconds): the store's steady state."""
        added = 0
        total = 141 * 2**30
        for (node, gpu), slot in self._slots.items():
            record = self.pods[self.layout.namespace(node)][slot]
            key = SeriesKey(record.view.namespace, record.view.name, self.layout.uuid(node, gpu))
            t = max(self.layout.born(node, gpu, now), now - history)
            while t < now - 1:
                util, mem = reading(node, gpu, t)
                added += self.state.store.add(
                    key, Point(t=t, gpu_util=util, sm_active=util, mem_used=mem, mem_total=total)
                )
                t += 1.0
        return added

    async def churn(self, deletion_lag: float) -> None:
        """Replace each pod when its lifetime is over (the policies see the new one), and forget the
        old one ``deletion_lag`` seconds later, when its deletion reaches the operator."""
        deletions = self.deleting
        while True:
            now = time.time()
            while self._due and self._due[0][0] <= now:
                due, node, gpu = heapq.heappop(self._due)
                records = self.pods[self.layout.namespace(node)]
                slot = self._slots[node, gpu]
                old = records[slot].view
                deletions.append((due + deletion_lag, old.namespace, old.name))
                # Named as of mid-life: the generation's boundary itself is a float comparison away.
                records[slot] = self._record(node, gpu, due + self.layout.lifetime / 2)
                self.replaced += 1
                heapq.heappush(self._due, (due + self.layout.lifetime, node, gpu))
            while deletions and deletions[0][0] <= now:
                _, namespace, name = deletions.popleft()
                self.operator.forget_pod(namespace, name)
            await asyncio.sleep(0.2)


async def serve(args: argparse.Namespace, layout: ChurningLayout, port_queue: Any, stop_event: Any) -> None:
    baseline: list[tracemalloc.Snapshot] = []
    counted: list[Counter[str]] = []
    api = BenchApi()
    heap = GlibcHeap.open()
    operator = build_operator(OperatorConfig(node_rate=20.0, max_body_bytes=8 * 2**20), api=api)  # type: ignore[arg-type]
    pace_collector()  # as `gpuwarden operator` does once the operator is built
    state, metrics, events = operator.state, operator.parts.metrics, operator.lifecycle.events
    operator.parts.shard.active = True
    fleet = Fleet(operator, layout)
    started = time.time()
    points = fleet.prefill(MIN_RETENTION, started)
    print(f"server: prefilled {points} readings in {time.time() - started:.1f}s", file=sys.stderr, flush=True)
    if args.tracemalloc:
        tracemalloc.start(4)  # after the prefill, which it would slow tenfold

    # What Lifecycle runs in the operator (the pruning, the accounting, which resolves each new pod's
    # workload and retires the pods gone silent, and the collector's and heap's upkeep), and the churn.
    work = dict(operator.lifecycle.tasks)
    background = [events.run(), fleet.churn(args.deletion_lag), *(run() for run in work.values())]
    tasks = [asyncio.create_task(t) for t in background]
    # The runners as the soak has always run them: neither scaling nor reclaiming.
    parts = replace(operator.parts, scaler=None, reclaimer=None)
    tasks += [
        asyncio.create_task(
            PolicyRunner(parts, PolicyKey(ns, "gpus")).run(
                body=policy_body(ns, args.interval), pods=fleet.pods, policies={}
            )
        )
        for ns in layout.namespaces
    ]
    died: list[str] = []
    # The collector's time by generation (its runs pause the server: they are on its hot path).
    collecting: list[float] = [0.0, 0.0, 0.0]
    began: list[float] = [0.0]

    def time_collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collecting[info["generation"]] += time.perf_counter() - began[0]

    gc.callbacks.append(time_collector)

    def report_death(task: asyncio.Task[Any]) -> None:
        # A loop that raised would otherwise die unseen, and the soak would go on measuring a server
        # that no longer judges (it happened: every policy's loop stopped at minute 10).
        if not task.cancelled() and task.exception() is not None:
            died.append(repr(task.exception()))
            task.print_stack(file=sys.stderr)
            traceback.print_exception(task.exception(), file=sys.stderr)

    for task in tasks:
        task.add_done_callback(report_death)

    async def stats(request: web.Request) -> web.Response:
        metrics.exposition()  # a scrape, as Prometheus makes (it ages out the per-pod gauges)
        growth: list[str] = []
        recent: list[str] = []
        if args.tracemalloc:
            snapshot = tracemalloc.take_snapshot()
            if not baseline:
                baseline.append(snapshot)
            growth = _growth(snapshot, baseline[0])
            # What grew since the last sample: past the stores' warm-up, only what keeps growing.
            recent = _growth(snapshot, baseline[-1])
            baseline[1:] = [snapshot]
        if args.count_objects:
            holders: Counter[str] = Counter()
            counts = _objects_by_type(holders)
            counts.update({f"held {k}": n for k, n in holders.items()})
            if not counted:
                counted.append(counts)
            growth = _count_growth(counts, counted[0])
            recent = _count_growth(counts, counted[-1])
            counted[1:] = [counts]
        get = metrics.registry.get_sample_value
        generations = gc.get_stats()
        store = state.store.stats()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        alive = {(r.view.namespace, r.view.name) for records in fleet.pods.values() for r in records}
        alive.update((namespace, name) for _, namespace, name in fleet.deleting)
        return web.json_response(
            {
                "now": time.time(),
                "cpu": usage.ru_utime + usage.ru_stime,
                "received": get("gpuwarden_operator_reports_total"),
                "points": get("gpuwarden_operator_points_total"),
                "series": store.series,
                "held": store.points,
                # Python's own objects, counted: flat while RSS rises means the C allocator keeps pages.
                "python_blocks": sys.getallocatedblocks(),
                "malloc_mib": _malloc_info(heap),
                "pymalloc": _pymalloc() if args.allocator == "pymalloc" else {},
                "jemalloc_mib": _jemalloc() if args.allocator == "jemalloc" else {},
                # The collector's generations: how often the oldest is collected decides how long
                # cyclic garbage waits.
                "gc_collections": [g["collections"] for g in generations],
                "gc_collected": [g["collected"] for g in generations],
                "gc_seconds": [round(c, 3) for c in collecting],
                "gc_garbage": _garbage() if args.count_garbage else [],
                # Series of pods that are gone: a report that landed after its pod's deletion.
                "orphans": sum(1 for k in state.store.keys() if (k.namespace, k.pod) not in alive),  # noqa: SIM118
                "replaced_pods": fleet.replaced,
                "events": api.events,
                "status_writes": api.status_writes,
                "events_pending": events.pending,
                "growth": growth,
                "growth_since_last": recent,
                "died": died,
            }
        )

    app = make_ingest_app(operator.ingest)
    app.router.add_get("/bench/stats", stats)
    await serve_until_stopped(app, port_queue, stop_event)
    for task in tasks:
        task.cancel()


def _growth(snapshot: tracemalloc.Snapshot, since: tracemalloc.Snapshot) -> list[str]:
    """The six allocation sites that grew most from ``since`` to ``snapshot``."""
    return [
        f"{d.size_diff / 2**20:+.2f} MiB {d.count_diff:+d} blocks: "
        + " < ".join(f"{f.filename.rpartition('/')[2]}:{f.lineno}" for f in reversed(d.traceback))
        for d in snapshot.compare_to(since, "traceback")[:6]
    ]


def _objects_by_type(holders: Counter[str] | None = None) -> Counter[str]:
    """Live objects by type: those the collector tracks and what they hold that it does not (floats,
    strings, ints, bytes, tuples of such), each counted once. Blind to objects only C code holds.
    ``holders``, when given, gets the untracked objects counted by who holds them: ``int<dict<Usage``
    (the type, its holder's, and that holder's holder where it is a dict, list or tuple)."""
    # Listed before the counter makes anything of its own, so that its id set and tables are not
    # among what it counts.
    tracked = gc.get_objects()
    seen = {id(obj) for obj in tracked}
    owner: dict[int, str] = {}
    if holders is not None:
        for obj in tracked:
            if type(obj) not in (dict, list, tuple, set):
                for ref in gc.get_referents(obj):
                    if type(ref) in (dict, list, tuple, set):
                        owner[id(ref)] = type(obj).__qualname__
    counts: Counter[str] = Counter()
    for obj in tracked:
        kind = type(obj).__qualname__
        counts[kind] += 1
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not gc.is_tracked(ref):
                seen.add(id(ref))
                name = type(ref).__qualname__
                counts[name] += 1
                if holders is not None:
                    holders[f"{name}<{kind}<{owner.get(id(obj), '?')}"] += 1
    del tracked
    return counts


def _malloc_info(heap: GlibcHeap | None) -> dict[str, float]:
    """glibc's own account of its heap (:class:`HeapUse`) in MiB; empty where there is no glibc."""
    if heap is None:
        return {}
    return {name: round(value / 2**20, 1) for name, value in heap.use()._asdict().items()}


def _jemalloc() -> dict[str, float]:
    """jemalloc's own account (``mallctl`` ``stats.*``, refreshed by an ``epoch``), in MiB: bytes the
    program holds (``allocated``), in pages with live objects (``active``), resident (``resident``),
    mapped, and unmapped but kept for reuse (``retained``)."""
    mallctl = ctypes.CDLL(None).mallctl
    epoch = ctypes.c_uint64(1)
    mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(8))
    out: dict[str, float] = {}
    for name in ("allocated", "active", "resident", "mapped", "retained"):
        value, size = ctypes.c_size_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if mallctl(f"stats.{name}".encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return {}
        out[name] = round(value.value / 2**20, 1)
    return out


def _pymalloc() -> dict[str, float]:
    """Python's small-object allocator's own account (``sys._debugmallocstats``, which writes to the
    C stderr): its arenas (1 MiB each) now, at most so far and ever reclaimed, and of their bytes
    (MiB) those in live blocks, those free in used pools and the unused pools."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")

    def number(label: str) -> int:
        found = re.search(rf"^{re.escape(label)}\s*=\s*([\d,]+)", text, re.MULTILINE)
        return int(found.group(1).replace(",", "")) if found else -1

    unused = re.search(r"^(\d+) unused pools \* (\d+) bytes", text, re.MULTILINE)
    return {
        "arenas": number("# arenas allocated current"),
        "arenas_highwater": number("# arenas highwater mark"),
        "arenas_reclaimed": number("# arenas reclaimed"),
        "in_blocks_mib": round(number("# bytes in allocated blocks") / 2**20, 1),
        "free_blocks_mib": round(number("# bytes in available blocks") / 2**20, 1),
        "unused_pools_mib": round(int(unused.group(1)) * int(unused.group(2)) / 2**20, 1) if unused else -1,
    }


def _garbage() -> list[str]:
    """What a full collection now finds unreachable, by type (the ten commonest): the cyclic garbage
    waiting for the collector."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        counts = Counter(type(obj).__qualname__ for obj in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return [f"{n} {k}" for k, n in counts.most_common(10)]


def _count_growth(counts: Counter[str], since: Counter[str]) -> list[str]:
    """The twelve types whose live count grew most from ``since`` to ``counts``."""
    diffs = sorted(((n - since[k], k) for k, n in counts.items()), reverse=True)[:12]
    return [f"{d:+d} {k} ({counts[k]})" for d, k in diffs]


def server_main(args: argparse.Namespace, layout: ChurningLayout, port_queue: Any, stop_event: Any) -> None:
    os.sched_setaffinity(0, {args.server_cpu})
    asyncio.run(serve(args, layout, port_queue, stop_event))


# -- the run ------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def rss_by_region(pid: int) -> dict[str, float]:
    """Where the RSS lives, in MiB: glibc's main heap (``[heap]``, what ``malloc`` takes below its mmap
    threshold on the main thread), other anonymous mappings (pymalloc's arenas, large buffers, other
    threads' malloc arenas) and the rest (code, libraries, stacks)."""
    regions = {"heap": 0, "anon": 0, "other": 0}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: range perms ... [name]
            name = fields[5] if len(fields) > 5 else ""
        elif fields[0] == "Rss:":
            regions["heap" if name == "[heap]" else "anon" if name == "" else "other"] += int(fields[1])
    return {region: round(kib / 1024, 1) for region, kib in regions.items()}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) pairs, per hour (0.0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return 3600.0 * sxy / sxx if sxx else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the fleet reports (60)")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes, one report a second each (1000)")
    parser.add_argument("--nodes-per-policy", type=int, default=100)
    parser.add_argument("--interval", default="10s", help="the policies' evaluationInterval")
    parser.add_argument("--pod-lifetime", type=float, default=600.0, help="seconds each pod lives (600)")
    parser.add_argument(
        "--deletion-lag",
        type=float,
        default=5.0,
        help="seconds from a pod's last report to its deletion reaching the operator (5; the kubelet "
        "stops it first); 0: the deletion can come first, and a late report leaves an orphan series",
    )
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples (60)")
    parser.add_argument("--settle", type=float, default=1.0, help="minutes left out of the slopes (1)")
    parser.add_argument("--connections", type=int, default=256, help="client connections in all")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--load-processes", type=int, default=0, help="default: one per other CPU")
    parser.add_argument("--out", type=Path, help="also write the samples here, one JSON object a line")
    allocators.add_argument(parser)
    # One way of finding what grows at a time: each fills the samples' growth lists.
    finders = parser.add_mutually_exclusive_group()
    finders.add_argument(
        "--tracemalloc",
        action="store_true",
        help="trace the server's allocations (slower); each sample then names the top growth since the "
        "first sample and since the one before",
    )
    finders.add_argument(
        "--count-objects",
        action="store_true",
        help="count the server's live objects by type at each sample (a second or two each, without "
        "tracemalloc's slowing of every allocation); each sample then names the types that grew most",
    )
    parser.add_argument(
        "--count-garbage",
        action="store_true",
        help="at each sample, collect the cyclic garbage and name it by type (collecting it each minute "
        "changes what the run measures: for finding what makes cycles, not for the figures)",
    )
    args = parser.parse_args()
    if args.minutes <= args.settle:
        parser.error(f"--minutes {args.minutes:g} leaves no sample after --settle {args.settle:g}")
    args.mode = "steady"  # what bench/ingest.py's load reads
    # Plain HTTP: the soak measures what the operator holds over time, not the TLS handshake's cost
    # (bench/ingest.py --tls measures that).
    args.tls_dir = ""
    args.seconds = args.minutes * 60 + 5

    cpus = sorted(os.sched_getaffinity(0))
    others = [c for c in cpus if c != args.server_cpu] or cpus
    processes = args.load_processes or len(others)
    args.connections = max(processes, args.connections - args.connections % processes)
    origin = time.time()
    layout = ChurningLayout(args.nodes, args.nodes_per_policy, lifetime=args.pod_lifetime, origin=origin)

    ctx = mp.get_context("spawn")
    port_queue, result_queue, stop_event = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=server_main, args=(args, layout, port_queue, stop_event))
    port = allocators.start_server(server, args.allocator, port_queue, timeout=900)
    server_pid = server.pid
    assert server_pid is not None  # started
    start = time.time() + 2.0
    loaders = start_load(ctx, args, port, others, result_queue, start, ChurningBodies(layout))

    samples: list[dict[str, Any]] = []
    out = args.out.open("w") if args.out else None
    previous: dict[str, Any] | None = None
    minute = 0
    while True:
        due = start + minute * args.sample_every
        time.sleep(max(0.0, due - time.time()))  # the sampling clock of a benchmark, not a test
        dead = [p.exitcode for p in loaders if p.exitcode is not None]
        if dead:
            # A load process that died leaves a fleet of zero reports a second: an hour of samples
            # that measure nothing. Say so now rather than at the end.
            stop_event.set()
            raise SystemExit(f"soak: a load process exited early ({dead}); see its traceback above")
        stats = fetch_stats(port)
        sample = {
            "minute": round((stats["now"] - start) / 60, 2),
            "rss_mib": round(rss_mib(server_pid), 1),
            **{f"{region}_mib": mib for region, mib in rss_by_region(server_pid).items()},
            "python_blocks": stats["python_blocks"],
            "malloc_mib": stats["malloc_mib"],
            "pymalloc": stats["pymalloc"],
            "jemalloc_mib": stats["jemalloc_mib"],
            "gc_collections": stats["gc_collections"],
            "gc_collected": stats["gc_collected"],
            "gc_seconds": stats["gc_seconds"],
            "gc_garbage": stats["gc_garbage"],
            "open_fds": open_fds(server_pid),
            "series": stats["series"],
            "readings_held": stats["held"],
            "orphan_series": stats["orphans"],
            "replaced_pods": stats["replaced_pods"],
            "events": stats["events"],
            "status_writes": stats["status_writes"],
            "events_pending": stats["events_pending"],
        }
        if stats["died"]:
            stop_event.set()
            raise SystemExit(f"soak: the server's loops died: {stats['died']}; see the traceback above")
        if stats["growth"]:
            sample["growth"] = stats["growth"]
            sample["growth_since_last"] = stats["growth_since_last"]
        if previous is not None:
            wall = stats["now"] - previous["now"]
            sample["reports_per_s"] = round((stats["received"] - previous["received"]) / wall, 1)
            sample["server_cpu_share"] = round((stats["cpu"] - previous["cpu"]) / wall, 3)
        previous = stats
        samples.append(sample)
        print(json.dumps(sample), file=sys.stderr, flush=True)
        if out is not None:
            print(json.dumps(sample), file=out, flush=True)
        if sample["minute"] >= args.minutes - 1e-6 or minute * args.sample_every >= args.minutes * 60:
            break
        minute += 1

    results = [result_queue.get(timeout=300) for _ in loaders]
    for p in loaders:
        p.join()
    stop_event.set()
    server.join(timeout=60)

    settled = [s for s in samples if s["minute"] >= args.settle]
    statuses: dict[str, int] = {}
    for r in results:
        for code, count in r["statuses"].items():
            statuses[str(code)] = statuses.get(str(code), 0) + count
    rates = [s["reports_per_s"] for s in samples if "reports_per_s" in s]

    def spread(name: str) -> dict[str, float]:
        return {"min": min(s[name] for s in settled), "max": max(s[name] for s in settled)}

    def slope(name: str, over: list[dict[str, Any]] = settled) -> float:
        return round(slope_per_hour([(s["minute"] * 60, s[name]) for s in over]), 2)

    # The target (issue 27): under 1 MiB/h over the second half, past the warm-up of every store.
    second_half = [s for s in samples if s["minute"] >= args.minutes / 2]

    summary = {
        "minutes": args.minutes,
        "nodes": args.nodes,
        "gpus_per_node": GPUS,
        "pod_lifetime_s": args.pod_lifetime,
        "replaced_pods": samples[-1]["replaced_pods"],
        "reports_per_s_mean": round(sum(rates) / len(rates), 1) if rates else None,
        "statuses": statuses,
        "slopes_over_minutes": [settled[0]["minute"], settled[-1]["minute"]],
        "rss_mib": {"first": samples[0]["rss_mib"], **spread("rss_mib"), "last": samples[-1]["rss_mib"]},
        "rss_slope_mib_per_hour": slope("rss_mib"),
        "second_half_minutes": [second_half[0]["minute"], second_half[-1]["minute"]],
        "rss_slope_second_half_mib_per_hour": slope("rss_mib", second_half),
        # Which part of the RSS moved in the second half, and whether Python's objects did.
        "second_half_slopes_per_hour": {
            key: slope(key, second_half) for key in ("heap_mib", "anon_mib", "other_mib", "python_blocks")
        },
        "open_fds": spread("open_fds"),
        "fds_slope_per_hour": slope("open_fds"),
        "series": spread("series"),
        "series_slope_per_hour": slope("series"),
        "orphan_series": spread("orphan_series"),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

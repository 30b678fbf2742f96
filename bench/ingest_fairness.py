"""Whether large reports starve a small one: a live report's latency while replays pour in.

Not a test: a benchmark, recorded in docs/benchmarks.md. One process runs the operator's
real ingest app (``POST /v1/reports`` over TCP: TokenReview cache, rate limit, parsing,
series store; the TokenReviews answered locally, each token bound to its node as a
projected token is). Another keeps ``--bulk`` connections busy, each posting large
reports (``--snapshots`` snapshots of 8 GPUs, about 4.5 kB a snapshot: a replay after an
outage) from a node of its own, back to back. A third posts one live report (one
snapshot) every ``--probe-interval`` and records how long the answer takes. Nodes, pods and
reports are bench/ingest.py's. First
``--seconds`` without the bulk load (the baseline), then as long with it.

    .venv/bin/python bench/ingest_fairness.py --bulk 10 --snapshots 230 --seconds 20
    .venv/bin/python bench/ingest_fairness.py --bulk 10 --snapshots 1200 --max-body-bytes 8Mi --seconds 20

230 snapshots (1 MB) is the largest report the default ``--max-body-bytes`` takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ingest.py's server parts

import allocators
from aiohttp import web
from ingest import TOKEN_PREFIX, BenchApi, Layout, exchange, node_gpus, pod_nodes

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig, parse_size
from gpuwarden.operator.endpoints.reports import make_ingest_app
from gpuwarden.operator.memory import pace_collector
from gpuwarden.wire.node import NodeReport, Snapshot, dump_report


def report_body(layout: Layout, node: int, seq: int, snapshots: int, t_end: float) -> bytes:
    gpus = node_gpus(layout, node)
    snaps = [Snapshot(timestamp=t_end - snapshots + i, gpus=gpus) for i in range(snapshots)]
    report = NodeReport(
        schema_version=1, node=layout.node(node), agent_id=f"a-{node}", seq=seq, snapshots=snaps
    )
    return dump_report(report)


def token(layout: Layout, node: int) -> str:
    return TOKEN_PREFIX + layout.node(node)


def serve(port_queue: Any, stop: Any, layout: Layout, max_body: str) -> None:
    async def main() -> None:
        config = OperatorConfig(max_body_bytes=parse_size(max_body, flag="--max-body-bytes"))
        operator = build_operator(config, api=BenchApi())  # type: ignore[arg-type]
        pace_collector()  # as `gpuwarden operator` does once the operator is built
        operator.parts.shard.active = True
        operator.state.pod_nodes, operator.state.pods_synced = pod_nodes(layout), True
        runner = web.AppRunner(make_ingest_app(operator.ingest), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port_queue.put(runner.addresses[0][1])
        await asyncio.to_thread(stop.wait)
        await runner.cleanup()

    asyncio.run(main())


def bulk(
    port: int, args: argparse.Namespace, layout: Layout, ready: Any, start: Any, stop: Any, out: Any
) -> None:
    async def one(node: int) -> tuple[int, dict[int, int]]:
        # The body is built once, its seq left open: the client costs the server's CPUs little.
        # (Later reports repeat the snapshots: parsed and attributed in full, not stored again.)
        mark = 987_654_321
        head, _, tail = report_body(layout, node, mark, args.snapshots, time.time()).partition(b"%d" % mark)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        statuses: dict[int, int] = {}
        opened.append(node)
        if len(opened) == args.bulk:
            ready.set()  # every connection open, every body built: the probe may start
        await asyncio.to_thread(start.wait)
        sent = 0
        while not stop.is_set():
            status = await exchange(reader, writer, b"%s%d%s" % (head, sent, tail), token(layout, node))
            statuses[status] = statuses.get(status, 0) + 1
            sent += 1
        writer.close()
        return len(head) + len(tail), statuses

    opened: list[int] = []

    async def main() -> None:
        results = await asyncio.gather(*(one(1 + i) for i in range(args.bulk)))
        statuses: dict[int, int] = {}
        for _, s in results:
            for k, v in s.items():
                statuses[k] = statuses.get(k, 0) + v
        out.put({"bulk_body_bytes": results[0][0] if results else 0, "bulk_statuses": statuses})

    asyncio.run(main())


async def probe(port: int, args: argparse.Namespace, layout: Layout, seconds: float) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    latencies: list[float] = []
    seq = int(time.time() * 1000)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        body = report_body(layout, 0, seq, 1, time.time())
        started = time.perf_counter()
        status = await exchange(reader, writer, body, token(layout, 0))
        latencies.append(time.perf_counter() - started)
        assert status == 200, status
        seq += 1
        await asyncio.sleep(args.probe_interval)
    writer.close()
    return latencies


def summary(latencies: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    return {
        "count": len(ms),
        "mean": round(statistics.fmean(ms), 2),
        "p50": round(statistics.median(ms), 2),
        "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "max": round(ms[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk", type=int, default=10, help="parallel connections posting large reports")
    parser.add_argument("--snapshots", type=int, default=230, help="snapshots per large report")
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase")
    parser.add_argument("--probe-interval", type=float, default=0.1)
    parser.add_argument(
        "--max-body-bytes",
        default=str(OperatorConfig().max_body_bytes),
        help="the operator's (%(default)s bytes)",
    )
    allocators.add_argument(parser)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    port_queue, out = ctx.Queue(), ctx.Queue()
    stop, ready, start, bulk_stop = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    layout = Layout(nodes=args.bulk + 1, nodes_per_policy=args.bulk + 1)
    server = ctx.Process(target=serve, args=(port_queue, stop, layout, args.max_body_bytes))
    port = allocators.start_server(server, args.allocator, port_queue, timeout=60)
    try:
        baseline = asyncio.run(probe(port, args, layout, args.seconds))
        loader = ctx.Process(target=bulk, args=(port, args, layout, ready, start, bulk_stop, out))
        loader.start()
        ready.wait(timeout=300)
        start.set()
        loaded = asyncio.run(probe(port, args, layout, args.seconds))
        bulk_stop.set()
        result = out.get(timeout=120)
        loader.join(timeout=60)
    finally:
        stop.set()
        server.join(timeout=30)
    print(
        json.dumps(
            {
                "bulk_connections": args.bulk,
                "snapshots_per_bulk_report": args.snapshots,
                "max_body_bytes": args.max_body_bytes,
                **result,
                "live_report_latency_ms_alone": summary(baseline),
                "live_report_latency_ms_under_bulk": summary(loaded),
                "cpus": os.cpu_count(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

"""30,000 idle connections against the operator's ingest server, as on main and as now, side by side.

Not a test: a benchmark, recorded in docs/benchmarks.md (issue 27, break 5; the test with a lowered
limit is tests/integration/test_attacks_connections.py). For each variant the server is the
operator's real ingest app (bench/ingest.py's: TokenReviews answered locally) in its own process,
under a file-descriptor limit of ``--fd-limit`` (20,000, what the issue's attack used up), served

- ``main``: as the operator served it before issue 27 (aiohttp's defaults: keep-alive 3,630 s,
  no header timeout, no connection cap, the limit not raised);
- ``now``: through :func:`gpuwarden.serving.serve`, as the operator serves it (idle timeout, the
  cap under the limit, the least recently heard-from connection closed at the cap).

Then ``--flood`` connections are opened that never send a byte (from ``--flood-processes``
processes, over several loopback source addresses: one address has ~28,000 ephemeral ports), each
until established or a minute has passed, and held for ``--seconds``; meanwhile a good agent
(aiohttp's client, kept-alive connection, as the agent's sender) posts one report a second, and the
server itself opens one new outgoing connection a second, as Kopf's API client does (what failed
with "Too many open files" and made the operator exit). Printed: answers and latency of the good
agent, the outgoing connections that failed, the server's open descriptors and RSS, whether it is
alive, its connection figures.

    .venv/bin/python bench/idle_connections.py                 # 30,000 idle, 20 s, both variants
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import select
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import allocators
from aiohttp import web
from ingest import TOKEN_PREFIX, BenchApi

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints.reports import make_ingest_app
from gpuwarden.operator.memory import pace_collector
from gpuwarden.serving import ConnectionLimiter, connection_cap, raise_fd_limit, serve
from gpuwarden.wire.node import GpuSample, NodeReport, PodRef, Snapshot, dump_report

NODE = "good-node"


# -- the server ---------------------------------------------------------------------------------


async def _server(variant: str, fd_limit: int, port_queue: Any, stop: Any, stats_queue: Any) -> None:
    operator = build_operator(OperatorConfig(), api=BenchApi())  # type: ignore[arg-type]
    pace_collector()  # as `gpuwarden operator` does once the operator is built
    operator.parts.shard.active = True
    app = make_ingest_app(operator.ingest)
    limiter: ConnectionLimiter | None = None
    if variant == "now":
        limiter = ConnectionLimiter(connection_cap(raise_fd_limit()))
        limiter.count_accept_errors(asyncio.get_running_loop())
        runner = await serve(app, "127.0.0.1", 0, limiter=limiter)
    else:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
    outgoing = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    out_port = outgoing.sockets[0].getsockname()[1]
    failed: list[str] = []
    made = 0

    async def api_client() -> None:
        # What Kopf's API client needs now and then: a new connection.
        nonlocal made
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", out_port)
                writer.close()
                made += 1
            except OSError as exc:
                failed.append(str(exc))
            await asyncio.sleep(1.0)

    task = asyncio.create_task(api_client())
    port_queue.put(runner.addresses[0][1])
    peak_fds = peak_open = 0
    while not stop.is_set():
        await asyncio.sleep(0.2)
        try:
            fds: int | str = len(os.listdir("/proc/self/fd"))
            peak_fds = max(peak_fds, int(fds))
        except OSError as exc:  # itself needs a descriptor
            fds = str(exc)
        peak_open = max(peak_open, len(limiter) if limiter else 0)
        stats_queue.put(
            {
                "open_fds": fds,
                "peak_open_fds": peak_fds,
                "peak_connections_open": peak_open if limiter else None,
                "outgoing_made": made,
                "outgoing_failed": len(failed),
                "outgoing_error": failed[-1] if failed else None,
                "connections_open": len(limiter) if limiter else None,
                "connections_limit": limiter.limit if limiter else None,
                "evicted": limiter.evicted if limiter else None,
                "accept_errors": limiter.accept_errors if limiter else None,
            }
        )
    task.cancel()
    await runner.cleanup()


def server_main(variant: str, fd_limit: int, port_queue: Any, stop: Any, stats_queue: Any) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The hard limit too: "main" never raised its soft limit, and "now" may raise it only this far.
    resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, min(hard, fd_limit)))
    asyncio.run(_server(variant, fd_limit, port_queue, stop, stats_queue))


# -- the flood ----------------------------------------------------------------------------------


def flood_main(port: int, count: int, first_source: int, ready: Any, stop: Any, connected: Any) -> None:
    """``count`` connections to ``port`` that never send, from 127.0.0.<first_source...>; ``ready``
    once each is established (or after a minute), ``connected`` then says how many were."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks: dict[int, socket.socket] = {}
    poll = select.epoll()
    per_source = 20_000
    for i in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((f"127.0.0.{first_source + i // per_source}", 0))
        s.connect_ex(("127.0.0.1", port))
        socks[s.fileno()] = s
        poll.register(s.fileno(), select.EPOLLOUT)
    waiting, done = set(socks), 0
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:
        for fd, _ in poll.poll(1.0):
            poll.unregister(fd)
            waiting.discard(fd)
            done += socks[fd].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    connected.value = done
    ready.set()
    stop.wait()
    for s in socks.values():
        s.close()


# -- the good agent -----------------------------------------------------------------------------


def _report(seq: int) -> bytes:
    sample = GpuSample(
        uuid="GPU-good",
        index=0,
        utilization_gpu=50.0,
        temperature_c=40.0,
        power_watts=100.0,
        memory_used_bytes=2**30,
        pods=[PodRef(namespace="default", name="p")],
    )
    report = NodeReport(
        schema_version=1,
        node=NODE,
        agent_id="bench",
        seq=seq,
        snapshots=[Snapshot(timestamp=time.time(), gpus=[sample])],
    )
    return dump_report(report)


async def good_agent(port: int, seconds: float) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/v1/reports"
    headers = {"Authorization": f"Bearer {TOKEN_PREFIX}{NODE}", "Content-Type": "application/json"}
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        seq = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seq += 1
            started = time.monotonic()
            try:
                async with session.post(url, data=_report(seq), headers=headers) as rsp:
                    await rsp.read()
                    key = str(rsp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                key = type(exc).__name__
            latencies.append(time.monotonic() - started)
            statuses[key] = statuses.get(key, 0) + 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    latencies.sort()
    return {
        "statuses": statuses,
        "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
        "latency_max_ms": round(1000 * latencies[-1], 1),
    }


# -- the run ------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    port_queue, stats_queue, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=server_main, args=(variant, args.fd_limit, port_queue, stop, stats_queue))
    port = allocators.start_server(server, args.allocator, port_queue, timeout=60)
    baseline = asyncio.run(good_agent(port, 3))
    rss_before = rss_mib(server.pid)  # type: ignore[arg-type]
    flood_stop = ctx.Event()
    share = args.flood // args.flood_processes
    floods = []
    for i in range(args.flood_processes):
        ready, connected = ctx.Event(), ctx.Value("i", 0)
        p = ctx.Process(target=flood_main, args=(port, share, 2 + 2 * i, ready, flood_stop, connected))
        p.start()
        floods.append((p, ready, connected))
    for _, ready, _ in floods:
        ready.wait(timeout=120)
    established = sum(c.value for _, _, c in floods)
    during = asyncio.run(good_agent(port, args.seconds))
    alive = server.is_alive()
    rss_during = rss_mib(server.pid) if alive else None  # type: ignore[arg-type]
    last: dict[str, Any] = {}
    while not stats_queue.empty():
        last = stats_queue.get()
    flood_stop.set()
    for p, _, _ in floods:
        p.join(timeout=60)
    after = asyncio.run(good_agent(port, 3)) if server.is_alive() else None
    stop.set()
    server.join(timeout=30)
    if server.is_alive():
        server.kill()
    return {
        "variant": variant,
        "idle_connections": share * args.flood_processes,
        "established": established,
        "fd_limit": args.fd_limit,
        "good_agent_before": baseline,
        "good_agent_during": during,
        "good_agent_after": after,
        "server_alive_during": alive,
        "server_rss_mib": {"before": rss_before, "during": rss_during},
        "server": last,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=30_000, help="idle connections (30000)")
    parser.add_argument("--flood-processes", type=int, default=2, help="processes opening them (2)")
    parser.add_argument("--fd-limit", type=int, default=20_000, help="the server's descriptors (20000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the flood is held (20)")
    parser.add_argument("--variants", default="main,now")
    allocators.add_argument(parser)
    args = parser.parse_args()
    results = [run_variant(v, args) for v in args.variants.split(",")]
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

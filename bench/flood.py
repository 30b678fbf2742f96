"""Operator memory and good agents' latency under a flood of issue 27's attacks 3, 4 and 7.

Not a test: a benchmark, recorded in docs/benchmarks.md. For each attack, a fresh server process
runs the operator's real ingest app (``POST /v1/reports`` and ``POST /v1/verdicts`` over TCP:
TokenReview cache, rate limit, parsing, series and health stores, the verdict board; TokenReviews
answered locally, each agent token bound to its node as a projected token is) with its store
pruning running, and one policy's daemon open. ``--agents`` good agents post one live report a
second each (8 GPUs with their health, as bench/ingest.py's), and their answers' latency is
recorded. Phases: ``--baseline`` seconds of good agents alone, ``--attack`` seconds with the
attacker too, ``--after`` seconds alone again. The server's RSS (``/proc/<pid>/status``) is read
four times a second.

The attacks (the attacker posts back to back on ``--connections`` connections):

- ``health`` (3): one node's token; each report one snapshot of 64 GPUs with new UUIDs, each
  listing 48 pods that do not exist;
- ``gpus`` (4): one node's token; each report 10 snapshots of 64 new GPU UUIDs with the node's own
  pod on each;
- ``verdicts`` (7): the operator's own token; each report 2,000 pods' verdicts on a new invented
  namespace and policy.

    .venv/bin/python bench/flood.py --attack 60

Prints, per attack, baseline RSS (the end of the baseline), peak RSS during the attack, RSS at
the end of the after phase, the ratio of peak to baseline, the good agents' p50/p99 per phase
and the attacker's answers by status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ingest.py's server parts

import allocators
from aiohttp import web
from ingest import TOKEN_PREFIX, BenchApi, Layout, exchange, node_gpus, pod_nodes
from ingest_fairness import summary

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints.reports import make_ingest_app
from gpuwarden.operator.kube.tokenreview import TokenAuthenticator
from gpuwarden.operator.memory import pace_collector
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.sharding.exchange import VerdictIngest
from gpuwarden.wire.node import GpuSample, NodeReport, PodRef, Snapshot, dump_report
from gpuwarden.wire.verdicts import PodVerdict, RuleVerdict, VerdictReport, dump_verdicts

ATTACKS = ("health", "gpus", "verdicts")
OPERATOR = "system:serviceaccount:gpuwarden-system:gpuwarden-operator"
OPERATOR_TOKEN = "bench-operator-token"


def serve(port_queue: Any, stop: Any, layout: Layout) -> None:
    async def main() -> None:
        api = BenchApi()
        config = OperatorConfig()
        operator = build_operator(config, api=api)  # type: ignore[arg-type]
        pace_collector()  # as `gpuwarden operator` does once the operator is built
        state = operator.state
        operator.parts.shard.active = True
        state.pod_nodes, state.pods_synced = pod_nodes(layout), True
        state.open_policy(PolicyKey(layout.namespace(0), "gpus"))

        async def review(token: str, audiences: list[str]) -> dict[str, Any]:
            await asyncio.sleep(0.005)
            ok = token == OPERATOR_TOKEN
            return {"authenticated": ok, "audiences": audiences, "user": {"username": OPERATOR}}

        verdicts = VerdictIngest(
            authenticator=TokenAuthenticator(
                lambda token: review(token, ["gpuwarden-operator"]),
                audience="gpuwarden-operator",
                username=OPERATOR,
                pod_bound=False,
            ),
            board=operator.parts.board,
            metrics=operator.parts.metrics,
            acting=lambda: True,
            received=lambda report: state.schedule.nudge_policy_data(report.namespace, report.policy),
            max_body_bytes=config.max_body_bytes,
            known=state.runs_policy,
        )
        runner = web.AppRunner(make_ingest_app(operator.ingest, verdicts.handle), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        pruning = asyncio.create_task(operator.lifecycle.tasks["gpuwarden pruning"]())
        port_queue.put(runner.addresses[0][1])
        await asyncio.to_thread(stop.wait)
        pruning.cancel()
        await runner.cleanup()

    asyncio.run(main())


def token(layout: Layout, node: int) -> str:
    return TOKEN_PREFIX + layout.node(node)


def live_body(layout: Layout, node: int, seq: int) -> bytes:
    report = NodeReport(
        schema_version=2,
        node=layout.node(node),
        agent_id=f"a-{node}",
        seq=seq,
        snapshots=[Snapshot(timestamp=time.time(), gpus=node_gpus(layout, node))],
    )
    return dump_report(report)


async def good_agents(
    port: int, layout: Layout, agents: int, stop: asyncio.Event
) -> list[tuple[float, float]]:
    """Each agent posts one report a second until ``stop``; (when sent, latency) of each."""
    out: list[tuple[float, float]] = []

    async def agent(node: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        seq = 0
        await asyncio.sleep(node / agents)  # spread over the second
        while not stop.is_set():
            body = live_body(layout, node, seq)
            started = time.perf_counter()
            status = await exchange(reader, writer, body, token(layout, node))
            assert status == 200, status
            out.append((time.time(), time.perf_counter() - started))
            seq += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
        writer.close()

    await asyncio.gather(*(agent(n) for n in range(agents)))
    return out


def attack_body(kind: str, layout: Layout, attacker: int, seq: int) -> tuple[bytes, str, str]:
    """One attack request: body, path, token."""
    now = time.time()
    if kind == "verdicts":
        rule = RuleVerdict(
            rule="idle",
            kind="utilizationFloor",
            holds=True,
            clears=False,
            value=3.0,
            threshold=20.0,
            unit="%",
            message="x" * 200,
        )
        verdicts = VerdictReport(
            schema_version=1,
            shard="forged",
            at=now,
            namespace=f"invented-{secrets.token_hex(6)}",
            policy=f"nope-{secrets.token_hex(6)}",
            pods=[PodVerdict(pod=f"p-{i}", rules=[rule]) for i in range(2000)],
        )
        return dump_verdicts(verdicts), "/v1/verdicts", OPERATOR_TOKEN
    namespace = layout.namespace(attacker)
    if kind == "health":
        ghosts = [PodRef(namespace=namespace, name=f"ghost-{secrets.token_hex(4)}") for _ in range(48)]
        gpus = [GpuSample(uuid=f"GPU-{secrets.token_hex(16)}", index=i, pods=ghosts) for i in range(64)]
        snapshots = [Snapshot(timestamp=now, gpus=gpus)]
    else:
        own = [PodRef(namespace=namespace, name=layout.pod(attacker, 0))]
        snapshots = [
            Snapshot(
                timestamp=now - 10 + k,
                gpus=[
                    GpuSample(uuid=f"GPU-{secrets.token_hex(16)}", index=i, utilization_gpu=50.0, pods=own)
                    for i in range(64)
                ],
            )
            for k in range(10)
        ]
    report = NodeReport(
        schema_version=2, node=layout.node(attacker), agent_id="evil", seq=seq, snapshots=snapshots
    )
    return dump_report(report), "/v1/reports", token(layout, attacker)


def attacker_main(
    kind: str, port: int, layout: Layout, attacker: int, connections: int, stop: Any, out: Any
) -> None:
    async def one(c: int) -> dict[int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        statuses: dict[int, int] = {}
        seq = c * 10_000_000
        while not stop.is_set():
            body, path, tok = attack_body(kind, layout, attacker, seq)
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                % (path.encode(), tok.encode(), len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = next(
                (int(line[15:]) for line in head.split(b"\r\n") if line[:15].lower() == b"content-length:"), 0
            )
            if length:
                await reader.readexactly(length)
            statuses[status] = statuses.get(status, 0) + 1
            seq += 1
        writer.close()
        return statuses

    async def main() -> None:
        totals: dict[int, int] = {}
        for statuses in await asyncio.gather(*(one(c) for c in range(connections))):
            for k, v in statuses.items():
                totals[k] = totals.get(k, 0) + v
        out.put(totals)

    asyncio.run(main())


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_attack(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    layout = Layout(nodes=args.agents + 1, nodes_per_policy=args.agents + 1)
    attacker = args.agents  # the last node: its own pod job-N-0 is in the pod index
    port_queue, out = ctx.Queue(), ctx.Queue()
    stop, attack_stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=serve, args=(port_queue, stop, layout))
    port = allocators.start_server(server, args.allocator, port_queue, timeout=60)
    pid = server.pid
    assert pid is not None  # started
    samples: list[tuple[float, float]] = []
    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.is_set():
            samples.append((time.time(), rss_mib(pid)))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    at: dict[str, float] = {}

    async def phases() -> tuple[list[tuple[float, float]], dict[int, int]]:
        done = asyncio.Event()
        agents = asyncio.create_task(good_agents(port, layout, args.agents, done))
        at["start"] = time.time()
        await asyncio.sleep(args.baseline)
        at["attack_from"] = time.time()
        loader = ctx.Process(
            target=attacker_main, args=(kind, port, layout, attacker, args.connections, attack_stop, out)
        )
        loader.start()
        await asyncio.sleep(args.attack)
        attack_stop.set()
        statuses = await asyncio.to_thread(out.get, True, 120)
        loader.join(timeout=60)
        at["attack_to"] = time.time()
        await asyncio.sleep(args.after)
        at["end"] = time.time()
        done.set()
        return await agents, statuses

    try:
        latencies, statuses = asyncio.run(phases())
    finally:
        sampling.set()
        sampler.join()
        stop.set()
        server.join(timeout=30)
    start, attack_from, attack_to, end = at["start"], at["attack_from"], at["attack_to"], at["end"]

    def rss_in(lo: float, hi: float) -> list[float]:
        return [r for t, r in samples if lo <= t <= hi]

    baseline = rss_in(attack_from - 2, attack_from)[-1]
    peak = max(rss_in(attack_from, attack_to))
    after = rss_in(end - 2, end)[-1]

    def lat(lo: float, hi: float) -> dict[str, float]:
        return summary([d for t, d in latencies if lo <= t < hi])

    return {
        "attack": kind,
        "rss_mib": {
            "baseline": round(baseline, 1),
            "peak_during_attack": round(peak, 1),
            "after": round(after, 1),
            "peak_over_baseline": round(peak / baseline, 2),
        },
        "good_latency_ms": {
            "baseline": lat(start, attack_from),
            "during_attack": lat(attack_from, attack_to),
            "after": lat(attack_to, end),
        },
        "attacker_answers": statuses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, of %(default)s")
    parser.add_argument("--agents", type=int, default=20, help="good agents, one report a second each")
    parser.add_argument("--connections", type=int, default=4, help="the attacker's")
    parser.add_argument("--baseline", type=float, default=20.0)
    parser.add_argument("--attack", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=30.0)
    allocators.add_argument(parser)
    args = parser.parse_args()
    results = [run_attack(kind, args) for kind in args.attacks.split(",")]
    print(json.dumps({"results": results, "agents": args.agents, "cpus": os.cpu_count()}, indent=2))


if __name__ == "__main__":
    main()

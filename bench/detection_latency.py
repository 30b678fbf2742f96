"""Detection latency: from the moment a scripted condition has held for its ``for`` duration to the
Kubernetes Event, through the real agent, operator and API server, at the agent's default intervals.

Not a test: a benchmark, recorded in docs/benchmarks.md. It starts a throwaway control plane (etcd +
kube-apiserver, as the integration tests do), ``gpuwarden operator`` as its own process, and the agent
(its real sampler and report sender, ``--backend scripted``) in another process whose scenario origin is
fixed by this script, so the moment each condition starts is known to the millisecond.

Each simulated GPU (one pod each) holds 50% of its memory, then jumps to 96% at a staggered scenario
time ``at``; a ``memoryCeiling`` rule (90%, ``for: 10s``) fires when memory stayed above the line for
the whole window, i.e. when the condition has held for ``for``: at ``origin + at + for``. (A
utilization rule judges the window's mean, which can cross its threshold before the condition held
for the whole ``for``; the memory ceiling has no such head start.) The Event is timed when this script
receives it on a watch of the namespace's Events, so the figure includes the API server's write and
watch fan-out. Two figures:

- **from the condition**: Event seen - (origin + at + for): includes the agent's 1 s sampling
  (the first sample after the condition held may come up to 1 s later) and any wait for the report;
- **from the sample**: Event seen - timestamp of the first agent sample on which the rule could
  fire (more than ``for`` after the last sample before the condition): the sample's wait for its
  report (none at the default ``--report-interval``: the agent sends each sample as it takes it) +
  ingest + evaluation + Event.

    .venv/bin/python bench/detection_latency.py --gpus 32 --rounds 4
    .venv/bin/python bench/detection_latency.py --gpus 32 --rounds 4 --report-interval 1s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

FOR_SECONDS = 10.0
LEAD_IN = 15.0
"""Seconds before the first condition starts (the operator and agent settle)."""


# -- the agent, in its own process, with a known origin ----------------------------------------


def agent_main(args: argparse.Namespace) -> int:
    """Run the real agent (sampler, attribution, sender) on a scripted backend whose origin is given."""
    from gpuwarden.agent import app, command
    from gpuwarden.agent.config import AgentConfig
    from gpuwarden.agent.scripted import ScriptedBackend
    from gpuwarden.sim.scenario import load_scenario

    samples = open(args.samples, "w", buffering=1)  # noqa: SIM115 (closed at exit)

    class Recording(ScriptedBackend):
        def sample_devices(self, now: float) -> Any:
            samples.write(f"{now!r}\n")
            return super().sample_devices(now)

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    agent_args = parser.parse_args(
        [
            "--backend=scripted",
            f"--scenario={args.scenario}",
            f"--operator-url={args.url}",
            f"--token-file={args.token_file}",
            f"--node-name={args.node}",
            "--listen=127.0.0.1:0",
            "--hook-socket=",  # no training hooks here
            *([f"--report-interval={args.report_interval}"] if args.report_interval else []),
        ]
    )
    config = AgentConfig.from_args(agent_args)
    backend = Recording(load_scenario(args.scenario), origin=args.origin)
    backend.open()
    return asyncio.run(app.serve(config, backend))


# -- the run ------------------------------------------------------------------------------------


def scenario(namespace: str, node: int, gpus: int, onsets: list[float]) -> dict[str, Any]:
    uuid = [f"GPU-{node:04x}{i:04x}-0000-4000-8000-{node * 1000 + i:012d}" for i in range(gpus)]
    return {
        "name": "detection",
        "duration": "1h",
        "seed": node,
        "gpus": [
            {
                "uuid": uuid[i],
                "index": i,
                "memoryTotal": "143771Mi",
                "utilization": [{"kind": "idle", "level": 50, "noise": 2}],
                "memory": [
                    {"kind": "idle", "level": "70Gi"},
                    {"kind": "idle", "at": f"{round(onsets[i] * 1000)}ms", "level": "135Gi"},
                ],
            }
            for i in range(gpus)
        ],
        "pods": [
            {
                "namespace": namespace,
                "name": f"job-{node}-{i}",
                "container": "main",
                "labels": {"bench": "detection"},
                "gpus": [uuid[i]],
                "processes": [{"pid": 1000 + i, "command": "python serve.py"}],
            }
            for i in range(gpus)
        ],
    }


async def watch_events(
    cp: Any, namespace: str, seen: dict[str, float], posted: dict[str, float], want: int, done: asyncio.Event
) -> None:
    """Record when each pod's first GPUMemoryNearLimit Event arrives on a watch; set ``done`` at ``want``."""
    import aiohttp

    ctx = ssl.create_default_context(cafile=str(cp.ca_path))
    url = f"{cp.server}/api/v1/namespaces/{namespace}/events?watch=1"
    headers = {"Authorization": f"Bearer {cp.admin_token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers=headers, ssl=ctx, timeout=None) as rsp,
    ):
        while line := await rsp.content.readline():
            now = time.time()
            event = json.loads(line)["object"]
            involved = event.get("involvedObject", {})
            if involved.get("kind") == "Pod" and event.get("reason") == "GPUMemoryNearLimit":
                seen.setdefault(involved["name"], now)
                posted.setdefault(involved["name"], datetime.fromisoformat(event["eventTime"]).timestamp())
                if len(seen) >= want:
                    done.set()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_round(cp: Any, workdir: Path, args: argparse.Namespace, round_no: int) -> list[tuple[float, ...]]:
    from operator_support import (
        Operator,
        agent_token,
        apply,
        apply_crds,
        create_gpu_pod,
        create_peering,
        write_token,
    )

    namespace = cp.create_namespace(f"bench-detect-{round_no}-{secrets.token_hex(2)}")
    apply_crds(cp)
    create_peering(cp, namespace, "gpuwarden")
    spacing = args.spread / max(1, args.gpus)
    onsets = {
        node: [LEAD_IN + (node * args.gpus + i) * spacing / args.nodes + 0.137 * i for i in range(args.gpus)]
        for node in range(args.nodes)
    }
    for node in range(args.nodes):
        for i in range(args.gpus):
            create_gpu_pod(
                cp, namespace, f"job-{node}-{i}", {"bench": "detection"}, node=f"bench-node-{node}"
            )
    apply(
        cp,
        {
            "apiVersion": "gpuwarden.dev/v1alpha1",
            "kind": "GPUMonitorPolicy",
            "metadata": {"name": "near-oom", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"bench": "detection"}},
                "evaluationInterval": "1s",
                "rules": [{"name": "near-oom", "memoryCeiling": {"percent": 90, "for": f"{FOR_SECONDS:g}s"}}],
            },
        },
    )
    tokens = [
        write_token(workdir / f"token-{round_no}-{node}", agent_token(cp, namespace, f"bench-node-{node}"))
        for node in range(args.nodes)
    ]
    operator = Operator(cp, workdir, namespace, peering="gpuwarden", pod_name=f"bench-operator-{round_no}")
    agents: list[subprocess.Popen[bytes]] = []
    seen: dict[str, float] = {}
    posted: dict[str, float] = {}
    """When the operator announced each Event (its ``eventTime``, set as it queues it for posting)."""
    try:
        operator.wait_ready(timeout=90)
        origin = time.time() + 3.0
        for node in range(args.nodes):
            spec_file = workdir / f"scenario-{round_no}-{node}.json"
            spec_file.write_text(json.dumps(scenario(namespace, node, args.gpus, onsets[node])))
            argv = [
                sys.executable, __file__, "agent", f"--scenario={spec_file}", f"--url={operator.url}",
                f"--token-file={tokens[node]}", f"--node=bench-node-{node}", f"--origin={origin!r}",
                f"--samples={workdir / f'samples-{round_no}-{node}.txt'}",
                *([f"--report-interval={args.report_interval}"] if args.report_interval else []),
            ]  # fmt: skip
            log = (workdir / f"agent-{round_no}-{node}.log").open("wb")
            agents.append(
                subprocess.Popen(argv, env=cp.env | {"PYTHONPATH": str(ROOT)}, stdout=log, stderr=log)
            )

        async def watch() -> None:
            done = asyncio.Event()
            task = asyncio.create_task(
                watch_events(cp, namespace, seen, posted, args.nodes * args.gpus, done)
            )
            deadline = origin + max(max(o) for o in onsets.values()) + FOR_SECONDS + 20
            with contextlib.suppress(TimeoutError):  # the missing ones are reported below
                await asyncio.wait_for(done.wait(), timeout=deadline - time.time())
            task.cancel()

        asyncio.run(watch())
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait(timeout=15)
        operator.stop()

    results: list[tuple[float, ...]] = []
    for node in range(args.nodes):
        sample_times = sorted(
            float(x) for x in (workdir / f"samples-{round_no}-{node}.txt").read_text().split()
        )
        for i, onset in enumerate(onsets[node]):
            name = f"job-{node}-{i}"
            if name not in seen:
                print(f"round {round_no}: no Event for {name}", file=sys.stderr)
                continue
            start = origin + onset
            # The engine judges a window by its samples: it can fire on the first sample more than
            # `for` after the last sample taken before the condition started.
            last_low = max((t for t in sample_times if t < start), default=None)
            completing = next((t for t in sample_times if last_low and t > last_low + FOR_SECONDS), None)
            if last_low is None or completing is None:
                print(f"round {round_no}: {name}: no samples around the condition", file=sys.stderr)
                continue
            results.append(
                (seen[name] - (start + FOR_SECONDS), seen[name] - completing, posted[name] - completing)
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    agent = sub.add_parser("agent", help="(internal) one agent with a fixed scenario origin")
    agent.add_argument("--scenario", required=True)
    agent.add_argument("--url", required=True)
    agent.add_argument("--token-file", required=True)
    agent.add_argument("--node", required=True)
    agent.add_argument("--origin", type=float, required=True)
    agent.add_argument("--samples", required=True)
    for each in (agent, parser):
        each.add_argument(
            "--report-interval",
            metavar="DURATION",
            help="the agent's --report-interval (its default if not given)",
        )
    parser.add_argument("--gpus", type=int, default=32, help="GPUs (pods) per simulated node")
    parser.add_argument("--nodes", type=int, default=1, help="agents")
    parser.add_argument("--spread", type=float, default=60.0, help="seconds over which the onsets spread")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.cmd == "agent":
        return agent_main(args)

    from controlplane import ControlPlane, locate_binaries

    from gpuwarden.agent.sender import DEFAULT_REPORT_INTERVAL
    from gpuwarden.units import parse_duration

    results: list[tuple[float, ...]] = []
    with (
        tempfile.TemporaryDirectory(prefix="gpuwarden-detect-") as tmp,
        ControlPlane(locate_binaries()) as cp,
    ):
        for round_no in range(args.rounds):
            results += run_round(cp, Path(tmp), args, round_no)
            print(f"round {round_no}: {len(results)} detections so far", file=sys.stderr)
    from_condition = [r[0] for r in results]
    from_sample = [r[1] for r in results]
    posted_after_sample = [r[2] for r in results]
    summary = {
        "when": datetime.now().isoformat(timespec="seconds"),
        "detections": len(results),
        "expected": args.rounds * args.nodes * args.gpus,
        "for_seconds": FOR_SECONDS,
        "report_interval_s": parse_duration(args.report_interval)
        if args.report_interval
        else DEFAULT_REPORT_INTERVAL,
        "sample_interval_s": 1.0,
        "evaluation_interval_s": 1.0,
        "cpus": os.cpu_count(),
    }
    for name, values in (
        ("from_condition_s", from_condition),
        ("from_sample_s", from_sample),
        ("posted_after_sample_s", posted_after_sample),
    ):
        summary[name] = {
            "p50": round(statistics.median(values), 3),
            "p90": round(pct(values, 0.90), 3),
            "p99": round(pct(values, 0.99), 3),
            "max": round(max(values), 3),
            "min": round(min(values), 3),
        }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End to end: a scripted day of GPU work, counted by the operator, kept by Prometheus, reported.

A day's pattern played in under three minutes (an hour is about 7 s) on a scripted node of six
GPUs, with pods of two namespaces and four kinds of owner, made on the real API server with real
ownerReferences: a Deployment (through its ReplicaSet) busy in the day and idle at night, a
CronJob's Job that trains (with GPM's SM activity below its utilization, which is what counts), a
bare notebook idling all day, and a StatefulSet whose two pods time-slice one GPU. Halfway through,
the operator is killed (SIGKILL) and started again: its counters start from zero, the agent replays
what it buffered meanwhile. Debian's Prometheus scrapes the operator every 250 ms; ``gpuwarden
report`` asks it for the day (table, JSON, CSV), and its figures match the scenario's truth within
1%, the restart neither losing nor doubling the time. Two GPUs are time-sliced (two embedders at 3:1,
four chat pods at unequal use, two of them running nothing): each holder is allocated its use and an
even part of what nobody used, the truth computed here by hand from the scenario; the time no pod
held a GPU is the node's unallocated row.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane, free_ports
from operator_support import (
    AGENT_NODE,
    CARD,
    IDLE_RULE,
    LOCAL_COMMAND,
    PEERING,
    Proc,
    Setup,
    apply,
    create_peering,
    get,
    monitor_policy,
    prepare,
    scrape,
    wait_until,
)
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_support import Prometheus, prometheus_binary

from gpuwarden.operator.accounting import AccountingBook, AccountingSettings, OwnerResolver
from gpuwarden.policy import Point
from gpuwarden.wire.node import GpuSample, PodRef, Snapshot

pytestmark = pytest.mark.integration

DAY = 170.0
"""Scenario seconds the day lasts (the last pod ends at 165 s): an hour is about 7 s."""
SAMPLE = "100ms"
"""The agent samples, attributes and reads per-process utilization ten times a second, and
Prometheus scrapes every 250 ms: the readings the restart and the pods' edges cost (a sampling
interval or two each) are then well under 1% of the day."""
RESTART_AT = 115.0
"""When the operator is killed (seconds after the agent starts): after the web pods and the job
ended, while the notebook and the embedders run on."""

# The scenario's truth in GPU-seconds per (namespace, kind, workload), namespace "a" or "b": each
# pod holds its GPU for its [from, until) window, at its pieces' levels.
#   web (Deployment, 2 pods with a GPU each, 5 s to 100 s): 2% until 35 s, 60% until 75 s, 2% after
#   nightly (CronJob, its Job's pod, 10 s to 70 s): utilization 90%, GPM's SM activity 45%
#   notebook (bare pod, 5 s to 165 s): 3%, idle all day
#   embed (StatefulSet, 2 pods time-slicing one GPU, 5 s to 165 s): 40%, split 3:1 by their processes
#     (30% and 10%: each allocated that and half of the 60% nobody used, 96 and 64 GPU-s, together the GPU's)
TRUTH = {
    ("a", "Deployment", "web"): {
        "allocated": 2 * 95.0,
        "used": 2 * (55 * 0.02 + 40 * 0.60),
        "idle": 2 * 55 * 0.98,  # idle is what was allocated and not used, under the floor
    },
    ("a", "CronJob", "nightly"): {"allocated": 60.0, "used": 60 * 0.45, "idle": 0.0},
    ("b", "Pod", "notebook"): {"allocated": 160.0, "used": 160 * 0.03, "idle": 160 * 0.97},
    ("b", "StatefulSet", "embed"): {"allocated": 160.0, "used": 160 * 0.40, "idle": 0.0},
    # GPU 5 time-sliced by four bare pods, 5 s to 165 s, at 50%: chat-a's processes 3/4 of it, chat-b's
    # 1/4, chat-c and chat-d run nothing. Each is allocated its use and a quarter of the unused 50%.
    ("b", "Pod", "chat-a"): {"allocated": 160 * 0.5, "used": 160 * 0.375, "idle": 0.0},
    ("b", "Pod", "chat-b"): {"allocated": 160 * 0.25, "used": 160 * 0.125, "idle": 0.0},
    ("b", "Pod", "chat-c"): {"allocated": 160 * 0.125, "used": 0.0, "idle": 160 * 0.125},
    ("b", "Pod", "chat-d"): {"allocated": 160 * 0.125, "used": 0.0, "idle": 160 * 0.125},
}
TOLERANCE = 0.01
UUIDS = [f"GPU-acc0a171-0000-4000-8000-00000000000{i}" for i in range(6)]


def steady(level: float, at: str | None = None) -> dict[str, Any]:
    piece: dict[str, Any] = {"kind": "idle", "level": level, "noise": 0}
    if at is not None:
        piece["at"] = at
    return piece


def card(index: int, utilization: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "uuid": UUIDS[index],
        "index": index,
        "model": "NVIDIA H200",
        "memoryTotal": CARD,
        "utilization": utilization,
        "memory": [steady(8 * 2**30)],
        **extra,
    }


def scripted_pod(
    namespace: str, name: str, gpu: int, pid: int | None, window: tuple[str, str], share: float = 1.0
) -> dict[str, Any]:
    """A pod on GPU ``gpu`` for ``window``, its one process ``pid`` (None: it runs nothing there)."""
    return {
        "namespace": namespace,
        "name": name,
        "container": "main",
        "gpus": [UUIDS[gpu]],
        "processes": [] if pid is None else [{"pid": pid, "command": "python work.py", "share": share}],
        "from": window[0],
        "until": window[1],
    }


def scenario(path: Path, a: str, b: str) -> Path:
    """The day: GPUs 0 and 1 web's, 2 the job's, 3 time-sliced by the embedders, 4 the notebook's, 5
    time-sliced by the four chat pods."""
    day = [steady(2), steady(60, "35s"), steady(2, "75s")]
    spec = {
        "name": "accounting-day",
        "duration": "1h",
        "seed": 31,
        "gpus": [
            card(0, day, gpm=False),
            card(1, day, gpm=False),
            card(2, [steady(90)], smActive=[steady(45)]),
            card(3, [steady(40)]),
            card(4, [steady(3)], gpm=False),
            card(5, [steady(50)]),
        ],
        "pods": [
            scripted_pod(a, "web-5d8f-a", 0, 1001, ("5s", "100s")),
            scripted_pod(a, "web-5d8f-b", 1, 1002, ("5s", "100s")),
            scripted_pod(a, "nightly-29412-q7x", 2, 2001, ("10s", "70s")),
            scripted_pod(b, "embed-0", 3, 4001, ("5s", "165s"), share=3),
            scripted_pod(b, "embed-1", 3, 4002, ("5s", "165s"), share=1),
            scripted_pod(b, "notebook", 4, 3001, ("5s", "165s")),
            scripted_pod(b, "chat-a", 5, 5001, ("5s", "165s"), share=3),
            scripted_pod(b, "chat-b", 5, 5002, ("5s", "165s"), share=1),
            scripted_pod(b, "chat-c", 5, None, ("5s", "165s")),
            scripted_pod(b, "chat-d", 5, None, ("5s", "165s")),
        ],
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"app": "x"}},
    "spec": {"containers": [{"name": "main", "image": "example.invalid/cuda:1"}]},
}


def owned(cp: ControlPlane, obj: dict[str, Any], owner: Mapping[str, Any] | None) -> dict[str, Any]:
    """Create ``obj`` (controlled by ``owner``, an object as the API returned it); return it as stored."""
    meta = obj["metadata"]
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
    apply(cp, obj)
    stored = get(cp, obj["kind"].lower(), meta["name"], "-n", meta["namespace"])
    assert stored is not None
    return dict(stored)


def gpu_pod(namespace: str, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "nodeName": AGENT_NODE,
            "containers": [
                {
                    "name": "main",
                    "image": "example.invalid/cuda:1",
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                }
            ],
        },
    }


def workloads(cp: ControlPlane, a: str, b: str) -> None:
    """The owners and the pods, as their controllers would have made them (no controller runs here)."""
    selector = {"matchLabels": {"app": "x"}}
    deployment = owned(
        cp,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": a},
            "spec": {"selector": selector, "template": TEMPLATE},
        },
        None,
    )
    replicaset = owned(
        cp,
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": "web-5d8f", "namespace": a},
            "spec": {"selector": selector, "template": TEMPLATE},
        },
        deployment,
    )
    for name in ("web-5d8f-a", "web-5d8f-b"):
        owned(cp, gpu_pod(a, name, {"team": "search"}), replicaset)
    job_spec = {"template": {**TEMPLATE, "spec": {**TEMPLATE["spec"], "restartPolicy": "Never"}}}
    cronjob = owned(
        cp,
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": {"name": "nightly", "namespace": a},
            "spec": {"schedule": "0 2 * * *", "jobTemplate": {"spec": job_spec}},
        },
        None,
    )
    job = owned(
        cp,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "nightly-29412", "namespace": a},
            "spec": {**job_spec, "manualSelector": True, "selector": selector},
        },
        cronjob,
    )
    owned(cp, gpu_pod(a, "nightly-29412-q7x", {"team": "research"}), job)
    owned(cp, gpu_pod(b, "notebook", {"team": "research"}), None)
    for name in ("chat-a", "chat-b", "chat-c", "chat-d"):
        owned(cp, gpu_pod(b, name, {"team": "search"}), None)
    statefulset = owned(
        cp,
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "embed", "namespace": b},
            "spec": {"selector": selector, "serviceName": "embed", "template": TEMPLATE},
        },
        None,
    )
    for name in ("embed-0", "embed-1"):
        owned(cp, gpu_pod(b, name, {"team": "search"}), statefulset)


def report(cp: ControlPlane, url: str, *args: str) -> str:
    """``gpuwarden report`` over the last 15 minutes (the whole test), with the test's kubeconfig."""
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "report", f"--prometheus={url}", "--window=15m", *args],
        cwd=REPO_ROOT,
        env={**cp.env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


class FastAgent(Proc):
    """The scripted agent of :class:`operator_support.Agent`, sampling and attributing every 100 ms."""

    def __init__(self, setup: Setup, scenario_path: Path, url: str) -> None:
        (self.port,) = free_ports(1)
        argv = [
            *LOCAL_COMMAND, "agent", "--backend=scripted", f"--scenario={scenario_path}",
            f"--operator-url={url}", f"--token-file={setup.token_file}", f"--node-name={AGENT_NODE}",
            f"--listen=127.0.0.1:{self.port}", f"--sample-interval={SAMPLE}", f"--process-interval={SAMPLE}",
            f"--attribution-interval={SAMPLE}", "--report-interval=250ms", "--hook-socket=",
        ]  # fmt: skip
        env = {**setup.cp.env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
        super().__init__("agent", argv, env, setup.workdir / "agent.log")

    def metrics(self) -> dict[str, float]:
        """Its /metrics, parsed ({} while it does not answer)."""
        return scrape(self.port)


def rows_of(metrics: Mapping[str, float], counter: str) -> dict[tuple[str, str, str], float]:
    """One counter's values by (namespace, workload_kind, workload), summed over group and model."""
    rows: dict[tuple[str, str, str], float] = {}
    for key, value in metrics.items():
        if key.startswith(counter + "{"):
            labels = dict(part.split("=", 1) for part in key[len(counter) + 1 : -1].split(","))
            row = (
                labels["namespace"].strip('"'),
                labels["workload_kind"].strip('"'),
                labels["workload"].strip('"'),
            )
            rows[row] = rows.get(row, 0.0) + value
    return rows


def assert_truth(
    source: str,
    truth: Mapping[tuple[str, str, str], Mapping[str, float]],
    got: Mapping[tuple[str, str, str], Mapping[str, float]],
) -> None:
    """Each workload's GPU-seconds as the report gave them (``source``) against the scenario's truth:
    within :data:`TOLERANCE` (a hundredth of a second where the truth is 0). Prints them side by side."""
    assert set(got) == set(truth), (source, got)
    for row, want in truth.items():
        for name, seconds in want.items():
            have = got[row][name]
            print(f"{source}: {'/'.join(row)} {name} {have:.2f} GPU-s, truth {seconds:.2f}")
            assert abs(have - seconds) <= TOLERANCE * max(seconds, 1.0), (source, row, name, have, seconds)


def test_a_scripted_day_is_counted_across_a_restart_and_reported(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "accounting")
    a = setup.namespace
    b = cp.create_namespace(f"{a}-b")
    create_peering(cp, b, PEERING)
    workloads(cp, a, b)
    setup.apply(monitor_policy(b, "idle", [IDLE_RULE], selector={"matchLabels": {"team": "research"}}))
    names = {"a": a, "b": b}
    truth = {(names[ns], kind, name): figures for (ns, kind, name), figures in TRUTH.items()}
    day = scenario(setup.workdir / "day.yaml", a, b)
    args = [
        f"--namespace={b}",
        "--accounting-group-label=team",
        "--accounting-price=NVIDIA H200=3.6",
        "--accounting-scrape-interval=1s",  # Prometheus scrapes every 250 ms: it keeps each new row's 0
    ]
    allocated = "gpuwarden_gpu_allocated_seconds_total"

    binary = prometheus_binary()
    if binary is None:
        pytest.fail("prometheus is missing (Debian: apt-get install prometheus)")

    with ExitStack() as running:
        first = running.enter_context(setup.operator(extra_args=args))
        first.wait_ready()
        # Debian's Prometheus scraping the operator every 250 ms (the restarted one listens on the same port).
        target = {
            "job_name": "gpuwarden-operator",
            "static_configs": [{"targets": [f"127.0.0.1:{first.metrics_port}"]}],
        }
        server = Prometheus(binary, setup.workdir / "prometheus", [target], [], interval="250ms")
        running.callback(server.stop)
        url = server.url
        started = time.time()
        scripted = running.enter_context(FastAgent(setup, day, first.url))

        # Every workload is counted by the first process, its owner read up the real ownerReferences.
        wait_until(
            lambda: set(rows_of(first.metrics(), allocated)) == set(truth),
            timeout=90,
            what="every workload counted",
            alive=lambda: first.alive() or scripted.alive(),
        )

        # Mid-day, while the policy flags the notebook idle, the report names that finding under it.
        def flagged() -> str | None:
            table = report(cp, url)
            return table if f"{b}/idle: pod notebook idle" in table else None

        midday = wait_until(flagged, timeout=60, every=2, what="the report naming the notebook's finding")
        print(midday)  # the report as people read it, in the test's log
        assert f"{b}/Pod/notebook" in midday.split("Worst offenders")[1]
        assert time.time() < started + RESTART_AT, "the mid-day report came after the restart's time"
        wait_until(
            lambda: time.time() > started + RESTART_AT, timeout=RESTART_AT + 30, what="the restart's time"
        )
        first.kill()  # SIGKILL: its counters die with it
        wait_until(
            lambda: scripted.metrics().get("gpuwarden_agent_report_buffer_snapshots", 0) >= 20,
            timeout=60,
            what="snapshots buffered while no operator listens",
            alive=scripted.alive,
        )
        second = running.enter_context(
            setup.operator(extra_args=args, ports=(first.ingest_port, first.metrics_port))
        )
        second.wait_ready()

        def day_over() -> bool:
            m = scripted.metrics()
            return (
                m.get("gpuwarden_agent_last_sample_timestamp_seconds", 0) > started + DAY + 5
                and m.get("gpuwarden_agent_report_buffer_snapshots", 1) == 0
            )

        wait_until(day_over, timeout=DAY + 120, what="the day played and delivered", alive=second.alive)
        # The new process counted only what it was sent: the replay and the rest of the day, of the
        # pods that still ran; its counters started from zero.
        after = rows_of(second.metrics(), allocated)
        assert set(after) == {
            (b, "Pod", "notebook"),
            (b, "StatefulSet", "embed"),
            *((b, "Pod", f"chat-{x}") for x in "abcd"),
        }, after
        for row, seconds in after.items():
            assert 0 < seconds < 0.5 * truth[row]["allocated"], (row, seconds)

        def scraped() -> bool:
            got = server.query(f"sum({allocated})")
            return bool(got) and float(got[0]["value"][1]) == pytest.approx(sum(after.values()), rel=1e-12)

        wait_until(scraped, timeout=30, what="Prometheus scraping the final counters")

        # The day's totals from Prometheus: the restart read as a counter reset, nothing lost or doubled.
        data = json.loads(report(cp, url, "--output=json"))
        assert_truth("json", truth, {
            (w["namespace"], w["kind"], w["workload"]): {
                name: w[f"{name}GpuHours"] * 3600 for name in ("allocated", "used", "idle")
            }
            for w in data["workloads"]
        })  # fmt: skip
        notebook = next(w for w in data["workloads"] if (w["namespace"], w["workload"]) == (b, "notebook"))
        assert notebook["idleCost"] == pytest.approx(
            TRUTH[("b", "Pod", "notebook")]["idle"] / 3600 * 3.6, rel=TOLERANCE
        )
        rows = list(csv.DictReader(io.StringIO(report(cp, url, "--output=csv"))))
        assert_truth("csv", truth, {
            (r["namespace"], r["kind"], r["workload"]): {
                name: float(r[f"{name}_gpu_hours"]) * 3600 for name in ("allocated", "used", "idle")
            }
            for r in rows
            if r["kind"] != "Unallocated"
        })  # fmt: skip
        # The GPUs before their pods came and after they left: the node's time nobody held.
        (free,) = [r for r in rows if r["kind"] == "Unallocated"]
        assert free["workload"] == f"{AGENT_NODE}/NVIDIA H200"
        assert float(free["allocated_gpu_hours"]) * 3600 > 100  # web's GPUs, idle 70 s each after it

        table = report(cp, url)
        print(table)
        worst = table.split("Worst offenders (most idle GPU-hours):\n")[1].splitlines()[0]
        assert worst.startswith(f"  {b}/Pod/notebook: "), table  # 155 idle GPU-s, web's 108


# -- the report for the people who pay, on a real Prometheus --

TEAM_PRICE = 3.6
"""The price of a GPU-hour of an H200 in the report's test."""
PROMPT, GENERATED = 5000, 1000
"""Tokens the inference server counts at each of the node's snapshots (every half second or so)."""


class Pods:
    """The pods' metadata as the API would answer the owner resolver (bare pods, each with a team)."""

    def __init__(self, teams: Mapping[str, str]) -> None:
        self.teams = teams

    async def get(self, path: str) -> Mapping[str, Any]:
        return {"metadata": {"labels": {"team": self.teams[path.rsplit("/", 1)[1]]}}}


def test_the_report_by_team_with_unallocated_gpus_and_cost_per_million_tokens(tmp_path: Path) -> None:
    """The operator's accounting book, fed a node's snapshots in real time (a vLLM pod of team search
    alone on GPU 0 at 60%, a notebook of team research idle on GPU 1, GPU 2 held by nobody), and a server
    exporting vLLM's token counters, both scraped by Debian's Prometheus; ``gpuwarden report --by
    label:team`` then states each team's hours, the unallocated GPU and the cost per million tokens,
    against the truth the test computes from what it fed."""
    binary = prometheus_binary()
    if binary is None:
        pytest.fail("prometheus is missing (Debian: apt-get install prometheus)")
    model = "NVIDIA H200"
    book = AccountingBook(
        AccountingSettings(group_label="team", prices={model: TEAM_PRICE}, scrape_interval=1.0),
        OwnerResolver(Pods({"llm-0": "search", "notebook": "research"}), group_label="team"),
        time.time,
    )
    registry = CollectorRegistry()
    registry.register(book)
    served = CollectorRegistry()
    prompt = Counter("vllm:prompt_tokens", "Prompt tokens.", registry=served)
    generated = Counter("vllm:generation_tokens", "Generated tokens.", registry=served)
    book_port, token_port = free_ports(2)
    servers = [
        start_http_server(book_port, "127.0.0.1", registry),
        start_http_server(token_port, "127.0.0.1", served),
    ]
    targets = [
        {"job_name": "gpuwarden-operator", "static_configs": [{"targets": [f"127.0.0.1:{book_port}"]}]},
        {
            # As a PodMonitor's relabelling labels a pod's series.
            "job_name": "vllm",
            "static_configs": [
                {"targets": [f"127.0.0.1:{token_port}"], "labels": {"namespace": "ml", "pod": "llm-0"}}
            ],
        },
    ]
    prometheus = Prometheus(binary, tmp_path / "prometheus", targets, [], interval="500ms")
    try:
        # The tokens' first scrape must see them at 0: increase() takes a series' first value as its base.
        wait_until(
            lambda: len(prometheus.query("up == 1")) == 2, timeout=60, what="Prometheus scraping both targets"
        )
        first = last = time.time()
        steps = 0
        while last - first < 20.0:
            last = time.time()
            gpus = [
                GpuSample(
                    uuid="GPU-0",
                    index=0,
                    model=model,
                    utilization_gpu=60.0,
                    pods=[PodRef(namespace="ml", name="llm-0")],
                ),
                GpuSample(
                    uuid="GPU-1",
                    index=1,
                    model=model,
                    utilization_gpu=0.0,
                    pods=[PodRef(namespace="ml", name="notebook")],
                ),
                GpuSample(uuid="GPU-2", index=2, model=model, utilization_gpu=0.0),
            ]
            readings = {
                "GPU-0": {("ml", "llm-0"): Point(last, gpu_util=60.0)},
                "GPU-1": {("ml", "notebook"): Point(last, gpu_util=0.0)},
            }
            book.observe("gpu-node-1", Snapshot(timestamp=last, gpus=gpus), readings)
            if steps == 0:
                asyncio.run(book.resolve_pending())
            else:
                prompt.inc(PROMPT)
                generated.inc(GENERATED)
            steps += 1
            time.sleep(0.5)  # the node's sampling period: the workload's clock, not a wait for a result

        def scraped() -> bool:
            return bool(prometheus.query(f"gpuwarden_gpu_allocated_seconds_total > {0.9 * (last - first)}"))

        wait_until(scraped, timeout=30, what="Prometheus holding the book's last seconds")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwarden",
                "report",
                f"--prometheus={prometheus.url}",
                "--window=2m",
                "--no-findings",
                "--by=label:team",
                "--output=json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=REPO_ROOT,
        )
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        table = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwarden",
                "report",
                f"--prometheus={prometheus.url}",
                "--window=2m",
                "--no-findings",
                "--by=label:team",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            cwd=REPO_ROOT,
        ).stdout
        print(table)
    finally:
        prometheus.stop()
        for server, thread in servers:
            server.shutdown()
            thread.join()
    teams = {g["team"]: g for g in data["groups"]}
    assert set(teams) == {"search", "research"}
    seconds = last - first  # what each GPU was read for (the first reading opens its account)
    search, research = teams["search"], teams["research"]
    # increase() extrapolates to the window's edges: a few percent on 20 s, well under 1% on a day.
    assert search["allocatedGpuHours"] * 3600 == pytest.approx(seconds, rel=0.1)
    assert search["usedGpuHours"] == pytest.approx(0.6 * search["allocatedGpuHours"], rel=0.02)
    assert research["idleGpuHours"] == pytest.approx(research["allocatedGpuHours"], rel=0.02)
    # Each figure is its own instant query, whose increase() extrapolates to its own instant: on 20 s
    # of data a percent or two apart, on a day's nothing worth a cent.
    assert search["cost"] == pytest.approx(search["allocatedGpuHours"] * TEAM_PRICE, rel=0.03)
    # The truth: the GPU-seconds and the tokens fed (6,000 a snapshot but the first).
    tokens = (steps - 1) * (PROMPT + GENERATED)
    assert search["tokens"] == pytest.approx(tokens, rel=0.1)
    assert search["gpuHoursPerMillionTokens"] == pytest.approx(seconds / 3600 / tokens * 1e6, rel=0.1)
    assert search["costPerMillionTokens"] == pytest.approx(
        seconds / 3600 / tokens * 1e6 * TEAM_PRICE, rel=0.1
    )
    assert research["tokens"] is None
    (free,) = data["unallocated"]
    assert (free["node"], free["gpuModel"]) == ("gpu-node-1", model)
    assert free["gpuHours"] == pytest.approx(search["allocatedGpuHours"], rel=0.05)
    assert free["cost"] == pytest.approx(free["gpuHours"] * TEAM_PRICE, rel=0.03)
    assert "UNALLOCATED TOTAL" in table

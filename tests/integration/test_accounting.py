"""End to end: a scripted day of GPU work on every sharing mode, counted by the operator, kept by
Prometheus, reported to the people who pay.

A day's pattern played in under three minutes (an hour is about 7 s) by the real agent (the scripted
backend standing in for NVML) on a node of nine GPUs, with pods of two namespaces and four kinds of
owner, made on the real API server with real ownerReferences: a Deployment (through its ReplicaSet)
busy in the day and idle at night, a CronJob's Job that trains (with GPM's SM activity below its
utilization, which is what counts), a bare notebook idling all day, a StatefulSet whose two pods
time-slice one GPU at 3:1, four chat pods time-slicing another at unequal use (two of them running
nothing), a GPU in MIG mode (a 2/8 MIG device training, a 1/8 one idle, 5/8 in no MIG device), a GPU
two pods share through one DRA ResourceClaim (3:1), and a GPU nobody holds. Halfway through, the
operator is killed (SIGKILL) and started again: its counters start from zero, the agent replays
what it buffered meanwhile. Debian's Prometheus scrapes the operator every 250 ms, and the chat pod's
inference server (``gpuwarden sim-server``, vLLM's token counters) as a PodMonitor would.

``gpuwarden report`` asks Prometheus for the day (table, JSON, CSV, ``--by label:team``), and the test
checks it against the truth it computes from the scenario by hand (:data:`TRUTH`, :data:`DEVICES`),
never from the product's code: each workload's allocated, used and idle GPU-seconds within 1%, used
never above allocated; for every device, its holders' allocated seconds add up to its physical
seconds while held (a MIG device its share of the GPU), and the node's unallocated seconds are the
rest of its nine GPUs' time, within 1%; the restart neither losing nor doubling time; the cost per
million tokens of the chat pod and of its team the cost of their GPU-hours over the tokens the test
sent the server.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane, free_ports
from draplugin import device_class, one_device
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
    http,
    monitor_policy,
    prepare,
    scrape,
    wait_until,
)
from prometheus_support import Prometheus, prometheus_binary

pytestmark = pytest.mark.integration

DAY = 170.0
"""Scenario seconds the day lasts (the last pod ends at 165 s): an hour is about 7 s."""
SAMPLE = "100ms"
"""The agent samples, attributes and reads per-process utilization ten times a second, and
Prometheus scrapes every 250 ms: the readings the restart and the pods' edges cost (a sampling
interval or two each) are then well under 1% of the day."""
SAMPLE_SECONDS = 0.1
RESTART_AT = 115.0
"""When the operator is killed (seconds after the agent starts): after the web pods and the job
ended, while the other pods run on."""
PRICE = 3.6
"""The price of a GPU-hour of an H200."""
MIG_SHARES = (2 / 8, 1 / 8)
"""The MIG devices' shares of GPU 6: their memory over the GPU's (a 2g and a 1g of eight)."""
REQUESTS, PROMPT_WORDS, MAX_TOKENS = 40, 120, 80
"""What the test asks the chat pod's inference server: 40 completions of 120 prompt tokens and 80
generated, 8,000 tokens."""

# The scenario's truth in GPU-seconds per (namespace, kind, workload), namespace "a" or "b": each
# pod holds its device for its [from, until) window, at its pieces' levels.
#   web (Deployment, 2 pods with a GPU each, 5 s to 100 s): 2% until 35 s, 60% until 75 s, 2% after
#   nightly (CronJob, its Job's pod, 10 s to 70 s): utilization 90%, GPM's SM activity 45%
#   notebook (bare pod, 5 s to 165 s): 3%, idle all day
#   embed (StatefulSet, 2 pods time-slicing one GPU, 5 s to 165 s): 40%, split 3:1 by their processes
#     (30% and 10%: each allocated that and half of the 60% nobody used, 96 and 64 GPU-s, together the GPU's)
HELD = 160.0
"""Seconds the pods of 5 s to 165 s hold their devices."""
TRUTH = {
    ("a", "Deployment", "web"): {
        "allocated": 2 * 95.0,
        "used": 2 * (55 * 0.02 + 40 * 0.60),
        "idle": 2 * 55 * 0.98,  # idle is what was allocated and not used, under the floor
    },
    ("a", "CronJob", "nightly"): {"allocated": 60.0, "used": 60 * 0.45, "idle": 0.0},
    ("b", "Pod", "notebook"): {"allocated": HELD, "used": HELD * 0.03, "idle": HELD * 0.97},
    ("b", "StatefulSet", "embed"): {"allocated": HELD, "used": HELD * 0.40, "idle": 0.0},
    # GPU 5 time-sliced by four bare pods at 50%: chat-a's processes 3/4 of it, chat-b's 1/4, chat-c
    # and chat-d run nothing. Each is allocated its use and a quarter of the unused 50%.
    ("b", "Pod", "chat-a"): {"allocated": HELD * 0.5, "used": HELD * 0.375, "idle": 0.0},
    ("b", "Pod", "chat-b"): {"allocated": HELD * 0.25, "used": HELD * 0.125, "idle": 0.0},
    ("b", "Pod", "chat-c"): {"allocated": HELD * 0.125, "used": 0.0, "idle": HELD * 0.125},
    ("b", "Pod", "chat-d"): {"allocated": HELD * 0.125, "used": 0.0, "idle": HELD * 0.125},
    # GPU 6 in MIG mode: a 2/8 MIG device at 70% SM activity, a 1/8 one at 2% (idle: under the floor).
    ("b", "Pod", "mig-train"): {
        "allocated": HELD * MIG_SHARES[0],
        "used": HELD * MIG_SHARES[0] * 0.70,
        "idle": 0.0,
    },
    ("b", "Pod", "mig-notebook"): {
        "allocated": HELD * MIG_SHARES[1],
        "used": HELD * MIG_SHARES[1] * 0.02,
        "idle": HELD * MIG_SHARES[1] * 0.98,
    },
    # GPU 7 shared through one DRA claim at 60%, 3:1 (45% and 15%): each allocated that and half of
    # the unused 40%.
    ("b", "Pod", "dra-a"): {"allocated": HELD * 0.65, "used": HELD * 0.45, "idle": 0.0},
    ("b", "Pod", "dra-b"): {"allocated": HELD * 0.35, "used": HELD * 0.15, "idle": 0.0},
}
DEVICES: dict[str, tuple[float, tuple[str, ...]]] = {
    # device: (its physical GPU-seconds while held, the workloads holding it)
    "GPU 0 and 1 (exclusive)": (2 * 95.0, ("web",)),
    "GPU 2 (exclusive)": (60.0, ("nightly",)),
    "GPU 3 (time-sliced by 2)": (HELD, ("embed",)),
    "GPU 4 (exclusive)": (HELD, ("notebook",)),
    "GPU 5 (time-sliced by 4)": (HELD, ("chat-a", "chat-b", "chat-c", "chat-d")),
    "GPU 6's 2/8 MIG device": (HELD * MIG_SHARES[0], ("mig-train",)),
    "GPU 6's 1/8 MIG device": (HELD * MIG_SHARES[1], ("mig-notebook",)),
    "GPU 7 (one DRA claim, 2 pods)": (HELD, ("dra-a", "dra-b")),
}
GPUS = 9
"""Physical GPUs on the node: GPU 8 is held by nobody, and 5/8 of GPU 6 is in no MIG device."""
TEAMS = {
    "search": ("web", "embed", "chat-a", "chat-b", "chat-c", "chat-d", "dra-a", "dra-b"),
    "research": ("nightly", "notebook", "mig-train", "mig-notebook"),
}
TOLERANCE = 0.01
UUIDS = [f"GPU-acc0a171-0000-4000-8000-00000000000{i}" for i in range(GPUS)]
MIGS = [f"MIG-acc0a171-0000-4000-8000-00000000006{i}" for i in range(len(MIG_SHARES))]
CLAIM = "shared-gpu"
DRIVER = "gpu.example.com"
CARD_BYTES = 143771 * 2**20
"""An H200's memory (:data:`operator_support.CARD`) in bytes."""


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
    namespace: str,
    name: str,
    device: str,
    pid: int | None,
    window: tuple[str, str] = ("5s", "165s"),
    share: float = 1.0,
    **extra: Any,
) -> dict[str, Any]:
    """A pod on ``device`` (a GPU's or MIG device's UUID) for ``window``, its one process ``pid``
    (None: it runs nothing there)."""
    return {
        "namespace": namespace,
        "name": name,
        "container": "main",
        "gpus": [device],
        "processes": [] if pid is None else [{"pid": pid, "command": "python work.py", "share": share}],
        "from": window[0],
        "until": window[1],
        **extra,
    }


def scenario(path: Path, a: str, b: str) -> Path:
    """The day: GPUs 0 and 1 web's, 2 the job's, 3 time-sliced by the embedders, 4 the notebook's, 5
    time-sliced by the four chat pods, 6 in MIG mode, 7 shared through a DRA claim, 8 nobody's."""
    day = [steady(2), steady(60, "35s"), steady(2, "75s")]
    migs = [
        {"uuid": uuid, "memoryTotal": round(CARD_BYTES * share), "smActive": [steady(level)]}
        for uuid, share, level in zip(MIGS, MIG_SHARES, (70, 2), strict=True)
    ]
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
            card(6, [steady(0)], mig=migs),
            card(7, [steady(60)]),
            card(8, [steady(0)]),
        ],
        "pods": [
            scripted_pod(a, "web-5d8f-a", UUIDS[0], 1001, ("5s", "100s")),
            scripted_pod(a, "web-5d8f-b", UUIDS[1], 1002, ("5s", "100s")),
            scripted_pod(a, "nightly-29412-q7x", UUIDS[2], 2001, ("10s", "70s")),
            scripted_pod(b, "embed-0", UUIDS[3], 4001, share=3),
            scripted_pod(b, "embed-1", UUIDS[3], 4002, share=1),
            scripted_pod(b, "notebook", UUIDS[4], 3001),
            scripted_pod(b, "chat-a", UUIDS[5], 5001, share=3),
            scripted_pod(b, "chat-b", UUIDS[5], 5002, share=1),
            scripted_pod(b, "chat-c", UUIDS[5], None),
            scripted_pod(b, "chat-d", UUIDS[5], None),
            scripted_pod(b, "mig-train", MIGS[0], 6001),
            scripted_pod(b, "mig-notebook", MIGS[1], 6002),
            scripted_pod(b, "dra-a", UUIDS[7], 7001, share=3, claim=CLAIM),
            scripted_pod(b, "dra-b", UUIDS[7], 7002, share=1, claim=CLAIM),
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


def gpu_pod(
    namespace: str, name: str, labels: Mapping[str, str], resource: str = "nvidia.com/gpu", claim: str = ""
) -> dict[str, Any]:
    """A pod on the agent's node given one ``resource``, or with ``claim`` its GPU through that
    ResourceClaim (as the scheduler would have bound it; no scheduler runs here)."""
    container: dict[str, Any] = {"name": "main", "image": "example.invalid/cuda:1"}
    spec: dict[str, Any] = {"nodeName": AGENT_NODE, "containers": [container]}
    if claim:
        container["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    else:
        container["resources"] = {"limits": {resource: 1}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": spec,
    }


def workloads(cp: ControlPlane, a: str, b: str) -> None:
    """The owners and the pods, as their controllers would have made them (no controller runs here)."""
    selector = {"matchLabels": {"app": "x"}}
    search, research = {"team": "search"}, {"team": "research"}
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
        owned(cp, gpu_pod(a, name, search), replicaset)
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
    owned(cp, gpu_pod(a, "nightly-29412-q7x", research), job)
    owned(cp, gpu_pod(b, "notebook", research), None)
    for name in ("chat-a", "chat-b", "chat-c", "chat-d"):
        owned(cp, gpu_pod(b, name, search), None)
    owned(cp, gpu_pod(b, "mig-train", research, "nvidia.com/mig-2g.35gb"), None)
    owned(cp, gpu_pod(b, "mig-notebook", research, "nvidia.com/mig-1g.18gb"), None)
    apply(cp, device_class(DRIVER))
    apply(
        cp,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": CLAIM, "namespace": b},
            "spec": one_device(DRIVER),
        },
    )
    for name in ("dra-a", "dra-b"):
        owned(cp, gpu_pod(b, name, search, claim=CLAIM), None)
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
        owned(cp, gpu_pod(b, name, search), statefulset)


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


class TokenServer(Proc):
    """``gpuwarden sim-server``: a simulated vLLM replica over real HTTP, exporting vLLM's token counters."""

    def __init__(self, setup: Setup) -> None:
        (self.port,) = free_ports(1)
        argv = [
            *LOCAL_COMMAND, "sim-server", f"--listen=127.0.0.1:{self.port}",
            "--max-num-seqs=8", "--prefill-time=10ms", "--token-time=2ms",
        ]  # fmt: skip
        env = {**setup.cp.env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
        super().__init__("sim-server", argv, env, setup.workdir / "sim-server.log")

    def complete(self, _: int) -> int:
        """One completion of :data:`PROMPT_WORDS` words and :data:`MAX_TOKENS` tokens; its tokens."""
        body = {"prompt": " ".join(["word"] * PROMPT_WORDS), "max_tokens": MAX_TOKENS}
        status, answer = http(
            "POST",
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, answer
        return int(answer["usage"]["total_tokens"])


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


def close(have: float, want: float) -> bool:
    """Within :data:`TOLERANCE` of the truth (a hundredth of a GPU-second where the truth is 0)."""
    return abs(have - want) <= TOLERANCE * max(want, 1.0)


def assert_truth(
    source: str,
    truth: Mapping[tuple[str, str, str], Mapping[str, float]],
    got: Mapping[tuple[str, str, str], Mapping[str, float]],
) -> None:
    """Each workload's GPU-seconds as the report gave them (``source``) against the scenario's truth,
    and used never above allocated. Prints them side by side."""
    assert set(got) == set(truth), (source, got)
    for row, want in truth.items():
        for name, seconds in want.items():
            have = got[row][name]
            print(f"{source}: {'/'.join(row)} {name} {have:.2f} GPU-s, truth {seconds:.2f}")
            assert close(have, seconds), (source, row, name, have, seconds)
        assert got[row]["used"] <= got[row]["allocated"], (source, row, got[row])


def first_sample(agent: FastAgent) -> float | None:
    """When the agent took its first snapshot, once its /metrics answers (None before)."""
    m = agent.metrics()
    taken = m.get("gpuwarden_agent_samples_total", 0.0)
    if taken < 1:
        return None
    return m["gpuwarden_agent_last_sample_timestamp_seconds"] - (taken - 1) * SAMPLE_SECONDS


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
    workload_of = {name: (names[ns], kind, name) for ns, kind, name in TRUTH}
    day = scenario(setup.workdir / "day.yaml", a, b)
    args = [
        f"--namespace={b}",
        "--accounting-group-label=team",
        f"--accounting-price=NVIDIA H200={PRICE}",
        "--accounting-scrape-interval=1s",  # Prometheus scrapes every 250 ms: it keeps each new row's 0
    ]
    allocated = "gpuwarden_gpu_allocated_seconds_total"

    binary = prometheus_binary()

    with ExitStack() as running:
        first = running.enter_context(setup.operator(extra_args=args))
        tokens = running.enter_context(TokenServer(setup))
        first.wait_ready()
        # Debian's Prometheus scraping the operator (the restarted one listens on the same port) and
        # the chat pod's inference server, labelled with its pod as a PodMonitor labels it, every 250 ms.
        targets = [
            {
                "job_name": "gpuwarden-operator",
                "static_configs": [{"targets": [f"127.0.0.1:{first.metrics_port}"]}],
            },
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{tokens.port}"], "labels": {"namespace": b, "pod": "chat-a"}}
                ],
            },
        ]
        server = Prometheus(binary, setup.workdir / "prometheus", targets, [], interval="250ms")
        running.callback(server.stop)
        url = server.url
        started = time.time()
        scripted = running.enter_context(FastAgent(setup, day, first.url))
        began = wait_until(
            lambda: first_sample(scripted), timeout=60, every=0.02, what="the agent's first snapshot",
            alive=scripted.alive,
        )  # fmt: skip

        # The server's token counters scraped at 0 first (increase() takes a series' first value as
        # its base), then the requests, 8 at a time.
        wait_until(
            lambda: server.query('up{job="vllm"} == 1'), timeout=60, what="Prometheus scraping the server",
            alive=tokens.alive,
        )  # fmt: skip
        with ThreadPoolExecutor(8) as pool:
            sent = sum(pool.map(tokens.complete, range(REQUESTS)))
        assert sent == REQUESTS * (PROMPT_WORDS + MAX_TOKENS)

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

        def day_over() -> float | None:
            m = scripted.metrics()
            last = m.get("gpuwarden_agent_last_sample_timestamp_seconds", 0)
            done = last > started + DAY + 5 and m.get("gpuwarden_agent_report_buffer_snapshots", 1) == 0
            return last if done else None

        wait_until(day_over, timeout=DAY + 120, what="the day played and delivered", alive=second.alive)
        # The agent stops (what it sampled still goes out): from now on the counters stand still.
        ended = wait_until(day_over, timeout=30, what="the agent's last snapshot", alive=second.alive)
        scripted.stop()
        span = ended - began
        # The new process counted only what it was sent: the replay and the rest of the day, of the
        # pods that still ran; its counters started from zero.
        after = rows_of(second.metrics(), allocated)
        assert set(after) == {row for row in truth if row[0] == b}, after
        for row, seconds in after.items():
            assert 0 < seconds < 0.5 * truth[row]["allocated"], (row, seconds)

        def scraped() -> bool:
            got = server.query(f"sum({allocated})")
            return bool(got) and float(got[0]["value"][1]) == pytest.approx(sum(after.values()), rel=1e-12)

        wait_until(scraped, timeout=30, what="Prometheus scraping the final counters")

        # The day's totals from Prometheus: the restart read as a counter reset, nothing lost or doubled.
        data = json.loads(report(cp, url, "--output=json"))
        got = {
            (w["namespace"], w["kind"], w["workload"]): {
                name: w[f"{name}GpuHours"] * 3600 for name in ("allocated", "used", "idle")
            }
            for w in data["workloads"]
        }
        assert_truth("json", truth, got)
        # For every device, its holders' allocated seconds are its physical seconds while they held it.
        for device, (physical, holders) in DEVICES.items():
            have = sum(got[workload_of[name]]["allocated"] for name in holders)
            print(
                f"{device}: {have:.2f} GPU-s allocated, physical {physical:.2f} ({have / physical - 1:+.3%})"
            )
            assert close(have, physical), (device, have, physical)
        # And the rest of the node's nine GPUs' time is unallocated: GPU 8's, the 5/8 of GPU 6 in no MIG
        # device, and each device's time before its pods came and after they left.
        (free,) = data["unallocated"]
        assert (free["node"], free["gpuModel"]) == (AGENT_NODE, "NVIDIA H200")
        physical = GPUS * span
        unallocated = physical - sum(held for held, _ in DEVICES.values())
        have = free["gpuHours"] * 3600
        print(f"unallocated: {have:.2f} GPU-s, truth {unallocated:.2f} of {physical:.2f} ({span:.2f} s read)")
        assert close(have, unallocated), (have, unallocated)
        assert free["cost"] == pytest.approx(unallocated / 3600 * PRICE, rel=TOLERANCE)
        notebook = next(w for w in data["workloads"] if (w["namespace"], w["workload"]) == (b, "notebook"))
        assert notebook["idleCost"] == pytest.approx(
            TRUTH[("b", "Pod", "notebook")]["idle"] / 3600 * PRICE, rel=TOLERANCE
        )
        # The chat pod's tokens, joined to its workload: its GPU-hours' cost over what it served.
        chat = next(w for w in data["workloads"] if (w["namespace"], w["workload"]) == (b, "chat-a"))
        hours = TRUTH[("b", "Pod", "chat-a")]["allocated"] / 3600
        assert chat["tokens"] == pytest.approx(sent, rel=TOLERANCE)
        assert chat["gpuHoursPerMillionTokens"] == pytest.approx(hours / sent * 1e6, rel=TOLERANCE)
        assert chat["costPerMillionTokens"] == pytest.approx(hours * PRICE / sent * 1e6, rel=TOLERANCE)
        assert all(w["tokens"] is None for w in data["workloads"] if w is not chat)

        rows = list(csv.DictReader(io.StringIO(report(cp, url, "--output=csv"))))
        assert_truth("csv", truth, {
            (r["namespace"], r["kind"], r["workload"]): {
                name: float(r[f"{name}_gpu_hours"]) * 3600 for name in ("allocated", "used", "idle")
            }
            for r in rows
            if r["kind"] != "Unallocated"
        })  # fmt: skip
        (free_row,) = [r for r in rows if r["kind"] == "Unallocated"]
        assert free_row["workload"] == f"{AGENT_NODE}/NVIDIA H200"
        assert close(float(free_row["allocated_gpu_hours"]) * 3600, unallocated)

        # For the people who pay: each team's hours and cost, and the search team's cost per million
        # tokens, its hours over the tokens of the one server that counts them.
        by_team = json.loads(report(cp, url, "--output=json", "--by=label:team"))
        teams = {g["team"]: g for g in by_team["groups"]}
        assert set(teams) == set(TEAMS)
        for team, members in TEAMS.items():
            want = {
                name: sum(TRUTH[next(k for k in TRUTH if k[2] == w)][name] for w in members)
                for name in ("allocated", "used", "idle")
            }
            for name, seconds in want.items():
                have = teams[team][f"{name}GpuHours"] * 3600
                print(f"team {team}: {name} {have:.2f} GPU-s, truth {seconds:.2f}")
                assert close(have, seconds), (team, name, have, seconds)
            assert teams[team]["cost"] == pytest.approx(want["allocated"] / 3600 * PRICE, rel=TOLERANCE)
        search = sum(TRUTH[next(k for k in TRUTH if k[2] == w)]["allocated"] for w in TEAMS["search"]) / 3600
        assert teams["search"]["tokens"] == pytest.approx(sent, rel=TOLERANCE)
        assert teams["search"]["costPerMillionTokens"] == pytest.approx(
            search * PRICE / sent * 1e6, rel=TOLERANCE
        )
        assert teams["research"]["tokens"] is None
        print(report(cp, url, "--by=label:team"))

        table = report(cp, url)
        print(table)
        worst = table.split("Worst offenders (most idle GPU-hours):\n")[1].splitlines()[0]
        assert worst.startswith(f"  {b}/Pod/notebook: "), table  # 155 idle GPU-s, web's 108

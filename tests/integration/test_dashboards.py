"""The chart's dashboards and alerts against a real Prometheus scraping the real agent and operator.

The chart is installed on the real test node as in test_chart_on_node.py (local images, the
scripted backend playing ``e2e-fast`` with ``--attribution kubelet``), with its monitoring on:
the PodMonitors, the PrometheusRule and the dashboards' ConfigMap; and with the accounting grouped
by the pods' ``team`` label and a price on the scenario's GPU model. The node's four GPUs are held
by pods of two namespaces: a Deployment of three (the idle, the leaking and the saturated GPU) with
the scaling policy, and a Job's pod (the GPU at 55%) in another namespace. prometheus-operator is not
here, so its kinds are permissive stand-in CRDs (as in test_chart.py) and the test does its part:
the PodMonitors and the PrometheusRule, as the API server stored them, become a real Prometheus
server's scrape configuration (:func:`prometheus_support.podmonitor_scrape_config`, what
prometheus-operator generates, the chart's relabelings included) and rule file. Debian's build
has no Kubernetes discovery, so the test lists the agent's and both operator replicas' pods and
hands Prometheus the labels that discovery gives them (file discovery); Prometheus relabels them
and scrapes the pods over the pod network.

Then every query of both dashboards (every panel's every target, and every variable's
``label_values``), as the ConfigMap holds them, with Grafana's variables replaced by what Grafana
would send (both namespaces selected), runs against that Prometheus and must return the series the
panel shows: the test's GPUs, pods, findings and scale decisions by the labels its legend names, and
the GPU-hours each namespace, workload and group held, used and held idle, in the proportions the
scenario's GPUs give them (the idle cost exactly the idle GPU-hours at the price). And the rules
load, each evaluates without an error, and GPUWardenGPUMemoryLeak fires for the leaking pod
once the operator's leak finding appears and its ``for`` has passed, never before.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from node import Node
from operator_support import Timeout, get, wait_until
from prometheus_support import Prometheus, PrometheusError, podmonitor_scrape_config, prometheus_binary
from test_chart import _MONITORING_KINDS, _stub_crd
from test_chart_on_node import CHART, GPU_PRESENT, RELEASE, SYSTEM, Installed
from test_chart_on_node import values as chart_values
from test_node import apply, container, deployment, wait
from test_operator_scaling import APP, policy

pytestmark = pytest.mark.integration

SCRAPE_SECONDS = 2
"""The PodMonitors' interval, and the rules' evaluation interval."""
RATE_INTERVAL = f"{4 * SCRAPE_SECONDS}s"
"""Grafana's ``$__rate_interval`` at that scrape interval: four of them."""
LEAK_GPU = "GPU-1a6b8c2d-4e3f-4a51-8b7c-9d0e1f2a3b71"
"""GPU 1 of e2e-fast: 20Gi, then 3Gi/m, straight: its 140Gi are full in about 40 minutes."""
GPUS = 4
LEAK_FOR = 10
"""The ``for`` of GPUWardenGPUMemoryLeak here (monitoring.prometheusRule.rules), seconds."""
LEAK_RULE = {"name": "leak", "memoryGrowth": {"rate": "1Gi/m", "window": "1m", "minFit": 0.8}}
"""Found about a minute into the readings (test_operator_rules.py's)."""
TIMEOUT = 240.0
SERVING = 3
"""The Deployment's replicas (the policy scales it to one more, which finds no GPU left)."""
JOB_GPU = "GPU-2c7d9e3f-5a4b-4c62-9d8e-0f1a2b3c4d82"
"""GPU 2 of e2e-fast, ~55% busy, which no finding the test waits for needs: the Job's, in the
other namespace."""
JOB = "vision-train"
GROUP_LABEL = "team"
TEAMS = ("serving", "vision")
"""The Deployment's pods' team and the Job's (the pods' GROUP_LABEL)."""
GPU_MODEL = "NVIDIA H200"
"""e2e-fast's GPUs."""
PRICE = 3.5
"""accounting.pricePerGpuHour of GPU_MODEL here."""
SM_SHARE = 0.85
"""The scripted backend's SM activity (which the accounting counts as use) where a GPU's script
gives only its utilization."""
EFFICIENCY = ((0.03 * SM_SHARE + 0.875 * SM_SHARE + 0.97) / 3, 0.55 * SM_SHARE)
"""Used over allocated GPU time, from the GPUs' scripts: the Deployment's (the idle GPU, the leaking
one's sawtooth, the saturated one's SM activity) and the Job's."""
EMPTY_LABELS = {"mig_id"}
"""Legend labels empty here (whole GPUs, no MIG), which Prometheus stores as no label at all."""


def monitoring_values(node: Node) -> dict[str, Any]:
    """test_chart_on_node's values, with the chart's monitoring on."""
    values = chart_values(node)
    interval = f"{SCRAPE_SECONDS}s"
    values["monitoring"] = {
        "podMonitor": {"enabled": True, "interval": interval, "scrapeTimeout": interval},
        "prometheusRule": {"enabled": True, "rules": {"GPUWardenGPUMemoryLeak": {"for": f"{LEAK_FOR}s"}}},
        "grafanaDashboard": {"enabled": True},
    }
    values["accounting"] = {
        "groupByLabel": GROUP_LABEL,
        "pricePerGpuHour": {GPU_MODEL: PRICE},
        "scrapeInterval": interval,  # a new row's zero is scraped before its seconds
    }
    return values


@dataclass
class Watched(Installed):
    prometheus: Prometheus = field(kw_only=True)
    monitors: list[dict[str, Any]] = field(kw_only=True)
    """The PodMonitors as the API server stored them."""
    rules: list[dict[str, Any]] = field(kw_only=True)
    """The PrometheusRule's rules as the API server stored them."""
    dashboards: dict[str, dict[str, Any]] = field(kw_only=True)
    """The ConfigMap's dashboards, by file name."""
    jobs: str = field(kw_only=True)
    """The other namespace: the Job's."""
    policy_at: float = 0.0
    """When the policy was applied: no finding can be older, nor any alert on one."""

    def leaking_pod(self) -> str:
        return self.allocated()[LEAK_GPU]

    def job_pod(self) -> str:
        (pod,) = self.pods(self.jobs, f"job-name={JOB}")
        return str(pod["metadata"]["name"])


def monitoring_crds(node: Node) -> None:
    """prometheus-operator's kinds on the node's API server, as test_chart.py's stand-ins.

    Left installed: the next module's install renders no monitoring object, and nothing else reads them.
    """
    cp = node.control_plane
    for kind, plural in _MONITORING_KINDS:
        if cp.kubectl("get", "crd", f"{plural}.monitoring.coreos.com").returncode != 0:
            cp.kubectl("create", "-f", "-", input=yaml.safe_dump(_stub_crd(kind, plural)), check=True)
    for _, plural in _MONITORING_KINDS:
        cp.kubectl(
            "wait", "--for=condition=established", "--timeout=60s", f"crd/{plural}.monitoring.coreos.com",
            check=True, timeout=90,
        )  # fmt: skip


@pytest.fixture(scope="module")
def prometheus_server() -> str:
    return prometheus_binary()


@pytest.fixture(scope="module")
def watched(
    node: Node, prometheus_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Watched]:
    cp = node.control_plane
    for image in (node.images.agent, node.images.operator):
        node.import_image(image.archive)
    cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}=true", "--overwrite", check=True)
    suffix = int(time.time()) % 100000
    namespace, jobs = cp.create_namespace(f"dash-{suffix}"), cp.create_namespace(f"dash-jobs-{suffix}")
    for ns in (namespace, jobs):
        cp.kubectl("wait", "--for=create", "serviceaccount/default", "-n", ns, "--timeout=60s", check=True)
    prometheus: Prometheus | None = None
    try:
        share_out(node, namespace, jobs)
        monitoring_crds(node)

        # Another module's install may leave its namespace terminating.
        cp.kubectl("wait", "--for=delete", f"namespace/{SYSTEM}", "--timeout=120s", check=True, timeout=150)
        installed_at = time.time()
        helm = cp.run_helm(
            "install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace", "-f", "-",
            input=yaml.safe_dump(monitoring_values(node)), timeout=180,
        )  # fmt: skip
        assert helm.returncode == 0, f"helm install: {helm.stderr}"
        monitors = get(cp, "podmonitors", "-n", SYSTEM)["items"]
        (rule,) = get(cp, "prometheusrules", "-n", SYSTEM)["items"]
        (dashboards,) = get(cp, "configmaps", "-n", SYSTEM, "-l", "app.kubernetes.io/component=monitoring")[
            "items"
        ]
        for selector in ("app.kubernetes.io/component=agent", "app.kubernetes.io/component=operator"):
            wait(node, SYSTEM, "--for=condition=Ready", "pod", "-l", selector)
        workdir = tmp_path_factory.mktemp("prometheus")
        prometheus = Prometheus(
            prometheus_server,
            workdir,
            [c for m in monitors for c in podmonitor_scrape_config(m, cp, workdir)],
            rule["spec"]["groups"],
            interval=f"{SCRAPE_SECONDS}s",
        )
        world = Watched(
            node, namespace, installed_at,
            jobs=jobs,
            prometheus=prometheus,
            monitors=monitors,
            rules=[r for group in rule["spec"]["groups"] for r in group["rules"]],
            dashboards={name: json.loads(text) for name, text in dashboards["data"].items()},
        )  # fmt: skip
        # The policy only now, so that Prometheus has seen the time before any finding.
        world.policy_at = time.time()
        # First at its maximum, so that the scaler knows the policy (its decision counters born at 0)
        # and Prometheus has scraped the zeros before the one scale-up: a counter whose first sample
        # is already 1 shows no increase() (Prometheus's rule for a new series), and the readings
        # are saturated before the policy exists, so it would scale at its first evaluation.
        scaling = policy(namespace, hi=SERVING, interval="1s")
        scaling["spec"]["rules"].append(LEAK_RULE)
        apply(node, namespace, scaling)
        zeros = f'gpuwarden_policy_scale_decisions_total{{namespace="{namespace}"}} == 0'
        until(world, lambda: world.prometheus.query(zeros), "the policy's scale decisions scraped at 0")
        scaling["spec"]["actions"]["scale"]["maxReplicas"] = SERVING + 1
        apply(node, namespace, scaling)
        yield world
    finally:
        if prometheus is not None:
            prometheus.stop()
        cp.kubectl("delete", "namespace", namespace, jobs, "--wait=true", "--timeout=90s", timeout=120)
        cp.run_helm("uninstall", RELEASE, "--namespace", SYSTEM, "--wait", "--timeout=90s", timeout=120)
        cp.kubectl("delete", "namespace", SYSTEM, "--wait=true", "--timeout=120s", timeout=150)
        cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}-")


def share_out(node: Node, namespace: str, jobs: str) -> None:
    """The GPUs held as the test wants: :data:`JOB_GPU` by the Job's pod in ``jobs``, the others by
    the Deployment's in ``namespace``.

    The kubelet hands out free GPUs in no set order, so the Deployment takes all four first, and
    the one that got :data:`JOB_GPU` is the one its scale-down removes (the lowest deletion cost):
    the Job's pod then finds only that one free.
    """
    server = container(
        "server",
        node.images.workload.name,
        ["sleep", "infinity"],
        resources={"limits": {"nvidia.com/gpu": 1}},
    )
    serving = deployment(APP, SERVING + 1, server)
    serving["spec"]["template"]["metadata"]["labels"] = {"app": APP, GROUP_LABEL: TEAMS[0]}
    apply(node, namespace, serving)
    wait(node, namespace, "--for=condition=Available", f"deployment/{APP}")
    holder = Installed(node, namespace, time.time()).allocated()[JOB_GPU]
    cp = node.control_plane
    cost = "controller.kubernetes.io/pod-deletion-cost=-1000"
    cp.kubectl("annotate", "pod", "-n", namespace, holder, cost, check=True)
    cp.kubectl("scale", "deployment", APP, "-n", namespace, f"--replicas={SERVING}", check=True)
    wait(node, namespace, "--for=delete", f"pod/{holder}")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": JOB},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"app": JOB, GROUP_LABEL: TEAMS[1]}},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{**server, "name": "trainer"}],
                },
            },
        },
    }
    apply(node, jobs, job)
    wait(node, jobs, "--for=jsonpath={.status.ready}=1", f"job/{JOB}")  # its pod may not exist yet
    env = cp.kubectl("exec", "-n", jobs, f"job/{JOB}", "--", "printenv", "NVIDIA_VISIBLE_DEVICES", check=True)
    assert env.stdout.strip() == JOB_GPU, "the Job's pod got another GPU than the one set free for it"


def until(world: Watched, probe: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    """:func:`wait_until`, failing with Prometheus' log and the pods' on a timeout."""
    try:
        return wait_until(probe, timeout=timeout, what=what, every=1.0)
    except Timeout as exc:
        raise AssertionError(
            f"{exc}\n--- prometheus ---\n{world.prometheus.process.log_tail(40)}\n{world.diagnose()}"
        ) from None


def test_prometheus_scrapes_the_agent_and_both_operators_as_the_podmonitors_say(watched: Watched) -> None:
    jobs = {f"{SYSTEM}/{m['metadata']['name']}": m for m in watched.monitors}
    assert len(jobs) == 2  # the operator's and the agent's

    def all_up() -> list[dict[str, Any]] | None:
        targets = watched.prometheus.targets()
        up = [t for t in targets if t["health"] == "up"]
        return targets if len(targets) == 3 and len(up) == 3 else None

    targets = until(watched, all_up, "the agent and both operator replicas scraped")
    operators = {p["metadata"]["name"] for p in watched.pods(SYSTEM, "app.kubernetes.io/component=operator")}
    agent = watched.agent_pod()["metadata"]["name"]
    by_instance = {t["labels"]["instance"]: t["labels"] for t in targets}
    assert set(by_instance) == {*operators, agent}
    for instance, labels in by_instance.items():
        assert labels["job"] in jobs
        assert labels["job"].endswith("-agent" if instance == agent else "-operator")
        assert labels["node"] == watched.node.name
        # The chart drops the target's own namespace/pod/container: a GPU series keeps its workload's.
        assert not {"namespace", "pod", "container"} & set(labels)


# ------------------------------------------------------------------------------------------ panels


def variables(world: Watched, since: float, at: float) -> dict[str, str]:
    """What Grafana puts for each variable at ``at``: this node, both namespaces (a multiple choice,
    as Grafana writes it for a regex match; DNS names: nothing in them for its escaping to escape),
    its interval variables at this scrape interval, and the time range since ``since``."""
    return {
        "node": world.node.name,
        "namespace": f"({world.namespace}|{world.jobs})",
        "__rate_interval": RATE_INTERVAL,
        "__interval": f"{SCRAPE_SECONDS}s",
        "__range": f"{int(at - since) + 1}s",
    }


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced; an unknown variable fails the test."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


Series = list[tuple[dict[str, str], float]]
"""A query's answer: each series' labels and its last value."""
Check = Callable[[Series], bool]


def run_target(world: Watched, target: dict[str, Any], since: float, at: float) -> Series:
    """The target's query as Grafana sends it at ``at``: instant, or a range over the half minute before."""
    expr = substitute(target["expr"], variables(world, since, at))
    if target.get("instant"):
        return [(s["metric"], float(s["value"][1])) for s in world.prometheus.query(expr, at)]
    matrix = world.prometheus.query_range(expr, at - 30, at, SCRAPE_SECONDS)
    return [(s["metric"], float(s["values"][-1][1])) for s in matrix]


def one(series: Series) -> float:
    (only,) = series
    return only[1]


def keyed(series: Series, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(m.get(label, "") for label in labels): v for m, v in series}


def near(value: float, expected: float, within: float) -> bool:
    return abs(value - expected) <= within


def expectations(world: Watched) -> dict[str, Check | dict[str, Check]]:
    """Every panel of both dashboards, by title, and what its answer must show in this scenario
    (by refId where the panel's targets show different things)."""
    ns, jobs, node = world.namespace, world.jobs, world.node.name
    gpus = {(node, str(i)) for i in range(GPUS)}
    pods = {(ns, pod) for pod in world.allocated().values()} | {(jobs, world.job_pod())}
    leak = (ns, world.leaking_pod(), "llm-serving", "leak")
    reasons = {(ns, "GPUUnderutilized"), (ns, "GPUSaturated"), (ns, "GPUMemoryLeakSuspected")}
    serving = {(ns, "Deployment", APP)}

    def by(*labels: str) -> Callable[[Series], dict[tuple[str, ...], float]]:
        return lambda s: keyed(s, *labels)

    def split(label: str, first: str, second: str, check: Callable[[float, float], bool]) -> Check:
        """Series for ``first`` and ``second`` of ``label`` and no other, and ``check`` of their values."""

        def holds(s: Series) -> bool:
            values = keyed(s, label)
            return set(values) == {(first,), (second,)} and check(values[(first,)], values[(second,)])

        return holds

    def namespaces(check: Callable[[float, float], bool]) -> Check:
        """The Deployment's namespace and the Job's, ``check(deployment's, job's)``."""
        return split("namespace", ns, jobs, check)

    def teams(check: Callable[[float, float], bool]) -> Check:
        return split("group", *TEAMS, check)

    def three_to_one(a: float, b: float) -> bool:  # three GPUs held to one, for as long
        return 2.7 <= a / b <= 3.3

    def more(a: float, b: float) -> bool:
        return a > b > 0

    def idle_only_first(a: float, b: float) -> bool:  # the Deployment's idle GPU; the Job's at 55%
        return a > 0 and b == 0

    def efficient(within: float) -> Callable[[float, float], bool]:
        return lambda a, b: near(a, EFFICIENCY[0], within) and near(b, EFFICIENCY[1], within)

    def worst(check: Callable[[float], bool]) -> Check:
        """The Deployment alone: the Job was never idle."""
        return lambda s: set(by("namespace", "workload_kind", "workload")(s)) == serving and check(one(s))

    return {
        # gpuwarden / GPUs: the agent's series.
        "GPUs reporting": lambda s: one(s) == GPUS,
        "Mean GPU utilization": lambda s: 0 < one(s) < 1,
        "Idle allocated GPUs (15m < 5%)": lambda s: one(s) >= 1,  # GPU 0, ~3%
        "GPU memory in use": lambda s: 0 < one(s) < 1,
        "GPU utilization by GPU": lambda s: set(by("node", "index")(s)) == gpus,
        "GPU memory used by GPU": lambda s: set(by("node", "index")(s)) == gpus,
        "GPU utilization by pod": lambda s: pods <= set(by("namespace", "pod")(s)),
        "GPU memory used by pod": lambda s: pods <= set(by("namespace", "pod")(s)),
        # gpuwarden / Findings and waste: the operator's.
        "Active findings": lambda s: one(s) >= 3,
        "Pods with an active finding": lambda s: one(s) >= 3,
        "Soonest memory full": lambda s: 0 < one(s) < 3600,
        "Scale decisions": lambda s: one(s) >= 1,
        "Active findings by reason and namespace": lambda s: reasons <= set(by("namespace", "reason")(s)),
        "Active findings by pod": lambda s: (
            (*leak[:2], "GPUMemoryLeakSuspected") in by("namespace", "pod", "reason")(s)
            and reasons <= set(by("namespace", "reason")(s))
            and all(v >= 0 for _, v in s)
        ),
        "Leaks: time until the memory is full": lambda s: (
            0 < by("namespace", "pod", "policy", "rule")(s)[leak] < 3600
        ),
        "Scaling decisions": lambda s: (
            (ns, "llm-serving", "ScaledUp") in by("namespace", "policy", "reason")(s)
        ),
        "Desired replicas by policy": lambda s: (
            by("namespace", "policy")(s)[(ns, "llm-serving")] == SERVING + 1
        ),
        # ... and its accounting counters.
        "GPU-hours wasted by namespace": namespaces(idle_only_first),
        "GPU-hours allocated and used by namespace": {
            "A": namespaces(three_to_one),
            "B": namespaces(more),
            "C": namespaces(idle_only_first),
            "D": namespaces(efficient(0.05)),
        },
        "GPU efficiency by namespace": namespaces(efficient(0.1)),  # over 8 s: the sawtooth's phase
        "Idle GPUs by namespace": namespaces(lambda a, b: near(a, 1, 0.15) and b == 0),
        "Worst workloads by idle GPU-hours": {
            "A": worst(lambda v: v > 0),
            "B": worst(lambda v: v > 0),
            "C": worst(lambda v: near(v, EFFICIENCY[0], 0.05)),
        },
        "Idle cost by namespace": namespaces(idle_only_first),
        "GPU-hours by group": {"A": teams(three_to_one), "B": teams(more), "C": teams(idle_only_first)},
    }


def panels(world: Watched) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, dashboard in sorted(world.dashboards.items()):
        for panel in dashboard["panels"]:
            yield f"{name}: {panel['title']}", panel


def test_every_panel_of_both_dashboards_returns_the_series_it_shows(watched: Watched) -> None:
    assert set(watched.dashboards) == {"gpuwarden-gpus.json", "gpuwarden-findings.json"}
    expected = expectations(watched)
    titles = [panel["title"] for _, panel in panels(watched)]
    assert sorted(set(titles)) == sorted(expected), "a panel without an expectation here, or one gone"
    for where, panel in panels(watched):
        check = expected[panel["title"]]
        if isinstance(check, dict):
            assert set(check) == {t["refId"] for t in panel["targets"]}, where
    since = watched.installed_at

    def problems() -> list[str]:
        at = time.time()  # one refresh: every panel at the same time
        out = []
        for where, panel in panels(watched):
            for target in panel["targets"]:
                try:
                    series = run_target(watched, target, since, at)
                except PrometheusError as exc:
                    out.append(f"{where} [{target['refId']}]: {exc}")
                    continue
                # The legend's labels are on every series it names.
                legend = (
                    set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))) - EMPTY_LABELS
                )
                missing = [m for m, _ in series if not legend <= set(m)]
                check = expected[panel["title"]]
                if isinstance(check, dict):
                    check = check[target["refId"]]
                if not series or missing or not _holds(check, series):
                    out.append(f"{where} [{target['refId']}] {target['expr']!r} -> {series}")
        return out

    try:
        wait_until(lambda: not problems(), timeout=TIMEOUT, what="every panel's data", every=2.0)
    except Timeout:
        pytest.fail("panels without their data:\n" + "\n".join(problems()) + f"\n{watched.diagnose()}")


def _holds(check: Check, series: Series) -> bool:
    try:
        return bool(check(series))
    except (ValueError, KeyError, ZeroDivisionError):  # one() of several or none; a series missing
        return False


def test_the_idle_cost_is_the_wasted_gpu_hours_at_the_price(watched: Watched) -> None:
    findings = watched.dashboards["gpuwarden-findings.json"]["panels"]
    (hours,) = next(p for p in findings if p["title"] == "GPU-hours wasted by namespace")["targets"]
    (cost,) = next(p for p in findings if p["title"] == "Idle cost by namespace")["targets"]

    def both() -> tuple[dict[tuple[str, ...], float], dict[tuple[str, ...], float]] | None:
        at, since = time.time(), watched.installed_at
        idle, costs = (keyed(run_target(watched, t, since, at), "namespace") for t in (hours, cost))
        return (idle, costs) if idle.get((watched.namespace,), 0) > 0 else None

    idle, costs = until(watched, both, "idle GPU-hours counted")
    assert set(costs) == set(idle) == {(watched.namespace,), (watched.jobs,)}
    for namespace, value in idle.items():
        assert costs[namespace] == pytest.approx(value * PRICE, rel=1e-9), namespace


def test_every_variable_lists_this_node_and_both_namespaces(watched: Watched) -> None:
    wanted = {"node": [watched.node.name], "namespace": [watched.namespace, watched.jobs]}
    for name, dashboard in sorted(watched.dashboards.items()):
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
            assert match, f"{name}: {variable['name']}: not a label_values query"
            metric, label = match.groups()
            for value in wanted[variable["name"]]:

                def lists(metric: str = metric, label: str = label, value: str = value) -> bool:
                    return value in watched.prometheus.api(f"label/{label}/values", **{"match[]": metric})

                until(watched, lists, f"{name}: ${variable['name']} listing {value}")


# ------------------------------------------------------------------------------------------- rules


def test_every_rule_loads_and_evaluates_without_an_error(watched: Watched) -> None:
    names = sorted(str(r.get("alert") or r.get("record")) for r in watched.rules)

    def evaluated() -> list[dict[str, Any]] | None:
        loaded = watched.prometheus.rules()
        return loaded if all(r["health"] != "unknown" for r in loaded) else None

    loaded = until(watched, evaluated, "every rule evaluated once", 60)
    assert sorted(r["name"] for r in loaded) == names
    assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []


def first_sample(world: Watched, selector: str) -> float | None:
    """The timestamp of the first raw sample of ``selector`` in the last half hour (None: none)."""
    series = world.prometheus.query(f"{selector}[30m]")
    return min((float(v[0]) for s in series for v in s["values"]), default=None)


def test_the_leak_alert_fires_for_the_leaking_pod_once_its_finding_held_for_its_for(watched: Watched) -> None:
    leak = watched.leaking_pod()
    alert = f'ALERTS{{alertname="GPUWardenGPUMemoryLeak",namespace="{watched.namespace}",pod="{leak}"'

    firing = until(
        watched, lambda: watched.prometheus.query(alert + ',alertstate="firing"}'), "the alert firing"
    )
    (labels,) = [s["metric"] for s in firing]
    assert (labels["policy"], labels["rule"], labels["severity"]) == ("llm-serving", "leak", "warning")
    assert labels["reason"] == "GPUMemoryLeakSuspected"

    # Not before: the condition's first sample (the operator's leak finding, scraped), then the alert
    # pending from the evaluation that saw it, then firing LEAK_FOR later.
    finding = f'gpuwarden_finding_started_timestamp_seconds{{pod="{leak}",reason="GPUMemoryLeakSuspected"}}'
    condition = first_sample(watched, finding)
    pending = first_sample(watched, alert + ',alertstate="pending"}')
    fired = first_sample(watched, alert + ',alertstate="firing"}')
    assert condition is not None
    assert pending is not None
    assert fired is not None
    assert condition >= watched.policy_at - 1  # no finding, no series, before the policy
    assert pending >= condition
    assert fired - pending >= LEAK_FOR - 0.01
    (active,) = [
        a
        for a in watched.prometheus.api("alerts")["alerts"]
        if a["labels"].get("alertname") == labels["alertname"]
    ]
    assert active["state"] == "firing"
    # Its time to full, from the operator's projection: the leak's ~40 minutes.
    assert re.search(r"; at its rate it is full in [1-5][0-9]m ", active["annotations"]["description"])
    # The other findings (idle, saturated) are not leaks: no alert of this name for their pods.
    others = watched.prometheus.query('ALERTS{alertname="GPUWardenGPUMemoryLeak"}')
    assert {s["metric"]["pod"] for s in others} == {leak}

"""gpuwarden's alert rules in a real Prometheus, firing for the real operator's findings.

The operator and a scripted agent run as their own processes against the real API server (as in
test_operator_rules.py), with four GPU pods breaking a rule each from the start: ``idle-0`` at about
3% (utilizationFloor); ``leak-0`` growing 3Gi/m (memoryGrowth, its card full in about 40 minutes);
``flood-0`` growing 40Gi/m (memoryGrowth's GPUMemoryExhaustionImminent, its card full after about
three and a half minutes, when the tests are done); and ``broken-0``, whose GPU has an uncorrected ECC
error at 5 s (gpuHealth). Debian's Prometheus scrapes the operator and the agent under the job names
the rule file selects (``gpuwarden-operator``, ``gpuwarden-agent``, the agent's node added as
``node``, as the chart's monitors do) and loads charts/gpuwarden/rules/gpuwarden-alerts.yaml, the
plain rule file users load, with shorter ``for``s.

Then every rule evaluates without an error; GPUWardenGPUIdle fires for the idle pod,
GPUWardenGPUMemoryLeak for the leaking one, GPUWardenGPUMemoryExhaustionImminent (critical) for the
flooding one and GPUWardenGPUUnhealthy for the broken one: each with the finding's labels and a
description naming the node (and for the leaks the time to full), not before the finding was scraped
and its ``for`` passed, and for no other pod. The alerts that wrong scrape job names would raise are
not even pending.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane
from operator_support import (
    AGENT_NODE,
    IDLE_RULE,
    Timeout,
    World,
    gpu,
    monitor_policy,
    operator_and_agent,
    pod,
    prepare,
    wait_until,
)
from prometheus_support import Prometheus, prometheus_binary

pytestmark = pytest.mark.integration

RULES = REPO_ROOT / "charts" / "gpuwarden" / "rules" / "gpuwarden-alerts.yaml"
SCRAPE = "1s"
"""Prometheus' scrape and evaluation interval."""
FOR = {"GPUWardenGPUIdle": 5, "GPUWardenGPUMemoryLeak": 5, "GPUWardenGPUUnhealthy": 5}
"""The ``for`` this test gives the alerts it waits on, seconds (the imminent one keeps its 0s)."""
LABELS = {"team": "alerts"}
POLICY = "gpus"
# pod -> (alert, rule, the finding's reason, severity)
CASES = {
    "idle-0": ("GPUWardenGPUIdle", "idle", "GPUUnderutilized", "warning"),
    "leak-0": ("GPUWardenGPUMemoryLeak", "leak", "GPUMemoryLeakSuspected", "warning"),
    "flood-0": ("GPUWardenGPUMemoryExhaustionImminent", "leak", "GPUMemoryExhaustionImminent", "critical"),
    "broken-0": ("GPUWardenGPUUnhealthy", "gpu-health", "GPUUnhealthy", "warning"),
}
TIMEOUT = 150.0
"""The leak is found about a minute into the readings; the rest within seconds."""


def scenario(namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    uuids = [f"GPU-a1e47000-0000-4000-8000-00000000000{i}" for i in range(4)]
    gpus = [
        gpu(uuids[0], 0, [{"kind": "idle", "level": 3, "noise": 1}], [{"kind": "idle", "level": "9Gi"}]),
        gpu(uuids[1], 1, [{"kind": "idle", "level": 50, "noise": 2}],
            [{"kind": "leak", "start": "20Gi", "rate": "3Gi/m", "noise": "2Mi"}]),
        gpu(uuids[2], 2, [{"kind": "idle", "level": 50, "noise": 2}],
            [{"kind": "leak", "start": "1Gi", "rate": "40Gi/m", "noise": "2Mi"}]),
        gpu(uuids[3], 3, [{"kind": "idle", "level": 50, "noise": 2}], [{"kind": "idle", "level": "9Gi"}]),
    ]  # fmt: skip
    gpus[3]["health"] = [{"kind": "ecc", "at": "5s", "uncorrected": 1}]
    pods = [pod(namespace, name, uuids[i], LABELS, 5000 + i) for i, name in enumerate(CASES)]
    return gpus, pods


def rule_groups() -> list[dict[str, Any]]:
    """The rule file's groups, with this test's shorter ``for``s."""
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            if rule["alert"] in FOR:
                rule["for"] = f"{FOR[rule['alert']]}s"
    return groups


@dataclass
class Alerting(World):
    prometheus: Prometheus
    groups: list[dict[str, Any]]

    def alerts(self, name: str, state: str | None = None) -> dict[str, dict[str, Any]]:
        """Prometheus' active alerts of ``name`` (in ``state``), by pod."""
        return {
            a["labels"].get("pod", ""): a
            for a in self.prometheus.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and state in (None, a["state"])
        }

    def until(self, probe: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        """:func:`wait_until`, failing with Prometheus' log on a timeout."""
        try:
            return wait_until(probe, timeout=timeout, what=what, every=0.5, alive=self.alive)
        except Timeout as exc:
            raise AssertionError(
                f"{exc}\n--- prometheus ---\n{self.prometheus.process.log_tail(40)}"
            ) from None


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Alerting]:
    binary = prometheus_binary()
    setup = prepare(control_plane, tmp_path_factory, "alerts", gpu_pods=CASES, labels=LABELS)
    rules = [
        IDLE_RULE,
        {"name": "leak", "memoryGrowth": {"rate": "1Gi/m", "window": "1m", "minFit": 0.8}},
        {"name": "gpu-health", "gpuHealth": {}},
    ]
    setup.apply(monitor_policy(setup.namespace, POLICY, rules, selector={"matchLabels": LABELS}))
    gpus, pods = scenario(setup.namespace)
    groups = rule_groups()
    with operator_and_agent(setup, setup.scenario("alerts", gpus, pods)) as (operator, agent):
        scrape: list[dict[str, Any]] = [
            {
                "job_name": "gpuwarden-operator",
                "static_configs": [{"targets": [f"127.0.0.1:{operator.metrics_port}"]}],
            },
            {
                "job_name": "gpuwarden-agent",
                "honor_labels": True,  # the GPU series' namespace and pod are the workload's
                "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"], "labels": {"node": AGENT_NODE}}],
            },
        ]
        prometheus = Prometheus(binary, setup.workdir / "prometheus", scrape, groups, interval=SCRAPE)
        try:
            yield Alerting(control_plane, setup.namespace, operator, agent, prometheus, groups)
        finally:
            prometheus.stop()


def test_every_rule_loads_and_evaluates_without_an_error(world: Alerting) -> None:
    names = sorted(r["alert"] for g in world.groups for r in g["rules"])

    def evaluated() -> list[dict[str, Any]] | None:
        loaded = world.prometheus.rules()
        return loaded if loaded and all(r["health"] != "unknown" for r in loaded) else None

    loaded = world.until(evaluated, "every rule evaluated once", 60)
    assert sorted(r["name"] for r in loaded) == names
    assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []


def first_sample(world: Alerting, selector: str) -> float | None:
    """The timestamp of the first raw sample of ``selector`` in the last ten minutes (None: none)."""
    series = world.prometheus.query(f"{selector}[10m]")
    return min((float(v[0]) for s in series for v in s["values"]), default=None)


@pytest.mark.parametrize("pod_name", list(CASES))
def test_the_alert_fires_for_the_pod_once_its_finding_held_for_its_for(
    world: Alerting, pod_name: str
) -> None:
    name, rule, reason, severity = CASES[pod_name]
    firing = world.until(lambda: world.alerts(name, "firing").get(pod_name), f"{name} firing for {pod_name}")
    labels, annotations = firing["labels"], firing["annotations"]
    assert labels == {
        "alertname": name,
        "namespace": world.namespace,
        "pod": pod_name,
        "policy": POLICY,
        "rule": rule,
        "reason": reason,
        "severity": severity,
    }
    assert f"pod {world.namespace}/{pod_name} on node {AGENT_NODE} " in annotations["description"]
    assert annotations["runbook_url"].endswith(f"/docs/alerts.md#{name.lower()}")
    if rule == "leak":  # the operator's projection: the leak's ~40 minutes, the flood's few
        full_in = re.search(r"full in ((\d+)m )?[\d.]+s", annotations["description"])
        assert full_in, annotations["description"]
        assert int(full_in.group(2) or 0) < (45 if pod_name == "leak-0" else 5)

    # Not before: the finding's first scraped sample, then the alert pending from the evaluation that
    # saw it (never before the policy's first finding for the pod), then firing its `for` later.
    alert = f'ALERTS{{alertname="{name}",pod="{pod_name}"'
    condition = first_sample(
        world, f'gpuwarden_finding_started_timestamp_seconds{{pod="{pod_name}",reason="{reason}"}}'
    )
    pending = first_sample(world, alert + ',alertstate="pending"}')
    fired = first_sample(world, alert + ',alertstate="firing"}')
    assert condition is not None
    assert fired is not None
    if name in FOR:
        assert pending is not None
        assert condition <= pending
        assert fired - pending >= FOR[name] - 0.01
    else:  # `for: 0s`: firing from the first evaluation that sees it
        assert pending is None
        assert condition <= fired


def test_each_alert_fires_for_its_pod_alone(world: Alerting) -> None:
    def all_firing() -> bool:
        return all(world.alerts(name, "firing").get(pod_name) for pod_name, (name, *_) in CASES.items())

    world.until(all_firing, "every pod's alert firing")
    active = {
        (a["labels"]["alertname"], a["labels"]["pod"])
        for a in world.prometheus.api("alerts")["alerts"]
        if a["labels"]["alertname"].startswith("GPUWardenGPU")
    }
    assert active == {(name, pod_name) for pod_name, (name, *_) in CASES.items()}


def test_the_scrape_jobs_are_the_ones_the_rules_select(world: Alerting) -> None:
    """The operator is up and the agent's reports arrive, so the alerts that would fire on wrong job
    names (an `absent` of the operator's `up`; agents up with no report received) are not even pending."""
    world.until(lambda: world.alerts("GPUWardenGPUIdle", "firing"), "the first finding's alert firing")
    watching = {"GPUWardenOperatorDown", "GPUWardenOperatorReceivesNoReports", "GPUWardenAgentDown"}
    assert watching <= {r["alert"] for g in world.groups for r in g["rules"]}
    assert (
        world.prometheus.query('count(up{job=~"gpuwarden-operator|gpuwarden-agent"} == 1)')[0]["value"][1]
        == "2"
    )
    active = [a["labels"] for a in world.prometheus.api("alerts")["alerts"]]
    assert [a for a in active if a["alertname"] in watching] == []

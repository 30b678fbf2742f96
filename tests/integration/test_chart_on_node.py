"""The chart installed with ``helm install`` on the real test node, as a user installs it.

The values are the local images (``global.imageRegistry`` and the two tags) and the scripted
backend playing ``e2e-fast`` (the same four GPU UUIDs the node's device plugin advertises), with
``--attribution kubelet``: nothing else of the chart changes. The node's label
``nvidia.com/gpu.present=true`` is what NVIDIA's GPU feature discovery puts on a GPU node, and
what the chart's default ``agent.nodeSelector`` asks for.

What runs for real: the agent DaemonSet pod and both operator replicas (their probes, ``hostPID``,
the read-only root filesystems, the projected token), the kubelet's GPU allocation through the
device plugin and its PodResources socket, the ingest Service through kube-proxy and CoreDNS, the
TokenReview, the Events and the ``/scale`` patch. Only NVML is scripted. The scenario's processes
have made-up PIDs, so ``/proc/<pid>/cgroup`` under ``hostPID`` finds no container for them: GPU to
pod attribution here is the kubelet's PodResources answer, not per-process attribution.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from controlplane import REPO_ROOT, generate_pki
from node import CONTAINERD_SOCKET, Node
from operator_support import Timeout, events, get, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_node import apply, container, deployment, describe, wait
from test_operator_scaling import APP, policy  # idle-gpu < 20%, saturated > 90%, each for 5s

pytestmark = pytest.mark.integration

CHART = REPO_ROOT / "charts" / "gpuwarden"
RELEASE = "gpuwarden"
SYSTEM = "gpuwarden-system"
REPLICAS = 4
"""One pod per GPU of the node: every GPU is allocated, whichever way the kubelet hands them out."""
GPU_PRESENT = "nvidia.com/gpu.present"
IDLE_GPU = "GPU-0d3f5a1e-7c21-4b8e-9a0f-3e1d2c4b5a60"
"""GPU 0 of e2e-fast: ~3% busy from the start."""
SATURATED_GPU = "GPU-3e8f0a4b-6c5d-4d73-8e9f-1a2b3c4d5e93"
"""GPU 3 of e2e-fast: ~98% busy."""
TIMEOUT = 120.0
GRACE = 15.0
"""The reclaim policy's gracePeriod, seconds."""
POLICY = "llm-serving"
"""test_operator_scaling's policy: one more replica when a pod is saturated, at most REPLICAS + 1."""
T = TypeVar("T")


def values(node: Node) -> dict[str, Any]:
    images = node.images
    return {
        "global": {"imageRegistry": images.registry},
        # Reclaiming is granted (test_an_idle_deployment_is_reclaimed_and_restored); no policy here asks
        # for it but that test's, so the other tests see no difference.
        "operator": {"image": {"tag": images.operator_tag}, "reclaim": {"enabled": True}},
        "agent": {
            "image": {"tag": images.agent_tag},
            "backend": "scripted",
            "extraArgs": ["--scenario=e2e-fast", "--attribution=kubelet"],
        },
    }


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A Prometheus text page: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


@dataclass
class Installed:
    node: Node
    namespace: str
    """The workloads' namespace (the policy's)."""
    installed_at: float
    """Wall-clock time ``helm install`` started."""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def cp(self) -> Any:
        return self.node.control_plane

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return list(get(self.cp, "pods", "-n", namespace, "-l", selector)["items"])

    def agent_pod(self) -> dict[str, Any]:
        (agent,) = self.pods(SYSTEM, "app.kubernetes.io/component=agent")
        return agent

    def active_operator(self) -> dict[str, Any] | None:
        active = self.pods(SYSTEM, "app.kubernetes.io/component=operator,gpuwarden.dev/ingest-active=true")
        return active[0] if len(active) == 1 and active[0]["status"].get("podIP") else None

    def agent_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return scrape(f"http://{self.agent_pod()['status']['podIP']}:9400/metrics")

    def attributed(self) -> dict[str, str]:
        """GPU UUID -> pod, as the agent's ``/metrics`` attributes them (pods of the namespace only)."""
        return {
            labels["uuid"]: labels["pod"]
            for labels, _ in self.agent_metrics().get("gpuwarden_gpu_up", [])
            if labels.get("namespace") == self.namespace
        }

    def operator_pods(self) -> dict[str, set[str]]:
        """Pod -> GPU UUIDs in the active operator's per-pod series (built from the agent's reports)."""
        active = self.active_operator()
        if active is None:
            return {}
        samples = scrape(f"http://{active['status']['podIP']}:8080/metrics")
        series: dict[str, set[str]] = {}
        for labels, _ in samples.get("gpuwarden_pod_gpu_utilization_percent", []):
            if labels["namespace"] == self.namespace:
                series.setdefault(labels["pod"], set()).add(labels["gpu"])
        return series

    def allocated(self) -> dict[str, str]:
        """GPU UUID -> pod, as the kubelet allocated them (each container's NVIDIA_VISIBLE_DEVICES)."""
        out: dict[str, str] = {}
        for p in self.pods(self.namespace, f"app={APP}"):
            if p["status"].get("phase") != "Running":
                continue
            name = p["metadata"]["name"]
            env = self.cp.kubectl(
                "exec", "-n", self.namespace, name, "--", "printenv", "NVIDIA_VISIBLE_DEVICES"
            )
            if env.returncode == 0:
                out[env.stdout.strip()] = name
        return out

    def replicas(self) -> int:
        return int(get(self.cp, "deployment", APP, "-n", self.namespace)["spec"]["replicas"])

    def until(self, probe: Callable[[], T | None], what: str, timeout: float = TIMEOUT) -> T:
        """:func:`wait_until`, failing with the pods, their logs and the node's on a timeout."""
        try:
            return wait_until(probe, timeout=timeout, what=what)
        except Timeout as exc:
            raise AssertionError(f"{exc}\n{self.diagnose()}") from None

    def diagnose(self) -> str:
        agent_log = self.cp.kubectl(
            "logs", "-n", SYSTEM, "-l", "app.kubernetes.io/component=agent", "--tail=40"
        )
        operator_log = self.cp.kubectl(
            "logs", "-n", SYSTEM, "-l", "app.kubernetes.io/component=operator", "--tail=60", "--prefix"
        )
        return (
            f"{describe(self.node, SYSTEM)}\n--- agent ---\n{agent_log.stdout}\n"
            f"--- operator ---\n{operator_log.stdout}"
        )


def prepare(node: Node, prefix: str) -> str:
    """The node ready for the chart (our images imported, labelled as a GPU node) and a workloads'
    namespace of its own (``<prefix>-NNNNN``, its default ServiceAccount made); also
    test_service_metrics.py's."""
    cp = node.control_plane
    for image in (node.images.agent, node.images.operator):
        node.import_image(image.archive)
    cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}=true", "--overwrite", check=True)
    namespace = cp.create_namespace(f"{prefix}-{int(time.time()) % 100000}")
    cp.kubectl("wait", "--for=create", "serviceaccount/default", "-n", namespace, "--timeout=60s", check=True)
    return namespace


def helm_install(node: Node) -> None:
    """``helm install`` of the chart with :func:`values`; the CRDs are Established when it returns."""
    cp = node.control_plane
    # An earlier module's release namespace may still be terminating (tear_down does not wait for it).
    cp.kubectl("wait", "--for=delete", f"namespace/{SYSTEM}", "--timeout=120s", check=True, timeout=150)
    helm = cp.run_helm(
        "install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace", "-f", "-",
        input=yaml.safe_dump(values(node)), timeout=180,
    )  # fmt: skip
    assert helm.returncode == 0, f"helm install: {helm.stderr}"


def tear_down(node: Node, namespace: str) -> None:
    """The workloads' namespace, the release, its namespace, the node's label."""
    cp = node.control_plane
    cp.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=90s", timeout=120)
    cp.run_helm("uninstall", RELEASE, "--namespace", SYSTEM, "--wait", "--timeout=90s", timeout=120)
    cp.kubectl("delete", "namespace", SYSTEM, "--wait=false")
    cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}-")


def run_gpu_deployment(node: Node, namespace: str) -> None:
    """The workload the chart's agent attributes: REPLICAS pods of one GPU each, Available."""
    apply(
        node,
        namespace,
        deployment(
            APP,
            REPLICAS,
            container(
                "server",
                node.images.workload.name,
                ["sleep", "infinity"],
                resources={"limits": {"nvidia.com/gpu": 1}},
            ),
        ),
    )
    wait(node, namespace, "--for=condition=Available", f"deployment/{APP}")


@pytest.fixture(scope="module")
def installed(node: Node) -> Iterator[Installed]:
    namespace = prepare(node, "inference")
    run_gpu_deployment(node, namespace)

    installed_at = time.time()
    helm_install(node)
    # helm installs the CRDs first and waits for them to be Established: the policy is accepted now.
    apply(node, namespace, policy(namespace, hi=REPLICAS + 1, interval="1s"))
    world = Installed(node, namespace, installed_at)
    try:
        yield world
    finally:
        tear_down(node, namespace)


def test_the_agent_and_the_operator_pods_become_ready(installed: Installed) -> None:
    """Ready by their own readiness probes (`/readyz`: the agent's first snapshot, Kopf running)."""
    for selector in ("app.kubernetes.io/component=agent", "app.kubernetes.io/component=operator"):
        wait(installed.node, SYSTEM, "--for=condition=Ready", "pod", "-l", selector)
    installed.timings["pods ready"] = time.time() - installed.installed_at
    agent = installed.agent_pod()
    assert agent["spec"]["nodeName"] == installed.node.name
    assert agent["spec"]["hostPID"] is True
    operators = installed.pods(SYSTEM, "app.kubernetes.io/component=operator")
    assert len(operators) == 2  # the chart's default: one active, one standing by
    installed.until(installed.active_operator, "an active operator replica", TIMEOUT)


def attributed_as_allocated(installed: Installed) -> None:
    """Every GPU is allocated, and the agent's ``/metrics`` and the operator's series name its pod.

    Also test_dra.py's, where the pods hold their GPUs through DRA claims.
    """
    allocated = installed.allocated()
    assert sorted(allocated) == sorted(installed.node.gpu_uuids)
    # The agent's attribution refreshes every 5 s from the kubelet's PodResources socket.
    installed.until(lambda: installed.attributed() == allocated, f"the agent attributing {allocated}", 60)
    # The reports reach the active operator through the ingest Service, with the projected token
    # (TokenReview, bound to this node): its per-pod series are made of them. Both replicas start
    # together and one may act first, then pause in favour of the other: reports answered
    # "503 Standby" meanwhile are retried with a backoff of up to 30 s, hence TIMEOUT here.
    installed.until(
        lambda: installed.operator_pods() == {pod: {uuid} for uuid, pod in allocated.items()},
        "the operator's per-pod series from the agent's reports",
        TIMEOUT,
    )


def test_the_agent_attributes_the_scripted_gpus_to_the_pods_the_kubelet_allocated(
    installed: Installed,
) -> None:
    attributed_as_allocated(installed)
    agent = installed.agent_metrics()
    assert total(agent, "gpuwarden_agent_reports_sent_total") > 0
    assert {labels["backend"] for labels, _ in agent["gpuwarden_agent_info"]} == {"scripted"}


def test_the_operator_warns_about_the_idle_pod_and_scales_the_deployment(installed: Installed) -> None:
    warns_about_the_idle_pod_and_scales(installed)
    print(f"\nhelm install → {installed.timings}")


def warns_about_the_idle_pod_and_scales(installed: Installed) -> None:
    """GPUUnderutilized on the idle GPU's pod only, GPUSaturated on the saturated one's, one replica more.

    Also test_dra.py's, where the pods hold their GPUs through DRA claims.
    """
    allocated = installed.allocated()
    idle = allocated[IDLE_GPU]

    def underutilized() -> list[Any]:
        return events(installed.cp, installed.namespace, kind="Pod", name=idle, reason="GPUUnderutilized")

    (first, *_) = installed.until(underutilized, f"GPUUnderutilized on {idle}", TIMEOUT)
    installed.timings["first Event"] = time.time() - installed.installed_at
    assert "policy llm-serving, rule idle-gpu" in first["message"]
    assert first["type"] == "Warning"
    # Only the idle GPU's pod is underutilized (e2e-fast's others run at 55% and more); the policy
    # has its own copy of the Event.
    assert events(
        installed.cp, installed.namespace, kind="GPUMonitorPolicy", name=POLICY, reason="GPUUnderutilized"
    )
    idle_pods = {
        e["involvedObject"]["name"]
        for e in events(installed.cp, installed.namespace, kind="Pod", reason="GPUUnderutilized")
    }
    assert idle_pods == {idle}

    saturated = allocated[SATURATED_GPU]
    installed.until(
        lambda: events(installed.cp, installed.namespace, kind="Pod", name=saturated, reason="GPUSaturated"),
        f"GPUSaturated on {saturated}",
        TIMEOUT,
    )
    installed.until(lambda: installed.replicas() == REPLICAS + 1, "one replica more", TIMEOUT)
    (up,) = installed.until(
        lambda: events(installed.cp, installed.namespace, kind="Deployment", name=APP, reason="ScaledUp"),
        "the ScaledUp Event",
        30,
    )
    assert f"scaled {APP} {REPLICAS}→{REPLICAS + 1}" in up["message"]


def test_a_deleted_pod_leaves_the_agents_series_and_its_reports(installed: Installed) -> None:
    allocated = installed.allocated()
    gone = allocated[IDLE_GPU]
    installed.cp.kubectl(
        "delete",
        "pod",
        "-n",
        installed.namespace,
        gone,
        "--grace-period=1",
        "--wait=true",
        check=True,
        timeout=90,
    )

    deleted_at = time.monotonic()

    def reattributed() -> bool:
        attributed = installed.attributed()
        return gone not in attributed.values() and attributed.get(IDLE_GPU, gone) != gone

    # The freed GPU goes to another pod of the Deployment (its replacement, or the one that was
    # Pending for want of a GPU), and the deleted pod is in neither the agent's nor the operator's series.
    installed.until(reattributed, f"{gone} gone from the agent's /metrics", 60)
    timings = {"agent": time.monotonic() - deleted_at}
    successor = installed.attributed()[IDLE_GPU]
    assert successor == installed.allocated()[IDLE_GPU]
    # The operator forgets a pod on its DELETED event, but a report the agent sent before its next
    # PodResources refresh (every 5 s) can still name the pod after that: the operator then keeps its
    # series until they are stale (60 s without a reading), hence the longer wait.
    installed.until(
        lambda: gone not in (series := installed.operator_pods()) and series.get(successor) == {IDLE_GPU},
        f"{gone} gone from the operator's series, {successor} in them",
        TIMEOUT,
    )
    timings["operator"] = time.monotonic() - deleted_at
    print(f"\npod deleted → gone from the series of {timings}")


def test_a_killed_operator_restarts_and_the_agent_replays_its_buffer(installed: Installed) -> None:
    active = installed.until(installed.active_operator, "an active operator replica", TIMEOUT)
    name = active["metadata"]["name"]
    (status,) = active["status"]["containerStatuses"]
    restarts = status["restartCount"]
    errors_before = total(installed.agent_metrics(), "gpuwarden_agent_report_errors_total")
    killed_at = time.monotonic()
    # SIGKILL from the node's containerd: no graceful hand-over, the ingest endpoint just vanishes.
    subprocess.run(
        ["ctr", f"--address={CONTAINERD_SOCKET}", "-n", "k8s.io", "tasks", "kill", "--signal=SIGKILL",
         status["containerID"].removeprefix("containerd://")],
        check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip

    def buffering() -> bool:
        # A failed POST keeps its snapshots buffered. The counter, not the buffer's gauge: a
        # container restart can take the kubelet a second, an outage shorter than one poll.
        return total(installed.agent_metrics(), "gpuwarden_agent_report_errors_total") > errors_before

    def restarted() -> bool:
        (s,) = get(installed.cp, "pod", name, "-n", SYSTEM)["status"]["containerStatuses"]
        return bool(s["restartCount"] > restarts and s["ready"])

    def replayed() -> bool:
        agent = installed.agent_metrics()
        return (
            total(agent, "gpuwarden_agent_report_buffer_snapshots") == 0
            and total(agent, "gpuwarden_agent_reports_sent_total") > sent_then
        )

    installed.until(buffering, "the agent failing to deliver and buffering its snapshots", 60)
    timings = {"buffering": time.monotonic() - killed_at}
    installed.until(restarted, f"{name} restarted and Ready again", TIMEOUT)
    timings["restarted, Ready"] = time.monotonic() - killed_at
    sent_then = total(installed.agent_metrics(), "gpuwarden_agent_reports_sent_total")
    installed.until(replayed, "the agent's buffer delivered", TIMEOUT)
    timings["buffer delivered"] = time.monotonic() - killed_at
    # Nothing was lost: the buffer held every snapshot of the outage (its limit is 900).
    assert total(installed.agent_metrics(), "gpuwarden_agent_report_dropped_snapshots_total") == 0
    # The active replica (the restarted one or the other) has every pod's series again.
    installed.until(
        lambda: len(installed.operator_pods()) >= REPLICAS,
        "the operator's per-pod series after the restart",
        TIMEOUT,
    )
    print(f"\nSIGKILL of the active operator → {timings}")


# ----------------------------------------------------------------------------- TLS and NetworkPolicy

PROBE = r"""
import asyncio, json, ssl, sys, time
from prometheus_client import CollectorRegistry
from gpuwarden.agent.sender import ReportSender
from gpuwarden.wire.node import GpuSample, Snapshot

url, ca_file, ca_pem, server_name, node = sys.argv[1:]
async def main() -> None:
    registry = CollectorRegistry()
    tls = ssl.create_default_context(cafile=ca_file or None, cadata=ca_pem or None)
    sender = ReportSender(url, node, "/var/run/secrets/gpuwarden/token", registry=registry, tls=tls,
                          server_name=server_name or None, backoff_base=0.2, backoff_cap=0.5)
    sender.submit(Snapshot(timestamp=time.time(), gpus=[GpuSample(uuid="GPU-tls-probe", index=0)]))
    try:
        await asyncio.wait_for(sender.flush(), 5)  # retries until delivered: a bound, not a wait
    except TimeoutError:
        pass
    errors = {s.labels["reason"]: s.value for m in registry.collect() for s in m.samples
              if s.name == "gpuwarden_agent_report_errors_total" and s.value}
    sent = registry.get_sample_value("gpuwarden_agent_reports_sent_total")
    print(json.dumps({"sent": sent, "errors": errors}))
asyncio.run(main())
"""
"""An agent's ReportSender run in the agent's pod (its token, its node), told how to reach the operator."""


def probe(installed: Installed, url: str, *, ca_file: str = "", ca_pem: str = "", name: str = "") -> Any:
    """What a sender made in the agent's own pod achieves: ``{"sent": N, "errors": {reason: n}}``."""
    agent = installed.agent_pod()
    out = installed.cp.kubectl(
        "exec", "-n", SYSTEM, agent["metadata"]["name"], "-c", "agent", "--",
        "python", "-c", PROBE, url, ca_file, ca_pem, name, installed.node.name,
        check=True, timeout=60,
    )  # fmt: skip
    return yaml.safe_load(out.stdout.strip().splitlines()[-1])


def test_reports_flow_over_tls_and_nothing_else_is_taken(installed: Installed, tmp_path: Path) -> None:
    """TLS is the default: the agent reports over https, checking the ingest Service's name against the
    chart's CA. From the same pod, with the same token: plain HTTP is refused by the operator, and a
    sender that trusts another CA refuses the operator (so sends nothing, its token included)."""
    agent = installed.agent_pod()
    (container,) = agent["spec"]["containers"]
    server = f"{RELEASE}-operator-ingest.{SYSTEM}.svc"
    url = f"https://{server}:8443/v1/reports"
    assert f"--operator-url={url}" in container["args"]
    assert "--operator-ca-file=/etc/gpuwarden/operator-ca/ca.crt" in container["args"]
    assert f"--operator-server-name={server}" in container["args"]
    # The agent itself: its reports are delivered (the attribution test saw the operator's series made
    # of them) and none ever failed verification.
    installed.until(installed.active_operator, "an active operator replica", TIMEOUT)
    agent_metrics = installed.agent_metrics()
    assert total(agent_metrics, "gpuwarden_agent_reports_sent_total") > 0
    tls_errors = [
        v for labels, v in agent_metrics["gpuwarden_agent_report_errors_total"] if labels["reason"] == "tls"
    ]
    assert tls_errors == [0.0]

    ca = "/etc/gpuwarden/operator-ca/ca.crt"
    trusted = probe(installed, url, ca_file=ca, name=server)
    assert trusted == {"sent": 1.0, "errors": {}}, trusted
    plain = probe(installed, f"http://{server}:8443/v1/reports")
    assert (plain["sent"], set(plain["errors"])) == (0.0, {"connection"}), plain
    other_ca = generate_pki(tmp_path / "other").ca_cert.read_text()  # a real CA, not the operator's
    wrong_ca = probe(installed, url, ca_pem=other_ca, name=server)
    assert (wrong_ca["sent"], set(wrong_ca["errors"])) == (0.0, {"tls"}), wrong_ca
    # The operator's own CA, but a name its certificate does not carry (the Service's ClusterIP).
    service_ip = get(installed.cp, "service", f"{RELEASE}-operator-ingest", "-n", SYSTEM)["spec"]["clusterIP"]
    by_ip = probe(installed, f"https://{service_ip}:8443/v1/reports", ca_file=ca)
    assert (by_ip["sent"], set(by_ip["errors"])) == (0.0, {"tls"}), by_ip


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart uses matchLabels only
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_the_network_policies_select_the_pods_they_are_meant_for(installed: Installed) -> None:
    """Checked against the running pods' labels, not enforced: the test node's CNI (bridge + host-local)
    does not implement NetworkPolicy, so the API server stores these and nothing drops a packet."""
    policies = {
        p["metadata"]["name"]: p["spec"] for p in get(installed.cp, "networkpolicy", "-n", SYSTEM)["items"]
    }
    assert set(policies) == {f"{RELEASE}-operator", f"{RELEASE}-agent"}
    operators = installed.pods(SYSTEM, "app.kubernetes.io/component=operator")
    agent = installed.agent_pod()
    workloads = installed.pods(installed.namespace, f"app={APP}")
    assert operators
    assert workloads

    operator_policy, agent_policy = policies[f"{RELEASE}-operator"], policies[f"{RELEASE}-agent"]
    for spec in (operator_policy, agent_policy):
        assert spec["policyTypes"] == ["Ingress"]
    assert all(_selects(operator_policy["podSelector"], p["metadata"]["labels"]) for p in operators)
    assert not _selects(operator_policy["podSelector"], agent["metadata"]["labels"])
    assert _selects(agent_policy["podSelector"], agent["metadata"]["labels"])
    assert not any(_selects(agent_policy["podSelector"], p["metadata"]["labels"]) for p in operators)

    ingest, metrics = operator_policy["ingress"]
    assert ingest["ports"] == [{"port": "ingest", "protocol": "TCP"}]
    (peer,) = ingest["from"]  # not sharded: the agents only
    assert set(peer) == {"podSelector"}  # this namespace's pods only
    assert _selects(peer["podSelector"], agent["metadata"]["labels"])
    assert not any(_selects(peer["podSelector"], p["metadata"]["labels"]) for p in operators + workloads)
    # Named ports resolve to the containers' ports: the ones the Services send to.
    (operator_container,) = operators[0]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in operator_container["ports"]} == {
        "metrics": 8080,
        "ingest": 8443,
    }
    (agent_container,) = agent["spec"]["containers"]
    assert {p["name"] for p in agent_container["ports"]} == {"metrics"}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for rule in (metrics, *agent_policy["ingress"]):
        assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics["from"] == [monitoring]
    # The agents' /metrics also admits `helm test`'s pod (it reads their reports counter), nothing else.
    (agent_metrics,) = agent_policy["ingress"]
    source, tester = agent_metrics["from"]
    assert source == monitoring
    assert tester["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"
    assert not any(_selects(tester["podSelector"], p["metadata"]["labels"]) for p in operators + workloads)
    assert not _selects(tester["podSelector"], agent["metadata"]["labels"])
    # Neither the workloads' namespace nor gpuwarden's own is the monitoring one.
    for ns in (installed.namespace, SYSTEM):
        labels = get(installed.cp, "namespace", ns)["metadata"]["labels"]
        assert not _selects(metrics["from"][0]["namespaceSelector"], labels)


# -- helm test, a broken agent, the uninstall: in this order, last (each changes the release) -------------

TEST_POD = f"{RELEASE}-test"
"""The helm test pod's name (`<fullname>-test`; the release is named after the chart)."""


def reclaim_policy(namespace: str) -> dict[str, Any]:
    """Scale the notebook Deployment to zero once its pod has idled 5 s, GRACE after the warning."""
    return {
        "apiVersion": "gpuwarden.dev/v1alpha1",
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": "reclaim", "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": "notebook"}},
            "evaluationInterval": "1s",
            "rules": [
                {"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5s", "signal": "gpuUtil"}}
            ],
            "actions": {
                "reclaim": {
                    "rules": ["idle-gpu"],
                    "action": "ScaleToZero",
                    "gracePeriod": f"{GRACE:.0f}s",
                    "dryRun": False,
                }
            },
        },
    }


def event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(
        event.get("eventTime") or event["metadata"]["creationTimestamp"]
    ).timestamp()


def test_an_idle_deployment_is_warned_scaled_to_zero_after_its_grace_period_and_restored(
    installed: Installed,
) -> None:
    """A notebook Deployment on the idle GPU: warned, scaled to zero a grace period later, restored."""
    cp, namespace = installed.cp, installed.namespace
    # Free the idle GPU for the notebook: the scaling policy stops acting, and llm-server gives up its
    # pod on that GPU (the lowest deletion cost goes first; its Pending extra replica before any).
    patch = '{"spec":{"actions":{"scale":{"dryRun":true}}}}'
    cp.kubectl("patch", "gpumonitorpolicy", POLICY, "-n", namespace, "--type=merge", "-p", patch, check=True)
    on_idle = installed.allocated()[IDLE_GPU]
    cp.kubectl(
        "annotate",
        "pod",
        on_idle,
        "-n",
        namespace,
        "controller.kubernetes.io/pod-deletion-cost=-1000",
        check=True,
    )
    cp.kubectl("scale", "deployment", APP, "-n", namespace, f"--replicas={REPLICAS - 1}", check=True)
    installed.until(lambda: get(cp, "pod", on_idle, "-n", namespace) is None, f"{on_idle} gone", TIMEOUT)
    apply(
        installed.node,
        namespace,
        deployment(
            "notebook",
            1,
            container(
                "notebook",
                installed.node.images.workload.name,
                ["sleep", "infinity"],
                resources={"limits": {"nvidia.com/gpu": 1}},
            ),
        ),
    )
    wait(installed.node, namespace, "--for=condition=Available", "deployment/notebook")
    (pod,) = installed.pods(namespace, "app=notebook")
    name = pod["metadata"]["name"]
    gpu = cp.kubectl("exec", "-n", namespace, name, "--", "printenv", "NVIDIA_VISIBLE_DEVICES", check=True)
    assert gpu.stdout.strip() == IDLE_GPU  # the only GPU left free
    apply(installed.node, namespace, reclaim_policy(namespace))

    def said(reason: str) -> list[Any]:
        return events(cp, namespace, kind="Deployment", name="notebook", reason=reason)

    (warning,) = installed.until(lambda: said("ReclaimPending"), "the ReclaimPending warning", TIMEOUT)
    assert "will scale Deployment notebook to zero at " in warning["message"]
    assert f"(in {GRACE:.0f}s) unless its GPUs work: idle-gpu on 1/1 pods" in warning["message"]
    assert events(cp, namespace, kind="Pod", name=name, reason="ReclaimPending")

    (done,) = installed.until(lambda: said("Reclaimed"), "the Reclaimed Event", GRACE + 60)
    # Not before the grace period the warning named (each Event is stamped when posted: a second's slack).
    assert event_time(done) - event_time(warning) >= GRACE - 1
    notebook = get(cp, "deployment", "notebook", "-n", namespace)
    assert notebook["spec"]["replicas"] == 0
    assert notebook["metadata"]["annotations"]["gpuwarden.dev/previous-replicas"] == "1"
    installed.until(
        lambda: installed.pods(namespace, "app=notebook") == [], "the notebook's pod gone", TIMEOUT
    )

    restored = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "restore", "deployment/notebook", "-n", namespace],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
        timeout=60,
        check=False,
    )
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.strip() == f"restored deployment/notebook in {namespace}: replicas 1"
    wait(installed.node, namespace, "--for=condition=Available", "deployment/notebook")
    notebook = get(cp, "deployment", "notebook", "-n", namespace)
    assert not any(k.startswith("gpuwarden.dev/") for k in notebook["metadata"].get("annotations") or {})
    cp.kubectl("delete", "gpumonitorpolicy", "reclaim", "-n", namespace, check=True)
    cp.kubectl("delete", "deployment", "notebook", "-n", namespace, check=True)


def helm_test(installed: Installed) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    run = installed.cp.run_helm("test", RELEASE, "-n", SYSTEM, "--timeout=90s", timeout=120)
    return run, time.monotonic() - started


def test_helm_test_passes_in_under_a_minute(installed: Installed) -> None:
    """`gpuwarden check` in the operator's image: the agent Ready and reporting, a policy evaluated."""
    wait(installed.node, SYSTEM, "--for=condition=Ready", "pod", "-l", "app.kubernetes.io/component=agent")
    run, seconds = helm_test(installed)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{installed.diagnose()}"
    assert "Phase:          Succeeded" in run.stdout
    assert seconds < 60, seconds
    installed.timings["helm test"] = seconds
    print(f"\nhelm test passed in {seconds:.1f} s")
    # Its policy is gone again, and the pod with it (hook-succeeded).
    assert get(installed.cp, "gpumonitorpolicies", "-n", SYSTEM)["items"] == []
    assert get(installed.cp, "pod", TEST_POD, "-n", SYSTEM) is None


def test_an_agent_that_sees_no_gpu_fails_helm_test_naming_the_fix(installed: Installed) -> None:
    """The nvml backend on this GPU-less machine stands for a node whose runtime gives the agent no GPU."""
    cp = installed.cp
    broken = cp.run_helm(
        "upgrade", RELEASE, str(CHART), "-n", SYSTEM, "--reuse-values",
        "--set", "agent.backend=nvml", "--set-json", "agent.extraArgs=[]", timeout=180,
    )  # fmt: skip
    assert broken.returncode == 0, broken.stderr
    try:

        def exited() -> str | None:
            for pod in installed.pods(SYSTEM, "app.kubernetes.io/component=agent"):
                for status in pod["status"].get("containerStatuses") or []:
                    message = ((status.get("lastState") or {}).get("terminated") or {}).get("message")
                    if message and "NVML" in message:
                        return str(message)
            return None

        message = installed.until(exited, "the nvml agent exiting with its message", TIMEOUT)
        assert "agent.runtimeClassName=nvidia" in message

        run, seconds = helm_test(installed)
        assert run.returncode != 0, run.stdout
        pod = get(cp, "pod", TEST_POD, "-n", SYSTEM)
        (status,) = pod["status"]["containerStatuses"]
        said = status["state"]["terminated"]["message"]
        assert "FAIL: agent pod" in said
        assert "NVML failed to initialise" in said
        assert "agent.runtimeClassName=nvidia" in said
        assert seconds < 90, seconds
        print(f"\nhelm test with an agent that sees no GPU ({seconds:.1f} s), its pod's message:\n{said}")
    finally:
        fixed = cp.run_helm(
            "upgrade", RELEASE, str(CHART), "-n", SYSTEM, "-f", "-",
            input=yaml.safe_dump(values(installed.node)), timeout=180,
        )  # fmt: skip
        assert fixed.returncode == 0, fixed.stderr
        # The rollout, not a wait on the pods: the broken one is replaced under a selector's feet.
        rollout = cp.kubectl(
            "rollout", "status", f"daemonset/{RELEASE}-agent", "-n", SYSTEM, "--timeout=120s", timeout=150
        )
        assert rollout.returncode == 0, f"{rollout.stderr}\n{installed.diagnose()}"


def test_after_helm_uninstall_the_policies_and_the_crd_delete_within_30s(installed: Installed) -> None:
    """No finalizer is left on the policies that nothing would remove once the operator is gone."""
    cp = installed.cp
    assert get(cp, "gpumonitorpolicy", POLICY, "-n", installed.namespace)["metadata"].get("finalizers") in (
        None,
        [],
    )
    uninstalled = cp.run_helm("uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout=90s", timeout=120)
    assert uninstalled.returncode == 0, uninstalled.stderr
    started = time.monotonic()
    for args in (
        ("gpumonitorpolicies", "--all", "-n", installed.namespace),
        ("crd", "gpumonitorpolicies.gpuwarden.dev"),
    ):
        deleted = cp.kubectl("delete", *args, "--timeout=30s", timeout=40)
        assert deleted.returncode == 0, deleted.stderr
    assert time.monotonic() - started < 30

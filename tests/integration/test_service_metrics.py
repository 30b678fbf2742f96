"""The pods' own metrics end to end on the real test node (issue 30): the chart's agent scrapes real HTTP
servers, the operator judges their latency and scales, and broken endpoints are refused without a stall.

The chart is installed as in ``test_chart_on_node.py`` (scripted NVML playing ``e2e-fast``, attributed
by the kubelet). The workloads are pods of our agent image running ``gpuwarden sim-server``: a
simulated vLLM replica behind real aiohttp, exporting real prometheus_client histograms under vLLM's
names; each holds one of the node's four ``nvidia.com/gpu`` (only GPU pods are watched):

- ``llm``, a Deployment of one replica serving one request at a time (each ~1 s), loaded by this test
  with four concurrent clients so that its P99 climbs past the policy's 1.5 s: the ``RequestLatencyHigh``
  Event and one replica more (maxReplicas 2; the new pod may stay Pending for want of a GPU, which does
  not matter to ``/scale``);
- three pods whose ``/metrics`` hangs, streams 10 MiB, or answers an HTML page (``--metrics-fault``),
  selected by a second policy: its ``ServiceMetricsAvailable`` condition counts ``Timeout``,
  ``TooLarge`` and ``NotPrometheus``, each with its pod, while the good pod's scrapes and the agent's
  samples and reports keep their pace (measured over the same window).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from node import Node
from operator_support import events, get, policy_status
from test_chart_on_node import Installed, helm_install, prepare, tear_down, total
from test_node import apply, deployment, pod, wait

pytestmark = pytest.mark.integration

APP = "llm"
BROKEN = ("hang", "huge", "not-prometheus")
PORT = 8000
LATENCY_POLICY = "llm-latency"
BROKEN_POLICY = "broken-endpoints"
SCRAPE_INTERVAL = 2.0
TIMEOUT = 180.0


def server(image: str, *flags: str) -> dict[str, Any]:
    """A container of the agent image serving one simulated replica: one request at a time, ~1 s each
    (20 tokens of 45 ms after a 50 ms prefill), its port named ``metrics``."""
    args = ["sim-server", f"--listen=:{PORT}", "--max-num-seqs=1", "--prefill-time=50ms", "--token-time=45ms"]
    return {
        "name": "server",
        "image": image,
        "imagePullPolicy": "Never",
        "args": [*args, *flags],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "ports": [{"name": "metrics", "containerPort": PORT}],
    }


def policies(namespace: str) -> list[dict[str, Any]]:
    meta = {"namespace": namespace}
    latency = {
        "apiVersion": "gpuwarden.dev/v1alpha1",
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": LATENCY_POLICY, **meta},
        "spec": {
            "selector": {"matchLabels": {"app": APP}},
            "evaluationInterval": "2s",
            "serviceMetrics": {"server": "vllm", "interval": "2s"},  # the port: the container's named metrics
            "rules": [
                {
                    "name": "slow",
                    "requestLatency": {"percentile": 99, "threshold": "1500ms", "window": "30s", "for": "4s"},
                }
            ],
            "actions": {
                "scale": {
                    "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "scaleUpOn": ["slow"],
                    "behavior": {"scaleUp": {"stabilizationWindow": "0s", "step": 1, "cooldown": "5m"}},
                }
            },
        },
    }
    broken = {
        "apiVersion": "gpuwarden.dev/v1alpha1",
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": BROKEN_POLICY, **meta},
        "spec": {
            "selector": {"matchLabels": {"app": "broken"}},
            "evaluationInterval": "2s",
            "serviceMetrics": {"server": "vllm", "port": PORT, "interval": "2s"},
            "rules": [{"name": "queue", "requestQueue": {"limit": 5, "for": "10s"}}],
        },
    }
    return [latency, broken]


class Load:
    """Four clients posting completions to the good pod back to back, on threads, until stopped."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.errors = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _client(self) -> None:
        body = json.dumps({"model": "sim-llm", "prompt": "hello", "max_tokens": 20}).encode()
        while not self.stop.is_set():
            started = time.monotonic()
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                self.latencies.append(time.monotonic() - started)
            except OSError:
                self.errors += 1


@pytest.fixture(scope="module")
def served(node: Node) -> Iterator[Installed]:
    namespace = prepare(node, "served")
    image = node.images.agent.name
    apply(node, namespace, deployment(APP, 1, server(image)))
    for fault in BROKEN:
        manifest = pod(
            fault,
            {"terminationGracePeriodSeconds": 1, "containers": [server(image, f"--metrics-fault={fault}")]},
        )
        manifest["metadata"]["labels"] = {"app": "broken"}
        apply(node, namespace, manifest)
    wait(node, namespace, "--for=condition=Ready", "pod", "--all")
    helm_install(node)
    apply(node, namespace, *policies(namespace))
    try:
        yield Installed(node, namespace, time.time())
    finally:
        tear_down(node, namespace)


def condition(world: Installed, policy: str) -> dict[str, Any] | None:
    status = policy_status(world.cp, world.namespace, policy)
    found = [c for c in status.get("conditions", []) if c["type"] == "ServiceMetricsAvailable"]
    return found[0] if found else None


def counters(world: Installed) -> dict[str, float]:
    """The agent's own pace: samples, reports, and scrapes by result."""
    metrics = world.agent_metrics()
    out = {
        "samples": total(metrics, "gpuwarden_agent_samples_total"),
        "reports": total(metrics, "gpuwarden_agent_reports_sent_total"),
    }
    for labels, value in metrics.get("gpuwarden_agent_service_scrapes_total", []):
        out[labels["result"]] = value
    return out


def test_broken_endpoints_are_refused_with_the_condition_and_nothing_else_slows(served: Installed) -> None:
    world = served

    def refused() -> dict[str, Any] | None:
        found = condition(world, BROKEN_POLICY)
        return (
            found
            if found and all(r in found["message"] for r in ("Timeout", "TooLarge", "NotPrometheus"))
            else None
        )

    found = world.until(refused, "ServiceMetricsAvailable=False with the three reasons", TIMEOUT)
    assert (found["status"], found["reason"]) == ("False", "EndpointsFailing")
    for fault in BROKEN:
        assert fault in found["message"]
    # With the three failing beside it (and backing off), the agent's pace over its next 20 samples: it
    # samples every second, reports each sample, and scrapes the good pod at its interval.
    before, started = counters(world), time.monotonic()

    def twenty_more() -> dict[str, float] | None:
        now = counters(world)
        return now if now["samples"] >= before["samples"] + 20 else None

    after = world.until(twenty_more, "20 more samples", 60)
    took = time.monotonic() - started
    paces = {k: (after.get(k, 0) - before.get(k, 0)) / took for k in after}
    print(f"\nper second over {took:.1f} s: {paces}")
    assert took < 25  # --sample-interval 1s: 20 samples in 20 s, give or take the polls
    assert paces["reports"] > 0.8
    assert paces["ok"] > 0.8 / SCRAPE_INTERVAL  # the good pod, every 2 s
    for result in ("timeout", "too_large", "not_prometheus"):
        assert after[result] >= 1
    good = condition(world, LATENCY_POLICY)
    assert good is not None
    assert (good["status"], good["reason"]) == ("True", "MetricsRead")


def test_the_latency_finding_is_posted_and_the_deployment_scaled(served: Installed) -> None:
    world = served
    (llm,) = [p for p in world.pods(world.namespace, f"app={APP}") if p["status"].get("phase") == "Running"]
    url = f"http://{llm['status']['podIP']}:{PORT}/v1/completions"
    with Load(url) as load:
        (first, *_) = world.until(
            lambda: events(
                world.cp,
                world.namespace,
                kind="Pod",
                name=llm["metadata"]["name"],
                reason="RequestLatencyHigh",
            ),
            "the RequestLatencyHigh Event",
            TIMEOUT,
        )
        world.until(
            lambda: get(world.cp, "deployment", APP, "-n", world.namespace)["spec"]["replicas"] == 2 or None,
            "one replica more",
            60,
        )
    assert "P99" in first["message"]
    latencies = sorted(load.latencies)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\nclients measured {len(latencies)} requests, P99 {p99:.2f} s; Event: {first['message']}")
    assert p99 > 1.5  # what the clients felt is what the finding says
    (up,) = world.until(
        lambda: events(world.cp, world.namespace, kind="Deployment", name=APP, reason="ScaledUp"),
        "ScaledUp",
        30,
    )
    assert f"scaled {APP} 1→2" in up["message"]

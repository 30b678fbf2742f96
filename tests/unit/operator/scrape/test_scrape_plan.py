"""The node's scrape plan from policies and pods (pure): which pods, where, which names, how often; and
the ServiceMetricsAvailable condition from the pods' latest outcomes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuwarden.operator.policies.status import PolicyVerdict, build_status
from gpuwarden.operator.scrape import (
    AVAILABLE,
    ServicePod,
    ServicePolicy,
    availability,
    plan_node,
    service_pod,
    service_policy,
)
from gpuwarden.policy import LabelSelector, PodId, ServiceScrape, ServiceStore
from gpuwarden.wire.scrape import MAX_METRICS, ScrapeFailure

LATENCY = "vllm:e2e_request_latency_seconds"
WAITING = "vllm:num_requests_waiting"
LLM = LabelSelector(match_labels=(("app", "llm"),))


def pod(
    name: str, *, ip: str | None = "10.1.0.5", labels: dict[str, str] | None = None, **kw: Any
) -> ServicePod:
    return ServicePod(
        namespace="serving", name=name, uid=f"u-{name}", ip=ip, labels=labels or {"app": "llm"}, **kw
    )


def policy(name: str, metrics: set[str], *, interval: float = 10.0, **kw: Any) -> ServicePolicy:
    return ServicePolicy(name=name, selector=LLM, metrics=frozenset(metrics), interval_seconds=interval, **kw)


def test_a_selected_pod_is_planned_with_the_union_of_names_at_the_shortest_interval() -> None:
    policies = {
        "serving": [
            policy("latency", {LATENCY}, interval=10.0, port=8000),
            policy("queue", {WAITING}, interval=5.0),
        ]
    }
    planned = plan_node([pod("llm-0"), pod("web", labels={"app": "web"})], policies)
    (target,) = planned.plan.targets
    assert (target.name, target.uid, target.ip, target.port, target.path, target.scheme) == (
        "llm-0",
        "u-llm-0",
        "10.1.0.5",
        8000,
        "/metrics",
        "http",
    )
    assert target.metrics == sorted([LATENCY, WAITING])
    assert target.interval_seconds == 5.0
    assert planned.no_port == ()


def test_the_policy_wins_then_the_annotations_then_the_port_named_metrics() -> None:
    hinted = pod(
        "a", annotated_port=9090, annotated_path="/stats", annotated_scheme="https", metrics_port=7000
    )
    named = pod("b", metrics_port=7000)
    plain = pod("c")
    by_policy = plan_node([hinted], {"serving": [policy("p", {LATENCY}, port=8000, path="/m")]})
    assert [(t.port, t.path, t.scheme) for t in by_policy.plan.targets] == [(8000, "/m", "http")]
    by_pod = plan_node([hinted, named, plain], {"serving": [policy("p", {LATENCY})]})
    assert [(t.name, t.port, t.path, t.scheme) for t in by_pod.plan.targets] == [
        ("a", 9090, "/stats", "https"),
        ("b", 7000, "/metrics", "http"),
    ]
    assert by_pod.no_port == (PodId("serving", "c"),)


def test_pods_without_an_ip_or_of_other_namespaces_or_no_names_are_not_planned() -> None:
    pods = [pod("pending", ip=None), ServicePod("other", "x", "u-x", "10.1.0.9", {"app": "llm"}, 8000)]
    assert plan_node(pods, {"serving": [policy("p", {LATENCY}, port=8000)]}).plan.targets == []
    assert plan_node([pod("a")], {"serving": [policy("p", set(), port=8000)]}).plan.targets == []


def test_names_are_bounded_per_target() -> None:
    names = {f"metric_{i:03d}" for i in range(MAX_METRICS + 8)}
    (target,) = plan_node([pod("a")], {"serving": [policy("p", names, port=8000)]}).plan.targets
    assert len(target.metrics) == MAX_METRICS


def kube_pod(annotations: dict[str, str], ports: list[dict[str, Any]], ip: str | None) -> ServicePod:
    return service_pod(
        namespace="serving",
        name="llm-0",
        uid="u-0",
        labels={"app": "llm"},
        annotations=annotations,
        spec={"nodeName": "n1", "containers": [{"name": "server", "ports": ports}]},
        status={"podIP": ip} if ip else {},
    )


def test_the_pod_index_reads_the_annotations_and_ports_and_drops_invalid_ones() -> None:
    good = kube_pod(
        {"prometheus.io/port": "8000", "prometheus.io/path": "/metrics/", "prometheus.io/scheme": "https"},
        [{"name": "http", "containerPort": 80}, {"name": "metrics", "containerPort": 9400}],
        "fd00::5",
    )
    assert (good.ip, good.annotated_port, good.annotated_path, good.annotated_scheme, good.metrics_port) == (
        "fd00::5",
        8000,
        "/metrics/",
        "https",
        9400,
    )
    bad = kube_pod(
        {"prometheus.io/port": "eighty", "prometheus.io/path": "metrics", "prometheus.io/scheme": "ftp"},
        [{"name": "metrics", "containerPort": 70000}],
        "not-an-ip",
    )
    assert (bad.ip, bad.annotated_port, bad.annotated_path, bad.annotated_scheme, bad.metrics_port) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert kube_pod({}, [], None).ip is None


def latest_of(store: ServiceStore) -> Callable[[PodId], ServiceScrape | None]:
    def latest(pod: PodId) -> ServiceScrape | None:
        kept = store.scrapes(pod)
        return kept[-1] if kept else None

    return latest


def test_the_condition_counts_reasons_and_names_a_few_pods() -> None:
    store = ServiceStore(retention_seconds=600)
    pods = [PodId("serving", f"llm-{i}") for i in range(7)]
    assert availability(latest_of(store), pods)[:2] == ("Unknown", "NoScrapes")
    store.record(pods[0], ServiceScrape(at=100.0))
    assert availability(latest_of(store), pods) == (
        "True",
        "MetricsRead",
        "The metrics of all 1 scraped pods are read.",
    )
    for p in pods[1:5]:
        store.record(p, ServiceScrape(at=100.0, error=ScrapeFailure.TIMEOUT.value))
    store.record(pods[5], ServiceScrape(at=100.0, error=ScrapeFailure.NO_PORT.value))
    status, reason, message = availability(latest_of(store), pods)
    assert (status, reason) == ("False", "EndpointsFailing")
    assert message == (
        "5 of 6 pods' metrics cannot be read: NoPort 1 (llm-5); Timeout 4 (llm-1, llm-2, llm-3, …)."
    )
    store.record(pods[5], ServiceScrape(at=101.0))  # the latest decides
    assert "NoPort" not in availability(latest_of(store), pods)[2]


def policy_object(spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": "latency", "namespace": "serving", **meta}, "spec": spec}


def test_a_policy_of_gpu_rules_or_an_invalid_or_deleted_one_reads_no_pods() -> None:
    selector = {"matchLabels": {"app": "llm"}}
    idle = {"name": "idle", "utilizationFloor": {"percent": 20, "for": "5m"}}
    assert (
        service_policy(
            policy_object({"selector": selector, "serviceMetrics": {"port": 8000}, "rules": [idle]})
        )
        is None
    )
    assert service_policy(policy_object({"selector": selector, "rules": [{"name": "x"}]})) is None
    deleting = policy_object(
        {"selector": selector, "rules": [idle]}, deletionTimestamp="2026-12-04T18:00:00Z"
    )
    assert service_policy(deleting) is None


@pytest.mark.parametrize("interval", [0.2, 7200.0])
def test_an_interval_outside_the_wires_bounds_is_clamped(interval: float) -> None:
    (target,) = plan_node(
        [pod("a")], {"serving": [policy("p", {LATENCY}, interval=interval, port=1)]}
    ).plan.targets
    assert 1.0 <= target.interval_seconds <= 3600.0


def test_the_condition_is_in_the_status_while_the_spec_reads_pods_and_goes_when_it_stops() -> None:
    store = ServiceStore(retention_seconds=600)
    store.record(PodId("serving", "llm-0"), ServiceScrape(at=100.0, error=ScrapeFailure.TOO_LARGE.value))
    condition = availability(latest_of(store), [PodId("serving", "llm-0")])
    first = build_status(PolicyVerdict(generation=1, service_metrics=condition), None, now=1000.0)
    (written,) = [c for c in first["conditions"] if c["type"] == AVAILABLE]
    assert (written["status"], written["reason"]) == ("False", "EndpointsFailing")
    assert written["message"] == "1 of 1 pods' metrics cannot be read: TooLarge 1 (llm-0)."
    invalid = build_status(PolicyVerdict(generation=2, spec_error="rules: bad"), first, now=1001.0)
    assert AVAILABLE in {c["type"] for c in invalid["conditions"]}  # nothing new to say until it is valid
    gone = build_status(PolicyVerdict(generation=3), first, now=1002.0)
    assert AVAILABLE not in {c["type"] for c in gone["conditions"]}

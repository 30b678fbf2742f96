"""Which pods a node's agent scrapes: the plan, from the policies that read pods' metrics and the pods (pure).

The operator answers each report with its node's plan (:mod:`gpuwarden.wire.scrape`): every GPU pod
on that node that a policy whose rules read the pods' own metrics selects (``service_metric_names``
not empty: a service rule, with or without ``serviceMetrics``), once it has an IP, with the union of
the metric names those policies' rules read, at the shortest of their intervals.

Where a pod's endpoint is, first found wins:

- **port**: a selecting policy's ``serviceMetrics.port`` (the first such policy by name); else the
  pod's ``prometheus.io/port`` annotation; else its container port named ``metrics``; else none, and
  the pod is not scraped but counted (``NoPort``) in its policies' ``ServiceMetricsAvailable``;
- **path**: a policy's ``serviceMetrics.path``; else ``prometheus.io/path``; else ``/metrics``;
- **scheme**: a policy's ``serviceMetrics.scheme`` where one sets the port or the path; else
  ``prometheus.io/scheme``; else ``http``.

An annotation that is not a valid port, path or scheme counts as absent.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.policy import (
    LabelSelector,
    PodId,
    SpecError,
    parse_spec,
    selector_matches,
    service_metric_names,
)
from gpuwarden.wire.scrape import (
    MAX_INTERVAL,
    MAX_METRICS,
    MAX_TARGETS,
    MIN_INTERVAL,
    ScrapePlan,
    ScrapeTarget,
)

__all__ = [
    "METRICS_PORT_NAME",
    "PATH_ANNOTATION",
    "PORT_ANNOTATION",
    "SCHEME_ANNOTATION",
    "NodePlan",
    "ServicePod",
    "ServicePolicy",
    "plan_node",
    "service_pod",
    "service_policy",
]

PORT_ANNOTATION = "prometheus.io/port"
PATH_ANNOTATION = "prometheus.io/path"
SCHEME_ANNOTATION = "prometheus.io/scheme"
METRICS_PORT_NAME = "metrics"
DEFAULT_PATH = "/metrics"
_PATH = re.compile(r"^/[\x21-\x7e]{0,1023}$")


@dataclass(frozen=True, slots=True)
class ServicePolicy:
    """What one policy with ``serviceMetrics`` asks of the pods it selects."""

    name: str
    selector: LabelSelector
    metrics: frozenset[str]
    """The metric names its rules read (as exposed; a histogram's by its base name)."""
    interval_seconds: float
    """``serviceMetrics.intervalSeconds``, else the policy's evaluation interval."""
    port: int | None = None
    path: str | None = None
    scheme: str = "http"


@dataclass(frozen=True, slots=True)
class ServicePod:
    """A GPU pod as the scrape index keeps it (by its node): who, where, and its endpoint's hints."""

    namespace: str
    name: str
    uid: str
    ip: str | None
    """``status.podIP``; None until the pod has one."""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotated_port: int | None = None
    annotated_path: str | None = None
    annotated_scheme: str | None = None
    metrics_port: int | None = None
    """The first container port named ``metrics``."""

    @property
    def id(self) -> PodId:
        """The pod by namespace and name."""
        return PodId(self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class NodePlan:
    """A node's plan, and the selected pods that have no port to scrape."""

    plan: ScrapePlan
    no_port: tuple[PodId, ...] = ()


def service_policy(body: Mapping[str, Any]) -> ServicePolicy | None:
    """The policy index's record of a policy object: None unless its rules read the pods' own metrics
    (an invalid spec is not evaluated, a policy being deleted is stopping)."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    try:
        spec = parse_spec(body.get("spec") or {})
    except SpecError:
        return None
    names = service_metric_names(spec)
    if not names:
        return None
    source = spec.service_metrics
    interval = source.interval_seconds if source is not None else None
    return ServicePolicy(
        name=str(meta.get("name", "")),
        selector=spec.selector,
        metrics=names,
        interval_seconds=interval if interval is not None else spec.evaluation_interval_seconds,
        port=source.port if source is not None else None,
        path=source.path if source is not None else None,
        scheme=source.scheme if source is not None else "http",
    )


def service_pod(
    *,
    namespace: str,
    name: str,
    uid: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
) -> ServicePod:
    """The scrape index's record of a pod object (see the module doc for what counts)."""
    scheme = annotations.get(SCHEME_ANNOTATION)
    path = annotations.get(PATH_ANNOTATION)
    return ServicePod(
        namespace=namespace,
        name=name,
        uid=uid,
        ip=_ip(status.get("podIP")),
        labels=dict(labels),
        annotated_port=_port(annotations.get(PORT_ANNOTATION)),
        annotated_path=path if path is not None and _PATH.match(path) else None,
        annotated_scheme=scheme if scheme in ("http", "https") else None,
        metrics_port=_metrics_port(spec),
    )


def plan_node(pods: Iterable[ServicePod], policies: Mapping[str, Iterable[ServicePolicy]]) -> NodePlan:
    """The plan of the node that runs ``pods``, from the ``policies`` with ``serviceMetrics`` by namespace."""
    targets: list[ScrapeTarget] = []
    no_port: list[PodId] = []
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        if pod.ip is None or len(targets) >= MAX_TARGETS:
            continue
        selecting = sorted(
            (p for p in policies.get(pod.namespace, ()) if selector_matches(p.selector, pod.labels)),
            key=lambda p: p.name,
        )
        names: set[str] = set()
        for p in selecting:
            names |= p.metrics
        metrics = sorted(names)[:MAX_METRICS]
        if not metrics:
            continue  # its policies' rules read none of its metrics (yet)
        target = _target(pod, selecting, metrics)
        if target is None:
            no_port.append(pod.id)
        else:
            targets.append(target)
    return NodePlan(ScrapePlan(targets=targets), tuple(no_port))


def _target(pod: ServicePod, policies: list[ServicePolicy], metrics: list[str]) -> ScrapeTarget | None:
    assert pod.ip is not None
    port_from = next((p for p in policies if p.port is not None), None)
    path_from = next((p for p in policies if p.path is not None), None)
    port = port_from.port if port_from is not None else pod.annotated_port or pod.metrics_port
    if port is None:
        return None
    path = path_from.path if path_from is not None else pod.annotated_path
    decides = port_from or path_from
    scheme = decides.scheme if decides is not None else pod.annotated_scheme or "http"
    interval = min(p.interval_seconds for p in policies)
    return ScrapeTarget(
        namespace=pod.namespace,
        name=pod.name,
        uid=pod.uid,
        ip=pod.ip,
        port=port,
        path=path or DEFAULT_PATH,
        scheme="https" if scheme == "https" else "http",
        metrics=metrics,
        interval_seconds=min(MAX_INTERVAL, max(MIN_INTERVAL, interval)),
    )


def _ip(value: Any) -> str | None:
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) and value else None
    except ValueError:
        return None


def _port(text: str | None) -> int | None:
    if text is None or not text.strip().isdigit():
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def _metrics_port(spec: Mapping[str, Any]) -> int | None:
    for container in spec.get("containers") or ():
        for port in container.get("ports") or ():
            number = port.get("containerPort")
            if port.get("name") == METRICS_PORT_NAME and isinstance(number, int) and 1 <= number <= 65535:
                return number
    return None

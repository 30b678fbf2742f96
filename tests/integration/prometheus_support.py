"""A real Prometheus server (Debian's ``prometheus`` package) for the tests, configured as
prometheus-operator would configure it from the chart's PodMonitors and PrometheusRule.

:func:`podmonitor_scrape_config` turns a PodMonitor, as the API server stored it, into the
``scrape_configs`` entry prometheus-operator generates for it (its ``pkg/prometheus/promcfg.go``):
Kubernetes service discovery of the pods of the monitor's namespaces, kept by its selector and
port name, the target labels the operator adds (``namespace``, ``container``, ``pod``, ``job``,
``endpoint``), then the monitor's own relabelings. So what is checked is the chart's scrape
configuration itself, relabelings included, not a hand-written stand-in.

:class:`Prometheus` runs the server on a free local port with its own TSDB, and answers PromQL
through the HTTP API.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane, ManagedProcess, free_port, in_ci, wait_for

STARTUP_TIMEOUT = 60.0


def prometheus_binary() -> str:
    """The ``prometheus`` server binary on PATH (Debian's ``prometheus`` package); where it is missing,
    the test fails in CI and is skipped elsewhere."""
    binary = shutil.which("prometheus")
    if binary is None:
        if in_ci():
            pytest.fail(
                "CI=true: the prometheus server is missing (hack/ensure-system-deps.sh)", pytrace=False
            )
        pytest.skip("the prometheus server is not installed (Debian: apt-get install prometheus)")
    return binary


def _label_name(label: str) -> str:
    """A Kubernetes label as Prometheus' service discovery names it (``app.kubernetes.io/name`` ->
    ``app_kubernetes_io_name``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _relabel(config: dict[str, Any]) -> dict[str, Any]:
    """A prometheus-operator RelabelConfig (camelCase) as Prometheus' relabel_config (snake_case)."""
    return {re.sub(r"([A-Z])", r"_\1", key).lower(): value for key, value in config.items()}


def discovered(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """File service discovery target groups carrying the ``__meta_kubernetes_pod_*`` labels that
    Kubernetes pod discovery gives each declared container port of ``pods`` (as the API server has them).

    Debian's prometheus is built without Kubernetes service discovery (``kubernetes_sd_configs`` is
    not a field it knows), so the test lists the pods and Prometheus relabels what it is handed as it
    would relabel what it discovered.
    """
    groups = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod["spec"], pod["status"]
        if not status.get("podIP"):
            continue
        common = {
            "__meta_kubernetes_namespace": meta["namespace"],
            "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
            "__meta_kubernetes_pod_ip": status["podIP"],
            "__meta_kubernetes_pod_phase": status.get("phase", ""),
        }
        for key, value in meta.get("labels", {}).items():
            common[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
            common[f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}"] = "true"
        for c in spec["containers"]:
            for port in c.get("ports", []):
                labels = {
                    **common,
                    "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                }
                groups.append({"targets": [f"{status['podIP']}:{port['containerPort']}"], "labels": labels})
    return groups


def podmonitor_scrape_config(
    monitor: dict[str, Any], cp: ControlPlane, workdir: Path
) -> list[dict[str, Any]]:
    """The scrape configs prometheus-operator generates for ``monitor`` (one per endpoint), the pods of
    its namespaces listed through ``cp`` now (:func:`discovered`, in a file under ``workdir``)."""
    meta, spec = monitor["metadata"], monitor["spec"]
    namespaces = spec.get("namespaceSelector", {}).get("matchNames") or [meta["namespace"]]
    pods = [
        p
        for ns in namespaces
        for p in json.loads(cp.kubectl("get", "pods", "-n", ns, "-o", "json", check=True).stdout)["items"]
    ]
    targets = workdir / f"{meta['namespace']}-{meta['name']}.json"
    targets.write_text(json.dumps(discovered(pods)))
    keep_selected = [
        {
            "action": "keep",
            "source_labels": [
                f"__meta_kubernetes_pod_label_{_label_name(k)}",
                f"__meta_kubernetes_pod_labelpresent_{_label_name(k)}",
            ],
            "regex": f"({v});true",
        }
        for k, v in sorted(spec["selector"].get("matchLabels", {}).items())
    ]
    configs = []
    for i, endpoint in enumerate(spec["podMetricsEndpoints"]):
        config: dict[str, Any] = {
            "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "honor_labels": bool(endpoint.get("honorLabels", False)),
            "metrics_path": endpoint.get("path", "/metrics"),
            "scheme": endpoint.get("scheme", "http"),
            "file_sd_configs": [{"files": [str(targets)]}],
            "relabel_configs": [
                {
                    "action": "drop",
                    "source_labels": ["__meta_kubernetes_pod_phase"],
                    "regex": "(Failed|Succeeded)",
                },
                *keep_selected,
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": endpoint["port"],
                },
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
                {"target_label": "endpoint", "replacement": endpoint["port"]},
                *(_relabel(r) for r in endpoint.get("relabelings", [])),
            ],
        }
        for ours, theirs in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
            if endpoint.get(ours):
                config[theirs] = endpoint[ours]
        if endpoint.get("metricRelabelings"):
            config["metric_relabel_configs"] = [_relabel(r) for r in endpoint["metricRelabelings"]]
        configs.append(config)
    return configs


class PrometheusError(AssertionError):
    """The server did not start, or a query failed."""


class Prometheus:
    """A running Prometheus server: ``scrape_configs`` and the rule groups of ``rules``."""

    def __init__(
        self,
        binary: str,
        workdir: Path,
        scrape_configs: list[dict[str, Any]],
        rule_groups: list[dict[str, Any]],
        *,
        interval: str,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        rules = workdir / "rules.yml"
        rules.write_text(yaml.safe_dump({"groups": rule_groups}))
        config = workdir / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": interval, "evaluation_interval": interval},
                    "rule_files": [str(rules)],
                    "scrape_configs": scrape_configs,
                }
            )
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process = ManagedProcess(
            "prometheus",
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            workdir / "prometheus.log",
            workdir,
        )
        try:
            wait_for(self._ready, timeout=STARTUP_TIMEOUT, what="prometheus /-/ready", alive=self._exited)
        except BaseException:
            self.process.stop()
            raise

    def _exited(self) -> str | None:
        if self.process.running():
            return None
        return f"prometheus exited:\n{self.process.log_tail()}"

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.process.stop()

    def api(self, path: str, **params: str | float) -> Any:
        """``GET /api/v1/<path>``'s ``data``; a failed query raises :class:`PrometheusError`."""
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (vector or scalar results as a one-sample list)."""
        data = self.api("query", query=expr, **({"time": at} if at is not None else {}))
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's matrix: each series' ``metric`` and ``values``."""
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets."""
        return list(self.api("targets", state="active")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule, with its health and last error."""
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

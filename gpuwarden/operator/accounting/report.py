"""``gpuwarden report``: the last day or week of GPU-hours by namespace and workload, from Prometheus.

History comes from Prometheus, which scrapes the operator's accounting counters and keeps them
(docs/accounting.md says why not a ledger of the operator's own): each figure is
``sum by (namespace, workload_kind, workload) (increase(<counter>[<window>]))``, which spans the
operator's restarts (a counter reset) and the shards' handovers (one series per replica, summed).
Prometheus is reached at ``--prometheus URL``, or through the API server's service proxy
(``--prometheus-service NAMESPACE/NAME:PORT``, with the user's kubeconfig). The findings of the
worst offenders are the policies' ``status.violations``, read with the user's kubeconfig, their
pods resolved to workloads as the operator does.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import kopf

from gpuwarden.accounting.report import FORMATS, Finding, Line, WorkloadRef, build_report, render
from gpuwarden.operator.accounting.owners import OwnerResolver, Unresolved
from gpuwarden.operator.accounting.settings import LABEL_KEY
from gpuwarden.operator.kube import ApiError, KubeApi
from gpuwarden.operator.resources import GROUP, PLURAL, VERSION

__all__ = ["add_arguments", "run"]

WINDOWS = {"day": "1d", "week": "7d"}
DURATION = re.compile(r"^([0-9]{1,5}(w|d|h|m|s))+$")
"""A PromQL range: ``1d``, ``7d``, ``12h``, ``1h30m``."""
METRICS = {
    "allocated": "gpuwarden_gpu_allocated_seconds_total",
    "used": "gpuwarden_gpu_used_seconds_total",
    "idle": "gpuwarden_gpu_idle_seconds_total",
    "cost": "gpuwarden_gpu_idle_cost_total",
}
NODE_METRICS = {
    "allocated": "gpuwarden_node_gpu_allocated_seconds_total",
    "used": "gpuwarden_node_gpu_used_seconds_total",
    "idle": "gpuwarden_node_gpu_idle_seconds_total",
}
"""The same figures by node (``--by node``); no idle cost of their own."""
SERVICE = re.compile(r"^(?P<ns>[a-z0-9-]+)/(?P<name>[a-z0-9-]+):(?P<port>[A-Za-z0-9-]+)$")

Query = Callable[[str], Awaitable[Mapping[str, Any]]]
"""Runs one instant PromQL query; returns Prometheus' JSON answer."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The report's flags."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL", help="the Prometheus that scrapes the operator")
    source.add_argument(
        "--prometheus-service",
        metavar="NAMESPACE/NAME:PORT",
        help="that Prometheus's Service, reached through the API server's service proxy (your kubeconfig)",
    )
    parser.add_argument(
        "--window", default="day", help="day, week, or a PromQL range such as 12h (%(default)s)"
    )
    parser.add_argument("--output", "-o", choices=FORMATS, default="table", help="%(default)s")
    parser.add_argument("--top", type=int, default=5, help="worst offenders listed (%(default)s)")
    parser.add_argument("--namespace", "-n", default="", help="only this namespace")
    parser.add_argument(
        "--no-findings", action="store_true", help="do not read the policies' findings (no kubeconfig needed)"
    )
    _content_arguments(parser)


def _content_arguments(parser: argparse.ArgumentParser) -> None:
    """What the report shows: its grouping (docs/accounting.md)."""
    parser.add_argument(
        "--by",
        default="workload",
        type=_by,
        help="group by namespace, workload, label:KEY (the operator's --accounting-group-label, e.g. "
        "label:team), model or node (%(default)s)",
    )


def _by(text: str) -> str:
    grouping(text)
    return text


def grouping(by: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A ``--by`` value's columns and the counters' labels they are; both () for workload (the
    default report: namespaces, then workloads); ValueError for anything else."""
    key = by.removeprefix("label:")
    if by.startswith("label:") and key and LABEL_KEY.match(key):
        return (key,), ("group",)
    if by == "workload":
        return (), ()
    if by not in ("namespace", "model", "node"):
        raise argparse.ArgumentTypeError(f"{by!r} is not namespace, workload, label:KEY, model or node")
    return (by,), ("gpu_model" if by == "model" else by,)


def run(args: argparse.Namespace) -> int:
    """Print the report; 1 when Prometheus cannot be asked, 2 on a bad flag."""
    window = WINDOWS.get(args.window, args.window)
    if not DURATION.match(window):
        print(
            f"gpuwarden report: --window {args.window!r} is not day, week or a range like 12h",
            file=sys.stderr,
        )
        return 2
    if args.top < 0:
        print("gpuwarden report: --top must be 0 or more", file=sys.stderr)
        return 2
    try:
        text = asyncio.run(_report(args, window))
    except ReportFailed as exc:
        print(f"gpuwarden report: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


class ReportFailed(Exception):
    """Prometheus could not be asked, or answered something else than a result."""


async def _report(args: argparse.Namespace, window: str) -> str:
    api = KubeApi() if args.prometheus_service or not args.no_findings else None
    try:
        query = _direct(args.prometheus) if args.prometheus else _proxied(api, args.prometheus_service)
        workloads = await workload_lines(query, window, args.namespace)
        columns, labels = grouping(args.by)
        groups = await group_lines(query, window, labels, args.namespace) if labels else None
        unallocated = {} if args.namespace else await unallocated_lines(query, window)
        findings: dict[WorkloadRef, list[Finding]] = {}
        if api is not None and not args.no_findings:
            try:
                findings = await workload_findings(api, args.namespace)
            except (ApiError, Unresolved, kopf.LoginError) as exc:
                print(f"gpuwarden report: findings not read ({exc}); the figures stand", file=sys.stderr)
        label = {"1d": "day", "7d": "week"}.get(window, window)
        built = build_report(
            label, workloads, findings, top=args.top, unallocated=unallocated, by=columns, groups=groups
        )
        return render(built, args.output)
    finally:
        if api is not None:
            await api.close()


def _direct(url: str) -> Query:
    async def query(promql: str) -> Mapping[str, Any]:
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
                session.get(url.rstrip("/") + "/api/v1/query", params={"query": promql}) as rsp,
            ):
                answer: Mapping[str, Any] = await rsp.json(content_type=None)
                return answer
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ReportFailed(f"Prometheus at {url}: {exc!r}") from None

    return query


def _proxied(api: KubeApi | None, service: str) -> Query:
    match = SERVICE.match(service)
    if api is None or match is None:
        raise ReportFailed(f"--prometheus-service {service!r} is not NAMESPACE/NAME:PORT")
    client = api
    path = f"/api/v1/namespaces/{match['ns']}/services/{match['name']}:{match['port']}/proxy/api/v1/query"

    async def query(promql: str) -> Mapping[str, Any]:
        try:
            return await client.request("GET", path, params={"query": promql})
        except ApiError as exc:
            raise ReportFailed(f"Prometheus through {service}: {exc}") from None

    return query


TOKENS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "tgi_request_input_length_sum",
    "tgi_request_generated_tokens_sum",
)
"""Inference servers' token counters, prompt and generated: vLLM's, SGLang's, TGI's (its histograms'
sums). Prometheus must label them with the pod's ``namespace`` and ``pod``, as the usual Kubernetes
scrape configurations and ServiceMonitors/PodMonitors do. A colon may reach Prometheus as ``_`` (a
client escaping names for the exposition format it negotiated): both spellings count."""
PRICE = "max by (gpu_model) (gpuwarden_gpu_price_per_hour)"


async def _sums(query: Query, promql: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """An instant query's values by ``labels``."""
    answer = await query(promql)
    if answer.get("status") != "success":
        raise ReportFailed(f"Prometheus refused {promql}: {answer.get('error', answer)}")
    return {
        tuple(sample.get("metric", {}).get(label, "") for label in labels): float(sample["value"][1])
        for sample in answer.get("data", {}).get("result", [])
    }


async def _lines(
    query: Query, window: str, labels: tuple[str, ...], selector: str
) -> dict[tuple[str, ...], Line]:
    """Each group's hours, idle cost, cost and tokens over ``window``, summed by ``labels``."""
    by = ", ".join(labels)
    metrics = NODE_METRICS if "node" in labels else METRICS
    lines: dict[tuple[str, ...], Line] = {}
    for field, metric in metrics.items():
        for key, value in (
            await _sums(query, f"sum by ({by}) (increase({metric}{selector}[{window}]))", labels)
        ).items():
            line = lines.setdefault(key, Line())
            if field == "cost":
                line.cost = value
            else:
                setattr(line, field, value / 3600.0)
    priced = (
        f"sum by ({by}) (increase({metrics['allocated']}{selector}[{window}]) "
        f"* on (gpu_model) group_left () {PRICE}) / 3600"
    )
    for key, value in (await _sums(query, priced, labels)).items():
        lines.setdefault(key, Line()).total_cost = value
    if "gpu_model" not in labels and "node" not in labels:
        # The pods' token counters, labelled with each pod's workload (and group) while it was counted;
        # one query a counter (increase() drops the names, and two counters of a pod would collide).
        joined = [label for label in labels if label != "namespace"]
        info = f"max by ({', '.join(['namespace', 'pod', *joined])}) "
        inner = selector[1:-1] + ", " if selector else ""
        for name in TOKENS:
            counted = f'increase({{{inner}__name__=~"{re.escape(name).replace(":", "[:_]")}"}}[{window}])'
            tokens = (
                f"sum by ({by}) (sum by (namespace, pod) ({counted}) "
                f"* on (namespace, pod) group_left ({', '.join(joined)}) {info}"
                f"(max_over_time(gpuwarden_pod_workload_info{selector}[{window}])))"
            )
            for key, value in (await _sums(query, tokens, labels)).items():
                if key in lines:
                    lines[key].tokens = (lines[key].tokens or 0.0) + value
    return lines


async def workload_lines(query: Query, window: str, namespace: str = "") -> dict[WorkloadRef, Line]:
    """Each workload's GPU-hours over ``window`` (idle cost and cost where a price is set, tokens
    where its pods' servers count them)."""
    selector = f'{{namespace="{namespace}"}}' if namespace else ""
    lines = await _lines(query, window, ("namespace", "workload_kind", "workload"), selector)
    return {WorkloadRef(*key): line for key, line in lines.items()}


async def group_lines(
    query: Query, window: str, labels: tuple[str, ...], namespace: str = ""
) -> dict[tuple[str, ...], Line]:
    """Each group's figures over ``window`` (``--by``): by the counters' ``labels``."""
    selector = f'{{namespace="{namespace}"}}' if namespace else ""
    return await _lines(query, window, labels, selector)


async def unallocated_lines(query: Query, window: str) -> dict[tuple[str, str], Line]:
    """GPU-hours no pod held over ``window`` by (node, GPU model), and their cost where priced."""
    metric = "gpuwarden_gpu_unallocated_seconds_total"
    labels = ("node", "gpu_model")
    lines = {
        key: Line(allocated=value / 3600.0)
        for key, value in (
            await _sums(query, f"sum by (node, gpu_model) (increase({metric}[{window}]))", labels)
        ).items()
    }
    increase = f"increase({metric}[{window}])"
    priced = f"sum by (node, gpu_model) ({increase} * on (gpu_model) group_left () {PRICE}) / 3600"
    for key, value in (await _sums(query, priced, labels)).items():
        if key in lines:
            lines[key].total_cost = value
    return {(node, model): line for (node, model), line in lines.items()}


async def workload_findings(api: KubeApi, namespace: str = "") -> dict[WorkloadRef, list[Finding]]:
    """The policies' active violations (``status.violations``) by the workload of their pods."""
    where = f"/namespaces/{namespace}" if namespace else ""
    policies = await api.get(f"/apis/{GROUP}/{VERSION}{where}/{PLURAL}")
    resolver = OwnerResolver(api)
    found: dict[WorkloadRef, list[Finding]] = {}
    for policy in policies.get("items", []):
        meta = policy.get("metadata", {})
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        for violation in (policy.get("status") or {}).get("violations") or []:
            pod = str(violation.get("pod", ""))
            workload = await resolver.workload(ns, pod)
            found.setdefault(WorkloadRef(ns, workload.kind, workload.name), []).append(
                Finding(
                    f"{ns}/{name}",
                    pod,
                    str(violation.get("rule", "")),
                    str(violation.get("reason", "")),
                    str(violation.get("message", "")),
                )
            )
    return found

"""``gpuwarden report``: the last day or week of GPU-hours by namespace and workload, from Prometheus.

History comes from Prometheus, which scrapes the operator's accounting counters and keeps them
(docs/accounting.md says why not a ledger of the operator's own): each figure is
``sum by (namespace, workload_kind, workload) (increase(<counter>[<window>]))``, which spans the
operator's restarts (a counter reset) and the shards' handovers (one series per replica, summed).
Prometheus is reached at ``--prometheus URL`` (with the user's token, basic auth, CA and headers:
:mod:`gpuwarden.clients.prometheus`), or through the API server's service proxy
(``--prometheus-service NAMESPACE/NAME:PORT``). The findings of the worst offenders are the
policies' ``status.violations``, their pods resolved to workloads as the operator does. The API
server is logged in to as kubectl does (``--kubeconfig``, ``--context``, exec credential plugins,
in-cluster: :mod:`gpuwarden.clients.kubeconfig`). Each failure is one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from gpuwarden.accounting.table import FORMATS, Finding, Line, WorkloadRef, build_report, render
from gpuwarden.clients import (
    LoginError,
    PrometheusClient,
    PrometheusEndpoint,
    PrometheusError,
    failure,
    load_credentials,
)
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
SERVICE = re.compile(r"^(?P<ns>[a-z0-9-]+)/(?P<name>[a-z0-9-]+):(?P<port>[A-Za-z0-9-]+)$")

NODE_METRICS = {
    "allocated": "gpuwarden_node_gpu_allocated_seconds_total",
    "used": "gpuwarden_node_gpu_used_seconds_total",
    "idle": "gpuwarden_node_gpu_idle_seconds_total",
}
"""The same figures by node (``--by node``); no idle cost of their own."""
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
    add_connection_arguments(parser)
    _content_arguments(parser)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """How the report logs in: to the API server as kubectl does, to Prometheus with its credentials."""
    kube = parser.add_argument_group("Kubernetes (the findings, and --prometheus-service)")
    kube.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="the kubeconfig (default: $KUBECONFIG, else ~/.kube/config; in a pod, its ServiceAccount)",
    )
    kube.add_argument("--context", metavar="NAME", help="the kubeconfig's context (default: its current one)")
    prom = parser.add_argument_group(
        "Prometheus", "credentials, TLS and headers are for --prometheus URL (not through the API server)"
    )
    auth = prom.add_mutually_exclusive_group()
    auth.add_argument("--prometheus-token-file", metavar="PATH", help="a bearer token, read from PATH")
    auth.add_argument(
        "--prometheus-token",
        metavar="TOKEN",
        help="a bearer token (ps shows it to others: prefer the file)",
    )
    auth.add_argument("--prometheus-basic-auth", metavar="USER:PASSWORD", help="HTTP basic authentication")
    prom.add_argument(
        "--prometheus-ca-file", metavar="PATH", help="its certificate's CA (default: the system's)"
    )
    prom.add_argument("--prometheus-insecure", action="store_true", help="do not verify its certificate")
    prom.add_argument(
        "-H",
        "--prometheus-header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a header for every query, such as 'X-Scope-OrgID: TENANT' (Mimir, Cortex, Thanos); repeatable",
    )
    prom.add_argument(
        "--cluster",
        default="",
        metavar="NAME",
        help="only the series of this cluster, where one Prometheus keeps several (see --cluster-label)",
    )
    prom.add_argument(
        "--cluster-label",
        default="cluster",
        metavar="LABEL",
        help="the cluster's label (%(default)s)",
    )


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
    """Print the report; 1 when Prometheus or the API server cannot be asked, 2 on a bad flag."""
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
        endpoint = _endpoint(args)
        text = asyncio.run(_report(args, window, endpoint))
    except FlagError as exc:
        print(f"gpuwarden report: {exc}", file=sys.stderr)
        return 2
    except ReportFailed as exc:
        print(f"gpuwarden report: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


class FlagError(Exception):
    """A flag that cannot be used as given."""


class ReportFailed(Exception):
    """Prometheus or the API server could not be asked, or answered something else than a result."""


def _endpoint(args: argparse.Namespace) -> PrometheusEndpoint | None:
    """``--prometheus`` and its credentials; None with ``--prometheus-service`` (which takes none)."""
    given = [
        flag
        for flag, value in (
            ("--prometheus-token-file", args.prometheus_token_file),
            ("--prometheus-token", args.prometheus_token),
            ("--prometheus-basic-auth", args.prometheus_basic_auth),
            ("--prometheus-ca-file", args.prometheus_ca_file),
            ("--prometheus-insecure", args.prometheus_insecure),
            ("-H", args.prometheus_header),
        )
        if value
    ]
    if not args.prometheus:
        if given:
            raise FlagError(
                f"{', '.join(given)}: only with --prometheus (not through the API server's proxy)"
            )
        return None
    headers: dict[str, str] = {}
    for header in args.prometheus_header:
        name, colon, value = header.partition(":")
        if not colon or not name.strip():
            raise FlagError(f"-H {header!r} is not 'NAME: VALUE'")
        headers[name.strip()] = value.strip()
    token = args.prometheus_token
    if args.prometheus_token_file:
        try:
            token = Path(args.prometheus_token_file).read_text().strip()
        except OSError as exc:
            raise FlagError(f"--prometheus-token-file {args.prometheus_token_file}: {exc.strerror}") from None
    user = password = None
    if args.prometheus_basic_auth:
        user, colon, password = args.prometheus_basic_auth.partition(":")
        if not colon:
            raise FlagError("--prometheus-basic-auth is USER:PASSWORD")
    if (token or user) and any(name.lower() == "authorization" for name in headers):
        raise FlagError("-H 'Authorization: ...' and a token or basic auth: give one")
    return PrometheusEndpoint(
        args.prometheus,
        token=token,
        username=user,
        password=password,
        ca_file=args.prometheus_ca_file,
        insecure=args.prometheus_insecure,
        headers=headers,
    )


async def _report(args: argparse.Namespace, window: str, endpoint: PrometheusEndpoint | None) -> str:
    login = functools.partial(load_credentials, args.kubeconfig, args.context)
    api = KubeApi(login) if args.prometheus_service or not args.no_findings else None
    # Without --prometheus-service the API server is asked only for the findings: say how to do without.
    skip = "" if args.prometheus_service else "; --no-findings skips the findings"
    scope = {args.cluster_label: args.cluster} if args.cluster else {}
    try:
        async with _prometheus(endpoint, api, args.prometheus_service) as query:
            workloads = await workload_lines(query, window, args.namespace, scope)
            if not workloads:
                await _check_scraped(query, window, scope)
            columns, labels = grouping(args.by)
            groups = await group_lines(query, window, labels, args.namespace, scope) if labels else None
            unallocated = {} if args.namespace else await unallocated_lines(query, window, scope)
        findings: dict[WorkloadRef, list[Finding]] = {}
        if api is not None and not args.no_findings:
            findings = await workload_findings(api, args.namespace)
        label = {"1d": "day", "7d": "week"}.get(window, window)
        built = build_report(
            label, workloads, findings, top=args.top, unallocated=unallocated, by=columns, groups=groups
        )
        return render(built, args.output)
    except PrometheusError as exc:
        hint = "; give credentials with --prometheus-token-file, --prometheus-basic-auth or -H"
        raise ReportFailed(f"{exc}{hint if exc.status in (401, 403) else ''}") from None
    except LoginError as exc:
        raise ReportFailed(f"cannot log in to Kubernetes: {exc}{skip}") from None
    except ApiError as exc:
        assert api is not None
        raise ReportFailed(_api_failure(api, exc) + skip) from None
    except Unresolved as exc:
        assert api is not None
        raise ReportFailed(f"the API server at {api.credentials.server}: {exc}{skip}") from None
    finally:
        if api is not None:
            await api.close()


def _api_failure(api: KubeApi, exc: ApiError) -> str:
    """What went wrong with the API server, in one line."""
    where = f"the API server at {api.credentials.server}"
    if exc.status == 0:
        return f"{where}: {failure(exc.__cause__) if exc.__cause__ else exc.message}"
    if exc.status == 401:
        return f"{where} refused the credentials of {api.credentials.source} (401 Unauthorized)"
    return f"{where}: {exc.status}: {exc.message}"


@asynccontextmanager
async def _prometheus(
    endpoint: PrometheusEndpoint | None, api: KubeApi | None, service: str | None
) -> AsyncIterator[Query]:
    if endpoint is not None:
        async with PrometheusClient(endpoint) as client:
            yield client.query
    else:
        assert api is not None
        assert service is not None
        yield _proxied(api, service)


def _proxied(api: KubeApi, service: str) -> Query:
    match = SERVICE.match(service)
    if match is None:
        raise ReportFailed(f"--prometheus-service {service!r} is not NAMESPACE/NAME:PORT")
    path = f"/api/v1/namespaces/{match['ns']}/services/{match['name']}:{match['port']}/proxy/api/v1/query"

    async def query(promql: str) -> Mapping[str, Any]:
        try:
            return await api.request("GET", path, params={"query": promql})
        except ApiError as exc:
            if exc.status in (0, 401):
                raise  # the API server's, not Prometheus's
            raise ReportFailed(f"Prometheus through {service}: {exc}") from None

    return query


def _selector(labels: Mapping[str, str]) -> str:
    """A PromQL selector matching ``labels`` exactly (empty values left out)."""
    matchers = [f"{name}={json.dumps(value)}" for name, value in labels.items() if value]
    return "{" + ",".join(matchers) + "}" if matchers else ""


async def _check_scraped(query: Query, window: str, scope: Mapping[str, str]) -> None:
    """Raise :class:`ReportFailed` when Prometheus keeps no accounting series at all over ``window``
    (in ``scope``), so that no report reads as zero GPU-hours."""
    promql = f"count(count_over_time({METRICS['allocated']}{_selector(scope)}[{window}]))"
    answer = await query(promql)
    if answer.get("status") == "success" and not answer.get("data", {}).get("result"):
        where = f" with {_selector(scope)}" if scope else ""
        raise ReportFailed(f"no gpuwarden series{where} in the last {window}: is the operator scraped?")


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


def _price(scope: str) -> str:
    """Each GPU model's price per hour, in ``scope`` (a selector: the cluster's)."""
    return f"max by (gpu_model) (gpuwarden_gpu_price_per_hour{scope})"


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
    query: Query, window: str, labels: tuple[str, ...], selector: str, scope: str
) -> dict[tuple[str, ...], Line]:
    """Each group's hours, idle cost, cost and tokens over ``window``, summed by ``labels``; ``selector``
    matches the counters, ``scope`` the prices (the cluster's labels only)."""
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
        f"* on (gpu_model) group_left () {_price(scope)}) / 3600"
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


async def workload_lines(
    query: Query, window: str, namespace: str = "", scope: Mapping[str, str] | None = None
) -> dict[WorkloadRef, Line]:
    """Each workload's GPU-hours over ``window`` (idle cost and cost where a price is set, tokens
    where its pods' servers count them); ``scope`` is more labels to match (the cluster's)."""
    selector = _selector({"namespace": namespace, **(scope or {})})
    lines = await _lines(
        query, window, ("namespace", "workload_kind", "workload"), selector, _selector(scope or {})
    )
    return {WorkloadRef(*key): line for key, line in lines.items()}


async def group_lines(
    query: Query,
    window: str,
    labels: tuple[str, ...],
    namespace: str = "",
    scope: Mapping[str, str] | None = None,
) -> dict[tuple[str, ...], Line]:
    """Each group's figures over ``window`` (``--by``): by the counters' ``labels``."""
    selector = _selector({"namespace": namespace, **(scope or {})})
    return await _lines(query, window, labels, selector, _selector(scope or {}))


async def unallocated_lines(
    query: Query, window: str, scope: Mapping[str, str] | None = None
) -> dict[tuple[str, str], Line]:
    """GPU-hours no pod held over ``window`` by (node, GPU model), and their cost where priced."""
    where = _selector(scope or {})
    metric = f"gpuwarden_gpu_unallocated_seconds_total{where}"
    labels = ("node", "gpu_model")
    lines = {
        key: Line(allocated=value / 3600.0)
        for key, value in (
            await _sums(query, f"sum by (node, gpu_model) (increase({metric}[{window}]))", labels)
        ).items()
    }
    increase = f"increase({metric}[{window}])"
    priced = f"sum by (node, gpu_model) ({increase} * on (gpu_model) group_left () {_price(where)}) / 3600"
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

"""``gpuwarden check``: is this install working? The chart's ``helm test`` runs it in the operator's image.

In under a minute and without a GPU workload it checks, and says what is wrong and what to do when not:

1. the agent DaemonSet runs on at least one node, and has created its pods (a refused pod, say by Pod
   Security, shows only in the DaemonSet's Events: quoted);
2. every agent pod is Ready, which means fresh samples (its ``/readyz``); one that is not is named with
   its container's state: an image that cannot be pulled, or the message it exited with (the agent's
   own, naming the chart values that give it a GPU);
3. every agent reaches the operator: its ``gpuwarden_agent_reports_sent_total`` grows between two
   scrapes of its ``/metrics``, or its report errors are named by reason;
4. the operator evaluates policies: a policy selecting no pod is created, and must get a status for
   its generation; it is deleted afterwards.

Exit 0 when all hold, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.operator.kube import ApiError, JsonObject, KubeApi
from gpuwarden.operator.resources import GROUP, PLURAL, VERSION

CHECK_LABEL = "gpuwarden.dev/check"
"""The label of the check's policy, and of the pods it selects (there are none)."""

Metrics = dict[str, float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", ""),
        help="the release namespace, where the agent DaemonSet runs (default: $POD_NAMESPACE)",
    )
    parser.add_argument("--agent-daemonset", required=True, help="name of the agent DaemonSet")
    parser.add_argument("--agent-port", type=int, default=9400, help="the agents' /metrics port")
    parser.add_argument(
        "--policy-namespace",
        default="",
        help="where to create the check's policy: a namespace the operator watches (default: --namespace)",
    )
    parser.add_argument("--timeout", type=float, default=45.0, help="seconds for the whole check")


def run(args: argparse.Namespace) -> int:
    if not args.namespace:
        print("gpuwarden check: --namespace (or $POD_NAMESPACE) is required", file=sys.stderr)
        return 2
    problems = asyncio.run(
        check(
            KubeApi(),
            namespace=args.namespace,
            daemonset=args.agent_daemonset,
            agent_port=args.agent_port,
            policy_namespace=args.policy_namespace or args.namespace,
            seconds=args.timeout,
        )
    )
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print("OK: the agents sample and report, and the operator evaluates policies")
    return 1 if problems else 0


# -- what the objects say (pure) ------------------------------------------------------------------


def daemonset_problems(daemonset: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why the agent DaemonSet runs nowhere, or has not created its pods."""
    name = daemonset["metadata"]["name"]
    status = daemonset.get("status") or {}
    desired = int(status.get("desiredNumberScheduled", 0))
    created = int(status.get("currentNumberScheduled", 0))
    refusals = sorted({str(e.get("message", "")) for e in events if e.get("reason") == "FailedCreate"})
    problems = []
    if desired == 0:
        problems.append(
            f"the agent DaemonSet {name} runs on no node: no node matches agent.nodeSelector/agent.affinity "
            "(label your GPU nodes or set them to a label they carry; docs/install.md lists them per cluster)"
        )
    if refusals:
        problems.append(
            f"the agent DaemonSet {name} cannot create its pods: {refusals[-1]}"
            + (
                " (label the release namespace pod-security.kubernetes.io/enforce=privileged)"
                if "PodSecurity" in refusals[-1]
                else ""
            )
        )
    elif created < desired:
        problems.append(f"the agent DaemonSet {name} has created {created} of its {desired} pods")
    return problems


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """Why an agent pod is not Ready (None if it is), from its container's state."""
    if _ready(pod):
        return None
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName") or "no node yet"
    where = f"agent pod {pod['metadata']['name']} on {node}"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        terminated = (container.get("lastState") or {}).get("terminated") or (
            container.get("state") or {}
        ).get("terminated")
        if waiting.get("reason") in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName"):
            return (
                f"{where} cannot pull its image {container.get('image')}: {waiting.get('message', '')} "
                "(build and push the images, then set global.imageRegistry and global.imagePullSecrets)"
            ).strip()
        if terminated and terminated.get("message"):
            return f"{where} exited ({terminated.get('exitCode')}): {terminated['message'].strip()}"
        if waiting.get("reason"):
            return f"{where} is waiting: {waiting['reason']} {waiting.get('message', '')}".strip()
    return f"{where} is not Ready: its /readyz fails, so it takes no fresh samples (kubectl logs it)"


def parse_metrics(text: str) -> Metrics:
    """Samples by name and labels, e.g. ``gpuwarden_agent_report_errors_total{reason="unauthorized"}``."""
    found: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def reporting_problem(pod: str, before: Metrics, after: Metrics) -> str | None:
    """Whether the agent ``pod`` delivered reports between two scrapes, and why not."""
    sent = "gpuwarden_agent_reports_sent_total"
    if after.get(sent, 0.0) > before.get(sent, 0.0):
        return None
    errors = {
        key.partition('reason="')[2].rstrip('"}'): value - before.get(key, 0.0)
        for key, value in after.items()
        if key.startswith("gpuwarden_agent_report_errors_total{") and value > before.get(key, 0.0)
    }
    detail = ", ".join(f"{reason} x{count:g}" for reason, count in sorted(errors.items()))
    return f"agent pod {pod} is not reaching the operator: " + (
        f"its reports fail ({detail})" if detail else "it delivered no report between two scrapes"
    )


def check_policy(namespace: str) -> dict[str, Any]:
    """A policy selecting no pod, evaluated every second: the operator must give it a status."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GPUMonitorPolicy",
        "metadata": {
            "generateName": "gpuwarden-check-",
            "namespace": namespace,
            "labels": {CHECK_LABEL: "true"},
        },
        "spec": {
            "selector": {"matchLabels": {CHECK_LABEL: "no-such-pod"}},
            "evaluationInterval": "1s",
            "rules": [{"name": "check", "utilizationFloor": {"percent": 1, "for": "1m"}}],
        },
    }


# -- asking the cluster ---------------------------------------------------------------------------


async def _until(probe: Callable[[], Awaitable[bool]], deadline: float, every: float = 1.0) -> bool:
    while True:
        if await probe():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(every)


async def _scrape(session: aiohttp.ClientSession, url: str) -> Metrics | str:
    try:
        async with session.get(url) as rsp:
            if rsp.status != 200:
                return f"{url} answered {rsp.status}"
            return parse_metrics(await rsp.text())
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{url} cannot be reached: {exc!r}"


async def check(
    api: KubeApi,
    *,
    namespace: str,
    daemonset: str,
    agent_port: int,
    policy_namespace: str,
    seconds: float,
    report_wait: float = 10.0,
) -> list[str]:
    """Every problem found in about ``seconds`` (empty: the install works)."""
    deadline = time.monotonic() + seconds
    try:
        problems = await _agents(api, namespace, daemonset, agent_port, deadline, report_wait)
        problems += await _evaluation(api, policy_namespace, deadline)
    except ApiError as exc:
        problems = [f"the API server refused the check: {exc} (its Role is the chart's templates/tests/)"]
    finally:
        await api.close()
    return problems


async def _agents(
    api: KubeApi, namespace: str, name: str, port: int, deadline: float, report_wait: float
) -> list[str]:
    ds: JsonObject = await api.get(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}")
    events = await api.request(
        "GET",
        f"/api/v1/namespaces/{namespace}/events",
        params={"fieldSelector": f"involvedObject.kind=DaemonSet,involvedObject.name={name}"},
    )
    problems = daemonset_problems(ds, events.get("items") or [])
    if problems:
        return problems
    selector = ",".join(f"{k}={v}" for k, v in ds["spec"]["selector"]["matchLabels"].items())
    pods: list[JsonObject] = []

    async def all_ready() -> bool:
        nonlocal pods
        listed = await api.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector}
        )
        pods = list(listed.get("items") or [])
        return bool(pods) and all(_ready(p) for p in pods)

    # A pod that just started takes a sample within seconds; give them until half the time is left.
    await _until(all_ready, min(deadline, time.monotonic() + max(1.0, (deadline - time.monotonic()) / 2)))
    problems = [p for p in map(pod_problem, pods) if p is not None]
    ready = [p for p in pods if _ready(p)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        urls = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:{port}/metrics" for p in ready}
        before = {pod: await _scrape(session, url) for pod, url in urls.items()}
        await asyncio.sleep(min(report_wait, max(0.0, deadline - time.monotonic())))
        for pod, url in urls.items():
            first, second = before[pod], await _scrape(session, url)
            if isinstance(first, str) or isinstance(second, str):
                problems.append(f"agent pod {pod}: {first if isinstance(first, str) else second}")
                continue
            problem = reporting_problem(pod, first, second)
            if problem is not None:
                problems.append(problem)
    return problems


async def _evaluation(api: KubeApi, namespace: str, deadline: float) -> list[str]:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    created = await api.request("POST", base, body=check_policy(namespace))
    name = created["metadata"]["name"]
    try:

        async def evaluated() -> bool:
            policy = await api.get(f"{base}/{name}")
            status = policy.get("status") or {}
            return bool(status.get("observedGeneration") == policy["metadata"].get("generation"))

        if await _until(evaluated, max(deadline, time.monotonic() + 5)):
            return []
        return [
            f"the operator did not evaluate the policy {namespace}/{name} in time: is it running and "
            f"watching {namespace} (operator.watchNamespaces)? kubectl logs of its active replica "
            "(label gpuwarden.dev/ingest-active=true) say why"
        ]
    finally:
        await api.request("DELETE", f"{base}/{name}")

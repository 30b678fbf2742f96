"""Scaling against a real kube-apiserver: the scaler's calls, the chart's RBAC, and the operator end to end.

Most tests drive :class:`WorkloadScaler` directly over the operator's own API client, with the
decider fed synthetic findings and an injected clock (ten seconds of "time" per round,
no sleeping): the step-by-step climb to maxReplicas, the stabilized descent to
minReplicas, no flapping, HPA and policy conflicts, dryRun, a custom resource found
through discovery, and the chart's ServiceAccount. Each round writes the status the
way the operator does (``build_status`` + a ``/status`` merge patch), so the CRD's
schema judges what the WorkloadScaler reports. The last test runs the operator and a scripted
agent as processes and watches a Deployment scale up to its maximum and back down.

There is no controller-manager: a Deployment's ``spec.replicas`` is all that changes,
and that is exactly what the ``/scale`` subresource writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane
from operator_support import (
    InNamespace,
    World,
    apply,
    apply_crds,
    events,
    get,
    gpu,
    operator_and_agent,
    pod,
    prepare,
    wait_until,
)
from test_chart import can_i  # the chart tests' `kubectl auth can-i` as a ServiceAccount

from gpuwarden.clients import Credentials
from gpuwarden.operator.kube.client import KubeApi
from gpuwarden.operator.kube.events import EventPoster
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.policies.status import PolicyVerdict, build_status
from gpuwarden.operator.resources import GROUP, PLURAL, VERSION, PolicyKey
from gpuwarden.operator.scaling.api import KubeScaleApi
from gpuwarden.operator.scaling.claims import policy_claim
from gpuwarden.operator.scaling.workload import ScaleOutcome, WorkloadScaler
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.spec.model import ScaleAction

pytestmark = pytest.mark.integration

T0 = 1_900_000_000.0
"""The injected clock's start (epoch seconds)."""
TICK = 10.0
"""Seconds of injected time per evaluation round."""
APP = "llm-server"
CHART = REPO_ROOT / "charts" / "gpuwarden"
DOCS = REPO_ROOT / "docs" / "scaling.md"


@dataclass(frozen=True)
class F:
    """A synthetic active finding: what the WorkloadScaler reads of one."""

    rule: str
    pod: str


def on(rule: str, *pods: str) -> list[F]:
    return [F(rule, p) for p in pods]


PODS = ("llm-server-a", "llm-server-b")
SATURATED = on("saturated", *PODS)
IDLE = on("idle-gpu", *PODS)
HALF_IDLE = on("idle-gpu", PODS[0])


# --- objects ---------------------------------------------------------------------------------------


def deployment(namespace: str, replicas: int, name: str = APP) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "server", "image": "example.invalid/llm:1"}]},
            },
        },
    }


def policy(
    namespace: str,
    name: str = "llm-serving",
    *,
    lo: int = 1,
    hi: int = 4,
    dry_run: bool = False,
    target: dict[str, str] | None = None,
    scale_up: dict[str, Any] | None = None,
    scale_down: dict[str, Any] | None = None,
    interval: str = "5s",  # no longer than the rules' 5s windows, as the CRD demands
) -> dict[str, Any]:
    return {
        "apiVersion": "gpuwarden.dev/v1alpha1",
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": APP}},
            "evaluationInterval": interval,
            "rules": [
                {"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5s", "signal": "gpuUtil"}},
                {
                    "name": "saturated",
                    "utilizationCeiling": {"percent": 90, "for": "5s", "signal": "gpuUtil"},
                },
            ],
            "actions": {
                "scale": {
                    "targetRef": target or {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
                    "minReplicas": lo,
                    "maxReplicas": hi,
                    "scaleUpOn": ["saturated"],
                    "scaleDownOn": ["idle-gpu"],
                    "behavior": {
                        "scaleUp": scale_up or {"stabilizationWindow": "0s", "step": 1, "cooldown": "1m"},
                        "scaleDown": scale_down or {"stabilizationWindow": "5m", "step": 1, "cooldown": "1m"},
                    },
                    "dryRun": dry_run,
                }
            },
        },
    }


def hpa(namespace: str, name: str = "llm-hpa") -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
            "minReplicas": 1,
            "maxReplicas": 10,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
                }
            ],
        },
    }


def action_of(obj: dict[str, Any]) -> ScaleAction:
    action = parse_spec(obj["spec"]).actions.scale
    assert action is not None
    return action


def messages(found: Sequence[Any]) -> list[str]:
    """Events' messages, sorted: with the injected clock many Events share one real second, and
    Events of one second come back in no particular order."""
    return sorted(e["message"] for e in found)


# --- the bench: the WorkloadScaler over a real API server --------------------------------------------------


@dataclass
class Bench(InNamespace):
    """A namespace with the CRDs, a WorkloadScaler over the operator's API client, and its clock."""

    cp: ControlPlane
    namespace: str
    kube: KubeApi
    scaler: WorkloadScaler
    poster: EventPoster
    now: float = T0

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        apply(self.cp, obj)
        return obj

    def replicas(self, name: str = APP, resource: str = "deployment") -> int:
        return int(get(self.cp, resource, name, "-n", self.namespace)["spec"]["replicas"])

    def status(self, name: str = "llm-serving") -> dict[str, Any]:
        return self.policy_status(name)

    def condition(self, name: str = "llm-serving") -> dict[str, Any]:
        conditions = {c["type"]: c for c in self.status(name).get("conditions") or []}
        return dict(conditions.get("ScalingActive") or {})

    async def round(
        self, obj: dict[str, Any], findings: Sequence[F], matched: int = len(PODS), *, advance: bool = True
    ) -> ScaleOutcome:
        """One evaluation: the scaler reconciles, then the status is written as the operator writes it.

        The WorkloadScaler is given the namespace's policies as listed now: what the operator's index holds.
        """
        name = obj["metadata"]["name"]
        listing = await self.kube.get(f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}")
        outcome = await self.scaler.reconcile(
            PolicyKey(self.namespace, name),
            action_of(obj),
            findings,
            matched,
            self.now,
            [policy_claim(item) for item in listing["items"]],
        )
        await self.poster.drain()  # the Events it queued are posted, as the operator's poster posts them
        result = outcome.result()
        verdict = PolicyVerdict(
            generation=1, scale=result.status, problem=result.problem, scale_condition=result.condition
        )
        live = await self.kube.get(f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{name}")
        status = build_status(verdict, live.get("status"), self.now)
        await self.kube.patch_status(GROUP, VERSION, PLURAL, self.namespace, name, status, manager="test")
        if advance:
            self.now += TICK
        return outcome

    async def rounds(self, obj: dict[str, Any], findings: Sequence[F], n: int) -> list[int]:
        """``n`` rounds; the Deployment's replicas after each."""
        seen = []
        for _ in range(n):
            await self.round(obj, findings)
            seen.append(await self.read_replicas())
        return seen

    async def read_replicas(self) -> int:
        """The Deployment's replicas, read through /scale (cheaper than a kubectl per round)."""
        scale = await self.kube.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{APP}/scale")
        return int(scale["spec"]["replicas"])


@pytest.fixture(scope="module")
def crds(control_plane: ControlPlane) -> None:
    apply_crds(control_plane)


def admin_info(cp: ControlPlane, token: str | None = None) -> Credentials:
    return Credentials(cp.server, ca_file=str(cp.ca_path), token=token or cp.admin_token)


@pytest.fixture
async def bench(control_plane: ControlPlane, namespace: str, crds: None) -> AsyncIterator[Bench]:
    kube = KubeApi(admin_info(control_plane))
    try:
        async with posting(kube) as poster:
            yield Bench(control_plane, namespace, kube, WorkloadScaler(KubeScaleApi(kube), poster), poster)
    finally:
        await kube.close()


@contextlib.asynccontextmanager
async def posting(kube: KubeApi) -> AsyncIterator[EventPoster]:
    """The operator's Event poster over ``kube``, its worker running; what it queued is posted at exit."""
    poster = EventPoster(kube, instance="test", dropped=OperatorMetrics().events_dropped)
    worker = asyncio.create_task(poster.run())
    try:
        yield poster
        await poster.drain()
    finally:
        worker.cancel()


# --- the climb, the descent, no flapping -----------------------------------------------------------


async def test_saturation_steps_up_to_max_and_no_further(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=2))
    obj = bench.apply(policy(bench.namespace, hi=4))  # scale up: no window, 1 replica, 1m cooldown

    seen = await bench.rounds(obj, SATURATED, 20)  # 200 s

    # One step at once, then one per minute, then held at maxReplicas.
    assert seen == [3] * 6 + [4] * 14
    ups = bench.events("Deployment", APP, "ScaledUp")
    assert messages(ups) == sorted(
        [
            "policy llm-serving: scaled llm-server 2→3: saturated on 2/2 pods",
            "policy llm-serving: scaled llm-server 3→4: saturated on 2/2 pods for 1m",
        ]
    )
    assert all(e["type"] == "Normal" for e in ups)
    assert messages(bench.events("GPUMonitorPolicy", "llm-serving", "ScaledUp")) == sorted(
        [
            "scaled llm-server 2→3: saturated on 2/2 pods",
            "scaled llm-server 3→4: saturated on 2/2 pods for 1m",
        ]
    )
    # Events name the objects by uid, so `kubectl describe` finds them.
    deployment_uid = get(bench.cp, "deployment", APP, "-n", bench.namespace)["metadata"]["uid"]
    assert {e["involvedObject"]["uid"] for e in ups} == {deployment_uid}
    status = bench.status()
    assert status["scale"] == {
        "currentReplicas": 4,
        "desiredReplicas": 4,
        "lastScaleTime": "2030-03-17T17:47:40Z",  # T0 + 60 s
        "lastScaleReason": "scaled llm-server 3→4: saturated on 2/2 pods for 1m",
    }
    condition = bench.condition()
    assert (condition["status"], condition["reason"]) == ("True", "Active")
    assert condition["message"] == "saturated on 2/2 pods; already at maxReplicas 4"
    # `kubectl get gmp -o wide` shows the replicas.
    wide = bench.cp.kubectl("get", "gmp", "llm-serving", "-n", bench.namespace, "-o", "wide", check=True)
    assert re.search(r"llm-serving\s+\d+\s+\d+\s+4\s", wide.stdout), wide.stdout


async def test_idle_scales_down_after_the_window_and_never_below_min(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=4))
    obj = bench.apply(policy(bench.namespace, lo=2, hi=6))  # scale down: 5m window, 1 replica, 1m cooldown

    seen = await bench.rounds(obj, IDLE, 60)  # 600 s

    assert seen[:30] == [4] * 30  # t = 0 .. 290 s: waiting out the window
    assert seen[30:36] == [3] * 6  # t = 300 s: first step
    assert seen[36:] == [2] * 24  # t = 360 s: at minReplicas, and there it stays
    downs = bench.events("GPUMonitorPolicy", "llm-serving", "ScaledDown")
    assert messages(downs) == sorted(
        [
            "scaled llm-server 4→3: idle-gpu on 2/2 pods for 5m",
            "scaled llm-server 3→2: idle-gpu on 2/2 pods for 6m",
        ]
    )
    assert bench.condition()["message"] == "idle-gpu on 2/2 pods; already at minReplicas 2"


async def test_a_signal_hovering_at_the_threshold_does_not_flap(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=3))
    obj = bench.apply(policy(bench.namespace, hi=6))

    # The second pod's idleness comes and goes every 2 rounds for 15 minutes: never 5m of "all idle".
    hovering = [await bench.round(obj, IDLE if (i // 2) % 2 else HALF_IDLE) for i in range(90)]
    assert {o.status.current_replicas for o in hovering} == {3}
    assert bench.replicas() == 3

    # Saturation alternating with idleness: it scales up, never down (no direction change in a window).
    seen = []
    for i in range(30):
        await bench.round(obj, SATURATED if i % 2 else IDLE)
        seen.append(await bench.read_replicas())
    assert seen == sorted(seen)
    assert seen[-1] > 3
    assert bench.events("Deployment", APP, "ScaledDown") == []


async def test_replicas_set_outside_the_range_are_brought_back(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=9))
    obj = bench.apply(policy(bench.namespace, lo=2, hi=5))
    await bench.round(obj, [])
    assert bench.replicas() == 5
    bench.cp.kubectl("scale", "deployment", APP, "-n", bench.namespace, "--replicas=1", check=True)
    await bench.round(obj, [])
    assert bench.replicas() == 2
    assert messages(bench.events("GPUMonitorPolicy", "llm-serving")) == sorted(
        [
            "scaled llm-server 9→5: 9 replicas exceed maxReplicas 5",
            "scaled llm-server 1→2: 1 replicas are below minReplicas 2",
        ]
    )


# --- not acting: HPA, another policy, dryRun -------------------------------------------------------


async def test_an_hpa_on_the_deployment_blocks_scaling(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=2))
    obj = bench.apply(policy(bench.namespace))
    bench.apply(hpa(bench.namespace))

    for _ in range(8):
        outcome = await bench.round(obj, SATURATED)
        assert outcome.status.desired_replicas == 3  # still decided and published, not applied
    assert bench.replicas() == 2

    condition = bench.condition()
    assert (condition["status"], condition["reason"]) == ("False", "HPAConflict")
    assert "HorizontalPodAutoscaler llm-hpa also scales it" in condition["message"]
    assert bench.status()["conditions"][0]["type"] == "Ready"
    assert bench.status()["conditions"][0]["status"] == "True"  # the policy itself is fine
    # One Warning on each object, not one per evaluation.
    for kind, name in (("GPUMonitorPolicy", "llm-serving"), ("Deployment", APP)):
        (warning,) = bench.events(kind, name, "HPAConflict")
        assert warning["type"] == "Warning"

    bench.cp.kubectl("delete", "hpa", "llm-hpa", "-n", bench.namespace, check=True)
    await bench.round(obj, SATURATED)
    assert bench.replicas() == 3
    assert (bench.condition()["status"], bench.condition()["reason"]) == ("True", "Active")


async def test_two_policies_on_one_deployment_both_stop(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=2))
    a = bench.apply(policy(bench.namespace, "llm-a"))
    b = bench.apply(policy(bench.namespace, "llm-b"))

    for _ in range(3):
        for obj in (b, a):  # whichever evaluates first: both stop
            outcome = await bench.round(obj, SATURATED, advance=False)
            assert outcome.condition.reason == "PolicyConflict"
        bench.now += TICK
    assert bench.replicas() == 2
    for name in ("llm-a", "llm-b"):
        condition = bench.condition(name)
        assert (condition["status"], condition["reason"]) == ("False", "PolicyConflict")
        assert "policies llm-a, llm-b all target it" in condition["message"]
        assert len(bench.events("GPUMonitorPolicy", name, "PolicyConflict")) == 1

    # b goes to dryRun: it only watches now, and a acts.
    bench.apply(policy(bench.namespace, "llm-b", dry_run=True))
    await bench.round(a, SATURATED)
    assert bench.replicas() == 3


async def test_dry_run_changes_nothing_and_says_what_it_would_do(bench: Bench) -> None:
    bench.apply(deployment(bench.namespace, replicas=2))
    obj = bench.apply(policy(bench.namespace, dry_run=True))
    bench.apply(hpa(bench.namespace))  # dryRun feeding an HPA is the intended setup: no conflict

    seen = await bench.rounds(obj, SATURATED, 8)

    assert seen == [2] * 8
    status = bench.status()
    assert status["scale"]["currentReplicas"] == 2
    assert status["scale"]["desiredReplicas"] == 3
    assert (
        status["scale"]["lastScaleReason"]
        == "would scale llm-server 2→3: saturated on 2/2 pods for 1m (dryRun)"
    )
    condition = bench.condition()
    assert (condition["status"], condition["reason"]) == ("False", "DryRun")
    # Announced once per cooldown, like a real change.
    assert messages(bench.events("Deployment", APP, "WouldScaleUp")) == sorted(
        [
            "policy llm-serving: would scale llm-server 2→3: saturated on 2/2 pods (dryRun)",
            "policy llm-serving: would scale llm-server 2→3: saturated on 2/2 pods for 1m (dryRun)",
        ]
    )
    assert bench.events("Deployment", APP, "HPAConflict") == []


# --- targets ---------------------------------------------------------------------------------------


INFERENCE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferenceservices.serving.example.com"},
    "spec": {
        "group": "serving.example.com",
        "names": {"kind": "InferenceService", "plural": "inferenceservices", "singular": "inferenceservice"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
                "subresources": {
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
                },
            }
        ],
    },
}


async def test_a_custom_resource_is_found_through_discovery(bench: Bench) -> None:
    apply(bench.cp, INFERENCE_CRD)
    bench.cp.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferenceservices.serving.example.com",
        "--timeout=60s",
        check=True,
    )
    bench.apply(
        {
            "apiVersion": "serving.example.com/v1",
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": bench.namespace},
            "spec": {"replicas": 1},
        }
    )
    target = {"apiVersion": "serving.example.com/v1", "kind": "InferenceService", "name": "llama"}
    obj = bench.apply(policy(bench.namespace, target=target))

    await bench.round(obj, SATURATED)

    assert bench.replicas("llama", "inferenceservices.serving.example.com") == 2
    missing = bench.apply(policy(bench.namespace, "wrong-kind", target={**target, "kind": "InferenceServer"}))
    outcome = await bench.round(missing, SATURATED)
    assert outcome.condition.reason == "ScaleTargetNotScalable"
    assert "serves no kind InferenceServer" in outcome.condition.message
    ready = {c["type"]: c for c in bench.status("wrong-kind")["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ScaleTargetNotScalable")


async def test_a_missing_target_is_reported(bench: Bench) -> None:
    obj = bench.apply(policy(bench.namespace))
    await bench.round(obj, SATURATED)
    conditions = {c["type"]: c for c in bench.status()["conditions"]}
    assert (conditions["ScalingActive"]["reason"], conditions["Ready"]["reason"]) == (
        "ScaleTargetNotFound",
        "ScaleTargetNotFound",
    )
    (warning,) = bench.events("GPUMonitorPolicy", "llm-serving", "ScaleTargetNotFound")
    assert warning["message"] == "Deployment llm-server not found"


# --- RBAC: the chart's ServiceAccount ---------------------------------------------------------------


@pytest.fixture
def chart_operator_sa(control_plane: ControlPlane, namespace: str, crds: None) -> Iterator[tuple[str, str]]:
    """The chart's operator ServiceAccount and RBAC, rendered by ``helm template`` for ``namespace`` only."""
    cp = control_plane
    release = f"gw-scale-{secrets.token_hex(3)}"
    home = cp.create_namespace(f"{release}-system")
    rendered = cp.run_helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        home,
        "--set",
        f"operator.watchNamespaces={{{namespace}}}",
        check=True,
    ).stdout
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    objects = [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") in rbac_kinds]
    cp.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects), check=True)
    (sa,) = [
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "ServiceAccount" and "operator" in o["metadata"]["name"]
    ]
    yield home, sa
    for o in objects:
        if o["kind"] in {"ClusterRole", "ClusterRoleBinding"}:
            cp.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found")


async def test_the_chart_service_account_scales_through_scale_only(
    control_plane: ControlPlane, namespace: str, chart_operator_sa: tuple[str, str]
) -> None:
    cp = control_plane
    home, sa = chart_operator_sa
    assert can_i(cp, home, sa, "patch", "deployments.apps", "--subresource=scale", "-n", namespace)
    assert can_i(cp, home, sa, "get", "deployments.apps", "--subresource=scale", "-n", namespace)
    assert not can_i(cp, home, sa, "patch", "deployments.apps", "-n", namespace)
    assert not can_i(cp, home, sa, "get", "deployments.apps", "-n", namespace)
    assert can_i(cp, home, sa, "list", "horizontalpodautoscalers.autoscaling", "-n", namespace)
    assert can_i(cp, home, sa, "list", "gpumonitorpolicies.gpuwarden.dev", "-n", namespace)
    assert can_i(cp, home, sa, "create", "events", "-n", namespace)

    # And the WorkloadScaler, running as that ServiceAccount, does everything it does with nothing more.
    token = cp.kubectl("create", "token", sa, "-n", home, "--duration=1h", check=True).stdout.strip()
    apply(cp, deployment(namespace, replicas=1))
    obj = policy(namespace)
    apply(cp, obj)
    kube = KubeApi(admin_info(cp, token))
    try:
        indexed = [policy_claim(get(cp, "gmp", "llm-serving", "-n", namespace))]
        async with posting(kube) as poster:
            outcome = await WorkloadScaler(KubeScaleApi(kube), poster).reconcile(
                PolicyKey(namespace, "llm-serving"), action_of(obj), SATURATED, 2, T0, indexed
            )
        assert (outcome.applied, outcome.condition.reason) == (True, "Active"), outcome.condition
        status = build_status(
            PolicyVerdict(
                generation=1, scale=outcome.result().status, scale_condition=outcome.result().condition
            ),
            None,
            T0,
        )
        await kube.patch_status(GROUP, VERSION, PLURAL, namespace, "llm-serving", status, manager="test")
    finally:
        await kube.close()
    assert get(cp, "deployment", APP, "-n", namespace)["spec"]["replicas"] == 2
    assert [e["reason"] for e in events(cp, namespace, kind="Deployment", name=APP)] == ["ScaledUp"]
    managers = get(cp, "deployment", APP, "-n", namespace, "--show-managed-fields")["metadata"][
        "managedFields"
    ]
    assert any(m["manager"] == "gpuwarden-scaler" and m.get("subresource") == "scale" for m in managers)


# --- the docs' manifests -----------------------------------------------------------------------------


def doc_manifests() -> list[dict[str, Any]]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.S)
    return [d for block in blocks for d in yaml.safe_load_all(block) if isinstance(d, dict)]


def test_the_docs_manifests_are_accepted(control_plane: ControlPlane, namespace: str, crds: None) -> None:
    """Policies and HPAs in docs/scaling.md pass the API server's validation (server-side dry run)."""
    manifests = doc_manifests()
    checked = 0
    for doc in manifests:
        if doc.get("kind") in {"GPUMonitorPolicy", "HorizontalPodAutoscaler"}:
            doc["metadata"]["namespace"] = namespace
            proc = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc))
            assert proc.returncode == 0, f"{doc['kind']} {doc['metadata']['name']}: {proc.stderr}"
            checked += 1
    assert checked == 3  # the policy and the two HPAs
    kinds = [d.get("kind") for d in manifests]
    assert "ScaledObject" in kinds
    (adapter,) = [d for d in manifests if "externalRules" in d]
    assert {
        r["seriesQuery"].split("{")[0].strip("'") for r in adapter["rules"] + adapter["externalRules"]
    } == {
        "gpuwarden_pod_gpu_utilization_percent",
        "gpuwarden_policy_desired_replicas",
    }


# --- end to end: the operator and a scripted agent ----------------------------------------------------


E2E_IDLE_AT = 45.0
"""Scenario second at which the saturated GPUs go idle."""


class Scaling(World):
    def replicas(self) -> int:
        return int(get(self.cp, "deployment", APP, "-n", self.namespace)["spec"]["replicas"])

    def status(self) -> dict[str, Any]:
        return self.policy_status("llm-serving")


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scaling]:
    cp = control_plane
    labels = {"app": APP}
    setup = prepare(cp, tmp_path_factory, "scaling", gpu_pods=PODS, labels=labels)
    ns = setup.namespace
    uuids = [f"GPU-5ca1e000-0000-4000-8000-00000000000{i}" for i in range(2)]
    at = f"{int(E2E_IDLE_AT)}s"
    gpus = [
        gpu(u, i, [{"kind": "saturated", "level": 98}, {"kind": "idle", "at": at, "level": 3, "noise": 1}],
            [{"kind": "idle", "level": "60Gi"}])
        for i, u in enumerate(uuids)
    ]  # fmt: skip
    pods = [pod(ns, name, uuids[i], labels, 5000 + i) for i, name in enumerate(PODS)]
    scenario = setup.scenario("scaling", gpus, pods)
    setup.apply(deployment(ns, replicas=1))
    setup.apply(
        policy(
            ns,
            hi=3,
            interval="1s",
            scale_up={"stabilizationWindow": "0s", "step": 1, "cooldown": "5s"},
            scale_down={"stabilizationWindow": "10s", "step": 1, "cooldown": "5s"},
        ),
    )
    with operator_and_agent(setup, scenario) as (operator, agent):
        yield Scaling(cp, ns, operator, agent)


def test_the_operator_scales_a_deployment_up_to_max_and_back_to_min(world: Scaling) -> None:
    wait_until(lambda: world.replicas() == 3, timeout=60, what="3 replicas", alive=world.alive)
    scale = world.status().get("scale") or {}
    assert scale.get("desiredReplicas") == 3
    metric = f'gpuwarden_policy_desired_replicas{{namespace="{world.namespace}",policy="llm-serving"}}'
    assert world.operator.metrics().get(metric) == 3
    ups = world.events("Deployment", APP, "ScaledUp")
    assert [e["message"].split(":")[1].strip() for e in ups] == [
        "scaled llm-server 1→2",
        "scaled llm-server 2→3",
    ]

    # Still saturated, at the maximum: no further.
    wait_until(
        lambda: "already at maxReplicas 3" in _scaling_message(world),
        timeout=30,
        what="held at max",
        alive=world.alive,
    )
    assert world.replicas() == 3

    # Idle from E2E_IDLE_AT: down after the 10s window, one step per 5s cooldown, to minReplicas.
    wait_until(
        lambda: world.replicas() == 1, timeout=E2E_IDLE_AT + 90, what="back to 1 replica", alive=world.alive
    )
    downs = world.events("GPUMonitorPolicy", "llm-serving", "ScaledDown")
    assert [e["message"].split(":")[0] for e in downs] == ["scaled llm-server 3→2", "scaled llm-server 2→1"]
    assert "idle-gpu on 2/2 pods for" in downs[0]["message"]
    wait_until(
        lambda: "already at minReplicas 1" in _scaling_message(world),
        timeout=30,
        what="held at min",
        alive=world.alive,
    )
    assert world.replicas() == 1
    conditions = {c["type"]: c for c in world.status()["conditions"]}
    assert (conditions["ScalingActive"]["status"], conditions["Ready"]["status"]) == ("True", "True")


def _scaling_message(world: Scaling) -> str:
    conditions = {c["type"]: c for c in world.status().get("conditions") or []}
    return str((conditions.get("ScalingActive") or {}).get("message", ""))

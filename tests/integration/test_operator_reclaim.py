"""Reclaiming against a real kube-apiserver: each action warns, waits, acts, is cancelled by work, respects
the opt-out and the HPA rule, stops at the circuit breakers, and ``gpuwarden restore`` undoes it.

The tests drive :class:`Reclaimer` directly over the operator's own API client, with the evaluations
it reads built here (the pods' idle findings, and which pods worked in the last interval) and an injected
clock (ten seconds of "time" per round, no sleeping): the grace period is the policy's, measured on that
clock. Each round writes the status the way the operator does (``build_status`` + a ``/status`` merge
patch), so the CRD's schema judges what the Reclaimer reports. ``gpuwarden restore`` runs as the user
runs it: a process with a kubeconfig.

The module runs on an API server of its own with Kueue's real controller manager (:mod:`kueue`: built
from its Go module, installed from its release's CRDs and webhooks; their webhooks fail closed and must
not outlive it on the session's), and the real CRDs of RayCluster, JobSet and LeaderWorkerSet, whose
controllers do not run: nothing but Kueue acts on a reclaimed object. There is no controller-manager
either: a Deployment's pods are made here with the ownerReferences its ReplicaSet would give them, and a
Job's status stays empty (Kueue reads an unstarted Job as stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from controlplane import Binaries, ControlPlane, ControlPlaneError, running_control_plane
from kueue import Kueue
from operator_support import InNamespace, apply, apply_crds, get, wait_until

from gpuwarden.clients import Credentials
from gpuwarden.operator.kube.client import KubeApi
from gpuwarden.operator.kube.events import EventPoster
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.policies.status import PolicyVerdict, build_status
from gpuwarden.operator.reclaim import KubeReclaimApi, Reclaimer, ReclaimResult
from gpuwarden.operator.resources import GROUP, PLURAL, VERSION, PodRecord, PolicyKey
from gpuwarden.policy import Evaluation, Finding, PodId, PodView, RuleKind, parse_spec

pytestmark = pytest.mark.integration

T0 = 1_900_000_000.0
TICK = 10.0
GRACE = "1m"
CLUSTER_QUEUE = "gpus"
LOCAL_QUEUE = "team-a"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_WAIT_S = 60.0
"""How long Kueue may take to admit, evict or re-admit a Workload (it takes well under a second)."""


def policy(namespace: str, name: str = "idle", **reclaim: Any) -> dict[str, Any]:
    spec = {"rules": ["idle-gpu"], "action": "ScaleToZero", "gracePeriod": GRACE, "dryRun": False}
    spec.update(reclaim)
    return {
        "apiVersion": "gpuwarden.dev/v1alpha1",
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {},
            "evaluationInterval": "10s",
            "rules": [{"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5m"}}],
            "actions": {"reclaim": spec},
        },
    }


def controller_ref(owner: dict[str, Any]) -> dict[str, Any]:
    """An ownerReference naming ``owner`` (an object as the API server returned it) its controller."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def finding(namespace: str, pod: str, since: float) -> Finding:
    return Finding(
        policy="idle",
        rule="idle-gpu",
        kind=RuleKind("utilizationFloor"),
        reason="GPUUnderutilized",
        namespace=namespace,
        pod=pod,
        gpus=("GPU-0",),
        value=2.0,
        threshold=20.0,
        unit="percent",
        started_at=since,
        message="idle",
    )


@dataclass
class Bench(InNamespace):
    """A namespace with the CRDs, a Reclaimer over the operator's API client, and its clock."""

    cp: ControlPlane
    namespace: str
    kube: KubeApi
    poster: EventPoster
    reclaimer: Reclaimer
    now: float = T0
    pods: dict[str, PodRecord] = field(default_factory=dict)

    # --- objects ---------------------------------------------------------------------------------

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj`` (in this namespace) through the API; the object as stored."""
        api_version, kind, name = obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
        obj["metadata"]["namespace"] = self.namespace
        plural = {
            "Deployment": "deployments",
            "ReplicaSet": "replicasets",
            "StatefulSet": "statefulsets",
        }.get(kind, kind.lower() + "s")
        root = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        created = await self.kube.request("POST", f"{root}/namespaces/{self.namespace}/{plural}", body=obj)
        assert created["metadata"]["name"] == name
        return created

    async def pod_of(self, owner: dict[str, Any], name: str) -> None:
        """A GPU pod controlled by ``owner`` (Pending: nothing runs here)."""
        ref = controller_ref(owner)
        pod = await self.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "ownerReferences": [ref]},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "example.invalid/cuda:1",
                            "resources": {"limits": {"nvidia.com/gpu": 1}},
                        }
                    ]
                },
            }
        )
        view = PodView(self.namespace, name, {}, {})
        self.pods[name] = PodRecord(view, pod["metadata"]["uid"])

    async def deployment(
        self, name: str, replicas: int = 2, annotations: dict[str, str] | None = None
    ) -> None:
        """A Deployment with its ReplicaSet and one pod, as the controller-manager would have made them."""
        deploy = await self.create(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "annotations": annotations or {}},
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": {"app": name}},
                    "template": {
                        "metadata": {"labels": {"app": name}},
                        "spec": {"containers": [{"name": "nb", "image": "example.invalid/nb:1"}]},
                    },
                },
            }
        )
        rs = await self.create(
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {"name": f"{name}-abc", "ownerReferences": [controller_ref(deploy)]},
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": {"app": name}},
                    "template": {
                        "metadata": {"labels": {"app": name}},
                        "spec": {"containers": [{"name": "nb", "image": "example.invalid/nb:1"}]},
                    },
                },
            }
        )
        await self.pod_of(rs, f"{name}-abc-0")

    async def job(self, name: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if owner is not None:
            meta["ownerReferences"] = [controller_ref(owner)]
        job = await self.create(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": meta,
                "spec": {
                    "suspend": False,
                    "template": {
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [{"name": "train", "image": "example.invalid/train:1"}],
                        }
                    },
                },
            }
        )
        await self.pod_of(job, f"{name}-0")
        return job

    def read(self, resource: str, name: str) -> dict[str, Any]:
        found = get(self.cp, resource, name, "-n", self.namespace)
        assert found is not None, f"{resource}/{name} not found"
        return dict(found)

    # --- rounds ----------------------------------------------------------------------------------

    async def round(
        self, obj: dict[str, Any], idle: Iterable[str], working: Iterable[str] = (), *, since: float = T0
    ) -> ReclaimResult:
        """One evaluation: the pods ``idle`` have an active idle finding (since ``since``), ``working``
        worked in the last interval; the Reclaimer acts, then the status is written as the operator does."""
        name = obj["metadata"]["name"]
        spec = parse_spec(obj["spec"])
        ids = tuple(sorted(PodId(self.namespace, p) for p in self.pods))
        active = tuple(finding(self.namespace, p, since) for p in idle)
        evaluation = Evaluation(
            at=self.now,
            transitions=(),
            active=active,
            matched_pods=ids,
            violating_pods=tuple(sorted(PodId(self.namespace, f.pod) for f in active)),
        )
        live = await self.kube.get(f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{name}")
        result = await self.reclaimer.reclaim(
            PolicyKey(self.namespace, name),
            spec,
            evaluation,
            self.now,
            self.pods.values(),
            [PodId(self.namespace, p) for p in working],
            live["metadata"]["uid"],
        )
        assert result is not None
        await self.poster.drain()
        verdict = PolicyVerdict(
            generation=1, reclaim=result.status, reclaim_condition=result.condition, scaling=False
        )
        status = build_status(verdict, live.get("status"), self.now)
        await self.kube.patch_status(GROUP, VERSION, PLURAL, self.namespace, name, status, manager="test")
        self.now += TICK
        return result

    async def rounds(
        self, obj: dict[str, Any], idle: Sequence[str], n: int, **kw: Any
    ) -> list[ReclaimResult]:
        return [await self.round(obj, idle, **kw) for _ in range(n)]

    def condition(self, name: str = "idle") -> dict[str, Any]:
        conditions = {c["type"]: c for c in self.policy_status(name).get("conditions") or []}
        return dict(conditions["ReclaimActive"])

    def reasons(self, kind: str, name: str) -> list[str]:
        return [e["reason"] for e in self.events(kind, name)]

    def restore(self, workload: str) -> subprocess.CompletedProcess[str]:
        """``gpuwarden restore`` as a user runs it, with the admin kubeconfig."""
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)}
        return subprocess.run(
            [sys.executable, "-m", "gpuwarden", "restore", workload, "-n", self.namespace],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )


@pytest.fixture(scope="module")
def control_plane(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """This module's own API server (for it, the session's ``control_plane`` and ``namespace``): Kueue's
    webhooks, on pods, Deployments and Jobs among others, would fail every later module's requests."""
    with running_control_plane(control_plane_binaries, tmp_path_factory.mktemp("reclaim")) as cp:
        yield cp


@pytest.fixture(scope="module")
def kueue(
    control_plane: ControlPlane, control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Kueue]:
    """Kueue running, with a ClusterQueue of eight GPUs (one flavor) any namespace's LocalQueue may use;
    the GPUMonitorPolicy CRD beside it."""
    binaries = control_plane_binaries
    running = Kueue(control_plane, binaries.kueue, binaries.kueue_manifests, tmp_path_factory.mktemp("kueue"))
    try:
        try:
            running.start()
        except ControlPlaneError as exc:
            pytest.fail(f"Kueue did not start: {exc}", pytrace=False)
        apply_crds(control_plane)
        apply(
            control_plane,
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "gpu"}},
        )
        apply(
            control_plane,
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ClusterQueue",
                "metadata": {"name": CLUSTER_QUEUE},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": ["nvidia.com/gpu"],
                            "flavors": [
                                {"name": "gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 8}]}
                            ],
                        }
                    ],
                },
            },
        )
        control_plane.kubectl(
            "wait", "--for=condition=Active", f"clusterqueue/{CLUSTER_QUEUE}", "--timeout=60s", check=True
        )
        yield running
    finally:
        running.stop()


@contextlib.asynccontextmanager
async def bench_in(cp: ControlPlane, namespace: str, *, max_per_hour: int = 20) -> AsyncIterator[Bench]:
    kube = KubeApi(Credentials(cp.server, ca_file=str(cp.ca_path), token=cp.admin_token))
    poster = EventPoster(kube, instance="test", dropped=OperatorMetrics().events_dropped)
    worker = asyncio.create_task(poster.run())
    reclaimer = Reclaimer(KubeReclaimApi(kube), poster, max_per_hour=max_per_hour, enabled=True)
    try:
        yield Bench(cp, namespace, kube, poster, reclaimer)
        await poster.drain()
    finally:
        worker.cancel()
        await kube.close()


@pytest.fixture
async def bench(control_plane: ControlPlane, namespace: str, kueue: Kueue) -> AsyncIterator[Bench]:
    async with bench_in(control_plane, namespace) as b:
        yield b


# --- ScaleToZero -------------------------------------------------------------------------------------


async def test_an_idle_deployment_is_warned_scaled_to_zero_after_its_grace_period_and_restored(
    bench: Bench,
) -> None:
    await bench.deployment("notebook", replicas=2)
    obj = policy(bench.namespace)
    apply(bench.cp, obj)

    first = await bench.round(obj, ["notebook-abc-0"])
    # The warning: on the Deployment, the pod and the policy, naming the action and when.
    (warning,) = bench.events("Deployment", "notebook", "ReclaimPending")
    assert warning["type"] == "Warning"
    assert warning["message"] == (
        "policy idle: will scale Deployment notebook to zero at 2030-03-17T17:47:40Z (in 1m) unless its GPUs"
        ' work: idle-gpu on 1/1 pods; opt out with the annotation gpuwarden.dev/reclaim: "false"'
    )
    assert [e["reason"] for e in bench.events("Pod", "notebook-abc-0")] == ["ReclaimPending"]
    assert bench.reasons("GPUMonitorPolicy", "idle") == ["ReclaimPending"]
    assert first.status["pendingWorkloads"] == 1
    assert bench.condition()["reason"] == "Active"

    # The grace period: nothing changes for a minute of the policy's clock.
    await bench.rounds(obj, ["notebook-abc-0"], 5)  # T0+10 .. T0+50
    assert bench.read("deployment", "notebook")["spec"]["replicas"] == 2
    await bench.round(obj, ["notebook-abc-0"])  # T0+60: due
    deploy = bench.read("deployment", "notebook")
    assert deploy["spec"]["replicas"] == 0
    marks = deploy["metadata"]["annotations"]
    assert marks["gpuwarden.dev/previous-replicas"] == "2"
    assert marks["gpuwarden.dev/reclaimed-at"] == "2030-03-17T17:47:40Z"
    assert marks["gpuwarden.dev/reclaimed-by"] == "idle: idle-gpu on 1/1 pods for 1m"
    (done,) = bench.events("Deployment", "notebook", "Reclaimed")
    assert done["message"] == (
        "policy idle: scaled to zero (2→0) Deployment notebook: idle-gpu on 1/1 pods for 1m; undo:"
        f" gpuwarden restore deployment/notebook -n {bench.namespace}"
    )
    status = bench.policy_status("idle")["reclaim"]
    assert status["lastReclaimTime"] == "2030-03-17T17:47:40Z"
    assert status["pendingWorkloads"] == 0
    # Acted once: the pods idle on (they would go, with a controller) and nothing more happens.
    await bench.rounds(obj, ["notebook-abc-0"], 3)
    assert len(bench.events("Deployment", "notebook", "Reclaimed")) == 1

    restored = bench.restore("deploy/notebook")
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.strip() == f"restored deployment/notebook in {bench.namespace}: replicas 2"
    deploy = bench.read("deployment", "notebook")
    assert deploy["spec"]["replicas"] == 2
    assert not any(k.startswith("gpuwarden.dev/") for k in deploy["metadata"].get("annotations") or {})
    again = bench.restore("deployment/notebook")
    assert again.returncode == 1
    assert "was not reclaimed" in again.stderr


async def test_work_in_the_grace_period_cancels_the_reclaim(bench: Bench) -> None:
    await bench.deployment("notebook", replicas=1)
    obj = policy(bench.namespace)
    apply(bench.cp, obj)
    await bench.rounds(obj, ["notebook-abc-0"], 4)  # warned at T0, due at T0+60
    # The notebook runs a cell at T0+40: its 5m idle finding still holds, the last interval does not.
    await bench.round(obj, ["notebook-abc-0"], working=["notebook-abc-0"])
    (cancelled,) = bench.events("Deployment", "notebook", "ReclaimCancelled")
    assert "no longer idle" in cancelled["message"]
    await bench.rounds(obj, [], 4)  # past the old deadline: nothing due
    assert bench.read("deployment", "notebook")["spec"]["replicas"] == 1
    assert bench.events("Deployment", "notebook", "Reclaimed") == []
    # Idle again: a new warning and a whole new grace period.
    await bench.round(obj, ["notebook-abc-0"])
    assert len(bench.events("Deployment", "notebook", "ReclaimPending")) == 2


async def test_the_opt_out_on_the_workload_or_its_namespace_is_respected(bench: Bench) -> None:
    await bench.deployment("keep", annotations={"gpuwarden.dev/reclaim": "false"})
    obj = policy(bench.namespace)
    apply(bench.cp, obj)
    await bench.rounds(obj, ["keep-abc-0"], 8)
    assert bench.read("deployment", "keep")["spec"]["replicas"] == 2
    assert bench.events("Deployment", "keep") == []

    await bench.deployment("other")
    bench.cp.kubectl("annotate", "namespace", bench.namespace, "gpuwarden.dev/reclaim=false", check=True)
    await bench.rounds(obj, ["keep-abc-0", "other-abc-0"], 8)
    assert bench.read("deployment", "other")["spec"]["replicas"] == 2
    assert bench.events("Deployment", "other") == []


async def test_an_hpa_on_the_deployment_means_no_reclaim(bench: Bench) -> None:
    await bench.deployment("served")
    apply(
        bench.cp,
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "served", "namespace": bench.namespace},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "served"},
                "minReplicas": 1,
                "maxReplicas": 4,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": 80},
                        },
                    }
                ],
            },
        },
    )
    obj = policy(bench.namespace)
    apply(bench.cp, obj)
    await bench.rounds(obj, ["served-abc-0"], 8)
    assert bench.read("deployment", "served")["spec"]["replicas"] == 2
    (conflict,) = bench.events("Deployment", "served", "HPAConflict")  # said once, not every evaluation
    assert "HorizontalPodAutoscaler served scales it" in conflict["message"]


async def test_dry_run_announces_and_changes_nothing(bench: Bench) -> None:
    await bench.deployment("notebook")
    obj = policy(bench.namespace, dryRun=True)
    apply(bench.cp, obj)
    await bench.rounds(obj, ["notebook-abc-0"], 10)
    assert bench.read("deployment", "notebook")["spec"]["replicas"] == 2
    (would,) = bench.events("GPUMonitorPolicy", "idle", "WouldReclaim")
    assert (
        would["message"]
        == "would have scaled to zero (2→0) Deployment notebook: idle-gpu on 1/1 pods for 1m (dryRun)"
    )
    assert (bench.condition()["status"], bench.condition()["reason"]) == ("False", "DryRun")


async def test_the_breaker_stops_at_max_per_hour_and_says_so(bench: Bench) -> None:
    for name in ("a", "b", "c"):
        await bench.deployment(name)
    obj = policy(bench.namespace, maxPerHour=2)
    apply(bench.cp, obj)
    idle = ["a-abc-0", "b-abc-0", "c-abc-0"]
    await bench.rounds(obj, idle, 10)
    replicas = {n: bench.read("deployment", n)["spec"]["replicas"] for n in ("a", "b", "c")}
    assert replicas == {"a": 0, "b": 0, "c": 2}
    condition = bench.condition()
    assert (condition["status"], condition["reason"]) == ("False", "BreakerOpen")
    assert condition["message"] == (
        "circuit breaker open: 2 reclaims by this policy in the last hour (maxPerHour 2);"
        " Deployment c and any other due wait until 2030-03-17T18:47:40Z"
    )
    (opened,) = bench.events("GPUMonitorPolicy", "idle", "ReclaimBreakerOpen")
    assert opened["type"] == "Warning"
    # Still idle, it waits out the hour (evaluated every 50 s meanwhile), then goes through.
    while bench.now < T0 + 3650:
        await bench.round(obj, idle[2:])
        bench.now += 40
    assert bench.read("deployment", "c")["spec"]["replicas"] == 2
    assert bench.condition()["reason"] == "BreakerOpen"
    bench.now = T0 + 3660  # an hour after the first two
    await bench.round(obj, idle[2:])
    assert bench.read("deployment", "c")["spec"]["replicas"] == 0
    assert bench.condition()["reason"] == "Active"
    assert len(bench.events("GPUMonitorPolicy", "idle", "ReclaimBreakerOpen")) == 1


async def test_the_cluster_breaker_holds_every_policy(
    control_plane: ControlPlane, namespace: str, kueue: Kueue
) -> None:
    async with bench_in(control_plane, namespace, max_per_hour=1) as bench:
        await bench.deployment("a")
        await bench.deployment("b")
        first, second = policy(namespace, "first"), policy(namespace, "second")
        apply(bench.cp, first)
        apply(bench.cp, second)
        for _ in range(8):
            await bench.round(first, ["a-abc-0"])
            bench.now -= TICK
            await bench.round(second, ["b-abc-0"])
        assert sorted(bench.read("deployment", n)["spec"]["replicas"] for n in ("a", "b")) == [0, 2]
        reasons = {bench.condition("first")["reason"], bench.condition("second")["reason"]}
        assert reasons == {"Active", "BreakerOpen"}
        held = next(n for n in ("first", "second") if bench.condition(n)["reason"] == "BreakerOpen")
        assert "--reclaim-max-per-hour 1" in bench.condition(held)["message"]


async def test_leader_worker_set_scales_to_zero_through_its_groups(bench: Bench) -> None:
    lws = await bench.create(
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": "llm"},
            "spec": {
                "replicas": 3,
                "leaderWorkerTemplate": {
                    "size": 1,
                    "workerTemplate": {
                        "spec": {"containers": [{"name": "w", "image": "example.invalid/w:1"}]}
                    },
                },
            },
        }
    )
    leaders = await bench.create(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {
                "name": "llm",
                "ownerReferences": [controller_ref(lws)],
            },
            "spec": {
                "replicas": 3,
                "serviceName": "llm",
                "selector": {"matchLabels": {"app": "llm"}},
                "template": {
                    "metadata": {"labels": {"app": "llm"}},
                    "spec": {"containers": [{"name": "l", "image": "example.invalid/l:1"}]},
                },
            },
        }
    )
    await bench.pod_of(leaders, "llm-0")
    obj = policy(bench.namespace)
    apply(bench.cp, obj)
    await bench.rounds(obj, ["llm-0"], 7)
    assert bench.read("leaderworkerset", "llm")["spec"]["replicas"] == 0
    assert (
        bench.read("statefulset", "llm")["spec"]["replicas"] == 3
    )  # the group's, left to the LWS controller
    assert bench.restore("lws/llm").returncode == 0
    assert bench.read("leaderworkerset", "llm")["spec"]["replicas"] == 3


# --- Suspend -------------------------------------------------------------------------------------------


async def test_an_idle_job_is_suspended_and_restored(bench: Bench) -> None:
    await bench.job("train")
    obj = policy(bench.namespace, action="Suspend")
    apply(bench.cp, obj)
    first = await bench.round(obj, ["train-0"])
    assert first.condition == ("True", "Active", "1 workload(s) warned, in their grace period")
    (warning,) = bench.events("Job", "train", "ReclaimPending")
    assert "will suspend Job train at 2030-03-17T17:47:40Z (in 1m)" in warning["message"]
    await bench.rounds(obj, ["train-0"], 5)
    assert bench.read("job", "train")["spec"]["suspend"] is False
    await bench.round(obj, ["train-0"])
    job = bench.read("job", "train")
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["annotations"]["gpuwarden.dev/previous-suspend"] == "false"
    result = bench.restore("job/train")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"restored job/train in {bench.namespace}: suspend false"
    assert bench.read("job", "train")["spec"]["suspend"] is False


async def test_a_jobset_is_suspended_not_its_jobs(bench: Bench) -> None:
    jobset = await bench.create(
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": "pretrain"},
            "spec": {
                "suspend": False,
                "replicatedJobs": [
                    {
                        "name": "workers",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "template": {
                                    "spec": {
                                        "restartPolicy": "Never",
                                        "containers": [{"name": "w", "image": "example.invalid/w:1"}],
                                    }
                                }
                            }
                        },
                    }
                ],
            },
        }
    )
    await bench.job("pretrain-workers-0", owner=jobset)
    obj = policy(bench.namespace, action="Suspend")
    apply(bench.cp, obj)
    await bench.rounds(obj, ["pretrain-workers-0-0"], 7)
    assert bench.read("jobset", "pretrain")["spec"]["suspend"] is True
    assert bench.read("job", "pretrain-workers-0")["spec"]["suspend"] is False
    assert bench.restore("jobset/pretrain").returncode == 0
    assert bench.read("jobset", "pretrain")["spec"]["suspend"] is False


async def test_a_ray_cluster_is_suspended_and_restored(bench: Bench) -> None:
    ray = await bench.create(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {"name": "ray"},
            "spec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {
                        "spec": {"containers": [{"name": "head", "image": "example.invalid/ray:1"}]}
                    },
                }
            },
        }
    )
    await bench.pod_of(ray, "ray-head")
    obj = policy(bench.namespace, action="Suspend")
    apply(bench.cp, obj)
    await bench.rounds(obj, ["ray-head"], 7)
    cluster = bench.read("raycluster", "ray")
    assert cluster["spec"]["suspend"] is True
    assert cluster["metadata"]["annotations"]["gpuwarden.dev/previous-suspend"] == "false"
    assert bench.restore("raycluster/ray").returncode == 0
    assert bench.read("raycluster", "ray")["spec"]["suspend"] is False


def conditions(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """An object's ``status.conditions``: type → (status, reason)."""
    return {c["type"]: (c["status"], c["reason"]) for c in (obj.get("status") or {}).get("conditions") or []}


async def test_a_job_kueue_admits_is_deactivated_through_its_workload_and_readmitted_on_restore(
    bench: Bench,
) -> None:
    await bench.create(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": LOCAL_QUEUE},
            "spec": {"clusterQueue": CLUSTER_QUEUE},
        }
    )
    job = await bench.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "queued", "labels": {QUEUE_LABEL: LOCAL_QUEUE}},
            "spec": {
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "train",
                                "image": "example.invalid/train:1",
                                "resources": {
                                    "requests": {"nvidia.com/gpu": 1},
                                    "limits": {"nvidia.com/gpu": 1},
                                },
                            }
                        ],
                    }
                }
            },
        }
    )
    assert job["spec"]["suspend"] is True  # Kueue's webhook: a queued Job waits for admission
    uid = job["metadata"]["uid"]

    def workload(**want: tuple[str, str]) -> dict[str, Any] | None:
        """The Job's Workload (Kueue names it), once its conditions include ``want``."""
        for item in get(bench.cp, "workloads.kueue.x-k8s.io", "-n", bench.namespace)["items"]:
            if any(r["uid"] == uid for r in item["metadata"].get("ownerReferences") or []):
                have = conditions(item)
                return dict(item) if all(have.get(t) == v for t, v in want.items()) else None
        return None

    def suspended(value: bool) -> bool:
        return bench.read("job", "queued")["spec"]["suspend"] is value

    admitted = wait_until(
        lambda: workload(QuotaReserved=("True", "QuotaReserved"), Admitted=("True", "Admitted")),
        timeout=KUEUE_WAIT_S,
        what="Kueue admitting the Job's Workload",
    )
    name = admitted["metadata"]["name"]
    assert admitted["status"]["admission"]["clusterQueue"] == CLUSTER_QUEUE
    wait_until(lambda: suspended(False), timeout=KUEUE_WAIT_S, what="Kueue starting the admitted Job")
    await bench.pod_of(job, "queued-0")

    obj = policy(bench.namespace, action="Suspend")
    apply(bench.cp, obj)
    await bench.rounds(obj, ["queued-0"], 7)
    deactivated = bench.read("workloads.kueue.x-k8s.io", name)
    assert deactivated["spec"]["active"] is False
    assert deactivated["metadata"]["annotations"]["gpuwarden.dev/previous-active"] == "true"
    (done,) = bench.events("Job", "queued", "Reclaimed")
    assert f"(its Kueue Workload {name})" in done["message"]
    # Kueue evicts the deactivated Workload, suspends the Job (gpuwarden leaves the Job to it: a suspend
    # set on an admitted Job, Kueue would undo) and, the Job stopped, releases its quota.
    evicted = wait_until(
        lambda: workload(
            Evicted=("True", "Deactivated"),
            Requeued=("False", "Deactivated"),
            QuotaReserved=("False", "Pending"),
            Admitted=("False", "NoReservation"),
        ),
        timeout=KUEUE_WAIT_S,
        what="Kueue evicting the deactivated Workload",
    )
    assert "admission" not in evicted["status"]
    assert suspended(True)

    result = bench.restore("job/queued")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"restored job/queued (its Kueue Workload {name}) in {bench.namespace}: active true"
    )
    readmitted = wait_until(
        lambda: workload(
            Requeued=("True", "Reactivated"),
            QuotaReserved=("True", "QuotaReserved"),
            Admitted=("True", "Admitted"),
        ),
        timeout=KUEUE_WAIT_S,
        what="Kueue re-admitting the reactivated Workload",
    )
    assert readmitted["spec"]["active"] is True
    assert not any(k.startswith("gpuwarden.dev/") for k in readmitted["metadata"].get("annotations") or {})
    wait_until(lambda: suspended(False), timeout=KUEUE_WAIT_S, what="Kueue resuming the re-admitted Job")


async def test_a_kind_the_action_does_not_fit_is_said_once(bench: Bench) -> None:
    await bench.job("train")
    obj = policy(bench.namespace)  # ScaleToZero: a Job has no replicas
    apply(bench.cp, obj)
    await bench.rounds(obj, ["train-0"], 8)
    (said,) = bench.events("Job", "train", "ReclaimNotApplicable")
    assert said["message"] == "not reclaiming Job train: ScaleToZero does not apply to a Job"
    assert bench.read("job", "train")["spec"]["suspend"] is False

"""GPUs allocated by Dynamic Resource Allocation, attributed on the real test node.

A DRA driver's kubelet plugin (draplugin.py, over the kubelet's real registration and DRA
gRPC APIs) and its ResourceSlice publish the scenario's GPUs as ``gpu-0``… of driver
``gpu.example.com`` (not NVIDIA's name: the agent is told it with ``--dra-drivers``). The
scheduler allocates them to ResourceClaims, the kubelet has the plugin prepare them and reports
them in PodResources ``dynamic_resources``; the agent's own client, ResourceSlice watch (as a
ServiceAccount with only the chart's DRA rule) and attributor put them on the scripted GPUs of
the same UUIDs. Processes are the containers' real ones, found through /proc.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from draplugin import DraPlugin, device_class, one_device, resource_slice
from node import KUBELET_ROOT, NODE_NAME, Node
from operator_support import events
from test_chart_on_node import (
    CHART,
    GPU_PRESENT,
    IDLE_GPU,
    RELEASE,
    REPLICAS,
    SYSTEM,
    TIMEOUT,
    Installed,
    attributed_as_allocated,
    values,
    warns_about_the_idle_pod_and_scales,
)
from test_node import apply, container, deployment, get, pod, wait
from test_operator_scaling import APP, policy

from gpuwarden.agent.attribution import (
    CgroupReader,
    DraDevice,
    DraResolver,
    NodePods,
    PodAttributor,
    PodResourcesClient,
    ResourceSlices,
    SlicesState,
    UnresolvedReason,
)
from gpuwarden.local.policies import LocalPolicy
from gpuwarden.local.session import Session
from gpuwarden.local.subjects import SubjectKind
from gpuwarden.operator.policies.pods import requests_gpu
from gpuwarden.policy.findings import Transition
from gpuwarden.policy.parse import parse_policy_object
from gpuwarden.wire.node import GpuSample, PodRef, ProcessSample, Snapshot

pytestmark = pytest.mark.integration

STARTED = Transition.STARTED
DRIVER = "gpu.example.com"
RESOURCES = "resource.k8s.io/v1"
NO_UUID_DEVICE = "gpu-4"
"""Published without a ``uuid`` attribute, as a dynamic MIG device is before it is prepared."""
AGENT_RULE = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list", "watch"]}
"""What charts/gpuwarden grants the agent for DRA (templates/agent-rbac.yaml)."""


def claim_json(node: Node, namespace: str, name: str) -> dict[str, Any] | None:
    claim: dict[str, Any] | None = node.control_plane.get_json(
        f"/apis/{RESOURCES}/namespaces/{namespace}/resourceclaims/{name}"
    )
    return claim


def publish(node: Node, generation: int, devices: list[tuple[str, str | None]] | None = None) -> None:
    """The ResourceSlice: the scenario's GPUs as gpu-0… and a device without a uuid, unless told."""
    if devices is None:
        devices = [*((f"gpu-{i}", uuid) for i, uuid in enumerate(node.gpu_uuids)), (NO_UUID_DEVICE, None)]
    manifest = resource_slice(DRIVER, NODE_NAME, devices, generation=generation)
    node.control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)


@pytest.fixture(scope="module")
def driver(node: Node) -> Iterator[DraPlugin]:
    """The plugin registered with the kubelet, its DeviceClass and its ResourceSlice published."""
    plugin = DraPlugin(DRIVER, lambda ns, name: claim_json(node, ns, name), KUBELET_ROOT)
    plugin.start()
    try:
        # The kubelet's plugin watcher calls GetInfo, then NotifyRegistrationStatus: an event, set by it.
        assert plugin.registered.wait(60), f"not registered: {plugin.registration_error!r}\n{node.logs()}"
        # After registration: the kubelet deletes the slices of drivers it does not know.
        node.control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(device_class(DRIVER)), check=True)
        publish(node, generation=1)
        yield plugin
    finally:
        node.control_plane.kubectl("delete", "deviceclass", DRIVER, "--ignore-not-found")
        node.control_plane.kubectl("delete", "resourceslice", f"{NODE_NAME}-{DRIVER}", "--ignore-not-found")
        plugin.stop()


def agent_token(node: Node, namespace: str, tmp_path: Path) -> Path:
    """A token of a ServiceAccount allowed what the chart's agent is: list pods, list/watch ResourceSlices."""
    cp = node.control_plane
    cp.kubectl("create", "serviceaccount", "agent", "-n", namespace, check=True)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{namespace}-agent"},
        "rules": [AGENT_RULE, {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(role), check=True)
    cp.kubectl(
        "create", "clusterrolebinding", f"{namespace}-agent", f"--clusterrole={namespace}-agent",
        f"--serviceaccount={namespace}:agent", check=True,
    )  # fmt: skip
    token = cp.kubectl(
        "create", "token", "agent", "-n", namespace, "--duration=1h", check=True
    ).stdout.strip()
    path = tmp_path / "token"
    path.write_text(token)
    return path


def claim_pod(name: str, image: str, claim: dict[str, str]) -> dict[str, Any]:
    """A pod whose container ``main`` holds one claim (``resourceClaimName`` or ``…TemplateName``)."""
    return pod(
        name,
        {
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", **claim}],
            "containers": [
                container("main", image, ["sleep", "infinity"], resources={"claims": [{"name": "gpu"}]})
            ],
        },
    )


def allocated_device(node: Node, namespace: str, claim: str) -> str:
    """The device the scheduler allocated to a claim."""
    found = claim_json(node, namespace, claim) or {}
    (result,) = found["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, NODE_NAME)
    return str(result["device"])


def shared_idle_policy(namespace: str) -> LocalPolicy:
    """Every pod of the namespace below 20% of its own SM use for 5 s (per process on a shared GPU)."""
    checked = parse_policy_object(
        {
            "apiVersion": "gpuwarden.dev/v1alpha1",
            "kind": "GPUMonitorPolicy",
            "metadata": {"name": "idle", "namespace": namespace},
            "spec": {
                "selector": {},
                "evaluationInterval": "1s",
                "rules": [
                    {"name": "idle", "utilizationFloor": {"percent": 20, "for": "5s", "signal": "auto"}}
                ],
            },
        }
    )
    return LocalPolicy(name=checked.name, namespace=checked.namespace, spec=checked.spec)


def main_pid(pod_uid: str) -> int:
    """The host PID of the pod's ``sleep infinity``: found through /proc/<pid>/cgroup, as the agent does."""
    reader = CgroupReader()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (Path("/proc") / entry / "comm").read_text().strip() == "sleep":
            identity = reader.identity(int(entry))
            if identity is not None and identity.pod_uid == pod_uid:
                return int(entry)
    raise AssertionError(f"no sleep process in pod {pod_uid}")


async def test_dra_claims_are_attributed_through_pod_resources_and_resource_slices(
    node: Node, node_namespace: str, driver: DraPlugin, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ns, image = node_namespace, node.images.workload.name
    template = {
        "apiVersion": RESOURCES,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu"},
        "spec": {"spec": one_device(DRIVER, 0)},
    }
    shared = {"apiVersion": RESOURCES, "kind": "ResourceClaim", "metadata": {"name": "shared"}}
    no_uuid = {"apiVersion": RESOURCES, "kind": "ResourceClaim", "metadata": {"name": "no-uuid"}}
    apply(
        node,
        ns,
        template,
        {**shared, "spec": one_device(DRIVER, 1)},
        {**no_uuid, "spec": one_device(DRIVER, len(node.gpu_uuids))},
        claim_pod("solo", image, {"resourceClaimTemplateName": "one-gpu"}),
        claim_pod("left", image, {"resourceClaimName": "shared"}),
        claim_pod("right", image, {"resourceClaimName": "shared"}),
        claim_pod("stray", image, {"resourceClaimName": "no-uuid"}),
    )
    for name in ("solo", "left", "right", "stray"):
        wait(node, ns, "--for=condition=Ready", f"pod/{name}")
    solo = get(node, ns, "pod", "solo")
    # The controller-manager made the template's claim; its name is in the pod's status.
    (solo_claim,) = [s["resourceClaimName"] for s in solo["status"]["resourceClaimStatuses"]]
    assert allocated_device(node, ns, solo_claim) == "gpu-0"
    assert allocated_device(node, ns, "shared") == "gpu-1"
    assert allocated_device(node, ns, "no-uuid") == NO_UUID_DEVICE
    # The kubelet prepared each claim through our plugin (the shared one for each of its pods, or once:
    # preparing is idempotent, and which the kubelet does depends on how the two pods' starts overlap).
    assert set(driver.prepared) == {f"{ns}/{solo_claim}", f"{ns}/shared", f"{ns}/no-uuid"}

    cp = node.control_plane
    token = agent_token(node, ns, tmp_path)
    slices = ResourceSlices(NODE_NAME, cp.server, token_path=token, ca_path=cp.ca_path)
    unresolved: list[UnresolvedReason] = []
    client = PodResourcesClient(node.pod_resources_socket, dra_drivers=frozenset({DRIVER}))
    pods = NodePods(NODE_NAME, cp.server, token_path=token, ca_path=cp.ca_path)
    attributor = PodAttributor(
        client, pod_lookup=pods, dra=DraResolver(slices, on_unresolved=unresolved.append)
    )
    watch = asyncio.create_task(slices.run())
    try:
        await asyncio.wait_for(slices.synced.wait(), 30)
        assert slices.state is SlicesState.SYNCED
        with caplog.at_level(logging.WARNING, "gpuwarden.agent.attribution.dra"):
            await attributor.refresh()
            await attributor.refresh()  # an unresolved device is counted and logged once, not per refresh

        uid = {name: get(node, ns, "pod", name)["metadata"]["uid"] for name in ("left", "right")}
        pid = {name: main_pid(u) for name, u in uid.items()}
        gpus = [GpuSample(uuid=u, index=i) for i, u in enumerate(node.gpu_uuids)]
        gpus[1] = gpus[1].model_copy(update={"processes": [ProcessSample(pid=p) for p in pid.values()]})
        annotated = attributor.annotate(Snapshot(timestamp=1.0, gpus=gpus))

        def ref(name: str, claim: str) -> PodRef:
            return PodRef(namespace=ns, name=name, container="main", claim=claim)

        assert annotated.gpus[0].pods == [ref("solo", solo_claim)]
        # A shared claim: both pods hold the GPU, each process is put on its own pod.
        assert annotated.gpus[1].pods == [ref("left", "shared"), ref("right", "shared")]
        assert {p.pid: p.pod for p in annotated.gpus[1].processes} == {
            pid["left"]: ref("left", "shared"),
            pid["right"]: ref("right", "shared"),
        }
        assert [g.pods for g in annotated.gpus[2:]] == [[]] * (len(gpus) - 2)

        # The engine judges each pod on the shared GPU by its own process: the idle one is flagged alone.
        session = Session([shared_idle_policy(ns)], subjects=SubjectKind.PODS)
        started = []
        for t in range(1, 16):
            busy = {pid["left"]: 2.0, pid["right"]: 85.0}
            reading = gpus[1].model_copy(
                update={
                    "utilization_gpu": 87.0,
                    "processes": [ProcessSample(pid=p, sm_util=busy[p]) for p in pid.values()],
                }
            )
            step = session.observe(attributor.annotate(Snapshot(timestamp=float(t), gpus=[reading])))
            started += [
                a.transition.finding for a in step.announcements if a.transition.transition is STARTED
            ]
        assert [(f.pod, f.rule) for f in started] == [("left", "idle")]

        # The device without a uuid is not dropped silently: counted once and logged, with its claim.
        missing = DraDevice(DRIVER, NODE_NAME, NO_UUID_DEVICE)
        assert unresolved == [UnresolvedReason.NO_UUID]
        assert attributor.allocations.claimed[missing] == (ref("stray", "no-uuid"),)
        (record,) = [r for r in caplog.records if "cannot be resolved" in r.getMessage()]
        assert f"{missing}" in record.getMessage()
        assert "claim no-uuid" in record.getMessage()

        # The watch follows the driver: a new generation of the pool gives gpu-1 another uuid.
        devices: list[tuple[str, str | None]] = [(f"gpu-{i}", u) for i, u in enumerate(node.gpu_uuids)]
        devices[1] = ("gpu-1", "GPU-replaced")
        publish(node, generation=2, devices=devices)
        replaced = DraDevice(DRIVER, NODE_NAME, "gpu-1")
        async with asyncio.timeout(30):
            while (gpu := slices.devices.get(replaced)) is None or gpu.uuid != "GPU-replaced":
                await slices.changed()
        assert DraDevice(DRIVER, NODE_NAME, NO_UUID_DEVICE) not in slices.devices  # generation 1 is gone
    finally:
        watch.cancel()
        await slices.close()
        await pods.close()
        await client.close()
        # While the plugin still serves: the kubelet unprepares each claim as its last pod goes.
        cp.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=1", "--wait=true", "--timeout=60s")
        publish(node, generation=3)  # as the fixture left it, for the tests after this one
    assert set(driver.unprepared) == set(driver.prepared)


# -- the chart's agent and operator, on a Deployment whose pods take their GPU from a claim template ----


class DraInstalled(Installed):
    """The chart installed on the node; the Deployment's replicas hold their GPU through claims."""

    def allocated(self) -> dict[str, str]:
        """GPU UUID -> pod, from each running replica's claim and the device the scheduler allocated it."""
        uuids = dict(enumerate(self.node.gpu_uuids))
        out: dict[str, str] = {}
        for p in self.pods(self.namespace, f"app={APP}"):
            if p["status"].get("phase") != "Running":
                continue
            (status,) = p["status"]["resourceClaimStatuses"]
            device = allocated_device(self.node, self.namespace, status["resourceClaimName"])
            out[uuids[int(device.removeprefix("gpu-"))]] = p["metadata"]["name"]
        return out


@pytest.fixture(scope="module")
def installed(node: Node, driver: DraPlugin) -> Iterator[DraInstalled]:
    """helm install with ``agent.dra.drivers`` naming the driver; REPLICAS replicas of one GPU claim each."""
    cp = node.control_plane
    for image in (node.images.agent, node.images.operator):
        node.import_image(image.archive)
    cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}=true", "--overwrite", check=True)
    namespace = cp.create_namespace(f"dra-{int(time.time()) % 100000}")
    cp.kubectl("wait", "--for=create", "serviceaccount/default", "-n", namespace, "--timeout=60s", check=True)
    # The GPUs with a uuid only (the stray pod below takes the other one).
    with_uuid = one_device(DRIVER)
    with_uuid["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].index < {len(node.gpu_uuids)}'}}
    ]
    server = container("server", node.images.workload.name, ["sleep", "infinity"])
    server["resources"] = {"claims": [{"name": "gpu"}]}
    app = deployment(APP, REPLICAS, server)
    app["spec"]["template"]["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    template = {"apiVersion": RESOURCES, "kind": "ResourceClaimTemplate", "metadata": {"name": "gpu"}}
    stray = {"apiVersion": RESOURCES, "kind": "ResourceClaim", "metadata": {"name": "no-uuid"}}
    apply(
        node,
        namespace,
        {**template, "spec": {"spec": with_uuid}},
        {**stray, "spec": one_device(DRIVER, len(node.gpu_uuids))},
        claim_pod("stray", node.images.workload.name, {"resourceClaimName": "no-uuid"}),
        app,
    )
    wait(node, namespace, "--for=condition=Available", f"deployment/{APP}")
    wait(node, namespace, "--for=condition=Ready", "pod/stray")

    # test_chart_on_node's install, if it ran first, leaves its namespace terminating.
    cp.kubectl("wait", "--for=delete", f"namespace/{SYSTEM}", "--timeout=120s", check=True, timeout=150)
    chart_values = values(node)
    chart_values["agent"]["dra"] = {"drivers": [DRIVER]}
    installed_at = time.time()
    helm = cp.run_helm(
        "install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace", "-f", "-",
        input=yaml.safe_dump(chart_values), timeout=180,
    )  # fmt: skip
    assert helm.returncode == 0, f"helm install: {helm.stderr}"
    apply(node, namespace, policy(namespace, hi=REPLICAS + 1, interval="1s"))
    world = DraInstalled(node, namespace, installed_at)
    try:
        for selector in ("app.kubernetes.io/component=agent", "app.kubernetes.io/component=operator"):
            wait(node, SYSTEM, "--for=condition=Ready", "pod", "-l", selector)
        world.until(world.active_operator, "an active operator replica", TIMEOUT)
        yield world
    finally:
        cp.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=90s", timeout=120)
        cp.run_helm("uninstall", RELEASE, "--namespace", SYSTEM, "--wait", "--timeout=90s", timeout=120)
        # Gone before the next module installs the chart again.
        cp.kubectl("delete", "namespace", SYSTEM, "--wait=true", "--timeout=120s", timeout=150)
        cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}-")


def test_the_chart_agent_attributes_claimed_gpus_and_counts_the_unresolvable(installed: DraInstalled) -> None:
    # The operator's pod selection counts a claim as a GPU request (the real pod, as the API server has it).
    assert all(requests_gpu(p["spec"]) for p in installed.pods(installed.namespace, f"app={APP}"))
    attributed_as_allocated(installed)
    metrics = installed.agent_metrics()
    (synced,) = [
        v for labels, v in metrics["gpuwarden_agent_dra_resource_slices_state"] if labels["state"] == "synced"
    ]
    assert synced == 1.0  # listed and watched with the chart's RBAC
    unresolved = {
        labels["reason"]: v for labels, v in metrics["gpuwarden_agent_dra_unresolved_devices_total"]
    }
    # the stray pod's
    assert unresolved == {
        "slices_unavailable": 0.0,
        "unknown_device": 0.0,
        "no_uuid": 1.0,
        "mig_not_found": 0.0,
    }
    log = installed.cp.kubectl("logs", "-n", SYSTEM, "-l", "app.kubernetes.io/component=agent").stdout
    assert f"DRA device {DRIVER}/{NODE_NAME}/{NO_UUID_DEVICE} cannot be resolved" in log


def test_the_operator_warns_about_the_idle_claimed_pod_and_scales_the_deployment(
    installed: DraInstalled,
) -> None:
    warns_about_the_idle_pod_and_scales(installed)
    # The Warning names the claim through which the idle pod holds its GPU (the agent's report,
    # kept for the pod the report's node may speak for).
    idle = installed.allocated()[IDLE_GPU]
    (pod,) = [p for p in installed.pods(installed.namespace, f"app={APP}") if p["metadata"]["name"] == idle]
    (status,) = pod["status"]["resourceClaimStatuses"]
    (warning, *_) = events(
        installed.cp, installed.namespace, kind="Pod", name=idle, reason="GPUUnderutilized"
    )
    assert f"claim {status['resourceClaimName']})" in warning["message"]

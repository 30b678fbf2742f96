"""The test node is a real one: it registers, runs pods, allocates GPUs, routes Services, resolves names.

Every check here is what the chart's pods rely on (tests/integration/node.py): pods scheduled by the
scheduler and made by controllers, an ``nvidia.com/gpu`` allocated by the kubelet and reported by its
PodResources API to gpuwarden's own client, and a Service reached by its DNS name and its ClusterIP.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import yaml
from node import NODE_NAME, Node

from gpuwarden.agent.attribution.kubelet import PodResourcesClient
from gpuwarden.wire.node import PodRef

WAIT = "--timeout=120s"


def apply(node: Node, namespace: str, *manifests: dict[str, Any]) -> None:
    node.control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(manifests), check=True
    )


def get(node: Node, namespace: str, *what: str) -> Any:
    out = node.control_plane.kubectl("get", "-n", namespace, *what, "-o", "json", check=True).stdout
    return json.loads(out)


def wait(node: Node, namespace: str, *args: str) -> None:
    """``kubectl wait`` (a watch, not a poll); a timeout fails with the node's logs."""
    proc = node.control_plane.kubectl("wait", "-n", namespace, *args, WAIT, timeout=150)
    assert proc.returncode == 0, f"kubectl wait {args}: {proc.stderr}\n{describe(node, namespace)}"


def describe(node: Node, namespace: str) -> str:
    """The namespace's pods, their containers' output, and the node's logs."""
    cp = node.control_plane
    pods = cp.kubectl("describe", "pods", "-n", namespace).stdout
    output = cp.kubectl(
        "logs", "-n", namespace, "--all-containers", "--prefix", "-l", "!no-such-label"
    ).stdout
    return f"{pods}\n--- containers' output ---\n{output}\n{node.logs()}"


def container(name: str, image: str, command: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": image, "imagePullPolicy": "Never", "command": command, **extra}


def pod(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def deployment(name: str, replicas: int, main: dict[str, Any]) -> dict[str, Any]:
    """A Deployment of pods labelled ``app: <name>`` running container ``main``."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"terminationGracePeriodSeconds": 1, "containers": [main]},
            },
        },
    }


def test_node_registers_ready_with_the_scenario_gpus(node: Node) -> None:
    obj = node.node_object()
    assert obj is not None
    status = obj["status"]
    ready = {c["type"]: c["status"] for c in status["conditions"]}["Ready"]
    assert ready == "True"
    assert status["capacity"]["nvidia.com/gpu"] == str(len(node.gpu_uuids)) == "4"
    assert status["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert status["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {"type": "InternalIP", "address": node.ip} in status["addresses"]


async def test_a_gpu_pod_is_scheduled_runs_and_is_reported_by_pod_resources(
    node: Node, node_namespace: str
) -> None:
    apply(
        node,
        node_namespace,
        pod(
            "trainer",
            {
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    container(
                        "main",
                        node.images.workload.name,
                        ["sh", "-c", 'echo "visible=$NVIDIA_VISIBLE_DEVICES"; exec sleep infinity'],
                        resources={"limits": {"nvidia.com/gpu": 1}},
                    )
                ],
            },
        ),
    )
    wait(node, node_namespace, "--for=condition=Ready", "pod/trainer")
    placed = get(node, node_namespace, "pod", "trainer")
    # No nodeName in the manifest: the scheduler placed it, counting the Node's GPUs.
    assert placed["spec"]["nodeName"] == NODE_NAME
    assert placed["status"]["phase"] == "Running"

    # The container really ran, with the device the kubelet allocated through our plugin.
    logs = node.control_plane.kubectl("logs", "-n", node_namespace, "trainer", check=True).stdout
    visible = logs.strip().removeprefix("visible=")
    assert visible in node.gpu_uuids, logs
    exec_out = node.control_plane.kubectl(
        "exec", "-n", node_namespace, "trainer", "--", "cat", "/proc/1/cmdline", check=True
    ).stdout
    assert exec_out.split("\0")[:2] == ["sleep", "infinity"]

    client = PodResourcesClient(node.pod_resources_socket)
    try:
        allocations = await client.list()
    finally:
        await client.close()
    trainer = PodRef(namespace=node_namespace, name="trainer", container="main")
    assert allocations.devices[visible] == (trainer,)
    assert allocations.containers[(node_namespace, "trainer")] == ("main",)


def test_a_deployment_makes_its_pods_through_the_controller_manager(node: Node, node_namespace: str) -> None:
    apply(
        node,
        node_namespace,
        deployment("sleeper", 2, container("main", node.images.workload.name, ["sleep", "infinity"])),
    )
    wait(node, node_namespace, "--for=condition=Available", "deployment/sleeper")
    pods = get(node, node_namespace, "pods", "-l", "app=sleeper")["items"]
    assert len(pods) == 2
    assert {p["status"]["phase"] for p in pods} == {"Running"}
    owners = {o["kind"] for p in pods for o in p["metadata"]["ownerReferences"]}
    assert owners == {"ReplicaSet"}


def test_a_pod_reaches_a_service_by_its_dns_name_and_its_cluster_ip(node: Node, node_namespace: str) -> None:
    token = secrets.token_hex(8)
    serve = f"mkdir -p /srv && echo {token} > /srv/token && exec python3 -m http.server 8080 -d /srv"
    apply(
        node,
        node_namespace,
        deployment(
            "web",
            1,
            container(
                "main",
                node.images.workload.name,
                ["sh", "-c", serve],
                ports=[{"containerPort": 8080}],
                readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1},
            ),
        ),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    wait(node, node_namespace, "--for=condition=Available", "deployment/web")
    cluster_ip = get(node, node_namespace, "service", "web")["spec"]["clusterIP"]
    name = f"web.{node_namespace}.svc"
    # Resolved by CoreDNS behind the kube-dns Service; both requests go through kube-proxy's rules.
    # kube-proxy programs a new endpoint after the pod turns Ready, an event the API does not show, so
    # the client retries a refused connection as any client would: for up to a minute, since on a loaded
    # 2-core CI machine the rules once took longer than 10 s (its sync period is 1 s when idle).
    client = (
        "import socket, time, urllib.error, urllib.request\n"
        f"print('resolved', socket.gethostbyname({name!r}))\n"
        "def fetch(host):\n"
        "    for _ in range(120):\n"
        "        try:\n"
        "            with urllib.request.urlopen(f'http://{host}/token', timeout=10) as r:\n"
        "                return r.read().decode().strip()\n"
        "        except urllib.error.URLError as e:\n"
        "            if not isinstance(e.reason, ConnectionRefusedError): raise\n"
        "            time.sleep(0.5)\n"
        "    raise SystemExit(f'{host}: refused for 60 s')\n"
        f"for host in ({name!r}, {cluster_ip!r}):\n"
        "    print('fetched', host, fetch(host))\n"
    )
    apply(
        node,
        node_namespace,
        pod(
            "client",
            {
                "restartPolicy": "Never",
                "containers": [container("main", node.images.workload.name, ["python3", "-c", client])],
            },
        ),
    )
    wait(node, node_namespace, "--for=jsonpath={.status.phase}=Succeeded", "pod/client")
    logs = node.control_plane.kubectl("logs", "-n", node_namespace, "client", check=True).stdout.splitlines()
    assert logs == [f"resolved {cluster_ip}", f"fetched {name} {token}", f"fetched {cluster_ip} {token}"]

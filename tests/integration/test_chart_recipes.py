"""Each recipe of docs/install.md ("Where the agent sees no GPU") is a values file in charts/gpuwarden/ci/;
`helm template` with it renders what the recipe's row says. Every recipe file has its checks here and a
row in docs/install.md. (test_chart.py also lints, templates and installs every ci/ file.)"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, Binaries

pytestmark = pytest.mark.integration

CHART = REPO_ROOT / "charts" / "gpuwarden"
INSTALL_DOC = REPO_ROOT / "docs" / "install.md"
Objects = dict[str, dict[str, Any]]
"""Rendered objects by kind (one of each kind checked here)."""


def render(helm: Path, values: Path) -> Objects:
    proc = subprocess.run(
        [str(helm), "template", "gpuwarden", str(CHART), "-n", "gpuwarden-system", "-f", str(values)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    found: Objects = {}
    for doc in yaml.safe_load_all(proc.stdout):
        if doc and doc["kind"] in ("DaemonSet", "Deployment", "PriorityClass"):
            found[doc["kind"]] = doc
    return found


def pod(objects: Objects) -> dict[str, Any]:
    spec: dict[str, Any] = objects["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def agent(objects: Objects) -> dict[str, Any]:
    (container,) = pod(objects)["containers"]
    return dict(container)


def env(objects: Objects) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in agent(objects)["env"]}


def pod_annotations(objects: Objects) -> dict[str, str]:
    return dict(objects["DaemonSet"]["spec"]["template"]["metadata"].get("annotations") or {})


def node_terms(objects: Objects) -> list[list[tuple[str, str, tuple[str, ...]]]]:
    """The agent's required node affinity, as (key, operator, values) per term."""
    affinity = pod(objects).get("affinity") or {}
    required = affinity.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return [
        [(e["key"], e["operator"], tuple(e.get("values", ()))) for e in term["matchExpressions"]]
        for term in required.get("nodeSelectorTerms", [])
    ]


def tolerates(objects: Objects, key: str, value: str | None = None, effect: str | None = None) -> bool:
    return any(
        t.get("key") == key
        and (value is None or t.get("value") == value)
        and (effect is None or t.get("effect") in (None, effect))
        for t in pod(objects).get("tolerations") or []
    )


def privileged(objects: Objects) -> bool:
    context = agent(objects).get("securityContext") or {}
    if context.get("privileged"):
        assert context.get("allowPrivilegeEscalation") is True  # the API server refuses the pair otherwise
        return True
    return False


def driver_mount(objects: Objects) -> str | None:
    volumes = {v["name"]: v for v in pod(objects)["volumes"]}
    mounts = {m["name"]: m for m in agent(objects)["volumeMounts"]}
    if "nvidia-driver" not in volumes:
        assert "nvidia-driver" not in mounts
        return None
    assert mounts["nvidia-driver"] == {
        "name": "nvidia-driver",
        "mountPath": "/usr/local/nvidia",
        "readOnly": True,
    }
    assert env(objects)["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    return str(volumes["nvidia-driver"]["hostPath"]["path"])


GPU_PRESENT = {"nvidia.com/gpu.present": "true"}
EKS_TERMS = [
    [("karpenter.k8s.aws/instance-gpu-manufacturer", "In", ("nvidia",))],
    [("nvidia.com/gpu.present", "In", ("true",))],
]


def gpu_operator(o: Objects) -> None:
    assert pod(o)["runtimeClassName"] == "nvidia"
    assert pod(o)["nodeSelector"] == GPU_PRESENT
    assert tolerates(o, "nvidia.com/gpu")
    assert not privileged(o)
    assert "cdi.k8s.io/gpuwarden-agent" not in pod_annotations(o)


def containerd_toolkit(o: Objects) -> None:
    assert pod(o)["runtimeClassName"] == "nvidia"
    assert "nodeSelector" not in pod(o)
    assert node_terms(o) == [[("feature.node.kubernetes.io/pci-10de.present", "In", ("true",))]]
    assert not privileged(o)


def cdi(o: Objects) -> None:
    assert pod_annotations(o)["cdi.k8s.io/gpuwarden-agent"] == "nvidia.com/gpu=all"
    assert env(o)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert not privileged(o)
    assert "runtimeClassName" not in pod(o)


def gke(o: Objects) -> None:
    assert privileged(o)
    assert driver_mount(o) == "/home/kubernetes/bin/nvidia"
    assert "nodeSelector" not in pod(o)
    assert node_terms(o) == [[("cloud.google.com/gke-accelerator", "Exists", ())]]
    assert tolerates(o, "nvidia.com/gpu")


def eks_al2023(o: Objects) -> None:
    assert not privileged(o)
    assert "runtimeClassName" not in pod(o)
    assert driver_mount(o) is None
    assert "nodeSelector" not in pod(o)
    assert node_terms(o) == EKS_TERMS


def eks_bottlerocket(o: Objects) -> None:
    assert privileged(o)
    assert driver_mount(o) is None
    assert node_terms(o) == EKS_TERMS


def aks(o: Objects) -> None:
    assert pod(o)["nodeSelector"] == {"kubernetes.azure.com/accelerator": "nvidia"}
    assert tolerates(o, "sku", "gpu", "NoSchedule")
    assert tolerates(o, "nvidia.com/gpu")
    assert not privileged(o)


def openshift(o: Objects) -> None:
    context = o["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert "runAsUser" not in context
    assert "runAsGroup" not in context
    assert context["runAsNonRoot"] is True
    assert pod(o)["nodeSelector"] == GPU_PRESENT
    assert pod(o)["hostPID"] is True  # hence the privileged SCC the recipe grants
    assert not privileged(o)


RECIPES: dict[str, Callable[[Objects], None]] = {
    "recipe-gpu-operator-values.yaml": gpu_operator,
    "recipe-containerd-toolkit-values.yaml": containerd_toolkit,
    "recipe-cdi-values.yaml": cdi,
    "recipe-gke-values.yaml": gke,
    "recipe-eks-al2023-values.yaml": eks_al2023,
    "recipe-eks-bottlerocket-values.yaml": eks_bottlerocket,
    "recipe-aks-values.yaml": aks,
    "recipe-openshift-values.yaml": openshift,
}


def test_every_recipe_file_is_checked_and_in_the_install_doc() -> None:
    files = {p.name for p in (CHART / "ci").glob("recipe-*-values.yaml")}
    assert files == set(RECIPES)
    doc = INSTALL_DOC.read_text()
    assert [name for name in RECIPES if f"`{name}`" not in doc] == []


@pytest.mark.parametrize(
    "name", sorted(RECIPES), ids=lambda n: n.removeprefix("recipe-").removesuffix("-values.yaml")
)
def test_the_recipe_renders_what_it_says(control_plane_binaries: Binaries, name: str) -> None:
    objects = render(control_plane_binaries.helm, CHART / "ci" / name)
    RECIPES[name](objects)
    # Every recipe keeps the chart's own PriorityClass, which any namespace may use.
    assert pod(objects)["priorityClassName"] == objects["PriorityClass"]["metadata"]["name"]
    assert agent(objects)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_by_default_the_agent_runs_under_the_charts_own_priority_class(
    control_plane_binaries: Binaries,
) -> None:
    objects = render(control_plane_binaries.helm, CHART / "values.yaml")
    assert objects["PriorityClass"]["metadata"]["name"] == "gpuwarden-agent"
    assert objects["PriorityClass"]["value"] == 1_000_000_000
    assert pod(objects)["priorityClassName"] == "gpuwarden-agent"
    assert not privileged(objects)

"""The install lines of docs/install.md (and the chart README's, the same three) on a real kube-apiserver
whose Pod Security admission enforces "baseline" by default, as a hardened cluster's does:

- run as written, the agent's pod (the DaemonSet's template, on a node by name) is admitted, and the
  notes carry no Pod Security warning;
- `helm install --create-namespace` instead: the namespace has no label, the agent's pod is refused
  (hostPID, hostPath), and the notes say so and how to label it; a namespace enforcing "restricted"
  by label is named as such.

The agent's pod is created with a server-side dry run: admission runs in full, nothing is stored, and
no kubelet is needed. The API server is this module's own (its admission configuration is a flag).
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, Binaries, ControlPlane

pytestmark = pytest.mark.integration

CHART = REPO_ROOT / "charts" / "gpuwarden"
INSTALL_DOC = REPO_ROOT / "docs" / "install.md"
CHART_README = REPO_ROOT / "charts" / "gpuwarden" / "README.md"
WARNING = "is not labelled pod-security.kubernetes.io/enforce=privileged"

ADMISSION = {
    "apiVersion": "apiserver.config.k8s.io/v1",
    "kind": "AdmissionConfiguration",
    "plugins": [
        {
            "name": "PodSecurity",
            "configuration": {
                "apiVersion": "pod-security.admission.config.k8s.io/v1",
                "kind": "PodSecurityConfiguration",
                "defaults": {
                    "enforce": "baseline",
                    "enforce-version": "latest",
                    "warn": "baseline",
                    "warn-version": "latest",
                    "audit": "baseline",
                    "audit-version": "latest",
                },
                "exemptions": {"usernames": [], "runtimeClasses": [], "namespaces": []},
            },
        }
    ],
}


@pytest.fixture(scope="module")
def enforcing(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    workdir = tmp_path_factory.mktemp("enforcing-baseline")
    config = workdir / "admission.yaml"
    config.write_text(yaml.safe_dump(ADMISSION))
    cp = ControlPlane(
        control_plane_binaries,
        workdir / "cp",
        apiserver_flags=[f"--admission-control-config-file={config}"],
    )
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def install_lines(path: Any) -> list[str]:
    """The first console block that installs the chart (with `helm install`)."""
    blocks = re.findall(r"```console\n(.*?)```", path.read_text(), re.S)
    block = next(b for b in blocks if "helm install" in b)
    return [line for line in block.splitlines() if line.strip()]


def run_line(cp: ControlPlane, line: str) -> str:
    tool, *args = shlex.split(line.replace("charts/gpuwarden", str(CHART)))
    proc = cp.kubectl(*args) if tool == "kubectl" else cp.run_helm(*args) if tool == "helm" else None
    assert proc is not None, f"not kubectl or helm: {line}"
    assert proc.returncode == 0, f"{line}: {proc.stderr}"
    return proc.stdout


def agent_pod(cp: ControlPlane, release: str, namespace: str) -> dict[str, Any]:
    """The release's agent DaemonSet's pod, bound to a node by name (no scheduler here)."""
    manifest = cp.run_helm("get", "manifest", release, "-n", namespace, check=True).stdout
    (daemonset,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "DaemonSet"]
    template = daemonset["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"agent-{secrets.token_hex(3)}", "namespace": namespace, **template["metadata"]},
        "spec": {**template["spec"], "nodeName": "gpu-node-1"},
    }


def admit(cp: ControlPlane, pod: dict[str, Any]) -> tuple[bool, str]:
    proc = cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    return proc.returncode == 0, proc.stderr


def test_the_docs_install_lines_are_the_chart_readmes() -> None:
    assert install_lines(INSTALL_DOC) == install_lines(CHART_README)


def test_the_documented_install_runs_the_agent_under_an_enforcing_default(enforcing: ControlPlane) -> None:
    cp = enforcing
    lines = install_lines(INSTALL_DOC)
    notes = "".join(run_line(cp, line) for line in lines)
    (helm,) = [shlex.split(line) for line in lines if line.startswith("helm install")]
    release, namespace = helm[2], helm[helm.index("--namespace") + 1]
    assert WARNING not in notes

    admitted, error = admit(cp, agent_pod(cp, release, namespace))
    assert admitted, error


def test_create_namespace_leaves_the_agent_refused_and_the_notes_say_so(enforcing: ControlPlane) -> None:
    cp = enforcing
    release = namespace = f"gw-{secrets.token_hex(3)}"
    installed = cp.run_helm("install", release, str(CHART), "-n", namespace, "--create-namespace")
    assert installed.returncode == 0, installed.stderr
    assert f"namespace {namespace} {WARNING}" in installed.stdout
    assert "helm install --create-namespace creates it without labels" in installed.stdout
    assert (
        f"kubectl label namespace {namespace} pod-security.kubernetes.io/enforce=privileged"
        in installed.stdout
    )

    admitted, error = admit(cp, agent_pod(cp, release, namespace))
    assert not admitted
    assert 'violates PodSecurity "baseline:latest"' in error
    assert "hostPID" in error


def test_a_namespace_enforcing_restricted_is_named_in_the_notes(enforcing: ControlPlane) -> None:
    cp = enforcing
    release = namespace = f"gw-{secrets.token_hex(3)}"
    cp.create_namespace(namespace)
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted", check=True)
    installed = cp.run_helm("install", release, str(CHART), "-n", namespace)
    assert installed.returncode == 0, installed.stderr
    assert 'it enforces "restricted"' in installed.stdout

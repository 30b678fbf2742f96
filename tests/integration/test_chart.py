"""The Helm chart against helm and a real kube-apiserver.

- ``helm lint --strict`` and ``helm template`` for every ``ci/*-values.yaml`` scenario;
- ``helm install`` of every scenario: the release installs, the CRDs are Established, every object is
  accepted by the API server; ``helm uninstall`` leaves nothing of the release behind but the CRDs;
- RBAC, with ``kubectl auth can-i`` as each ServiceAccount: what each component needs is allowed, what it
  must never do is denied (cluster-wide and single-namespace installs);
- the values schema rejects wrong values at ``helm install``;
- ``deploy/`` is what ``hack/render-manifests.sh`` renders today, and the API server accepts it.

There is no controller-manager, scheduler or kubelet: Deployments and DaemonSets are accepted but no pod
ever starts, so the assertions are about accepted objects, never running pods.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane, in_ci

pytestmark = pytest.mark.integration

CHART = REPO_ROOT / "charts" / "gpuwarden"
CHART_HOME = yaml.safe_load((CHART / "Chart.yaml").read_text())["home"]
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
CRD_NAMES = (
    "gpumonitorpolicies.gpuwarden.dev",
    "clusterkopfpeerings.kopf.dev",
    "kopfpeerings.kopf.dev",
)

# The prometheus-operator kinds the monitoring scenario renders, as permissive stand-ins: the API server
# then accepts the objects (and checks their apiVersion, kind and metadata) without prometheus-operator.
_MONITORING_KINDS = (
    ("ServiceMonitor", "servicemonitors"),
    ("PodMonitor", "podmonitors"),
    ("PrometheusRule", "prometheusrules"),
)


# deploy/gpuwarden.yaml has cert-manager issue the operator's certificate (hack/render-manifests.sh).
_CERT_MANAGER_KINDS = (("Certificate", "certificates"), ("Issuer", "issuers"))


def _stub_crd(kind: str, plural: str, group: str = "monitoring.coreos.com") -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


def ok(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def unique(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(3)}"


def ensure_namespace(cp: ControlPlane, name: str) -> None:
    """Create a namespace unless it exists (namespaces are never deleted: no controller-manager)."""
    doc = yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    ok(cp.kubectl("apply", "-f", "-", input=doc), f"namespace {name}")


@pytest.fixture(scope="module")
def monitoring_crds(control_plane: ControlPlane) -> None:
    # Only where prometheus-operator's real CRDs are not there already.
    for kind, plural in _MONITORING_KINDS:
        if control_plane.kubectl("get", "crd", f"{plural}.monitoring.coreos.com").returncode != 0:
            ok(
                control_plane.kubectl("create", "-f", "-", input=yaml.safe_dump(_stub_crd(kind, plural))),
                kind,
            )
    for _, plural in _MONITORING_KINDS:
        ok(
            control_plane.kubectl(
                "wait", "--for=condition=established", "--timeout=60s", f"crd/{plural}.monitoring.coreos.com"
            ),
            f"{plural} established",
        )


# ------------------------------------------------------------------------- lint, template


@pytest.mark.parametrize("ci_file", CI_FILES, ids=lambda p: p.stem)
def test_helm_lint(control_plane: ControlPlane, ci_file: Path) -> None:
    out = ok(control_plane.run_helm("lint", "--strict", str(CHART), "-f", str(ci_file)), "helm lint")
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("ci_file", CI_FILES, ids=lambda p: p.stem)
def test_helm_template(control_plane: ControlPlane, ci_file: Path) -> None:
    rendered = ok(
        control_plane.run_helm(
            "template", "gpuwarden", str(CHART), "--namespace", "gpuwarden-system", "-f", str(ci_file)
        ),
        "helm template",
    )
    docs = docs_of(rendered)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "Service"} <= kinds
    for doc in docs:
        assert doc.get("apiVersion"), doc
        assert doc["metadata"].get("name"), doc
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]


@pytest.mark.parametrize(
    ("values", "host_dir"),
    [
        ((), "/run/gpuwarden"),
        (("--set", "agent.hook.hostDir=/var/lib/gpuwarden-hook"), "/var/lib/gpuwarden-hook"),
        (("--set", "agent.hook.enabled=false"), None),
    ],
    ids=["default", "hostDir", "disabled"],
)
def test_the_agent_listens_for_hooks_in_the_mounted_host_directory(
    control_plane: ControlPlane, values: tuple[str, ...], host_dir: str | None
) -> None:
    rendered = ok(control_plane.run_helm("template", "gpuwarden", str(CHART), *values), "helm template")
    (daemonset,) = (d for d in docs_of(rendered) if d["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    (flag,) = (a for a in agent["args"] if a.startswith("--hook-socket"))
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    if host_dir is None:
        assert flag == "--hook-socket="  # off, although the agent's own default is on
        assert "hook" not in mounts
        assert "hook" not in volumes
        return
    socket = Path(flag.removeprefix("--hook-socket="))
    assert str(socket.parent) == mounts["hook"]["mountPath"]
    assert not mounts["hook"].get("readOnly")  # the agent creates the socket there
    assert volumes["hook"]["hostPath"] == {"path": host_dir, "type": "DirectoryOrCreate"}


# ---------------------------------------------------------------------------- install


@dataclass
class Release:
    name: str
    namespace: str
    manifest: str
    output: str
    """What `helm install` printed (NOTES.txt)."""

    @property
    def docs(self) -> list[dict[str, Any]]:
        return docs_of(self.manifest)

    def objects(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    @property
    def operator_sa(self) -> str:
        (sa,) = (d for d in self.objects("ServiceAccount") if d["metadata"]["name"].endswith("-operator"))
        return str(sa["metadata"]["name"])

    @property
    def agent_sa(self) -> str:
        (sa,) = (d for d in self.objects("ServiceAccount") if d["metadata"]["name"].endswith("-agent"))
        return str(sa["metadata"]["name"])


def install(cp: ControlPlane, namespace: str, *args: str) -> Release:
    name = unique("gpuwarden")
    output = ok(
        cp.run_helm("install", name, str(CHART), "--namespace", namespace, *args), f"helm install {name}"
    )
    manifest = ok(cp.run_helm("get", "manifest", name, "--namespace", namespace), "helm get manifest")
    return Release(name, namespace, manifest, output)


def uninstall(cp: ControlPlane, release: Release) -> None:
    ok(cp.run_helm("uninstall", release.name, "--namespace", release.namespace), "helm uninstall")


def existing(cp: ControlPlane, release: Release) -> list[str]:
    """The release's objects that the API server still has."""
    out = ok(
        cp.kubectl("get", "-f", "-", "--ignore-not-found", "-o", "name", input=release.manifest),
        "kubectl get -f manifest",
    )
    return out.split()


def labelled(cp: ControlPlane, release: Release) -> list[str]:
    """Every object of the kinds the release created, anywhere, carrying its instance label."""
    kinds = {d["kind"].lower() for d in release.docs}
    # networkpolicy → networkpolicies, priorityclass → priorityclasses, role → roles
    resources = sorted(
        k.removesuffix("y") + "ies" if k.endswith("y") else k + ("es" if k.endswith("s") else "s")
        for k in kinds
    )
    out = ok(
        cp.kubectl(
            "get",
            ",".join(resources),
            "--all-namespaces",
            "-l",
            f"app.kubernetes.io/instance={release.name}",
            "-o",
            "name",
        ),
        "kubectl get -l instance",
    )
    return out.split()


@pytest.mark.usefixtures("monitoring_crds")
@pytest.mark.parametrize("ci_file", CI_FILES, ids=lambda p: p.stem)
def test_install_and_uninstall(control_plane: ControlPlane, namespace: str, ci_file: Path) -> None:
    cp = control_plane
    for ns in (yaml.safe_load(ci_file.read_text()) or {}).get("operator", {}).get("watchNamespaces", []):
        ensure_namespace(cp, ns)
    release = install(cp, namespace, "-f", str(ci_file))

    # Every object of the release was accepted and is there.
    assert len(existing(cp, release)) == len(release.docs)
    for crd in CRD_NAMES:
        ok(cp.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{crd}"), crd)

    uninstall(cp, release)
    assert existing(cp, release) == []
    assert labelled(cp, release) == []
    assert cp.run_helm("status", release.name, "--namespace", namespace).returncode != 0
    # ... but the CRDs stay (and with them every policy).
    for crd in CRD_NAMES:
        ok(cp.kubectl("get", "crd", crd), f"{crd} kept after uninstall")


def test_default_install_objects(control_plane: ControlPlane, namespace: str) -> None:
    """The objects as the API server stored them: what the operator and agent rely on."""
    cp = control_plane
    release = install(cp, namespace)
    try:
        # NOTES.txt: the next commands to run (test_notes_commands_work_without_the_repository runs them).
        for command in (
            f"kubectl -n {namespace} get pods -l app.kubernetes.io/instance={release.name}",
            "kubectl apply -f - <<'EOF'",
            "kubectl get gpumonitorpolicies -A",
            "kubectl get events -A --field-selector reason=GPUUnderutilized",
            "helm show crds <chart> | kubectl apply --server-side -f -",
        ):
            assert command in release.output, release.output

        (deploy,) = release.objects("Deployment")
        stored = json.loads(
            ok(
                cp.kubectl("get", "deployment", deploy["metadata"]["name"], "-n", namespace, "-o", "json"),
                "get",
            )
        )
        spec = stored["spec"]
        assert spec["replicas"] == 2
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert args[0] == "operator"
        assert "--all-namespaces" in args
        assert f"--peering={release.name}" in args
        assert f"--agent-service-account={namespace}:{release.agent_sa}" in args
        assert not any(a.startswith("--priority") for a in args)  # derived per pod: replicas differ
        env = {
            e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]
        }
        assert env["POD_NAME"] == "metadata.name"
        assert env["POD_NAMESPACE"] == "metadata.namespace"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert "limits" not in container["resources"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]

        services = {s["metadata"]["name"]: s for s in release.objects("Service")}
        ingest = services[f"{release.name}-operator-ingest"]
        assert ingest["spec"]["selector"]["gpuwarden.dev/ingest-active"] == "true"
        assert ingest["spec"]["ports"][0]["port"] == 8443

        (peering,) = release.objects("ClusterKopfPeering")
        assert peering["metadata"]["name"] == release.name
        ok(cp.kubectl("get", "clusterkopfpeering", release.name), "peering object")

        (ds,) = release.objects("DaemonSet")
        agent = ds["spec"]["template"]["spec"]
        (agent_container,) = agent["containers"]
        assert agent["hostPID"] is True
        assert agent["priorityClassName"] == f"{release.name}-agent"  # the chart's own
        (priority,) = release.objects("PriorityClass")
        assert priority["metadata"]["name"] == f"{release.name}-agent"
        assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists"} in agent["tolerations"]
        # TLS by default: the agent trusts the release's CA (ca.crt of its Secret, nothing else of it).
        assert (
            f"--operator-url=https://{release.name}-operator-ingest.{namespace}.svc:8443/v1/reports"
            in agent_container["args"]
        )
        assert "--operator-ca-file=/etc/gpuwarden/operator-ca/ca.crt" in agent_container["args"]
        mounts = {m["mountPath"]: m for m in agent_container["volumeMounts"]}
        assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True
        assert mounts["/host/sys/fs/cgroup"]["readOnly"] is True
        assert mounts["/var/run/secrets/gpuwarden"]["readOnly"] is True
        volumes = {v["name"]: v for v in agent["volumes"]}
        (source,) = volumes["operator-token"]["projected"]["sources"]
        assert source["serviceAccountToken"]["audience"] == "gpuwarden-operator"
        assert source["serviceAccountToken"]["path"] == "token"
        assert volumes["operator-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
        tls = ok(
            cp.kubectl("get", "secret", f"{release.name}-operator-tls", "-n", namespace, "-o", "json"), "tls"
        )
        assert set(json.loads(tls)["data"]) == {"ca.crt", "tls.crt", "tls.key"}
        env_names = {e["name"] for e in agent_container["env"]}
        assert {"NODE_NAME", "NVIDIA_VISIBLE_DEVICES"} <= env_names
        assert agent_container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert agent_container["securityContext"]["privileged"] is False
        assert agent_container["livenessProbe"]["httpGet"]["port"] == "metrics"
        assert agent_container["ports"][0]["containerPort"] == 9400
    finally:
        uninstall(cp, release)


def test_schema_rejects_wrong_values_at_install(control_plane: ControlPlane, namespace: str) -> None:
    name = unique("gpuwarden")
    result = control_plane.run_helm(
        "install", name, str(CHART), "--namespace", namespace, "--set", "operator.replicas=abc"
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert "/operator/replicas" in result.stderr
    assert "want integer" in result.stderr
    assert control_plane.run_helm("status", name, "--namespace", namespace).returncode != 0


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("agent.backend=cuda", "/agent/backend"),
        ("operator.replicas=0", "/operator/replicas"),
        ("agent.sampleInterval=1x", "/agent/sampleInterval"),
        ("operator.podAntiAffinity=maybe", "/operator/podAntiAffinity"),
        ("operator.reclaim.maxPerHour=0", "/operator/reclaim/maxPerHour"),
        ("no.such.value=1", "additional properties 'no' not allowed"),
    ],
)
def test_schema_rejects_wrong_values(control_plane: ControlPlane, setting: str, message: str) -> None:
    result = control_plane.run_helm("template", "gpuwarden", str(CHART), "--set", setting)
    assert result.returncode != 0
    assert message in result.stderr


# ------------------------------------------------------------------------------- RBAC


def can_i(cp: ControlPlane, namespace: str, sa: str, *request: str) -> bool:
    """``kubectl auth can-i`` as the ServiceAccount (with the groups its tokens carry)."""
    proc = cp.kubectl(
        "auth",
        "can-i",
        *request,
        f"--as=system:serviceaccount:{namespace}:{sa}",
        "--as-group=system:serviceaccounts",
        f"--as-group=system:serviceaccounts:{namespace}",
        "--as-group=system:authenticated",
    )
    answer = proc.stdout.strip()
    assert answer in {"yes", "no"}, f"kubectl auth can-i {request}: {proc.stdout}{proc.stderr}"
    return answer == "yes"


def _denied(cp: ControlPlane, namespace: str, sa: str, requests: list[tuple[str, ...]]) -> list[str]:
    return [" ".join(r) for r in requests if can_i(cp, namespace, sa, *r)]


def _missing(cp: ControlPlane, namespace: str, sa: str, requests: list[tuple[str, ...]]) -> list[str]:
    return [" ".join(r) for r in requests if not can_i(cp, namespace, sa, *r)]


# Requests that neither component may ever make, wherever it runs.
FORBIDDEN_EVERYWHERE: list[tuple[str, ...]] = [
    ("get", "secrets", "-n", "team-a"),
    ("list", "secrets", "--all-namespaces"),
    ("watch", "secrets", "--all-namespaces"),
    ("get", "configmaps", "-n", "team-a"),
    ("create", "pods", "--subresource=exec", "-n", "team-a"),
    ("get", "pods", "--subresource=log", "-n", "team-a"),
    ("create", "pods", "--subresource=attach", "-n", "team-a"),
    ("create", "pods", "-n", "team-a"),
    ("delete", "pods", "-n", "team-a"),
    ("get", "deployments.apps", "-n", "team-a"),
    ("patch", "deployments.apps", "-n", "team-a"),
    ("update", "deployments.apps", "-n", "team-a"),
    ("delete", "deployments.apps", "-n", "team-a"),
    ("patch", "statefulsets.apps", "-n", "team-a"),
    ("delete", "statefulsets.apps", "-n", "team-a"),
    ("create", "gpumonitorpolicies.gpuwarden.dev", "-n", "team-a"),
    ("delete", "gpumonitorpolicies.gpuwarden.dev", "-n", "team-a"),
    ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("escalate", "clusterroles.rbac.authorization.k8s.io"),
    ("bind", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io", "-n", "team-a"),
    ("create", "namespaces"),
    ("delete", "namespaces"),
    ("patch", "nodes"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "serviceaccounts", "--subresource=token", "-n", "team-a"),
    ("impersonate", "serviceaccounts", "-n", "team-a"),
    ("delete", "events", "-n", "team-a"),
    ("create", "horizontalpodautoscalers.autoscaling", "-n", "team-a"),
]


# ------------------------------------------------------------------------- NOTES.txt


def notes_policy(output: str) -> str:
    """The here-document that NOTES.txt gives for a first policy, as a shell command."""
    start = output.index("kubectl apply -f - <<'EOF'\n")
    end = output.index("\nEOF\n", start) + len("\nEOF\n")
    return output[start:end]


def shell(cp: ControlPlane, command: str, cwd: Path) -> str:
    """Run a command line as a user would paste it (kubectl and helm on PATH, pointed at ``cp``)."""
    env = {**cp.env, "PATH": f"{cp.kubectl_path.parent}:{cp.helm.parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command], env=env, capture_output=True, text=True, cwd=cwd
    )
    return ok(done, command)


def test_notes_commands_work_without_the_repository(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """A chart-repository user has the chart only: NOTES must name no file of this repository, and the
    policy and CRD-upgrade commands they print must work as printed."""
    cp = control_plane
    release = install(cp, namespace, "--set", f"operator.watchNamespaces={{{namespace}}}")
    try:
        for path in ("examples/", "charts/gpuwarden", "crds/", "docs/"):
            assert path not in release.output.replace(f"{CHART_HOME}/blob/main/docs/", ""), release.output
        policy = notes_policy(release.output)
        assert f"namespace: {namespace}\n" in policy, policy  # the namespace the operator watches
        assert "gpumonitorpolicy.gpuwarden.dev/idle-gpus created" in shell(cp, policy, tmp_path)
        # The upgrade step as printed, with <chart> the chart directory (a repository reference reads the
        # same chart).
        upgrade = "helm show crds <chart> | kubectl apply --server-side -f -"
        assert upgrade in release.output, release.output
        applied = shell(cp, upgrade.replace("<chart>", str(CHART)), tmp_path)
        assert "gpumonitorpolicies.gpuwarden.dev serverside-applied" in applied, applied
    finally:
        uninstall(cp, release)


def _node(name: str, labels: dict[str, str]) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}})


def test_notes_warn_when_no_node_carries_the_agents_label(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """NOTES ask the cluster which nodes carry agent.nodeSelector's label; without a cluster to ask
    (client-side --dry-run, as `helm template`) they say it was not checked."""
    cp = control_plane
    # A letter first: PyYAML (YAML 1.1) writes 123e4567 unquoted and Helm (YAML 1.2) reads it as a number.
    value = f"v{secrets.token_hex(4)}"
    label = f"gpuwarden.test/gpu={value}"
    values = tmp_path / "values.yaml"
    # null drops the default label: Helm merges maps.
    values.write_text(
        yaml.safe_dump(
            {"agent": {"nodeSelector": {"nvidia.com/gpu.present": None, "gpuwarden.test/gpu": value}}}
        )
    )
    release = install(cp, namespace, "-f", str(values))
    try:
        assert f"WARNING: no node carries the label {label} that agent.nodeSelector selects" in release.output
        assert "node(s) carry the label" not in release.output
        node = unique("gpu-node")
        ok(cp.kubectl("create", "-f", "-", input=_node(node, {"gpuwarden.test/gpu": value})), "create node")
        try:
            upgraded = ok(
                cp.run_helm("upgrade", release.name, str(CHART), "--namespace", namespace, "-f", str(values)),
                "helm upgrade",
            )
            assert f"1 node(s) carry the label {label} that agent.nodeSelector selects." in upgraded, upgraded
            assert "WARNING: no node" not in upgraded, upgraded
        finally:
            ok(cp.kubectl("delete", "node", node), "delete node")
        offline = ok(
            cp.run_helm("install", unique("offline"), str(CHART), "--namespace", namespace, "-f", str(values),
                        "--dry-run"),
            "helm install --dry-run",
        )  # fmt: skip
        said = " ".join(offline.split())
        not_checked = "Not checked (no cluster to ask: helm template or a client-side --dry-run)"
        assert f"{not_checked}: whether any node carries the label {label} that" in said, offline
        assert "WARNING: no node" not in offline, offline
    finally:
        uninstall(cp, release)


@pytest.fixture(scope="module")
def cluster_release(control_plane: ControlPlane) -> Iterator[Release]:
    """A default (all namespaces) install, for the RBAC checks."""
    ns = control_plane.create_namespace(unique("rbac-cluster"))
    release = install(control_plane, ns)
    yield release
    uninstall(control_plane, release)


def test_operator_is_allowed_what_it_needs(control_plane: ControlPlane, cluster_release: Release) -> None:
    r = cluster_release
    own = ("-n", r.namespace)
    needed: list[tuple[str, ...]] = [
        ("list", "gpumonitorpolicies.gpuwarden.dev", "--all-namespaces"),
        ("watch", "gpumonitorpolicies.gpuwarden.dev", "--all-namespaces"),
        ("patch", "gpumonitorpolicies.gpuwarden.dev", "-n", "team-a"),
        ("patch", "gpumonitorpolicies.gpuwarden.dev", "--subresource=status", "-n", "team-a"),
        ("list", "pods", "--all-namespaces"),
        ("watch", "pods", "--all-namespaces"),
        ("create", "events", "-n", "team-a"),
        ("get", "deployments.apps", "--subresource=scale", "-n", "team-a"),
        ("patch", "deployments.apps", "--subresource=scale", "-n", "team-a"),
        ("get", "statefulsets.apps", "--subresource=scale", "-n", "team-a"),
        ("patch", "statefulsets.apps", "--subresource=scale", "-n", "team-a"),
        ("list", "horizontalpodautoscalers.autoscaling", "--all-namespaces"),
        ("create", "tokenreviews.authentication.k8s.io"),
        ("list", "clusterkopfpeerings.kopf.dev"),
        ("watch", "clusterkopfpeerings.kopf.dev"),
        ("get", f"clusterkopfpeerings.kopf.dev/{r.name}"),
        ("patch", f"clusterkopfpeerings.kopf.dev/{r.name}"),
        ("list", "customresourcedefinitions.apiextensions.k8s.io"),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
        ("list", "namespaces"),
        ("watch", "namespaces"),
        ("patch", "pods", *own),  # its own ingest-active label
        # operator.nodeHealth (on by default): a node's uid and GPUHealthy condition, Events about nodes.
        ("get", "nodes"),
        ("patch", "nodes", "--subresource=status"),
        ("create", "events", "-n", "default"),
    ]
    assert _missing(control_plane, r.namespace, r.operator_sa, needed) == []


def test_operator_is_denied_the_rest(control_plane: ControlPlane, cluster_release: Release) -> None:
    r = cluster_release
    forbidden = [
        *FORBIDDEN_EVERYWHERE,
        ("get", "secrets", "-n", r.namespace),
        ("create", "pods", "--subresource=exec", "-n", r.namespace),
        ("patch", "pods", "-n", "team-a"),  # only its own namespace's pods
        ("delete", "pods", "-n", r.namespace),
        ("patch", "clusterkopfpeerings.kopf.dev/someone-else"),
        ("delete", f"clusterkopfpeerings.kopf.dev/{r.name}"),
        ("patch", "kopfpeerings.kopf.dev", "-n", "team-a"),
        ("patch", "deployments.apps", "--subresource=status", "-n", "team-a"),
        ("patch", "replicasets.apps", "--subresource=scale", "-n", "team-a"),
        ("update", "namespaces"),
        ("list", "nodes"),  # only the reporting nodes, by name
        ("update", "nodes", "--subresource=status"),
        ("delete", "nodes"),
        ("create", "pods", "--subresource=eviction", "-n", "team-a"),
        # Granted before and never used (issue 39): Events are only POSTed, HPAs only listed.
        ("patch", "events", "-n", "team-a"),
        ("create", "events.events.k8s.io", "-n", "team-a"),
        ("watch", "horizontalpodautoscalers.autoscaling", "--all-namespaces"),
        ("get", "leases.coordination.k8s.io", "-n", r.namespace),  # not sharded: no Leases at all
    ]
    assert _denied(control_plane, r.namespace, r.operator_sa, forbidden) == []


def test_agent_is_allowed_only_its_pod_list_and_resource_slices(
    control_plane: ControlPlane, cluster_release: Release
) -> None:
    r = cluster_release
    allowed = [
        ("list", "pods", "--all-namespaces"),
        ("list", "resourceslices.resource.k8s.io"),
        ("watch", "resourceslices.resource.k8s.io"),
    ]
    assert _missing(control_plane, r.namespace, r.agent_sa, allowed) == []
    forbidden = [
        *FORBIDDEN_EVERYWHERE,
        ("get", "resourceslices.resource.k8s.io"),
        ("create", "resourceslices.resource.k8s.io"),
        ("list", "resourceclaims.resource.k8s.io", "--all-namespaces"),
        ("get", "pods", "-n", "team-a"),
        ("watch", "pods", "--all-namespaces"),
        ("patch", "pods", "-n", r.namespace),
        ("create", "events", "-n", r.namespace),
        ("create", "tokenreviews.authentication.k8s.io"),
        ("list", "nodes"),
        ("get", "deployments.apps", "--subresource=scale", "-n", "team-a"),
        ("list", "gpumonitorpolicies.gpuwarden.dev", "--all-namespaces"),
        ("patch", f"clusterkopfpeerings.kopf.dev/{r.name}"),
    ]
    assert _denied(control_plane, r.namespace, r.agent_sa, forbidden) == []


def test_single_namespace_rbac(control_plane: ControlPlane) -> None:
    cp = control_plane
    ns = cp.create_namespace(unique("rbac-single"))
    watched = cp.create_namespace(unique("rbac-watched"))
    release = install(
        cp, ns, "--set", f"operator.watchNamespaces={{{watched}}}", "--set", "agent.podList.enabled=false",
        "--set", "agent.dra.resourceSlices=false",
    )  # fmt: skip
    try:
        (peering,) = release.objects("KopfPeering")
        assert peering["metadata"]["namespace"] == watched
        assert release.objects("ClusterKopfPeering") == []
        needed: list[tuple[str, ...]] = [
            ("list", "pods", "-n", watched),
            ("watch", "gpumonitorpolicies.gpuwarden.dev", "-n", watched),
            ("patch", "gpumonitorpolicies.gpuwarden.dev", "--subresource=status", "-n", watched),
            ("create", "events", "-n", watched),
            ("patch", "deployments.apps", "--subresource=scale", "-n", watched),
            ("list", "horizontalpodautoscalers.autoscaling", "-n", watched),
            ("get", f"kopfpeerings.kopf.dev/{release.name}", "-n", watched),
            ("patch", f"kopfpeerings.kopf.dev/{release.name}", "-n", watched),
            ("create", "tokenreviews.authentication.k8s.io"),
            ("patch", "pods", "-n", ns),
        ]
        assert _missing(cp, ns, release.operator_sa, needed) == []
        forbidden: list[tuple[str, ...]] = [
            *FORBIDDEN_EVERYWHERE,
            ("list", "pods", "--all-namespaces"),
            ("list", "pods", "-n", "team-a"),
            ("list", "gpumonitorpolicies.gpuwarden.dev", "--all-namespaces"),
            ("create", "events", "-n", "team-a"),
            ("patch", "deployments.apps", "--subresource=scale", "-n", "team-a"),
            ("patch", f"clusterkopfpeerings.kopf.dev/{release.name}"),
            ("get", "secrets", "-n", watched),
            ("patch", "deployments.apps", "-n", watched),
        ]
        assert _denied(cp, ns, release.operator_sa, forbidden) == []
        # agent.podList.enabled=false, agent.dra.resourceSlices=false: the agent has no API access at all.
        rbac = release.objects("ClusterRole") + release.objects("ClusterRoleBinding")
        assert not [d for d in rbac if d["metadata"]["name"].endswith("-agent")]
        (ds,) = release.objects("DaemonSet")
        assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        assert _denied(cp, ns, release.agent_sa, [("list", "pods", "--all-namespaces")]) == []
    finally:
        uninstall(cp, release)


NODE_HEALTH = [
    ("get", "nodes"),
    ("patch", "nodes", "--subresource=status"),
    ("create", "events", "-n", "default"),
]
CORDON = [("patch", "nodes")]


@pytest.mark.parametrize(
    ("settings", "flags", "allowed", "denied"),
    [
        (["operator.nodeHealth.enabled=false"], [], [], NODE_HEALTH + CORDON),
        (
            ["operator.nodeHealth.cordon.enabled=true"],
            ["--node-health", "--cordon=dry-run"],
            NODE_HEALTH,
            CORDON,
        ),
        (
            ["operator.nodeHealth.cordon.enabled=true", "operator.nodeHealth.cordon.dryRun=false"],
            ["--node-health", "--cordon=on"],
            NODE_HEALTH + CORDON,
            [],
        ),
    ],
    ids=["node-health-off", "cordon-dry-run", "cordon-on"],
)
def test_node_health_rbac_follows_the_values(
    control_plane: ControlPlane,
    settings: list[str],
    flags: list[str],
    allowed: list[tuple[str, ...]],
    denied: list[tuple[str, ...]],
) -> None:
    """Watching one namespace (so nothing cluster-wide covers `default`): the node view's rules are there
    only when it is on, nodes patch only when cordoning for real (a dry run gets none)."""
    cp = control_plane
    ns = cp.create_namespace(unique("rbac-nodes"))
    watched = cp.create_namespace(unique("rbac-nodes-watched"))
    sets = [arg for setting in settings for arg in ("--set", setting)]
    release = install(cp, ns, "--set", f"operator.watchNamespaces={{{watched}}}", *sets)
    try:
        assert _missing(cp, ns, release.operator_sa, allowed) == []
        assert _denied(cp, ns, release.operator_sa, denied) == []
        (deployment,) = release.objects("Deployment")
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert [a for a in args if a in ("--node-health", "--cordon=dry-run", "--cordon=on")] == flags
    finally:
        uninstall(cp, release)


# ----------------------------------------------------------------------------- deploy/


def test_deploy_manifests_are_up_to_date(control_plane: ControlPlane) -> None:
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "render-manifests.sh"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM": str(control_plane.helm)},
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"deploy/ is stale: run hack/render-manifests.sh\n{proc.stdout}{proc.stderr}"


def test_deploy_manifests_are_accepted(control_plane: ControlPlane) -> None:
    """deploy/ as committed: CRDs applied, every other object accepted by a server-side dry run."""
    cp = control_plane
    deploy = REPO_ROOT / "deploy"
    ok(cp.kubectl("apply", "--server-side", "-f", str(deploy / "crds")), "apply deploy/crds")
    for kind, plural in _CERT_MANAGER_KINDS:
        if cp.kubectl("get", "crd", f"{plural}.cert-manager.io").returncode != 0:
            stub = yaml.safe_dump(_stub_crd(kind, plural, "cert-manager.io"))
            ok(cp.kubectl("create", "-f", "-", input=stub), kind)
    cert_manager = [f"{plural}.cert-manager.io" for _, plural in _CERT_MANAGER_KINDS]
    for crd in (*CRD_NAMES, *cert_manager):
        ok(cp.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{crd}"), crd)
    docs = docs_of((deploy / "gpuwarden.yaml").read_text())
    (namespace,) = (d for d in docs if d["kind"] == "Namespace")
    assert namespace["metadata"]["name"] == "gpuwarden-system"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # The namespace for real (a dry run would not create it for the objects in it), the rest dry-run only,
    # so no cluster-scoped object named "gpuwarden-*" is left behind for other tests.
    ok(cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(namespace)), "namespace")
    rest = "---\n".join(yaml.safe_dump(d) for d in docs if d["kind"] != "Namespace")
    out = ok(cp.kubectl("apply", "--dry-run=server", "-f", "-", input=rest), "apply --dry-run=server")
    assert len(out.strip().splitlines()) == len(docs) - 1
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "DaemonSet", "ClusterKopfPeering", "ClusterRole", "Role", "Certificate"} <= kinds
    assert "Secret" not in kinds  # no private key shared by every cluster that applies deploy/


# -------------------------------------------------------------------------------- alerts

ALERT_RULES = CHART / "rules" / "gpuwarden-alerts.yaml"
PLACEHOLDER_JOBS = {"operator": 'job="gpuwarden-operator"', "agent": 'job="gpuwarden-agent"'}
"""The scrape jobs the rule file selects, which the chart replaces with the release's."""


def render_alerts(cp: ControlPlane, values: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The rendered PrometheusRule's groups (release gw in mon), and the release's Services by component."""
    out = ok(
        cp.run_helm(
            "template", "gw", str(CHART), "--namespace", "mon", "-f", "-", input=yaml.safe_dump(values)
        ),
        "helm template",
    )
    docs = docs_of(out)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    services = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["metadata"]["name"]
        for d in docs
        if d["kind"] == "Service"
    }
    return rule["spec"]["groups"], services


def alert_values(**prometheus_rule: Any) -> dict[str, Any]:
    return {
        "monitoring": {
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, **prometheus_rule},
        }
    }


def test_the_prometheus_rule_is_the_rule_file_with_the_releases_jobs_and_the_overrides(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    values = alert_values(
        alertLabels={"team": "ml-platform"},
        runbookUrl="https://wiki.example.com/gpu#",
        rules={
            "GPUWardenGPUIdle": {"for": "1h", "severity": "info"},
            "GPUWardenGPUUnhealthy": {"severity": "critical"},
            "GPUWardenEvaluationsLate": {"enabled": False},
        },
        additionalRules=[{"alert": "Mine", "expr": "vector(1)", "labels": {"severity": "info"}}],
    )
    groups, services = render_alerts(control_plane, values)
    source = yaml.safe_load(ALERT_RULES.read_text())["groups"]
    assert [g["name"] for g in groups] == [*(g["name"] for g in source), "gpuwarden-additional"]
    assert groups[-1]["rules"] == values["monitoring"]["prometheusRule"]["additionalRules"]

    def releases(text: str) -> str:  # the file's jobs as the ServiceMonitors name them: their Services
        for component, placeholder in PLACEHOLDER_JOBS.items():
            text = text.replace(placeholder, f'job="{services[component]}"')
        return text

    rendered = {r["alert"]: r for g in groups[:-1] for r in g["rules"]}
    expected = [r for g in source for r in g["rules"] if r["alert"] != "GPUWardenEvaluationsLate"]
    assert list(rendered) == [r["alert"] for r in expected]
    for rule in expected:
        name, got = rule["alert"], rendered[rule["alert"]]
        assert got["expr"] == releases(rule["expr"]), name
        assert got["for"] == {"GPUWardenGPUIdle": "1h"}.get(name, rule["for"]), name
        severity = {"GPUWardenGPUIdle": "info", "GPUWardenGPUUnhealthy": "critical"}.get(name)
        assert got["labels"] == {"severity": severity or rule["labels"]["severity"], "team": "ml-platform"}, (
            name
        )
        assert got["annotations"] == {
            **{k: releases(v) for k, v in rule["annotations"].items()},
            "runbook_url": f"https://wiki.example.com/gpu#{name.lower()}",
        }, name
    text = yaml.safe_dump(groups)
    assert not any(placeholder in text for placeholder in PLACEHOLDER_JOBS.values())

    # What Prometheus loads from it, checked by Prometheus' own tool.
    promtool = shutil.which("promtool")
    if promtool is None:
        if in_ci():
            pytest.fail("CI=true: promtool is missing (hack/ensure-system-deps.sh)", pytrace=False)
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(expected) + 1} rules found" in check.stdout


def test_the_prometheus_rule_follows_the_podmonitors_jobs_and_the_agents_absence(
    control_plane: ControlPlane,
) -> None:
    values: dict[str, Any] = {
        "monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    }
    groups, services = render_alerts(control_plane, values)
    exprs = {r["alert"]: r["expr"] for g in groups for r in g["rules"]}
    assert f'up{{job="mon/{services["operator"]}"}}' in exprs["GPUWardenOperatorDown"]
    assert f'up{{job="mon/{services["agent"]}"}}' in exprs["GPUWardenAgentDown"]

    values["agent"] = {"enabled": False}
    groups, _ = render_alerts(control_plane, values)
    kept = {r["alert"] for g in groups for r in g["rules"]}
    on_agents = {name for name, expr in exprs.items() if f'job="mon/{services["agent"]}"' in expr}
    assert on_agents == {
        "GPUWardenAgentDown",
        "GPUWardenAgentDroppingReports",
        "GPUWardenOperatorReceivesNoReports",
    }
    assert kept == set(exprs) - on_agents


def test_an_override_of_an_alert_gpuwarden_does_not_have_fails(control_plane: ControlPlane) -> None:
    values = alert_values(rules={"GPUWardenGPUIdel": {"for": "1h"}})
    proc = control_plane.run_helm(
        "template", "gw", str(CHART), "--namespace", "mon", "-f", "-", input=yaml.safe_dump(values)
    )
    assert proc.returncode != 0
    assert "monitoring.prometheusRule.rules.GPUWardenGPUIdel: gpuwarden has no such alert" in proc.stderr
    assert "GPUWardenGPUIdle" in proc.stderr  # the names it has

"""A release as users install it: `make release` pushes both images and the chart to a real OCI registry
(Debian's docker-registry, on this machine), and the real test node installs
`helm install oci://.../gpuwarden --version X` with its containerd pulling both images from there: pods
Ready, the first Event, and `helm test` passing.

The registry speaks plain HTTP on loopback (`INSECURE=1`: podman's --tls-verify=false, helm's
--plain-http; the node's containerd trusts it through a hosts.toml). Nothing of the chart changes but
the scripted backend, as in test_chart_on_node.py: no GPU here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import tomllib
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from controlplane import REPO_ROOT, free_ports
from node import CONTAINERD_SOCKET, Node
from operator_support import events, wait_until
from test_chart_on_node import GPU_PRESENT, REPLICAS, SYSTEM, TIMEOUT, run_gpu_deployment, tear_down
from test_node import apply, wait
from test_operator_scaling import policy

pytestmark = pytest.mark.integration

VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
RELEASE = "gpuwarden"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``HOST:PORT`` of a docker-registry serving plain HTTP on loopback, its storage a temporary folder."""
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is missing: run hack/ensure-system-deps.sh", pytrace=False)
    workdir = tmp_path_factory.mktemp("registry")
    (port,) = free_ports(1)
    host = f"127.0.0.1:{port}"
    config = workdir / "config.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "log": {"level": "warn"},
                "storage": {"filesystem": {"rootdirectory": str(workdir / "data")}},
                "http": {"addr": host},
            }
        )
    )
    log = (workdir / "registry.log").open("wb")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://{host}/v2/", timeout=2) as rsp:
                return bool(rsp.status == 200)
        except OSError:
            return False

    try:
        wait_until(answers, timeout=30, what=f"docker-registry on {host}", alive=lambda: None)
        yield host
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_make_release_then_helm_install_from_the_registry_on_the_node(registry: str, node: Node) -> None:
    cp = node.control_plane
    started = time.monotonic()
    release = subprocess.run(
        ["make", "release", f"VERSION={VERSION}", f"REGISTRY={registry}", "INSECURE=1", f"HELM={cp.helm}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert release.returncode == 0, release.stdout[-3000:] + release.stderr[-3000:]
    pushed = release.stdout.splitlines()
    assert f"pushed {registry}/gpuwarden/gpuwarden-agent:{VERSION}" in pushed
    assert f"pushed {registry}/gpuwarden/gpuwarden-operator:{VERSION}" in pushed
    assert f"pushed oci://{registry}/gpuwarden/charts/gpuwarden:{VERSION}" in pushed
    timings = {"make release": time.monotonic() - started}

    node.trust_plain_http_registry(registry)
    cp.kubectl("label", "node", node.name, f"{GPU_PRESENT}=true", "--overwrite", check=True)
    namespace = cp.create_namespace(f"release-{int(time.time()) % 100000}")
    cp.kubectl("wait", "--for=create", "serviceaccount/default", "-n", namespace, "--timeout=60s", check=True)
    try:
        run_gpu_deployment(node, namespace)
        cp.kubectl("wait", "--for=delete", f"namespace/{SYSTEM}", "--timeout=120s", check=True, timeout=150)
        installed_at = time.monotonic()
        values = {
            "global": {"imageRegistry": registry},
            "agent": {"backend": "scripted", "extraArgs": ["--scenario=e2e-fast", "--attribution=kubelet"]},
        }
        helm = cp.run_helm(
            "install", RELEASE, f"oci://{registry}/gpuwarden/charts/gpuwarden", "--version", VERSION,
            "--plain-http", "--namespace", SYSTEM, "--create-namespace", "-f", "-",
            input=yaml.safe_dump(values), timeout=180,
        )  # fmt: skip
        assert helm.returncode == 0, helm.stderr
        for selector in ("app.kubernetes.io/component=agent", "app.kubernetes.io/component=operator"):
            wait(node, SYSTEM, "--for=condition=Ready", "pod", "-l", selector)
        timings["pods Ready"] = time.monotonic() - installed_at

        # Both images came from the registry: the node's containerd holds them under its name.
        listed = subprocess.run(
            ["ctr", f"--address={CONTAINERD_SOCKET}", "-n", "k8s.io", "images", "ls", "-q"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split()  # fmt: skip
        for component in ("agent", "operator"):
            assert f"{registry}/gpuwarden/gpuwarden-{component}:{VERSION}" in listed

        apply(node, namespace, policy(namespace, hi=REPLICAS + 1, interval="1s"))
        wait_until(
            lambda: events(cp, namespace, reason="GPUUnderutilized"),
            timeout=TIMEOUT,
            what="the first GPUUnderutilized Event",
        )
        timings["first Event"] = time.monotonic() - installed_at

        test = cp.run_helm("test", RELEASE, "-n", SYSTEM, "--timeout=90s", timeout=120)
        assert test.returncode == 0, f"{test.stdout}\n{test.stderr}"
        timings["helm test"] = time.monotonic() - installed_at
        print(f"\nrelease from {registry} → {timings}")
    finally:
        tear_down(node, namespace)
        for component in ("agent", "operator"):  # make release's tags, for this run's registry only
            target = f"{registry}/gpuwarden/gpuwarden-{component}:{VERSION}"
            subprocess.run(["podman", "untag", target, target], capture_output=True, check=False, timeout=60)

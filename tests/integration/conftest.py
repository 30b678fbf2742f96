"""Fixtures for integration tests against a real etcd + kube-apiserver, and a real node.

``control_plane`` (session): a :class:`ControlPlane` (kubeconfig, server, ca_path,
admin_token, kubectl(), helm).  ``namespace`` (function): a fresh namespace per test.
``images`` (session): the container images, built with podman (:mod:`images`).

``node`` (session): a :class:`node.Node`, a kubelet with containerd, kube-proxy, CoreDNS,
the scheduler, the controller-manager and a device plugin for ``nvidia.com/gpu``, on a
control plane of its own (``node.control_plane``).  ``node_namespace`` (function): a fresh
namespace on it, with its ``default`` ServiceAccount.

Binaries come from ``hack/build-control-plane.sh --print-env``, images from
``hack/build-images.sh --print-env`` (each builds what is missing).
Under ``CI=true`` a failed build, a missing prerequisite or a failed start is a test
failure, never a skip.
"""

from __future__ import annotations

import re
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
# tests/integration is not a package: make `import controlplane` work under every
# pytest import mode (prepend adds this directory already; importlib does not).
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from controlplane import (  # noqa: E402
    Binaries,
    BuildError,
    ControlPlane,
    ControlPlaneError,
    in_ci,
    locate_binaries,
)
from images import Images, locate_images  # noqa: E402
from node import Node, missing_prerequisites  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers the marker too; registering twice is harmless and keeps
    # --strict-markers happy if this directory is run with another config.
    config.addinivalue_line(
        "markers",
        "integration: needs the real kube-apiserver/etcd/kubectl/helm built by hack/build-control-plane.sh",
    )


_STARTUPS: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per control plane started, with its measured start time."""
    for line in _STARTUPS:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/integration carries the ``integration`` marker; the release test runs
    after the other integration tests.

    It pulls from a registry the very images the node imported for every other test (the same image
    IDs under the registry's names); containerd 1.6's CRI plugin then loses an imported name when a
    later module imports it again, and that module's pods end ErrImageNeverPull (seen in CI: the
    service-metrics pods after the release test, whichever of the two names went first).
    """
    ours = [_HERE in Path(str(item.path)).resolve().parents for item in items]
    for item, integration in zip(items, ours, strict=True):
        if integration:
            item.add_marker(pytest.mark.integration)
    release = [item for item in items if Path(str(item.path)).name == "test_release.py"]
    if release and True in ours:
        last = len(ours) - 1 - ours[::-1].index(True)
        items[:] = [i for i in items[: last + 1] if i not in release] + release + items[last + 1 :]


@pytest.fixture(scope="session")
def control_plane_binaries() -> Binaries:
    """Paths of kube-apiserver, kubectl, etcd and helm (building them if missing)."""
    try:
        return locate_binaries()
    except BuildError as exc:
        error = str(exc)
    if in_ci():
        pytest.fail(f"CI=true: control-plane binaries unavailable: {error}", pytrace=False)
    pytest.skip(
        "control-plane binaries could not be built (run hack/build-control-plane.sh; "
        f"needs Go >= 1.26 and the Go module proxy): {error}"
    )


@pytest.fixture(scope="session")
def images() -> Images:
    """The agent, operator, pause and workload images (building what is missing: needs root)."""
    try:
        return locate_images()
    except BuildError as exc:
        error = str(exc)
    if in_ci():
        pytest.fail(f"CI=true: the images could not be built: {error}", pytrace=False)
    pytest.skip(f"the images could not be built (run hack/build-images.sh as root): {error}")


@pytest.fixture(scope="session")
def control_plane(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A running etcd + kube-apiserver for the whole session, always torn down."""
    cp = ControlPlane(control_plane_binaries, tmp_path_factory.mktemp("controlplane"))
    try:
        cp.start()
    except ControlPlaneError as exc:
        error = str(exc)
    else:
        error = ""
    if error:
        pytest.fail(f"control plane did not start: {error}", pytrace=False)
    versions = " ".join(f"{k.lower()}={v}" for k, v in sorted(control_plane_binaries.versions.items()))
    _STARTUPS.append(f"control plane ({versions}) ready in {cp.startup_seconds:.1f}s at {cp.server}")
    try:
        yield cp
    finally:
        cp.stop()


_NOT_DNS = re.compile(r"[^a-z0-9-]+")


def _unique_name(request: pytest.FixtureRequest) -> str:
    stem = _NOT_DNS.sub("-", request.node.name.lower()).strip("-")
    suffix = secrets.token_hex(3)
    return f"{stem[: 63 - len(suffix) - 1].rstrip('-')}-{suffix}".lstrip("-")


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> str:
    """A new, uniquely named namespace for this test.

    Namespaces are not deleted afterwards: without kube-controller-manager a deleted
    namespace stays Terminating forever, so uniqueness is what isolates tests.
    """
    return control_plane.create_namespace(_unique_name(request))


@pytest.fixture(scope="session")
def node(
    control_plane_binaries: Binaries, images: Images, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    """A running node and its control plane for the whole session, always torn down."""
    if missing := ", ".join(missing_prerequisites()):
        if in_ci():
            pytest.fail(f"CI=true: this machine cannot run the test node: {missing}", pytrace=False)
        pytest.skip(f"this machine cannot run the test node: {missing}")
    started = Node(control_plane_binaries, images, tmp_path_factory.mktemp("node"))
    try:
        started.start()
    except ControlPlaneError as exc:
        pytest.fail(f"node did not start: {exc}", pytrace=False)
    phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in started.phase_seconds.items())
    _STARTUPS.append(f"node {started.name} ready in {started.startup_seconds:.1f}s ({phases})")
    try:
        yield started
    finally:
        t = time.monotonic()
        started.stop()
        steps = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in started.teardown_seconds.items())
        _STARTUPS.append(f"node {started.name} torn down in {time.monotonic() - t:.1f}s ({steps})")


@pytest.fixture
def node_namespace(node: Node, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace on the node's cluster, once its ``default`` ServiceAccount exists.

    Pods are admitted only then (the ServiceAccount admission plugin); the namespace is
    deleted afterwards, which the node's controller-manager carries out.
    """
    cp = node.control_plane
    name = cp.create_namespace(_unique_name(request))
    cp.kubectl(
        "wait", "--for=create", "serviceaccount/default", "-n", name, "--timeout=60s", check=True, timeout=90
    )
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false")

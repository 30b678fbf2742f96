"""The container images, built by hack/build-images.sh with podman, run as the chart runs them.

Each container has a read-only root filesystem, every capability dropped and the image's own user
(:func:`images.podman_run`). The operator image (uid 65532) runs against the real kube-apiserver with a
kubeconfig, the agent image plays a scripted scenario and reports to it with a ServiceAccount token, and
the operator finds the idle GPU: both images' whole runtime, from the wheel to the TokenReview. The
pause image is checked for what the kubelet needs of a sandbox: PID 1 that reaps and stops on SIGTERM.
"""

from __future__ import annotations

import base64
import json
import secrets
import tarfile
from pathlib import Path

import pytest
import yaml
from controlplane import ControlPlane
from images import Images, podman, podman_run, removed_afterwards, run_once
from operator_support import OPERATOR_POD, http, idle_pod, parse_metrics, prepare, wait_until

import gpuwarden

pytestmark = pytest.mark.integration

GPU_UUID = "GPU-1f00aa00-0000-4000-8000-0000000000e1"


def _container(what: str) -> str:
    return f"gpuwarden-test-{what}-{secrets.token_hex(3)}"


@pytest.mark.parametrize("what", ["agent", "operator", "pause", "workload"])
def test_each_archive_names_its_image(images: Images, what: str) -> None:
    """`ctr images import` and `podman load` name the image after the archive's ref.name annotation."""
    image = getattr(images, what)
    with tarfile.open(image.archive) as archive:
        index = json.loads(archive.extractfile("index.json").read())  # type: ignore[union-attr]
    (manifest,) = index["manifests"]
    assert manifest["annotations"]["org.opencontainers.image.ref.name"] == image.name
    assert image.name.startswith(f"{images.registry}/gpuwarden/")


@pytest.mark.parametrize("component", ["agent", "operator"])
def test_image_prints_its_version(images: Images, component: str) -> None:
    image = getattr(images, component).name
    run = run_once(image, _container(component), "--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"gpuwarden {gpuwarden.__version__}\n"
    inspect = podman("image", "inspect", "--format={{json .Labels}}", image)
    labels = json.loads(inspect.stdout)
    assert labels["org.opencontainers.image.version"] == gpuwarden.__version__
    assert labels["org.opencontainers.image.title"] == f"gpuwarden-{component}"
    # Built on the local base: BASE reached both stages.
    assert labels["org.opencontainers.image.base.name"] == images.workload.name
    assert getattr(images, f"{component}_tag") == image.rpartition(":")[2]


def test_operator_image_runs_as_65532(images: Images) -> None:
    run = run_once(images.operator.name, _container("id"), entrypoint="id")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[:2] == ["uid=65532(gpuwarden)", "gid=65532(gpuwarden)"]
    help_text = run_once(images.operator.name, _container("help"), "operator", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--ingest-address" in help_text.stdout


def test_operator_image_allocates_every_object_with_jemalloc(images: Images) -> None:
    """What bench/soak.py measures: jemalloc preloaded, and Python's objects its (none from pymalloc's
    arenas), so keep_memory finds no glibc heap to trim."""
    probe = (
        "import sys; from gpuwarden.operator.memory import GlibcHeap, jemalloc_loaded; "
        "maps = open('/proc/self/maps').read(); "
        "print('/libjemalloc.so' in maps, jemalloc_loaded(), sys.getallocatedblocks(), GlibcHeap.open())"
    )
    run = run_once(images.operator.name, _container("malloc"), "-c", probe, entrypoint="python")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "0", "None"], run.stdout + run.stderr


def _container_kubeconfig(cp: ControlPlane, path: Path) -> Path:
    """The control plane's kubeconfig with its CA inline, readable by the operator's uid 65532."""
    config = yaml.safe_load(cp.kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    ca = Path(cluster.pop("certificate-authority")).read_bytes()
    cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o644)
    return path


def test_operator_and_agent_images_find_an_idle_gpu(
    images: Images, control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "images")
    scenario = idle_pod(setup, "images", GPU_UUID)
    kubeconfig = _container_kubeconfig(cp, setup.workdir / "kubeconfig-container")
    operator_name, agent_name = _container("operator"), _container("agent")
    operator_command = podman_run(
        images.operator.name,
        operator_name,
        mounts={kubeconfig: "/etc/gpuwarden/kubeconfig"},
        env={
            "KUBECONFIG": "/etc/gpuwarden/kubeconfig",
            "POD_NAME": OPERATOR_POD,
            "POD_NAMESPACE": setup.namespace,
        },
    )
    # The scenario and the token at the paths the agent is given (the workdir, mounted where it is).
    agent_command = podman_run(images.agent.name, agent_name, mounts={setup.workdir: str(setup.workdir)})
    with removed_afterwards(operator_name, agent_name), setup.operator(command=operator_command) as operator:
        operator.wait_ready(timeout=120)
        with setup.agent(scenario, operator, command=agent_command) as agent:

            def gpu_up() -> float | None:
                try:
                    status, text = http("GET", f"http://127.0.0.1:{agent.port}/metrics")
                except OSError:
                    return None
                samples = parse_metrics(text) if status == 200 else {}
                up = [v for k, v in samples.items() if k.startswith("gpuwarden_gpu_up{") and GPU_UUID in k]
                return up[0] if up else None

            assert (
                wait_until(gpu_up, timeout=60, what="the agent container's /metrics", alive=agent.alive)
                == 1.0
            )
            assert http("GET", f"http://127.0.0.1:{agent.port}/readyz")[0] == 200
            # Reports reach the operator container (TokenReview of the mounted token) and are evaluated.
            wait_until(
                lambda: operator.findings("idle", "idle") >= 1,
                timeout=90,
                what="the idle finding in the operator container",
                alive=lambda: operator.alive() or agent.alive(),
            )
            (event, *_) = wait_until(
                lambda: setup.events("Pod", "idle-0", "GPUUnderutilized"),
                timeout=30,
                what="the GPUUnderutilized event",
            )
            assert event["reportingComponent"] == "gpuwarden-operator"
        assert agent.stop() == 0, agent.log_tail()
    assert operator.proc.returncode == 0, operator.log_tail()


def test_pause_reaps_orphans_and_stops_on_sigterm(images: Images) -> None:
    pause, workload = _container("pause"), _container("workload")
    with removed_afterwards(pause, workload):
        started = podman("run", "--detach", f"--name={pause}", "--network=none", images.pause.name)
        assert started.returncode == 0, started.stderr
        # A process of another container in the sandbox's PID namespace (as a pod with
        # shareProcessNamespace): orphaned at once, so the namespace's PID 1, pause, inherits it.
        # It must be gone after it exits, not left a zombie.
        script = (
            "orphan=$(sh -c 'sleep 0.2 & echo $!'); "
            "for i in $(seq 100); do [ -e /proc/$orphan ] || exit 0; sleep 0.1; done; "
            "grep State /proc/$orphan/status; exit 1"
        )
        reaped = podman(
            "run", "--rm", f"--name={workload}", f"--pid=container:{pause}", "--network=none",
            images.workload.name, "sh", "-c", script,
        )  # fmt: skip
        assert reaped.returncode == 0, f"the orphan was not reaped: {reaped.stdout}{reaped.stderr}"
        # The kubelet stops a sandbox with SIGTERM; a PID 1 that ignored it would be SIGKILLed (137).
        stopped = podman("stop", "--time=30", pause)
        assert stopped.returncode == 0, stopped.stderr
        code = podman("inspect", "--format={{.State.ExitCode}}", pause)
        assert code.stdout.strip() == "0"

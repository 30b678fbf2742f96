"""What the operator's end-to-end tests share: the operator and the agent as their own processes,
scripted scenarios written per test, GPU pods, ServiceAccount tokens, and polling the API.

Every wait polls the API server (or a process's endpoint) until a condition holds or a deadline
passes; nothing synchronises on a bare sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from controlplane import REPO_ROOT, ControlPlane, free_ports

T = TypeVar("T")

AUDIENCE = "gpuwarden-operator"
AGENT_SA = "gpuwarden-agent"
GI = 2**30
CARD = "143771Mi"  # an H200's memory, as NVML reports it


class Timeout(AssertionError):
    """A condition did not hold in time."""


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    every: float = 0.5,
    alive: Callable[[], str | None] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy; return that, or raise :class:`Timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if alive is not None and (err := alive()):
            raise Timeout(f"while waiting for {what}: {err}")
        if time.monotonic() > deadline:
            raise Timeout(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(every)  # the polling interval of a condition wait


def apply_crds(cp: ControlPlane) -> None:
    """The GPUMonitorPolicy and Kopf peering CRDs, established (idempotent)."""
    for crd in ("gpuwarden.dev_gpumonitorpolicies.yaml", "kopf.dev_peerings.yaml"):
        _kubectl(cp, "apply", "--server-side", "--force-conflicts", "-f", str(REPO_ROOT / "crds" / crd))
    for name in ("gpumonitorpolicies.gpuwarden.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        _kubectl(cp, "wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


def _kubectl(cp: ControlPlane, *args: str, input: str | None = None) -> str:
    """kubectl that fails with its stderr in the message."""
    proc = cp.kubectl(*args, input=input)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def apply(cp: ControlPlane, obj: Mapping[str, Any]) -> None:
    """``kubectl apply`` one object."""
    _kubectl(cp, "apply", "-f", "-", input=json.dumps(obj))


def get(cp: ControlPlane, *args: str) -> Any:
    """``kubectl get ... -o json``, decoded (None when not found)."""
    proc = cp.kubectl("get", *args, "-o", "json")
    if proc.returncode != 0:
        if "NotFound" in proc.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)} failed: {proc.stderr}")
    return json.loads(proc.stdout)


def events(
    cp: ControlPlane, namespace: str, *, kind: str | None = None, name: str | None = None
) -> list[Any]:
    """Events in a namespace, optionally about one object, oldest first."""
    items = get(cp, "events", "-n", namespace)["items"]
    if kind is not None:
        items = [e for e in items if e["involvedObject"].get("kind") == kind]
    if name is not None:
        items = [e for e in items if e["involvedObject"].get("name") == name]
    return sorted(items, key=lambda e: e.get("eventTime") or e["metadata"]["creationTimestamp"])


def create_peering(cp: ControlPlane, namespace: str, name: str) -> None:
    """The KopfPeering object Kopf keeps its keep-alives in (it does not create it itself)."""
    apply(
        cp,
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": name, "namespace": namespace},
        },
    )


def create_gpu_pod(cp: ControlPlane, namespace: str, name: str, labels: Mapping[str, str]) -> None:
    """A pod that asks for a GPU; bound to a node by name (no scheduler), it stays Pending (no kubelet)."""
    apply(
        cp,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {
                "nodeName": "gpu-node-1",
                "containers": [
                    {
                        "name": "main",
                        "image": "example.invalid/cuda:1",
                        "resources": {"limits": {"nvidia.com/gpu": 1}},
                    }
                ],
            },
        },
    )


def create_plain_pod(cp: ControlPlane, namespace: str, name: str) -> None:
    """A pod without a GPU (stands for an operator replica's own pod)."""
    apply(
        cp,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": "gpuwarden-operator"}},
            "spec": {
                "nodeName": "cpu-node-1",
                "containers": [{"name": "operator", "image": "example.invalid/op:1"}],
            },
        },
    )


def service_account_token(cp: ControlPlane, namespace: str, name: str, audience: str = AUDIENCE) -> str:
    """A TokenRequest token (``kubectl create token``) for a ServiceAccount, created if missing."""
    if get(cp, "serviceaccount", name, "-n", namespace) is None:
        cp.kubectl("create", "serviceaccount", name, "-n", namespace, check=True)
    proc = cp.kubectl(
        "create", "token", name, "-n", namespace, f"--audience={audience}", "--duration=2h", check=True
    )
    return proc.stdout.strip()


def write_token(path: Path, token: str) -> Path:
    path.write_text(token)
    path.chmod(0o600)
    return path


# -- scenarios ------------------------------------------------------------------------------------


def gpu(
    uuid: str, index: int, utilization: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> dict[str, Any]:
    """A scripted H200 (SM activity derived from utilization)."""
    return {"uuid": uuid, "index": index, "memoryTotal": CARD, "utilization": utilization, "memory": memory}


def pod(namespace: str, name: str, gpu_uuid: str, labels: Mapping[str, str], pid: int) -> dict[str, Any]:
    """A scripted pod with one GPU and one process."""
    return {
        "namespace": namespace,
        "name": name,
        "container": "main",
        "labels": dict(labels),
        "gpus": [gpu_uuid],
        "processes": [{"pid": pid, "command": "python work.py"}],
    }


def write_scenario(path: Path, name: str, gpus: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Path:
    """A scenario file for ``gpuwarden agent --backend scripted``."""
    spec = {"name": name, "duration": "1h", "seed": 7, "gpus": gpus, "pods": pods}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# -- processes ------------------------------------------------------------------------------------


def _python_env(cp: ControlPlane, extra: Mapping[str, str]) -> dict[str, str]:
    env = cp.env
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Proc:
    """A gpuwarden command in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self) -> str | None:
        """None while running, else why it is not (for :func:`wait_until`)."""
        code = self.proc.poll()
        return None if code is None else f"{self.name} exited with {code}:\n{self.log_tail()}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM (graceful: Kopf leaves the peering, the label is removed), SIGKILL after ``grace``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as a crashed or evicted process."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)


def http(
    method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
) -> tuple[int, Any]:
    """One HTTP request; the status and the decoded JSON (or text) body."""
    request = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=30) as rsp:
            status, raw, hdrs = rsp.status, rsp.read(), rsp.headers
    except urllib.error.HTTPError as err:
        status, raw, hdrs = err.code, err.read(), err.headers
    if "json" in (hdrs.get("Content-Type") or ""):
        return status, json.loads(raw)
    return status, raw.decode(errors="replace")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{'name{labels}': value}`` (labels as written)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


class Operator(Proc):
    """``python -m gpuwarden operator`` watching one namespace, on free loopback ports."""

    def __init__(
        self,
        cp: ControlPlane,
        workdir: Path,
        namespace: str,
        *,
        peering: str,
        pod_name: str,
        priority: int | None = None,
        extra_args: Iterable[str] = (),
        ports: tuple[int, int] | None = None,
    ) -> None:
        self.ingest_port, self.metrics_port = ports or free_ports(2)
        self.namespace = namespace
        self.pod_name = pod_name
        argv = [
            sys.executable, "-m", "gpuwarden", "operator",
            f"--namespace={namespace}",
            f"--ingest-address=127.0.0.1:{self.ingest_port}",
            f"--metrics-address=127.0.0.1:{self.metrics_port}",
            f"--agent-service-account={namespace}:{AGENT_SA}",
            f"--peering={peering}",
            *([f"--priority={priority}"] if priority is not None else []),
            *extra_args,
        ]  # fmt: skip
        env = _python_env(cp, {"POD_NAME": pod_name, "POD_NAMESPACE": namespace})
        super().__init__(
            f"operator {pod_name}", argv, env, workdir / f"operator-{pod_name}-{time.time():.0f}.log"
        )

    @property
    def url(self) -> str:
        """The report endpoint."""
        return f"http://127.0.0.1:{self.ingest_port}/v1/reports"

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics, parsed ({} while it does not answer)."""
        try:
            status, text = http("GET", f"http://127.0.0.1:{self.metrics_port}/metrics")
        except OSError:
            return {}
        return parse_metrics(text) if status == 200 else {}

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def wait_ready(self, *, active: bool = True, timeout: float = 60) -> None:
        """Until /metrics answers and this replica acts (or stands by, with ``active=False``)."""
        want = 1.0 if active else 0.0
        wait_until(
            lambda: self.metrics().get("gpuwarden_operator_active") == want,
            timeout=timeout,
            what=f"{self.name} {'acting' if active else 'standing by'}",
            alive=self.alive,
        )


class Agent(Proc):
    """``python -m gpuwarden agent --backend scripted`` reporting to an operator."""

    def __init__(
        self, cp: ControlPlane, workdir: Path, scenario: Path, url: str, token_file: Path, node: str
    ) -> None:
        (port,) = free_ports(1)
        argv = [
            sys.executable, "-m", "gpuwarden", "agent",
            "--backend=scripted", f"--scenario={scenario}",
            f"--operator-url={url}", f"--token-file={token_file}", f"--node-name={node}",
            f"--listen=127.0.0.1:{port}", "--report-interval=1s", "--sample-interval=1s",
        ]  # fmt: skip
        super().__init__(
            f"agent {node}", argv, _python_env(cp, {}), workdir / f"agent-{node}-{time.time():.0f}.log"
        )


__all__ = [
    "AGENT_SA",
    "AUDIENCE",
    "GI",
    "Agent",
    "Operator",
    "Timeout",
    "apply",
    "apply_crds",
    "create_gpu_pod",
    "create_peering",
    "create_plain_pod",
    "events",
    "get",
    "gpu",
    "http",
    "parse_metrics",
    "pod",
    "service_account_token",
    "wait_until",
    "write_scenario",
    "write_token",
]

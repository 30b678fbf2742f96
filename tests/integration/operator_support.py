"""What the operator's end-to-end tests share: the operator and the agent as their own processes,
scripted scenarios written per test, GPU pods, ServiceAccount tokens, and polling the API.

Every wait polls the API server (or a process's endpoint) until a condition holds or a deadline
passes; nothing synchronises on a bare sleep.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import yaml
from controlplane import REPO_ROOT, ControlPlane, free_ports

if TYPE_CHECKING:
    # Only for prepare()'s signature: hack/ and bench/ import this module without pytest.
    import pytest

T = TypeVar("T")

AUDIENCE = "gpuwarden-operator"
AGENT_SA = "gpuwarden-agent"
AGENT_NODE = "gpu-node-1"
"""The node the tests' agent (and its GPU pods) run on."""
PEERING = "gpuwarden"
"""The KopfPeering every test's operators share (one namespace per test keeps them apart)."""
OPERATOR_POD = "gpuwarden-operator-0"
"""The pod name a lone operator replica runs as."""
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
    cp: ControlPlane,
    namespace: str,
    *,
    kind: str | None = None,
    name: str | None = None,
    reason: str | None = None,
) -> list[Any]:
    """Events in a namespace, optionally about one object and of one reason, oldest first."""
    items = get(cp, "events", "-n", namespace)["items"]
    if kind is not None:
        items = [e for e in items if e["involvedObject"].get("kind") == kind]
    if name is not None:
        items = [e for e in items if e["involvedObject"].get("name") == name]
    if reason is not None:
        items = [e for e in items if e["reason"] == reason]
    return sorted(items, key=lambda e: e.get("eventTime") or e["metadata"]["creationTimestamp"])


def policy_status(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    """A GPUMonitorPolicy's status ({} while the policy or its status does not exist)."""
    return dict((get(cp, "gpumonitorpolicy", name, "-n", namespace) or {}).get("status") or {})


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


def create_gpu_pod(
    cp: ControlPlane, namespace: str, name: str, labels: Mapping[str, str], node: str = AGENT_NODE
) -> None:
    """A pod that asks for a GPU; bound to a node by name (no scheduler), it stays Pending (no kubelet)."""
    apply(
        cp,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {
                "nodeName": node,
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


def service_account_token(
    cp: ControlPlane, namespace: str, name: str, audience: str = AUDIENCE, *, pod: str | None = None
) -> str:
    """A TokenRequest token (``kubectl create token``) for a ServiceAccount, created if missing;
    bound to ``pod`` (as a projected token is to its pod) when given, else to nothing."""
    if get(cp, "serviceaccount", name, "-n", namespace) is None:
        cp.kubectl("create", "serviceaccount", name, "-n", namespace, check=True)
    binding = ["--bound-object-kind=Pod", f"--bound-object-name={pod}"] if pod else []
    proc = cp.kubectl(
        "create", "token", name, "-n", namespace, f"--audience={audience}", "--duration=2h", *binding,
        check=True,
    )  # fmt: skip
    return proc.stdout.strip()


def create_node(cp: ControlPlane, name: str) -> None:
    """A Node object (no kubelet behind it): what a pod-bound token names as its pod's node."""
    apply(cp, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})


def agent_token(cp: ControlPlane, namespace: str, node: str = AGENT_NODE, audience: str = AUDIENCE) -> str:
    """The agent's token on ``node``, as its DaemonSet pod gets it: bound to an agent pod on that node.

    Creates the Node, the ServiceAccount and the (Pending) agent pod when missing.
    """
    create_node(cp, node)
    if get(cp, "serviceaccount", AGENT_SA, "-n", namespace) is None:
        cp.kubectl("create", "serviceaccount", AGENT_SA, "-n", namespace, check=True)
    pod = f"{AGENT_SA}-{node}"
    apply(
        cp,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": namespace, "labels": {"app": AGENT_SA}},
            "spec": {
                "nodeName": node,
                "serviceAccountName": AGENT_SA,
                "containers": [{"name": "agent", "image": "example.invalid/agent:1"}],
            },
        },
    )
    return service_account_token(cp, namespace, AGENT_SA, audience, pod=pod)


def write_token(path: Path, token: str) -> Path:
    path.write_text(token)
    path.chmod(0o600)
    return path


# -- policies -------------------------------------------------------------------------------------

IDLE_RULE: dict[str, Any] = {
    "name": "idle",
    "utilizationFloor": {"percent": 20, "for": "10s", "signal": "gpuUtil"},
}
"""Below 20% GPU utilization for 10 s: fires about ten seconds into an idle scenario."""


def monitor_policy(
    namespace: str,
    name: str,
    rules: Iterable[Mapping[str, Any]],
    *,
    selector: Mapping[str, Any] | None = None,
    actions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A GPUMonitorPolicy evaluated every second (the tests wait on it; the default 10 s is too slow).

    ``selector`` None selects every pod in the namespace; ``actions`` None leaves the CRD's defaults.
    """
    spec: dict[str, Any] = {
        "selector": dict(selector or {}),
        "evaluationInterval": "1s",
        "rules": [dict(rule) for rule in rules],
    }
    if actions is not None:
        spec["actions"] = dict(actions)
    return {
        "apiVersion": "gpuwarden.dev/v1alpha1",
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


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
    """A gpuwarden command in its own process group, its output in a log file.

    As a context manager it is stopped on the way out, so a failing test leaves no process behind.
    """

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

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

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


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` on a loopback port, parsed ({} while nothing answers there)."""
    try:
        status, text = http("GET", f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return {}
    return parse_metrics(text) if status == 200 else {}


LOCAL_COMMAND: tuple[str, ...] = (sys.executable, "-m", "gpuwarden")
"""The `gpuwarden` command of this checkout; tests/integration/images.py makes one that runs an image."""


class Operator(Proc):
    """``gpuwarden operator`` watching one namespace, on free loopback ports.

    ``command`` runs `gpuwarden` (default: this checkout's, in this interpreter); it is given the
    environment the operator needs (``KUBECONFIG``, ``POD_NAME``, ``POD_NAMESPACE``).
    """

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
        command: Sequence[str] = LOCAL_COMMAND,
    ) -> None:
        self.ingest_port, self.metrics_port = ports or free_ports(2)
        self.namespace = namespace
        self.pod_name = pod_name
        argv = [
            *command, "operator",
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
        return scrape(self.metrics_port)

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def evaluated(self, rounds: float, points: float = 0) -> bool:
        """Whether it has run ``rounds`` evaluations and ingested ``points`` samples (one scrape)."""
        metrics = self.metrics()
        return (
            metrics.get("gpuwarden_operator_evaluation_duration_seconds_count", 0.0) >= rounds
            and metrics.get("gpuwarden_operator_points_total", 0.0) >= points
        )

    def findings(self, policy: str, rule: str) -> float:
        """How many active findings it counts for one rule of one policy in its namespace."""
        labels = f'namespace="{self.namespace}",policy="{policy}",rule="{rule}"'
        return self.metric(f"gpuwarden_operator_findings{{{labels}}}")

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
    """``gpuwarden agent --backend scripted`` reporting to an operator (``command``: as for Operator)."""

    def __init__(
        self,
        cp: ControlPlane,
        workdir: Path,
        scenario: Path,
        url: str,
        token_file: Path,
        node: str,
        command: Sequence[str] = LOCAL_COMMAND,
        hook_socket: Path | None = None,
    ) -> None:
        (self.port,) = free_ports(1)
        argv = [
            *command, "agent",
            "--backend=scripted", f"--scenario={scenario}",
            f"--operator-url={url}", f"--token-file={token_file}", f"--node-name={node}",
            f"--listen=127.0.0.1:{self.port}", "--sample-interval=1s",
            # Per-process utilization as often as the device: a shared GPU's 10 s rule needs it.
            "--process-interval=1s",
            # The node's default path is one per host: the tests' agents listen only when asked.
            f"--hook-socket={hook_socket or ''}",
        ]  # fmt: skip
        super().__init__(
            f"agent {node}", argv, _python_env(cp, {}), workdir / f"agent-{node}-{time.time():.0f}.log"
        )

    def metrics(self) -> dict[str, float]:
        """The agent's /metrics, parsed ({} while it does not answer)."""
        return scrape(self.port)


@dataclass(frozen=True)
class Delivery:
    """What an agent took and still holds, and what its operator stored, read at one moment."""

    taken: int
    """Snapshots the agent sampled (``gpuwarden_agent_samples_total``)."""
    buffered: int
    """Snapshots not yet delivered (``gpuwarden_agent_report_buffer_snapshots``)."""
    stored: int
    """Readings the operator kept (``gpuwarden_operator_points_total``): one a snapshot for one GPU."""
    dropped: int
    """Snapshots the agent gave up on: pushed out of its full buffer, or refused (4xx)."""


_AGENT_STATE = (
    "gpuwarden_agent_samples_total",
    "gpuwarden_agent_last_sample_timestamp_seconds",
    "gpuwarden_agent_report_buffer_snapshots",
)


def delivery(agent: Agent, operator: Operator) -> Delivery | None:
    """The agent's books and the operator's, read together: None unless the agent took no snapshot
    and delivered nothing while the operator was read (its readings before and after agree).

    A snapshot is counted as taken a moment before it is buffered; the last sample's time moves with
    the buffer, so agreeing readings of both mean the three figures describe the same instant.
    """
    before = agent.metrics()
    stored = operator.metrics().get("gpuwarden_operator_points_total")
    after = agent.metrics()
    if stored is None or not before or any(before.get(k) != after.get(k) for k in _AGENT_STATE):
        return None
    dropped = sum(
        after.get(f'gpuwarden_agent_report_dropped_snapshots_total{{reason="{reason}"}}', 0.0)
        for reason in ("buffer_full", "rejected")
    )
    return Delivery(
        taken=int(after["gpuwarden_agent_samples_total"]),
        buffered=int(after["gpuwarden_agent_report_buffer_snapshots"]),
        stored=int(stored),
        dropped=int(dropped),
    )


# -- a namespace set up for an operator and its agent -----------------------------------------------


class InNamespace:
    """Reading what happened in one test's namespace (for :class:`Setup` and :class:`World`)."""

    cp: ControlPlane
    namespace: str

    def events(self, kind: str, name: str, reason: str | None = None) -> list[Any]:
        """The Events about one object in this namespace (of one reason), oldest first."""
        return events(self.cp, self.namespace, kind=kind, name=name, reason=reason)

    def policy_status(self, name: str) -> dict[str, Any]:
        return policy_status(self.cp, self.namespace, name)

    def violations(self, policy: str) -> list[Any]:
        """A policy's ``status.violations`` ([] while there are none)."""
        return list(self.policy_status(policy).get("violations") or [])

    def patch_spec(self, policy: str, spec: Mapping[str, Any]) -> int:
        """Merge ``spec`` into a policy's spec (``kubectl patch --type=merge``); its new generation."""
        patch = json.dumps({"spec": dict(spec)})
        _kubectl(
            self.cp, "patch", "gpumonitorpolicy", policy, "-n", self.namespace, "--type=merge", "-p", patch
        )
        return int(get(self.cp, "gpumonitorpolicy", policy, "-n", self.namespace)["metadata"]["generation"])

    def announcements(self, kind: str, name: str, reason: str) -> int:
        """How often the operator said ``reason`` about the object ``kind``/``name`` (this one, by uid).

        Counts the Events the operator created, each with its ``count``: a client that aggregates
        repeats, as client-go's recorder does, bumps one Event's count instead of creating another.
        """
        obj = get(self.cp, kind.lower(), name, "-n", self.namespace)
        assert obj is not None, f"{kind} {name} does not exist"
        uid = obj["metadata"]["uid"]
        return sum(
            int(e.get("count") or 1)
            for e in self.events(kind, name, reason)
            if e["involvedObject"].get("uid") == uid and e.get("reportingComponent") == "gpuwarden-operator"
        )


@dataclass(frozen=True)
class Setup(InNamespace):
    """A fresh namespace with the CRDs, the Kopf peering, GPU pods and the agent's token: what every
    end-to-end test needs before its operator starts. Per-test objects (policies, Deployments) are
    applied with :meth:`apply`.
    """

    cp: ControlPlane
    workdir: Path
    namespace: str
    token: str
    """The agent's token: its ServiceAccount's, audience gpuwarden-operator, bound to its pod on
    :data:`AGENT_NODE` (see :func:`agent_token`)."""
    token_file: Path
    """``token``, written where an agent's ``--token-file`` can read it."""

    def apply(self, obj: Mapping[str, Any]) -> None:
        apply(self.cp, obj)

    def scenario(self, name: str, gpus: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Path:
        return write_scenario(self.workdir / "scenario.yaml", name, gpus, pods)

    def operator(
        self,
        pod_name: str = OPERATOR_POD,
        *,
        priority: int | None = None,
        extra_args: Iterable[str] = (),
        ports: tuple[int, int] | None = None,
        command: Sequence[str] = LOCAL_COMMAND,
    ) -> Operator:
        """An operator replica in this namespace, in the shared peering (started, not yet ready)."""
        return Operator(
            self.cp,
            self.workdir,
            self.namespace,
            peering=PEERING,
            pod_name=pod_name,
            priority=priority,
            extra_args=extra_args,
            ports=ports,
            command=command,
        )

    def agent(
        self,
        scenario: Path,
        operator: Operator,
        command: Sequence[str] = LOCAL_COMMAND,
        *,
        node: str = AGENT_NODE,
        hook_socket: Path | None = None,
    ) -> Agent:
        """A scripted agent on ``node`` reporting to ``operator`` with its pod's token (on another
        node than :data:`AGENT_NODE`, a token bound to an agent pod made there), listening for
        training hooks on ``hook_socket`` if given."""
        token_file = self.token_file
        if node != AGENT_NODE:
            token = agent_token(self.cp, self.namespace, node)
            token_file = write_token(self.workdir / f"token-{node}", token)
        return Agent(self.cp, self.workdir, scenario, operator.url, token_file, node, command, hook_socket)


def prepare(
    cp: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *,
    gpu_pods: Iterable[str] = (),
    labels: Mapping[str, str] | None = None,
) -> Setup:
    """A :class:`Setup` named after the test file: workdir ``operator-<name>``, namespace ``gw-<name>-…``.

    ``gpu_pods`` are created with ``labels``; being Pending (no kubelet), they only exist for the
    operator to match against policies and attribute the agent's samples to.
    """
    workdir = tmp_path_factory.mktemp(f"operator-{name}")
    namespace = cp.create_namespace(f"gw-{name}-{secrets.token_hex(3)}")
    apply_crds(cp)
    for pod_name in gpu_pods:
        create_gpu_pod(cp, namespace, pod_name, labels or {})
    create_peering(cp, namespace, PEERING)
    token = agent_token(cp, namespace)
    return Setup(cp, workdir, namespace, token, write_token(workdir / "token", token))


def idle_pod(
    setup: Setup,
    scenario_name: str,
    gpu_uuid: str,
    *,
    actions: Mapping[str, Any] | None = None,
    busy_at: str | None = None,
    health: Iterable[Mapping[str, Any]] = (),
) -> Path:
    """Pod ``idle-0`` (app=x) on one GPU idling at about 3% (from ``busy_at`` on, busy at about 60%),
    the policy ``idle`` that flags it after 10 s (with ``actions``), and the agent's scenario for it.

    ``health``: the GPU's ``lost``/``recover`` events (see gpuwarden/sim/spec.py).
    """
    labels = {"app": "x"}
    create_gpu_pod(setup.cp, setup.namespace, "idle-0", labels)
    setup.apply(
        monitor_policy(
            setup.namespace, "idle", [IDLE_RULE], selector={"matchLabels": labels}, actions=actions
        )
    )
    utilization = [{"kind": "idle", "level": 3, "noise": 1}]
    if busy_at is not None:
        utilization.append({"kind": "idle", "level": 60, "noise": 2, "at": busy_at})
    card = gpu(gpu_uuid, 0, utilization, [{"kind": "idle", "level": "8Gi"}])
    card["health"] = [dict(event) for event in health]
    return setup.scenario(scenario_name, [card], [pod(setup.namespace, "idle-0", gpu_uuid, labels, 1234)])


@contextmanager
def operator_and_agent(
    setup: Setup, scenario: Path, *, extra_args: Iterable[str] = ()
) -> Iterator[tuple[Operator, Agent]]:
    """One acting operator, ready, and an agent reporting to it; both stopped on the way out."""
    with setup.operator(extra_args=extra_args) as operator:
        operator.wait_ready()
        with setup.agent(scenario, operator) as agent:
            yield operator, agent


@dataclass
class World(InNamespace):
    """What a module's end-to-end tests share: one operator and one agent over one :class:`Setup`."""

    cp: ControlPlane
    namespace: str
    operator: Operator
    agent: Agent

    def alive(self) -> str | None:
        """None while both run, else which one stopped and why (for :func:`wait_until`)."""
        return self.operator.alive() or self.agent.alive()


__all__ = [
    "AGENT_NODE",
    "AGENT_SA",
    "AUDIENCE",
    "GI",
    "IDLE_RULE",
    "LOCAL_COMMAND",
    "OPERATOR_POD",
    "PEERING",
    "Agent",
    "Delivery",
    "InNamespace",
    "Operator",
    "Proc",
    "Setup",
    "Timeout",
    "World",
    "agent_token",
    "apply",
    "apply_crds",
    "create_gpu_pod",
    "create_node",
    "create_peering",
    "create_plain_pod",
    "delivery",
    "events",
    "get",
    "gpu",
    "http",
    "idle_pod",
    "monitor_policy",
    "operator_and_agent",
    "parse_metrics",
    "pod",
    "policy_status",
    "prepare",
    "scrape",
    "service_account_token",
    "wait_until",
    "write_scenario",
    "write_token",
]

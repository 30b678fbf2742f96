"""``make demo-cluster``: the whole product on this machine, without a cloud or a GPU.

A throwaway etcd + kube-apiserver (the integration tests' :class:`ControlPlane`), the CRDs,
the scripted node's pods and the serving Deployment, then the operator and a scripted agent
as their own processes, the agent authenticated by a ServiceAccount token. The example
policy is applied with kubectl (plus two fast policies for the other namespaces, so that
everything shows within a few minutes), and as the scenario plays this prints the new
Events, ``kubectl get gpumonitorpolicies -A`` and the Deployment's replicas.

There is no kubelet, scheduler or controller-manager: the pods stay Pending (the agent's
scenario stands in for what runs on them) and a Deployment's ``spec.replicas`` is all a
scale changes. Everything started here is stopped on the way out, Ctrl-C included.

    hack/demo-cluster.sh [--duration 4m] [--every 15s] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The control-plane harness lives with the integration tests, which are not a package.
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO))

from controlplane import ControlPlane, free_ports, locate_binaries, running_control_plane  # noqa: E402
from operator_support import (  # noqa: E402
    Proc,
    agent_token,
    apply,
    apply_crds,
    create_gpu_pod,
    get,
    http,
    parse_metrics,
    wait_until,
    write_token,
)

from gpuwarden.sim.scenario import load_scenario  # noqa: E402
from gpuwarden.units import parse_duration  # noqa: E402

SCENARIO = REPO / "gpuwarden" / "sim" / "scenarios" / "e2e-fast.yaml"
EXAMPLE_POLICY = REPO / "examples" / "gpumonitorpolicy.yaml"
SYSTEM_NAMESPACE = "gpuwarden-system"
AGENT_SA = "gpuwarden-agent"
NODE = "gpu-node-1"

# The example policy covers the serving Deployment (namespace inference). These two cover
# the scenario's other pods, with windows short enough to show within the demo's minutes.
FAST_POLICIES = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: notebooks, namespace: research}
spec:
  selector: {}
  evaluationInterval: 2s
  rules:
    - name: idle-gpu
      utilizationFloor: {percent: 20, for: 30s, noiseFloor: 2}
---
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: training-jobs, namespace: training}
spec:
  selector: {}
  evaluationInterval: 2s
  rules:
    - name: leak
      memoryGrowth: {rate: 1Gi/m, window: 1m, minFit: 0.8}
    - name: near-oom
      memoryCeiling: {percent: 90, for: 30s}
"""


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    # Turned into KeyboardInterrupt so that every `finally` below runs and stops what it started.
    raise KeyboardInterrupt


class Printer:
    """Prints, as time goes on, what an operator of the cluster would look at."""

    def __init__(self, cp: ControlPlane, started: float) -> None:
        self.cp = cp
        self.started = started
        self.seen: set[str] = set()

    def stamp(self) -> str:
        s = int(time.monotonic() - self.started)
        return f"t+{s // 60}:{s % 60:02d}"

    def round(self) -> None:
        """New Events since the last round; the policies; the Deployment's replicas."""
        print(f"\n== {self.stamp()}  kubectl get events -A (new ones)")
        items = (get(self.cp, "events", "-A") or {}).get("items", [])
        fresh = [e for e in items if e["metadata"]["uid"] not in self.seen]
        fresh.sort(key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "")
        for e in fresh:
            self.seen.add(e["metadata"]["uid"])
            obj = e["involvedObject"]
            where = f"{e['metadata']['namespace']}/{obj.get('kind', '')}/{obj.get('name', '')}"
            print(f"  {e.get('type', ''):<8} {e.get('reason', ''):<28} {where}: {e.get('message', '')}")
        if not fresh:
            print("  (none)")
        print(f"== {self.stamp()}  kubectl get gpumonitorpolicies -A")
        print(_indent(self.cp.kubectl("get", "gpumonitorpolicies", "-A").stdout))
        deploy = get(self.cp, "deployment", "llm-server", "-n", "inference") or {}
        print(
            f"== {self.stamp()}  deployment inference/llm-server: spec.replicas {deploy['spec']['replicas']}"
        )
        sys.stdout.flush()


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.rstrip().splitlines())


def _env(cp: ControlPlane, extra: Mapping[str, str]) -> dict[str, str]:
    env = cp.env
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _kubectl_apply(cp: ControlPlane, *args: str, input: str | None = None) -> None:
    print(f"$ kubectl apply {' '.join(args)}")
    proc = cp.kubectl("apply", *args, input=input)
    print(_indent(proc.stdout or proc.stderr))
    if proc.returncode != 0:
        raise SystemExit(f"kubectl apply failed: {proc.stderr.strip()}")


def _deployment() -> dict[str, Any]:
    labels = {"app": "llm-server"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm-server", "namespace": "inference"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "server", "image": "example.invalid/vllm:1"}]},
            },
        },
    }


def _operator_active(metrics_port: int) -> bool:
    try:
        status, text = http("GET", f"http://127.0.0.1:{metrics_port}/metrics")
    except OSError:
        return False
    return status == 200 and parse_metrics(text).get("gpuwarden_operator_active") == 1.0


def play(cp: ControlPlane, workdir: Path, args: argparse.Namespace) -> int:
    """Set up the cluster's objects, run the operator and the agent, print as the scenario plays."""
    scenario = load_scenario(args.scenario)
    apply_crds(cp)
    namespaces = sorted({p.ref.namespace for p in scenario.pods} | {SYSTEM_NAMESPACE})
    for ns in namespaces:
        cp.create_namespace(ns)
    for p in scenario.pods:
        create_gpu_pod(cp, p.ref.namespace, p.ref.name, p.labels)
    apply(cp, _deployment())
    apply(cp, {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "gpuwarden"}})
    token = write_token(workdir / "agent-token", agent_token(cp, SYSTEM_NAMESPACE, NODE))
    print(
        f"namespaces {', '.join(namespaces)}; {len(scenario.pods)} GPU pods on {NODE} (Pending: no kubelet)"
    )

    ingest, metrics, agent_port = free_ports(3)
    operator = Proc(
        "operator",
        [
            sys.executable, "-m", "gpuwarden", "operator", "--all-namespaces",
            f"--ingest-address=127.0.0.1:{ingest}", f"--metrics-address=127.0.0.1:{metrics}",
            f"--agent-service-account={SYSTEM_NAMESPACE}:{AGENT_SA}", "--peering=gpuwarden",
        ],
        _env(cp, {"POD_NAME": "gpuwarden-operator-0", "POD_NAMESPACE": SYSTEM_NAMESPACE}),
        workdir / "operator.log",
    )  # fmt: skip
    agent: Proc | None = None
    try:
        wait_until(lambda: _operator_active(metrics), timeout=90, what="the operator", alive=operator.alive)
        print(f"operator acting (pid {operator.proc.pid}); log {operator.log_path}")
        _kubectl_apply(cp, "-f", str(EXAMPLE_POLICY))
        _kubectl_apply(cp, "-f", "-", input=FAST_POLICIES)
        agent = Proc(
            "agent",
            [
                sys.executable, "-m", "gpuwarden", "agent", "--backend=scripted",
                f"--scenario={args.scenario}",
                f"--operator-url=http://127.0.0.1:{ingest}/v1/reports", f"--token-file={token}",
                f"--node-name={NODE}", f"--listen=127.0.0.1:{agent_port}",
                "--hook-socket=",  # no training hooks in the demo
            ],
            _env(cp, {}),
            workdir / "agent.log",
        )  # fmt: skip
        print(f"agent on {NODE} playing {scenario.name!r} (pid {agent.proc.pid}); log {agent.log_path}")
        print(f"\nIn another terminal: export KUBECONFIG={cp.kubeconfig}; kubectl get events -A -w")
        printer = Printer(cp, time.monotonic())
        deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
        while time.monotonic() < deadline:
            time.sleep(min(args.every, max(0.0, deadline - time.monotonic())))  # a print cadence, not a wait
            if (dead := operator.alive() or agent.alive()) is not None:
                print(f"\n{dead}", file=sys.stderr)
                return 1
            printer.round()
        return 0
    finally:
        if agent is not None:
            agent.stop()
        operator.stop()


def main() -> int:
    """Run the demo cluster; 0 after ``--duration``, 130 on Ctrl-C, 1 if a component died."""
    parser = argparse.ArgumentParser(prog="hack/demo-cluster.sh", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--duration", type=_duration, default=240.0, help="how long to play (4m; 0s: until Ctrl-C)"
    )
    parser.add_argument("--every", type=_duration, default=15.0, help="print every (15s)")
    parser.add_argument("--scenario", default=str(SCENARIO), help="the agent's scenario (e2e-fast)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, kubeconfig)")
    args = parser.parse_args()
    # SIGINT too: a shell starts background jobs with it ignored, and Ctrl-C must still clean up.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_on_signal)

    print("control plane: locating (building, the first time) kube-apiserver, etcd and kubectl ...")
    binaries = locate_binaries()
    workdir = Path(tempfile.mkdtemp(prefix="gpuwarden-demo-cluster-"))
    try:
        with running_control_plane(binaries, workdir / "controlplane") as cp:
            print(f"control plane: {cp.server} (ready in {cp.startup_seconds:.1f} s); work dir {workdir}")
            return play(cp, workdir, args)
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return 130
    finally:
        # Every process is stopped by now (the `finally`s above); the files go unless asked to stay.
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""``gpuwarden agent``: the node agent (one per GPU node, a DaemonSet).

It samples the GPUs (NVML, or a scripted scenario when asked for explicitly), puts pod
names on the samples (kubelet PodResources + /proc cgroups) and what training hooks told it
(``--hook-socket``), serves ``/metrics``,
``/healthz`` and ``/readyz``, and sends the snapshots to the operator. SIGTERM or
SIGINT stops it cleanly; exit code 0 then, 1 if the backend cannot start or a
background task dies, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from gpuwarden.agent.app import serve
from gpuwarden.agent.attribution import NVIDIA_DRIVER
from gpuwarden.agent.backend import BackendError, DeviceBackend
from gpuwarden.agent.config import (
    DEFAULT_HOOK_SOCKET,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_TOKEN_FILE,
    HOOK_SOCKET_ENV,
    AgentConfig,
    UsageError,
    duration,
)
from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.agent.scrape import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT
from gpuwarden.agent.sender import DEFAULT_BUFFER_LIMIT, DEFAULT_REPORT_INTERVAL
from gpuwarden.sim.scenarios import PACKAGED


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the agent's flags."""
    parser.description = "The node agent: samples the GPUs, serves /metrics, reports to the operator."
    add = parser.add_argument
    add(
        "--backend",
        choices=("nvml", "scripted"),
        default="nvml",
        help="where readings come from: the GPUs through NVML (default), or a scripted scenario "
        "(demos and end-to-end tests only; never chosen automatically)",
    )
    add(
        "--scenario",
        metavar="FILE",
        help=f"scenario file for --backend scripted, or a packaged one by name ({', '.join(PACKAGED)})",
    )
    add(
        "--attribution",
        choices=("kubelet", "scenario"),
        default=None,
        help="where pods come from: the kubelet's PodResources API and /proc (the default with "
        "--backend nvml), or the scenario's own pods (the default with --backend scripted; nvml "
        "has no scenario). A scripted backend on a real node takes kubelet: the scripted GPUs are "
        "then attributed to the pods the kubelet allocated them to",
    )
    add(
        "--dra-drivers",
        default=NVIDIA_DRIVER,
        metavar="NAME[,NAME...]",
        help=f"DRA drivers whose allocated devices are GPUs ({NVIDIA_DRIVER}); each device is resolved "
        "to a UUID through its `uuid` attribute in this node's ResourceSlices (resource.k8s.io/v1, "
        f"watched with the pod's token where it has one), and for {NVIDIA_DRIVER} also by its name "
        "(gpu-<minor>) through NVML; empty: DRA allocations are not attributed",
    )
    add(
        "--dra-resource-slices",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="watch this node's ResourceSlices to resolve DRA devices (needs list/watch on resourceslices); "
        "--no-dra-resource-slices: by name only",
    )
    add("--node-name", default="", help="this node's name (default: $NODE_NAME)")
    add(
        "--operator-url",
        default="",
        metavar="URL",
        help="the operator's report endpoint, e.g. "
        "https://gpuwarden-operator-ingest.gpuwarden-system.svc:8443/v1/reports; empty: don't report. "
        "An http:// URL sends the token in clear: only where asked for explicitly",
    )
    add(
        "--operator-ca-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="CA bundle (PEM) the operator's certificate must chain to (default: the system's trust store)",
    )
    add(
        "--operator-server-name",
        default="",
        metavar="NAME",
        help="the name the operator's certificate must carry (default: the host of --operator-url); "
        "checked as well on the replica a sharded operator redirects reports to, at its pod IP",
    )
    add(
        "--token-file",
        type=Path,
        default=DEFAULT_TOKEN_FILE,
        metavar="PATH",
        help=f"ServiceAccount token sent with reports ({DEFAULT_TOKEN_FILE})",
    )
    intervals = (
        ("--sample-interval", 1.0, "device sampling period (1s)"),
        ("--process-interval", 10.0, "per-process SM utilization period (10s; it costs ~2 ms a GPU)"),
        (
            "--report-interval",
            DEFAULT_REPORT_INTERVAL,
            "least time between two reports (500ms): a snapshot is sent as soon as it is taken, "
            "unless a report left less than this long ago; then it goes when this much has passed, "
            "with whatever else was taken meanwhile",
        ),
        ("--attribution-interval", 5.0, "how often pod allocations and cgroups are re-read (5s)"),
    )
    for flag, default, text in intervals:
        add(flag, type=duration, default=default, metavar="DURATION", help=text)
    add(
        "--buffer-limit",
        type=_positive_int,
        default=DEFAULT_BUFFER_LIMIT,
        metavar="N",
        help="snapshots kept while the operator is unreachable; the oldest are dropped first "
        f"({DEFAULT_BUFFER_LIMIT})",
    )
    add(
        "--listen",
        default=":9400",
        metavar="[HOST]:PORT",
        help="address of /metrics, /healthz and /readyz (:9400)",
    )
    add(
        "--hook-socket",
        default=os.environ.get(HOOK_SOCKET_ENV, str(DEFAULT_HOOK_SOCKET)),
        metavar="PATH",
        help=f"Unix socket training hooks (gpuwarden.hook) write their readings to (default: "
        f"${HOOK_SOCKET_ENV}, else {DEFAULT_HOOK_SOCKET}); empty: no hook socket",
    )
    add(
        "--service-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scrape the metrics endpoints of the pods on this node that the operator's scrape plan names "
        "(a policy's serviceMetrics), checked against this node's pod list, and send what its rules read "
        "with the reports; --no-service-metrics: scrape nothing",
    )
    add(
        "--scrape-timeout",
        type=duration,
        default=DEFAULT_TIMEOUT,
        metavar="DURATION",
        help=f"the longest one scrape may take, and at most half its interval ({DEFAULT_TIMEOUT:g}s)",
    )
    add(
        "--scrape-concurrency",
        type=_positive_int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help=f"scrapes in flight at once ({DEFAULT_CONCURRENCY})",
    )
    paths = (
        ("--pod-resources-socket", DEFAULT_POD_RESOURCES_SOCKET, "the kubelet's PodResources socket"),
        ("--proc-root", Path("/proc"), "the host's /proc (the pod needs hostPID)"),
        ("--cgroup-root", Path("/sys/fs/cgroup"), "the host's cgroup tree"),
    )
    for flag, path, text in paths:
        add(flag, type=Path, default=path, metavar="PATH", help=f"{text} ({path})")
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log verbosity")


def open_backend(config: AgentConfig) -> DeviceBackend:
    """The backend the flags ask for, opened; :class:`BackendError` if it cannot start."""
    backend: DeviceBackend
    if config.backend == "scripted":
        # Imported here, not at the top: the scenario models and YAML are memory that the
        # nvml backend, the one on every node, never needs.
        from gpuwarden.agent.scripted import ScriptedBackend

        assert config.scenario is not None  # from_args checked it
        backend = ScriptedBackend.load(config.scenario)
    else:
        backend = NvmlBackend(proc_root=config.proc_root, first_process_window=config.process_interval)
    backend.open()
    return backend


# In a pod the agent requests no GPU, so it sees one only if the runtime injects the driver for it: which
# chart value makes that happen depends on the cluster (docs/install.md, "Where the agent sees no GPU").
_POD_HINT = """
  In a pod, the agent (which requests no GPU) sees the GPUs only if the container runtime injects the
  driver's libnvidia-ml and the /dev/nvidia* nodes for it. Set the chart value your nodes need:
    agent.runtimeClassName=nvidia        the NVIDIA runtime is not the node's default (containerd with the
                                         toolkit; the NVIDIA GPU Operator)
    agent.gpuAccess.mode=cdi             a CDI-only runtime (containerd enable_cdi, CRI-O, GPU Operator
                                         with cdi.enabled)
    agent.gpuAccess.mode=privileged      the toolkit refuses unprivileged pods (EKS Bottlerocket); with
      agent.gpuAccess.driverHostPath=/home/kubernetes/bin/nvidia   on GKE's own driver installer (COS, Ubuntu)
  Recipes per cluster: https://github.com/gpuwarden/gpuwarden/blob/main/docs/install.md#where-the-agent-sees-no-gpu"""

_HOST_HINT = """
  The nvml backend (the default) reads the GPUs through the NVIDIA driver and does not fall
  back to anything else. To play a scripted scenario instead (demos, tests), run with
  --backend scripted --scenario FILE (e.g. --scenario demo)."""


def no_gpu_hint(*, in_pod: bool) -> str:
    """What to do when NVML finds no GPU: in a pod, the chart values that give the agent one."""
    return _POD_HINT if in_pod else _HOST_HINT


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT; the process's exit code."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = AgentConfig.from_args(args)
    except UsageError as exc:
        print(f"gpuwarden agent: {exc}", file=sys.stderr)
        return 2
    try:
        backend = open_backend(config)
    except BackendError as exc:
        hint = no_gpu_hint(in_pod="KUBERNETES_SERVICE_HOST" in os.environ) if config.backend == "nvml" else ""
        print(f"gpuwarden agent: {config.backend} backend cannot start: {exc}{hint}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(serve(config, backend))
    finally:
        backend.close()

"""The agent's settings: :class:`AgentConfig`, checked, and what its flags and local mode's share
(the usage error, durations, ``[HOST]:PORT``, the default paths)."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.sim.scenarios import PACKAGED
from gpuwarden.units import parse_duration

DEFAULT_TOKEN_FILE = Path("/var/run/secrets/gpuwarden/token")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_HOOK_SOCKET = Path("/run/gpuwarden/hook.sock")
HOOK_SOCKET_ENV = "GPUWARDEN_HOOK_SOCKET"
"""Where training hooks connect; the hook (gpuwarden.hook) reads the same variable, same default."""


class UsageError(ValueError):
    """A flag (or a file one names) that makes no sense; the message says which and why (exit code 2).

    Local mode (``gpuwarden demo``, ``watch``) raises it too, through :mod:`gpuwarden.local.options`.
    """


def duration(text: str) -> float:
    """An argparse type: a policy-style duration (``1s``, ``500ms``, ``2m``), longer than zero.

    Every interval flag of the agent and of local mode is read by this one function.
    """
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be longer than zero")
    return seconds


def parse_listen(text: str) -> tuple[str | None, int]:
    """``:9400`` (every interface), ``127.0.0.1:9400`` or ``[::1]:9400`` → (host or None, port).

    ``gpuwarden watch --listen`` takes the same syntax through this function.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen {text!r}: expected [HOST]:PORT, e.g. :9400 or 127.0.0.1:9400")
    host = host.removeprefix("[").removesuffix("]")
    return (host or None), int(port)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The agent's settings, checked; built from the flags (:func:`add_arguments`, where their
    defaults are declared) and the environment by :meth:`from_args`, as the operator's
    :class:`~gpuwarden.operator.config.OperatorConfig` is."""

    backend: str
    """Where readings come from: ``nvml`` (the GPUs), or ``scripted`` (a scenario; demos and tests)."""
    scenario: str | None
    """The scenario file, or a packaged scenario's name, of the scripted backend."""
    attribution: str
    """Where pods come from: ``kubelet`` (PodResources and /proc), or ``scenario`` (its own pods)."""
    node: str
    """This node's name: ``--node-name``, else ``NODE_NAME``, else the host name (then only a label)."""
    operator_url: str
    """The operator's report endpoint; empty: no reports."""
    token_file: Path
    """The projected ServiceAccount token sent with each report (re-read every time)."""
    operator_ca_file: Path | None
    """The CA bundle the operator's certificate must chain to; None: the system's trust store."""
    operator_server_name: str | None
    """The name the operator's certificate must carry; None: the report URL's host. Set, it is
    checked on every replica a sharded operator sends reports to (at its pod IP) as well."""
    sample_interval: float
    """Seconds between two device samples."""
    process_interval: float
    """Seconds between two per-process SM utilization reads (they cost ~2 ms a GPU)."""
    report_interval: float
    """The least seconds between the starts of two rounds of reports."""
    attribution_interval: float
    """Seconds between two reads of the pod allocations and cgroups."""
    dra_drivers: frozenset[str]
    """DRA drivers whose devices are GPUs; empty: DRA allocations are not attributed."""
    dra_resource_slices: bool
    """Whether to watch the node's ResourceSlices (with the pod's API token) to resolve DRA devices."""
    buffer_limit: int
    """Snapshots kept while the operator is unreachable; the oldest go first."""
    host: str | None
    """The host /metrics, /healthz and /readyz listen on (None: every interface)."""
    port: int
    """Their port."""
    pod_resources_socket: Path
    """The kubelet's PodResources socket."""
    proc_root: Path
    """The host's /proc (the pod needs hostPID)."""
    cgroup_root: Path
    """The host's cgroup tree."""
    hook_socket: Path | None
    """Where training hooks (gpuwarden.hook) connect; None: no hook socket (``--hook-socket ""``)."""
    service_metrics: bool
    """Whether to scrape the pods the operator's plan names (their own metrics, issue 30)."""
    scrape_timeout: float
    """Seconds one scrape may take at most (and never more than half its interval)."""
    scrape_concurrency: int
    """Scrapes in flight at once."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> AgentConfig:
        """Check the flags and ``env`` (default: the process's) together; :class:`UsageError` names
        the flag or variable at fault."""
        env = os.environ if env is None else env
        if args.backend == "scripted" and not args.scenario:
            raise UsageError(
                f"--backend scripted needs --scenario FILE (or a packaged name: {', '.join(PACKAGED)})"
            )
        if args.backend == "nvml" and args.scenario:
            raise UsageError("--scenario only applies to --backend scripted")
        if args.backend == "nvml" and args.attribution == "scenario":
            raise UsageError("--attribution scenario needs --backend scripted")
        attribution = args.attribution or ("scenario" if args.backend == "scripted" else "kubelet")
        node = args.node_name or env.get("NODE_NAME", "")
        if not node:
            if args.operator_url:
                raise UsageError("reporting to --operator-url needs --node-name (or $NODE_NAME)")
            node = socket.gethostname()  # only labels /metrics then
        tls_flags = [
            f
            for f, v in (
                ("--operator-ca-file", args.operator_ca_file),
                ("--operator-server-name", args.operator_server_name),
            )
            if v
        ]
        if tls_flags and not args.operator_url.startswith("https://"):
            raise UsageError(f"{tls_flags[0]} needs an https:// --operator-url")
        if args.operator_ca_file and not args.operator_ca_file.is_file():
            raise UsageError(f"--operator-ca-file {args.operator_ca_file}: no such file")
        host, port = parse_listen(args.listen)
        return cls(
            backend=args.backend,
            scenario=args.scenario,
            attribution=attribution,
            node=node,
            operator_url=args.operator_url,
            token_file=args.token_file,
            operator_ca_file=args.operator_ca_file,
            operator_server_name=args.operator_server_name or None,
            sample_interval=args.sample_interval,
            process_interval=args.process_interval,
            report_interval=args.report_interval,
            attribution_interval=args.attribution_interval,
            dra_drivers=frozenset(d.strip() for d in args.dra_drivers.split(",") if d.strip()),
            dra_resource_slices=args.dra_resource_slices,
            buffer_limit=args.buffer_limit,
            host=host,
            port=port,
            pod_resources_socket=args.pod_resources_socket,
            proc_root=args.proc_root,
            cgroup_root=args.cgroup_root,
            hook_socket=Path(args.hook_socket) if args.hook_socket else None,
            service_metrics=args.service_metrics,
            scrape_timeout=args.scrape_timeout,
            scrape_concurrency=args.scrape_concurrency,
        )

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
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gpuwarden.agent.attribution import (
    NVIDIA_DRIVER,
    CgroupReader,
    DraResolver,
    NodePods,
    PodAttributor,
    PodResourcesClient,
    ResourceSlices,
    ResourceSlicesError,
    SlicesState,
    nvml_minor_numbers,
)
from gpuwarden.agent.backend import BackendError, DeviceBackend
from gpuwarden.agent.hookattach import HookStage
from gpuwarden.agent.hooksocket import HookReadings, HookServer, HookSocketError
from gpuwarden.agent.http import CleanupContext, background_task, build_app, listen
from gpuwarden.agent.metrics import DraMetrics, HookMetrics, PodResourcesCollector, build_registry
from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.agent.sender import DEFAULT_BUFFER_LIMIT, DEFAULT_REPORT_INTERVAL, ReportSender
from gpuwarden.agent.snapshots import Attributor, Sampler, SnapshotRing
from gpuwarden.policy.units import parse_duration
from gpuwarden.sim.scenarios import PACKAGED
from gpuwarden.wire.node import Snapshot

log = logging.getLogger("gpuwarden.agent")

DEFAULT_TOKEN_FILE = Path("/var/run/secrets/gpuwarden/token")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_HOOK_SOCKET = Path("/run/gpuwarden/hook.sock")
HOOK_SOCKET_ENV = "GPUWARDEN_HOOK_SOCKET"
"""Where training hooks connect; the hook (gpuwarden.hook) reads the same variable, same default."""
RING_SECONDS = 300.0
"""How much recent history the agent keeps in memory, whatever the sampling interval."""


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def parse_listen(text: str) -> tuple[str | None, int]:
    """``:9400`` (every interface), ``127.0.0.1:9400`` or ``[::1]:9400`` → (host or None, port).

    ``gpuwarden watch --listen`` takes the same syntax through this function.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen {text!r}: expected [HOST]:PORT, e.g. :9400 or 127.0.0.1:9400")
    host = host.removeprefix("[").removesuffix("]")
    return (host or None), int(port)


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
        help="the operator's report endpoint, e.g. http://gpuwarden-operator:8443/v1/reports; "
        "empty: don't report",
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
    paths = (
        ("--pod-resources-socket", DEFAULT_POD_RESOURCES_SOCKET, "the kubelet's PodResources socket"),
        ("--proc-root", Path("/proc"), "the host's /proc (the pod needs hostPID)"),
        ("--cgroup-root", Path("/sys/fs/cgroup"), "the host's cgroup tree"),
    )
    for flag, path, text in paths:
        add(flag, type=Path, default=path, metavar="PATH", help=f"{text} ({path})")
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log verbosity")


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
        host, port = parse_listen(args.listen)
        return cls(
            backend=args.backend,
            scenario=args.scenario,
            attribution=attribution,
            node=node,
            operator_url=args.operator_url,
            token_file=args.token_file,
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
        )


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
        hint = (
            "\n  The nvml backend (the default) reads the GPUs through the NVIDIA driver and does not fall"
            "\n  back to anything else. To play a scripted scenario instead (demos, tests), run with"
            "\n  --backend scripted --scenario FILE (e.g. --scenario demo)."
            if config.backend == "nvml"
            else ""
        )
        print(f"gpuwarden agent: {config.backend} backend cannot start: {exc}{hint}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(serve(config, backend))
    finally:
        backend.close()


class _Closer:
    """What the attributor opened (kubelet channel, API session), closed on the way out."""

    def __init__(self) -> None:
        self.client: PodResourcesClient | None = None
        self.pods: NodePods | None = None
        self.slices: ResourceSlices | None = None

    async def close(self) -> None:
        for closeable in (self.client, self.pods, self.slices):
            if closeable is not None:
                try:
                    await closeable.close()
                except Exception as exc:
                    log.warning("closing %s: %s", type(closeable).__name__, exc)


def _attributor(
    config: AgentConfig, backend: DeviceBackend, closer: _Closer, dra: DraResolver | None = None
) -> Attributor:
    if config.attribution == "scenario":
        # Loaded already (whoever built the backend imported it); here for the reason given
        # in open_backend.
        from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend

        assert isinstance(backend, ScriptedBackend)  # open_backend opened it from this config
        return ScenarioAttributor(backend)
    closer.client = PodResourcesClient(config.pod_resources_socket, dra_drivers=config.dra_drivers)
    # None outside a cluster or without an API token: PodResources alone then (logged by NodePods).
    closer.pods = NodePods.in_cluster(config.node)
    return PodAttributor(
        closer.client,
        cgroups=CgroupReader(config.proc_root, config.cgroup_root),
        pod_lookup=closer.pods,
        dra=dra,
    )


def _dra(config: AgentConfig, closer: _Closer, metrics: DraMetrics) -> DraResolver:
    # None without an API token: DRA devices then resolve by name only (logged).
    closer.slices = ResourceSlices.in_cluster(config.node) if config.dra_resource_slices else None
    return DraResolver(
        closer.slices,
        # Minor numbers are the real GPUs'; a scripted backend has none to offer.
        minor_numbers=nvml_minor_numbers if config.backend == "nvml" else None,
        on_unresolved=metrics.count_unresolved,
    )


async def serve(
    config: AgentConfig,
    backend: DeviceBackend,
    *,
    listening: Callable[[list[str]], None] | None = None,
) -> int:
    """Run the agent on an opened backend until SIGTERM/SIGINT or a background task dies.

    ``listening`` is called with the bound addresses once the HTTP server is up.
    """
    loop = asyncio.get_running_loop()
    ring = SnapshotRing(capacity=max(1, int(RING_SECONDS / config.sample_interval)))
    registry, metrics = build_registry(ring, backend=backend.name, node=config.node)
    closer = _Closer()
    dra: DraResolver | None = None
    if config.attribution == "kubelet" and config.dra_drivers:

        def slices_state() -> SlicesState:
            return closer.slices.state if closer.slices is not None else SlicesState.NOT_LISTED

        dra = _dra(config, closer, DraMetrics(registry, slices_state))
    attributor = _attributor(config, backend, closer, dra)
    if isinstance(attributor, PodAttributor):
        registry.register(PodResourcesCollector(lambda: attributor.pod_resources_state))
    sender = (
        ReportSender(
            url=config.operator_url,
            node=config.node,
            token_path=config.token_file,
            interval=config.report_interval,
            buffer_limit=config.buffer_limit,
            registry=registry,
        )
        if config.operator_url
        else None
    )

    def deliver(snapshot: Snapshot) -> None:
        metrics.count_xids(snapshot)  # XIDs are events: each is counted as its snapshot passes
        if sender is not None:
            sender.submit(snapshot)

    annotate = attributor.annotate
    hooks: HookServer | None = None
    if config.hook_socket is not None:
        readings = HookReadings()
        hook_metrics = HookMetrics(registry, readings, time.time)
        hooks = HookServer(config.hook_socket, readings, events=hook_metrics)
        stage = HookStage(readings, hook_metrics)

        def annotate(snapshot: Snapshot) -> Snapshot:
            return stage.annotate(attributor.annotate(snapshot))

    sampler = Sampler(
        backend,
        ring,
        interval=config.sample_interval,
        process_interval=config.process_interval,
        annotate=annotate,
        deliver=deliver,
        events=metrics,
    )

    stop = asyncio.Event()
    failed: list[str] = []

    def on_exit(name: str, error: BaseException | None) -> None:
        failed.append(name)
        stop.set()

    async def refresh_attribution() -> None:
        while True:
            await asyncio.sleep(config.attribution_interval)
            try:
                await attributor.refresh()
            except Exception:
                log.exception("refreshing pod attribution failed")
                metrics.error("attribution")

    # Started in this order and stopped in reverse: sampling stops first, the sender last,
    # so that what was sampled before SIGTERM still has its chance to go out.
    background: list[CleanupContext] = []
    if sender is not None:
        background.append(background_task("sender", sender.run, on_exit=on_exit))
    background.append(background_task("attribution", refresh_attribution, on_exit=on_exit))
    if closer.slices is not None:
        background.append(background_task("resource slices", closer.slices.run, on_exit=on_exit))
    background.append(background_task("sampler", sampler.run, on_exit=on_exit))

    if closer.slices is not None:
        # Before the first refresh, so that DRA devices resolve from the start instead of being
        # counted as unresolvable while the watch (started with the other tasks below) lists.
        with contextlib.suppress(ResourceSlicesError, TimeoutError):  # logged by list(); the watch retries
            await asyncio.wait_for(closer.slices.list(), timeout=max(5.0, config.attribution_interval))
    try:
        # Allocations first, so that the first snapshot already carries pod names.
        await asyncio.wait_for(attributor.refresh(), timeout=max(5.0, config.attribution_interval))
    except Exception as exc:
        log.warning(
            "first attribution refresh failed (%s); retrying every %ss", exc, config.attribution_interval
        )
        metrics.error("attribution")

    if hooks is not None:
        try:
            await hooks.start()
        except HookSocketError as exc:
            # The GPUs' readings matter more than the hooks': run on without them, loudly.
            log.error("%s; training hooks cannot reach this agent", exc)
            hooks = None
        else:
            log.info("training hooks connect to %s", hooks.path)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner: web.AppRunner | None = None
    try:
        runner, addresses = await listen(
            build_app(registry, ring, background=background), config.host, config.port
        )
        log.info(
            "agent on node %s, backend %s, listening on %s; reporting to %s",
            config.node,
            backend.name,
            ", ".join(addresses),
            config.operator_url or "nobody",
        )
        if listening is not None:
            listening(addresses)
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if runner is not None:
            await runner.cleanup()
        if hooks is not None:
            await hooks.close()
        await closer.close()
    if failed:
        log.error("stopped because %s ended", ", ".join(failed))
        return 1
    log.info("stopped")
    return 0

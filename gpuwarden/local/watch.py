"""``gpuwarden watch --policy FILE``: the policy engine on this host's GPUs, without Kubernetes.

The agent's sampling loop reads the GPUs through NVML (or, only when ``--scenario`` asks
for it, a scripted scenario), every ``--interval``; each snapshot goes through a
:class:`~gpuwarden.local.session.Session` whose subjects are host processes, shown by
PID and command line (the executable's basename and arguments, cut at 60 characters in
lines, the table and /metrics labels; whole, once, in the summary). ``/metrics`` (the agent's
series, plus ``gpuwarden_local_finding_active``) is served on ``--listen``. Training hooks
(:mod:`gpuwarden.hook`) reach it on ``--hook-socket``, as they reach the agent on a node; the path
is printed at the start.

``--service-metrics URL`` (repeatable) scrapes an inference server's own Prometheus metrics at the
policies' pace (:class:`~gpuwarden.local.scrapes.ServiceWatcher`: the agent's bounded fetch and
compaction), so the service rules (those that read the pods' own metrics) judge it:
each URL is a subject of its own, ``service/<host:port>``.

Host processes have no namespace and no labels, so every policy in the file judges
every process: selectors and namespaces are set aside, and so are scale actions (there
is no Deployment to scale); ``watch`` says so when it starts.

Judging an inference server's metrics needs no GPU on the machine that judges: with
``--service-metrics`` and no GPU NVML can read, watch says so and judges the servers alone
(:class:`NoGpus`, which reads nothing). Without ``--service-metrics`` there would be nothing to watch.

Exit codes: 0 stopped by ``--duration``, the end of a scenario, SIGINT or SIGTERM;
1 the sampling loop died or ``--listen`` cannot be bound; 2 bad flags, an unreadable
policy or scenario file; 3 (:data:`EXIT_NO_GPU`) NVML cannot start (no NVIDIA driver,
or no GPU) and there is no ``--service-metrics`` to judge. There is never a silent fallback
to a scenario.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from gpuwarden.accounting import DEFAULT_IDLE_FLOOR, Ledger, observe_snapshot, usage_lines
from gpuwarden.agent.backend import BackendError, DeviceBackend
from gpuwarden.agent.config import DEFAULT_HOOK_SOCKET, HOOK_SOCKET_ENV
from gpuwarden.agent.hookchannel import hook_channel, open_hook_channel
from gpuwarden.agent.scripted import ScriptedBackend
from gpuwarden.agent.snapshots import Sampler, SnapshotRing
from gpuwarden.local.display import LiveDisplay, PlainDisplay, elapsed_clock, summary_lines, wall_clock
from gpuwarden.local.history import History
from gpuwarden.local.metrics import local_registry, start_server
from gpuwarden.local.options import (
    Display,
    UsageError,
    broken_pipe,
    duration,
    parse_listen,
    positive_float,
    wants_live_display,
)
from gpuwarden.local.plot import PlotUnavailable, require_matplotlib, save_plot
from gpuwarden.local.policies import LocalPolicy, for_processes, load_policies
from gpuwarden.local.replay import ScenarioClock, ScenarioSampler
from gpuwarden.local.scrapes import ServiceWatcher, scrape_interval, service_subject, wanted_names
from gpuwarden.local.session import Session
from gpuwarden.local.subjects import SubjectKind, processes_in
from gpuwarden.local.suspicion import SuspicionResponder
from gpuwarden.policy import RULE_TYPES, PodView, SpecError, service_metric_names, snapshot_before
from gpuwarden.sim.scenario import PACKAGED, Scenario, ScenarioError, load_scenario
from gpuwarden.units import format_duration
from gpuwarden.wire.node import GpuSample, ProcessUtilization, Snapshot

log = logging.getLogger("gpuwarden.watch")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_GPU = 3
"""NVML could not start (no NVIDIA driver, or no GPU): distinct, so scripts can tell it from a failure."""

DEFAULT_LISTEN = ":9400"
_SERVICE_KINDS = ", ".join(t.key for t in RULE_TYPES if t.metric is not None)
"""The rule kinds that read the pods' own metrics, for the flags' words."""


def default_hook_socket(env: Mapping[str, str] = os.environ, preferred: Path = DEFAULT_HOOK_SOCKET) -> str:
    """Where watch listens for training hooks unless told: ``$GPUWARDEN_HOOK_SOCKET`` (empty: nowhere),
    else the agent's path (``preferred``) where this user may create it, so that a job's hook finds
    it without being told, else the user's runtime directory (``$XDG_RUNTIME_DIR``, or ``/tmp``)."""
    if HOOK_SOCKET_ENV in env:
        return env[HOOK_SOCKET_ENV]
    directory = preferred.parent
    existing = directory if directory.exists() else directory.parent
    if os.access(existing, os.W_OK | os.X_OK):
        return str(preferred)
    return str(Path(env.get("XDG_RUNTIME_DIR") or "/tmp") / "gpuwarden" / "hook.sock")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add watch's flags."""
    parser.description = (
        "Watch this host's GPUs with a GPUMonitorPolicy file, without Kubernetes: findings per "
        "process (PID and command line), /metrics, an optional plot."
    )
    add = parser.add_argument
    add("--policy", type=Path, required=True, metavar="FILE", help="GPUMonitorPolicy YAML (one or more)")
    add(
        "--scenario",
        metavar="FILE",
        help="read a scripted scenario instead of the GPUs (a file, or a packaged one by name: "
        f"{', '.join(PACKAGED)}); never chosen automatically",
    )
    add(
        "--speed",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="with --scenario: play it this many times faster than real time (1)",
    )
    add(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="[HOST]:PORT",
        help=f"address of /metrics ({DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    add("--interval", type=duration, default=1.0, metavar="DURATION", help="sampling period (1s)")
    add(
        "--process-interval",
        type=duration,
        default=10.0,
        metavar="DURATION",
        help="per-process SM utilization period (10s; NVML takes ~2 ms a GPU for it)",
    )
    add(
        "--duration",
        type=duration,
        metavar="DURATION",
        help="stop after this long (default: until Ctrl-C; with --scenario, at its end)",
    )
    add(
        "--hook-socket",
        default=default_hook_socket(),
        metavar="PATH",
        help=f"Unix socket training hooks (gpuwarden.hook) write to (default: ${HOOK_SOCKET_ENV}, else "
        f"{DEFAULT_HOOK_SOCKET} where this user may create it, else "
        "${XDG_RUNTIME_DIR:-/tmp}/gpuwarden/hook.sock); empty: none. Watch prints it at the start: "
        f"export {HOOK_SOCKET_ENV}=PATH in the job's environment when it is not the default",
    )
    add(
        "--service-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="an inference server's Prometheus metrics (e.g. http://127.0.0.1:8000/metrics), scraped at "
        f"the policies' pace for their service rules ({_SERVICE_KINDS}); repeatable",
    )
    add("--plot", type=Path, metavar="FILE.png", help="on exit, write utilization and memory per GPU")
    add("--plain", action="store_true", help="plain lines even on a terminal (no live table)")


@dataclass(frozen=True, slots=True)
class WatchConfig:
    """Watch's settings, checked."""

    policies: list[LocalPolicy]
    notes: list[str]
    """What was set aside from the policies (selectors, scale actions), to say at the start."""
    scenario: Scenario | None
    speed: float
    host: str | None
    port: int
    interval: float
    process_interval: float
    duration: float | None
    plot: Path | None
    live: bool
    hook_socket: Path | None
    """None: no hook socket (``--hook-socket ""``)."""
    service_urls: tuple[str, ...] = ()
    """``--service-metrics``: the servers whose metrics the service rules judge."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WatchConfig:
        """Check the flags and load the files; :class:`UsageError` says what is wrong."""
        if args.speed != 1.0 and args.scenario is None:
            raise UsageError("--speed only applies to --scenario (real GPUs run in real time)")
        host, port = parse_listen(args.listen)
        if args.plot is not None:
            require_matplotlib()
        try:
            loaded = load_policies(args.policy)
            scenario = load_scenario(args.scenario) if args.scenario is not None else None
        except (SpecError, ScenarioError) as exc:
            raise UsageError(str(exc)) from None
        for url in args.service_metrics:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
                raise UsageError(f"--service-metrics {url!r}: expected an http:// or https:// URL")
        if args.service_metrics and not wanted_names(loaded):
            raise UsageError(f"--service-metrics: no policy has a service rule ({_SERVICE_KINDS})")
        return cls(
            policies=[for_processes(p) for p in loaded],
            notes=_set_aside(loaded, args.service_metrics),
            scenario=scenario,
            speed=args.speed,
            host=host,
            port=port,
            interval=args.interval,
            process_interval=args.process_interval,
            duration=args.duration
            if args.duration is not None
            else (scenario.duration if scenario else None),
            plot=args.plot,
            live=wants_live_display(sys.stdout, plain=args.plain),
            hook_socket=Path(args.hook_socket) if args.hook_socket else None,
            service_urls=tuple(args.service_metrics),
        )


def _set_aside(policies: list[LocalPolicy], service_urls: Sequence[str]) -> list[str]:
    notes = []
    for p in policies:
        if not service_urls and service_metric_names(p.spec):
            notes.append(f"policy {p.key}: its service rules read nothing without --service-metrics URL")
        spec = p.spec
        if p.namespace or spec.selector.match_labels or spec.selector.match_expressions:
            notes.append(
                f"policy {p.key}: its namespace and selector speak of pods; watch judges every process"
            )
        if spec.actions.scale is not None:
            notes.append(f"policy {p.key}: scale action ignored (there is no Deployment on a bare host)")
    return notes


class NoGpus:
    """The backend of a watch that judges only inference servers: no GPU to read on this machine."""

    name = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        """Why the GPUs could not be read (NVML's error), to say at the start."""

    def open(self) -> None:
        pass

    def sample_devices(self, now: float) -> list[GpuSample]:
        return []

    def sample_process_utilization(self, now: float) -> ProcessUtilization:
        return {}

    def close(self) -> None:
        pass


def run(args: argparse.Namespace) -> int:
    """Watch until stopped; the process's exit code."""
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = WatchConfig.from_args(args)
    except (UsageError, PlotUnavailable) as exc:
        print(f"gpuwarden watch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    clock: Callable[[], float] = time.time
    backend: DeviceBackend
    if config.scenario is not None:
        backend = ScriptedBackend(config.scenario)  # played on its own time: see watch()
    else:
        from gpuwarden.agent.nvml import NvmlBackend

        backend = NvmlBackend(first_process_window=config.process_interval)
    try:
        backend.open()
    except BackendError as exc:
        if config.service_urls and config.scenario is None:
            backend = NoGpus(str(exc))
        else:
            print(
                f"gpuwarden watch: cannot read this host's GPUs: {exc}\n"
                "  watch reads NVIDIA GPUs through the driver's NVML library, and found none to read.\n"
                "  To judge an inference server's metrics alone: --service-metrics URL.\n"
                "  To watch a scripted scenario instead, say so: --scenario FILE (e.g. --scenario demo),\n"
                "  or play the demo: gpuwarden demo.",
                file=sys.stderr,
            )
            return EXIT_NO_GPU
    try:
        return asyncio.run(watch(config, backend, clock))
    except KeyboardInterrupt:  # before watch's own handler was in place: a normal stop
        return 0
    except BrokenPipeError:
        return broken_pipe()
    finally:
        backend.close()


async def watch(
    config: WatchConfig,
    backend: DeviceBackend,
    clock: Callable[[], float] = time.time,
    out: Display | None = None,
) -> int:
    """Sample ``backend`` until stopped, evaluate, display, serve /metrics; plot and summarise on exit.

    A scripted backend is played on scenario time from its origin (``clock`` is then not read):
    the same samples at any ``--speed`` (:mod:`gpuwarden.local.replay`).
    """
    scripted = config.scenario is not None
    if isinstance(backend, ScriptedBackend):
        clock = ScenarioClock(backend.origin if backend.origin is not None else clock())
    history = History()
    services = [service_subject(url) for url in config.service_urls]

    def subjects(snapshot: Snapshot) -> list[PodView]:
        """The processes on the GPUs, and the servers whose metrics are scraped."""
        return [*processes_in(snapshot), *(PodView(s.namespace, s.name) for s in services)]

    session = Session(
        config.policies,
        subjects=SubjectKind.PROCESSES,
        pods_of=subjects,
        sample_interval=config.interval,
        history=history,
    )
    scraper = (
        ServiceWatcher(
            config.service_urls,
            wanted_names(config.policies),
            session.services.record,
            interval=scrape_interval(config.policies) / config.speed,
            clock=clock,
        )
        if config.service_urls
        else None
    )
    ledger = Ledger()  # each process's GPU-seconds held, used, idle (docs/accounting.md), in the summary
    # A scenario's time starts at the backend's origin: findings are labelled in scenario time.
    start = backend.origin if isinstance(backend, ScriptedBackend) and backend.origin else clock()
    label = elapsed_clock(start) if scripted else wall_clock
    display: Display = out or (
        LiveDisplay(sys.stdout, label, subject_header="process")
        if config.live
        else PlainDisplay(sys.stdout, label)
    )
    ring = SnapshotRing.lasting(config.interval)
    registry, metrics = local_registry(ring, session.active, backend=backend.name, command_of=session.command)
    channel = hook_channel(config.hook_socket, registry) if config.hook_socket is not None else None
    annotate = channel.stage.annotate if channel is not None else None
    responders: list[SuspicionResponder] = []  # one, once the hook socket is up
    stop = asyncio.Event()
    failed: list[str] = []
    source = f"scenario {config.scenario.name!r}" if config.scenario is not None else socket.gethostname()
    title = f"gpuwarden watch: {source}, policies {', '.join(p.key for p in config.policies)}"

    def deliver(snapshot: Snapshot) -> None:
        metrics.count_xids(snapshot)
        try:
            step = session.observe(snapshot)
            observe_snapshot(ledger, snapshot, processes=True)
            display.show(step, f"{title}, {label(snapshot.timestamp)}")
            for responder in responders:
                responder.observe(session.active(), snapshot.timestamp)
        except Exception:
            log.exception("evaluating a snapshot failed")
            failed.append("evaluating a snapshot failed (the error is logged above)")
            stop.set()
            return
        if config.duration is not None and snapshot.timestamp - start >= config.duration:
            stop.set()

    # The agent's loop; a scenario's on scenario time, each sample at its instant, whatever the host's pace.
    sampler = (
        ScenarioSampler(
            backend,
            ring,
            clock=clock,
            speed=config.speed,
            interval=config.interval,
            process_interval=config.process_interval,
            annotate=annotate,
            deliver=deliver,
            events=metrics,
            note=display.note,
        )
        if isinstance(clock, ScenarioClock)
        else Sampler(
            backend,
            ring,
            interval=config.interval,
            process_interval=config.process_interval,
            annotate=annotate,
            deliver=deliver,
            events=metrics,
            clock=clock,
        )
    )
    loop = asyncio.get_running_loop()
    # Before anything is served: SIGINT/SIGTERM from here on stop the watch with its summary.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # The handlers stay in place through the summary and the plot: a Ctrl-C that comes while they are
    # written (the stop already set) must not cut them off with a KeyboardInterrupt.
    try:
        async with contextlib.AsyncExitStack() as opened:
            if channel is not None:
                hooks = await opened.enter_async_context(
                    open_hook_channel(
                        channel,
                        who="watch",
                        complain=lambda message: display.note(f"note: {message}"),
                        # A scenario's processes are not this host's: nothing to ask a snapshot of.
                        control=not scripted,
                    )
                )
                if hooks is not None:
                    display.note(
                        f"Training hooks: listening on {hooks.path} "
                        f"(export {HOOK_SOCKET_ENV}={hooks.path} for the job if that is not the default)"
                    )
                    if not scripted:
                        before = {
                            (p.key, rule): seconds
                            for p in session.policies
                            for rule, seconds in snapshot_before(p.spec.rules).items()
                        }
                        responders.append(SuspicionResponder(hooks, display.note, before))
                        opened.push_async_callback(responders[0].close)
            code = await _serve_until_stopped(config, sampler, scraper, registry, ring, display, stop, source)
            if code is not None:
                return code
            _summarise(history, label, config, title, usage_lines(ledger, session.subject_name))
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if failed:
        print(f"gpuwarden watch: stopped: {failed[0]}", file=sys.stderr)
        return EXIT_FAILED
    return 0


async def _serve_until_stopped(
    config: WatchConfig,
    sampler: Sampler,
    scraper: ServiceWatcher | None,
    registry: CollectorRegistry,
    ring: SnapshotRing,
    display: Display,
    stop: asyncio.Event,
    source: str,
) -> int | None:
    """Serve /metrics, sample (and scrape) until ``stop``; an exit code if the server could not start."""
    for note in config.notes:
        display.note(f"note: {note}")
    if isinstance(sampler.backend, NoGpus):
        display.note(
            f"note: no GPU to read here ({sampler.backend.reason}); judging only the service metrics"
        )
    try:
        runner, addresses = await start_server(registry, ring, config.host, config.port)
    except OSError as exc:
        display.close()
        print(f"gpuwarden watch: cannot listen on {config.host or ''}:{config.port}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    speed = f" at {config.speed:g}x" if config.scenario is not None and config.speed != 1 else ""
    until = f", for {format_duration(config.duration)}" if config.duration is not None else ""
    display.note(f"Watching {source}{speed}{until}; /metrics on {', '.join(addresses)}; Ctrl-C stops")
    if scraper is not None:
        every = format_duration(scraper.interval * config.speed)
        display.note(f"Service metrics: {', '.join(scraper.urls)} every {every}")
    # Started after the lines above, so that they come before the first finding.
    loops = {"sampling": asyncio.create_task(sampler.run(), name="sampler")}
    if scraper is not None:
        loops["scraping"] = asyncio.create_task(scraper.run(), name="service scraper")
    for task in loops.values():
        task.add_done_callback(lambda task: stop.set())
    try:
        await stop.wait()
    finally:
        for task in loops.values():
            task.cancel()
        results = await asyncio.gather(*loops.values(), return_exceptions=True)
        await runner.cleanup()
        display.close()
    for name, error in zip(loops, results, strict=True):
        if not isinstance(error, asyncio.CancelledError):
            # Both loops run forever: one that ended on its own did so by a bug.
            log.error("the %s loop ended", name, exc_info=error if isinstance(error, BaseException) else None)
            print(f"gpuwarden watch: stopped because the {name} loop ended", file=sys.stderr)
            return EXIT_FAILED
    return None


def _summarise(
    history: History, label: Callable[[float], str], config: WatchConfig, title: str, usage: list[str]
) -> None:
    watched = (history.last - history.first) if history.first is not None and history.last else 0.0
    print(f"\nSummary: watched {len(history.devices)} GPUs for {format_duration(max(0, round(watched)))}")
    for line in summary_lines(history, [], label):
        print(line)
    if usage:
        print(f"GPU time per process (idle: under {DEFAULT_IDLE_FLOOR:g}% active):")
        for line in usage:
            print(f"  {line}")
    if config.plot is not None:
        save_plot(history, config.plot, title)
        print(f"Plot: {config.plot}")
    sys.stdout.flush()

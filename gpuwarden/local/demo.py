"""``gpuwarden demo``: a scripted eight-GPU node played through the policy engine, in under a minute.

The scripted backend (the agent's, :class:`~gpuwarden.agent.scripted.ScriptedBackend`)
is read at scenario time ``t`` directly, one sample per ``--interval`` of scenario time,
attributed to the scenario's pods and fed to a :class:`~gpuwarden.local.session.Session`
with the demo's policies; the scenario's served replicas' metrics (vLLM's, from the queueing
model) go to the same session at the policies' scrape pace, for their service rules. Nothing
waits for scenario time to pass: at ``--speed`` 60 the loop only sleeps to keep the display at
60 scenario seconds per wall second (a few sleeps per frame, never one per sample; see
:mod:`gpuwarden.local.replay`), and ``--no-pace`` does not sleep at all.

Exit codes: 0 when the scenario played to its end; 2 for bad flags or an unreadable
scenario or policy file; 130 when interrupted (Ctrl-C), after the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.accounting import DEFAULT_IDLE_FLOOR, Ledger, observe_snapshot, usage_lines
from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend
from gpuwarden.agent.snapshots import SnapshotRing
from gpuwarden.local.display import LiveDisplay, PlainDisplay, elapsed_clock, summary_lines
from gpuwarden.local.history import History
from gpuwarden.local.metrics import local_registry, start_server
from gpuwarden.local.options import (
    Display,
    UsageError,
    broken_pipe,
    duration,
    positive_float,
    wants_live_display,
)
from gpuwarden.local.plot import PlotUnavailable, require_matplotlib, save_plot
from gpuwarden.local.policies import LocalPolicy, demo_policy_path, load_policies
from gpuwarden.local.replay import Pacer
from gpuwarden.local.rows import ScaleNote, Step
from gpuwarden.local.scrapes import scrape_interval, scrape_of_replica, wanted_names
from gpuwarden.local.session import Session
from gpuwarden.local.subjects import SubjectKind
from gpuwarden.policy import PodId, PodView, SpecError
from gpuwarden.sim.scenario import DEFAULT_ORIGIN, PACKAGED, Scenario, ScenarioError, load_scenario
from gpuwarden.units import format_duration
from gpuwarden.wire.node import Snapshot, merge_process_utilization

DEFAULT_SPEED = 60.0
"""Scenario seconds per wall second: the 30-minute demo plays in about 30 s."""
PROCESS_INTERVAL = 10.0
"""Scenario seconds between per-process utilization reads, the agent's default."""
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags."""
    parser.description = (
        "Play a scripted eight-GPU node (an idle pod with a scheduled job, a leaking training job, a "
        "caching allocator that plateaus, an inference Deployment scaled ahead of a ramp) through the "
        "policy engine, in under a minute."
    )
    add = parser.add_argument
    add(
        "--scenario",
        default="demo",
        metavar="FILE",
        help=f"scenario file, or a packaged one by name ({', '.join(PACKAGED)}); default: demo",
    )
    add(
        "--policy",
        type=Path,
        metavar="FILE",
        help="GPUMonitorPolicy YAML (one or more documents); default: the packaged demo policy",
    )
    add(
        "--speed",
        type=positive_float,
        default=DEFAULT_SPEED,
        metavar="X",
        help=f"scenario seconds per wall second ({DEFAULT_SPEED:g})",
    )
    add("--no-pace", action="store_true", help="run as fast as possible (no pacing sleeps)")
    add("--interval", type=duration, default=1.0, metavar="DURATION", help="sampling period (1s)")
    add("--plot", type=Path, metavar="FILE.png", help="write utilization and memory per GPU, findings marked")
    add("--metrics-port", type=int, metavar="PORT", help="serve /metrics on this port during the demo")
    add("--plain", action="store_true", help="plain lines even on a terminal (no live table)")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The demo's settings, checked."""

    scenario: Scenario
    policies: list[LocalPolicy]
    speed: float
    pace: bool
    interval: float
    plot: Path | None
    metrics_port: int | None
    live: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoConfig:
        """Load the scenario and policies; :class:`UsageError` says what is wrong."""
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise UsageError(f"--metrics-port {args.metrics_port}: not a port number")
        if args.plot is not None:
            require_matplotlib()
        try:
            scenario = load_scenario(args.scenario)
            policies = load_policies(args.policy or demo_policy_path())
        except (ScenarioError, SpecError) as exc:
            raise UsageError(str(exc)) from None
        return cls(
            scenario=scenario,
            policies=policies,
            speed=args.speed,
            pace=not args.no_pace,
            interval=args.interval,
            plot=args.plot,
            metrics_port=args.metrics_port,
            live=wants_live_display(sys.stdout, plain=args.plain),
        )


def run(args: argparse.Namespace) -> int:
    """Play the demo; the process's exit code."""
    try:
        config = DemoConfig.from_args(args)
    except (UsageError, PlotUnavailable) as exc:
        print(f"gpuwarden demo: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(play(config))
    except KeyboardInterrupt:  # before the run's own handler was in place
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return broken_pipe()


class ScenarioRun:
    """A scenario played through a :class:`Session`, one sample per ``interval`` of scenario time.

    The scripted backend is read at chosen scenario times as the agent's sampler reads
    it (devices every sample, per-process utilization every :data:`PROCESS_INTERVAL`),
    attributed to the scenario's pods and fed to the session. No clock, no sleeping:
    :meth:`steps` is as fast as the engine; pacing is the caller's business.
    """

    def __init__(self, scenario: Scenario, policies: Sequence[LocalPolicy], *, interval: float = 1.0) -> None:
        self.scenario = scenario
        self.interval = interval
        self.backend = ScriptedBackend(scenario, origin=DEFAULT_ORIGIN)
        self.backend.open()
        self._attributor = ScenarioAttributor(self.backend)
        self._next_processes = 0.0
        self.history = History()
        self.session = Session(
            policies,
            subjects=SubjectKind.PODS,
            pods_of=self._pods,
            sample_interval=interval,
            history=self.history,
        )
        self.scaling: list[ScaleNote] = []
        """Every scale decision so far (repeats included)."""
        self.ledger = Ledger()
        """Each pod's GPU-seconds allocated, used and idle, and the GPUs nobody held (docs/accounting.md)."""
        self._service_names = wanted_names(policies)
        self._scrape_every = scrape_interval(policies)
        self._next_scrape = 0.0

    def steps(self) -> Iterator[tuple[float, Snapshot, Step]]:
        """``(t, snapshot, step)`` from scenario time 0 to the scenario's end."""
        for i in range(int(self.scenario.duration // self.interval) + 1):
            t = i * self.interval
            snapshot = self.sample(t)
            self.scrape(t)
            step = self.session.observe(snapshot)
            observe_snapshot(self.ledger, snapshot)
            self.scaling.extend(step.scaling)
            for note in step.scaling:
                if note.applied:
                    # What the Deployment controller would do: replicas come and go, then serve.
                    self.scenario.scale(note.namespace, note.name, note.decision.desired, t)
            yield t, snapshot, step

    def sample(self, t: float) -> Snapshot:
        """The attributed snapshot at scenario time ``t``; per-process utilization at its own rate."""
        now = DEFAULT_ORIGIN + t
        gpus = self.backend.sample_devices(now)
        if t >= self._next_processes:
            self._next_processes = t + PROCESS_INTERVAL
            gpus = merge_process_utilization(gpus, self.backend.sample_process_utilization(now))
        return self._attributor.annotate(Snapshot(timestamp=now, gpus=gpus))

    def scrape(self, t: float) -> None:
        """At the policies' scrape pace, what the scenario's served replicas export at ``t``, into the
        session, as an agent would have scraped and compacted it."""
        if not self._service_names or t < self._next_scrape:
            return
        self._next_scrape = t + self._scrape_every
        for ref, metrics in self.scenario.service_metrics(t):
            scrape = scrape_of_replica(metrics, DEFAULT_ORIGIN + t, self._service_names)
            self.session.services.record(PodId(ref.namespace, ref.name), scrape)

    def _pods(self, snapshot: Snapshot) -> list[PodView]:
        """The scenario's pods at the snapshot's time, with their labels and annotations."""
        return [
            PodView(p.ref.namespace, p.ref.name, p.labels, p.annotations)
            for p in self.scenario.pods_at(snapshot.timestamp - DEFAULT_ORIGIN)
        ]


async def play(config: DemoConfig, out: Display | None = None) -> int:
    """Play the scenario to its end (or until SIGINT); print findings, a summary; plot if asked."""
    run = ScenarioRun(config.scenario, config.policies, interval=config.interval)
    clock = elapsed_clock(DEFAULT_ORIGIN)
    display: Display = out or (
        LiveDisplay(sys.stdout, clock, subject_header="pod")
        if config.live
        else PlainDisplay(sys.stdout, clock)
    )
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    # First thing: a Ctrl-C from here on ends the run with its summary, not a traceback.
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    ring = SnapshotRing(capacity=1)
    registry, metrics = local_registry(ring, run.session.active, backend=run.backend.name)
    runner = None
    total = clock(DEFAULT_ORIGIN + config.scenario.duration)
    if config.metrics_port is not None:
        try:
            runner, addresses = await start_server(registry, ring, None, config.metrics_port)
        except OSError as exc:
            loop.remove_signal_handler(signal.SIGINT)
            print(
                f"gpuwarden demo: cannot serve /metrics on port {config.metrics_port}: {exc}", file=sys.stderr
            )
            return 2
        display.note(f"/metrics on {', '.join(addresses)}")
    display.note(_intro(config))
    started = time.monotonic()
    pacer = Pacer(config.speed if config.pace else None, display.note)
    try:
        for i, (t, snapshot, step) in enumerate(run.steps()):
            ring.append(snapshot)
            # The scripted read takes no time worth measuring; the counter shows progress on /metrics.
            metrics.samples.inc()
            display.show(
                step, f"gpuwarden demo: {config.scenario.name}, {clock(snapshot.timestamp)} of {total}"
            )
            await pacer.wait(t + config.interval, i)
            if interrupted.is_set():
                break
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        display.close()
        if runner is not None:
            await runner.cleanup()
    wall = time.monotonic() - started
    history = run.history
    played = (history.last or DEFAULT_ORIGIN) - DEFAULT_ORIGIN
    print(
        f"\nSummary: {format_duration(round(played))} of scenario {config.scenario.name!r} in {wall:.1f} s "
        f"({played / max(wall, 1e-9):.0f}x), {len(history.devices)} GPUs, "
        f"{len(config.policies)} {'policy' if len(config.policies) == 1 else 'policies'}"
    )
    for line in summary_lines(history, run.scaling, clock, run.session.targets()):
        print(line)
    print(f"GPU time per pod (idle: under {DEFAULT_IDLE_FLOOR:g}% active):")
    for line in usage_lines(run.ledger, lambda namespace, pod: f"{namespace}/{pod}"):
        print(f"  {line}")
    if config.plot is not None:
        save_plot(history, config.plot, f"gpuwarden demo: scenario {config.scenario.name}")
        print(f"Plot: {config.plot}")
    sys.stdout.flush()
    return EXIT_INTERRUPTED if interrupted.is_set() else 0


def _intro(config: DemoConfig) -> str:
    names = ", ".join(p.key for p in config.policies)
    pace = f"{config.speed:g}x" if config.pace else "unpaced"
    return (
        f"Playing scenario {config.scenario.name!r} ({format_duration(config.scenario.duration)}, "
        f"{pace}) through policies {names}"
    )

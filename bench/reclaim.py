"""Reclaiming idle GPUs over a scripted day: reclaims, time from idle to reclaim, and false reclaims.

Not a test: a benchmark, recorded in docs/benchmarks.md. A day of bursty notebooks and jobs (one GPU
each) is played through the real policy engine (:class:`~gpuwarden.policy.PolicyEvaluator` over a
:class:`~gpuwarden.policy.SeriesStore`) and the reclaim decisions the operator takes
(:func:`~gpuwarden.policy.recently_active`, :func:`~gpuwarden.policy.idle_workloads`,
:class:`~gpuwarden.policy.ReclaimPlanner`, the circuit breakers), on a simulated clock: readings every
``--sample`` seconds, an evaluation every ``--interval``. What the Reclaimer does with the API (reading
owners, the patch) is left out: each workload is its own pod's owner, and a reclaim takes it away (no
more readings) until its script works again, when its user runs ``gpuwarden restore``.

Counted per reclaim: the time from the start of the idle stretch it ended (the script's last work) to
the reclaim, against the bound ``for`` + ``gracePeriod`` + one evaluation; and whether it was **false**:
the script had real work (a reading at or above the floor) between the warning and the reclaim, or at
the reclaim itself: work a reclaim would have lost. Also counted: warnings cancelled by work, and idle
stretches long enough to reclaim that were not reclaimed (missed).

    .venv/bin/python bench/reclaim.py
    .venv/bin/python bench/reclaim.py --for 5m --grace 5m
    .venv/bin/python bench/reclaim.py --findings-only   # the ablation: what the last interval's check saves
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwarden.policy import (  # noqa: E402 (the repository's root on the path first)
    CircuitBreaker,
    PodId,
    PodView,
    Point,
    PolicyEvaluator,
    ReclaimPlanner,
    ReclaimStepKind,
    SeriesKey,
    SeriesStore,
    WorkloadRef,
    idle_workloads,
    parse_spec,
    recently_active,
)
from gpuwarden.units import format_duration, parse_duration  # noqa: E402

NS = "bench"
FLOOR = 10.0
HOUR = 3600.0
MINUTE = 60.0

Script = Callable[[float, float | None], bool]
"""(seconds since midnight, when its current warning came or None) -> whether the workload works then."""


def spans(*ranges: tuple[float, float]) -> Script:
    """Works in the given [start, end) ranges (hours of the day)."""
    return lambda t, _: any(a * HOUR <= t < b * HOUR for a, b in ranges)


def every(period_min: float, busy_min: float, start_h: float = 0.0, end_h: float = 24.0) -> Script:
    """Works ``busy_min`` minutes out of every ``period_min``, between the hours given."""

    def works(t: float, _: float | None) -> bool:
        offset = t - start_h * HOUR
        return start_h * HOUR <= t < end_h * HOUR and offset % (period_min * MINUTE) < busy_min * MINUTE

    return works


def back_after_warning(after: float) -> Script:
    """Works 09:00-10:00; idle from 10:00 until ``after`` seconds past the first warning it gets, then
    works until noon: its user comes back during the grace period."""
    first: list[float] = []

    def works(t: float, warned: float | None) -> bool:
        if 9 * HOUR <= t < 10 * HOUR:
            return True
        if warned is not None and warned >= 10 * HOUR and not first:
            first.append(warned)
        return bool(first) and first[0] + after <= t < 12 * HOUR

    return works


def day(for_s: float, grace_s: float, interval: float) -> dict[str, Script]:
    """The scripted day (times in hours): ``for_s + grace_s`` is the least idle stretch reclaimed."""
    lag = (for_s + grace_s) / HOUR
    return {
        # Office hours of cells and thinking: work in bursts, idle stretches of 20-90 minutes, idle at night.
        "notebook-alice": spans((9.0, 9.6), (10.5, 11.2), (13.0, 13.3), (14.8, 16.0), (17.5, 17.6)),
        # Short cells every 15 minutes all afternoon: idle 13 minutes at a time, warned, and back.
        "notebook-bob": every(15, 2, 13, 18),
        # Back to work half way through its grace period.
        "notebook-back-in-grace": back_after_warning(grace_s / 2),
        # Back one evaluation before the deadline: only the last interval's readings can save its work.
        "notebook-back-at-deadline": back_after_warning(grace_s - interval),
        # A nightly job: an hour at 02:00, idle the rest of the day (its pod stays, holding the GPU).
        "job-nightly": spans((2.0, 3.0)),
        # A scheduled burst of 5 minutes every 20: idle gaps of 15 minutes, shorter than for + grace.
        "job-periodic": every(20, 5),
        # Training all morning, then a hung process: idle from 12:00.
        "job-training": spans((0.0, 12.0)),
        # An evaluation that pauses for just under `for` + grace between its phases: never reclaimed.
        "job-phases": spans((8.0, 9.0), (9.0 + lag - 0.02, 10.0)),
    }


@dataclass
class Track:
    """One workload's day as the benchmark sees it."""

    script: Script
    present: bool = True
    """Its pod exists (False while reclaimed, until its script works again and it is restored)."""
    last_work: float = -1.0
    warned_at: float | None = None
    reclaims: list[tuple[float, float, bool]] = field(default_factory=list)
    """(idle since, reclaimed at, whether a circuit breaker held it back first)."""
    held: bool = False
    false: list[float] = field(default_factory=list)
    cancelled: int = 0
    worked_since_warning: bool = False


def run(args: argparse.Namespace) -> dict[str, Track]:
    for_s, grace_s = parse_duration(args.for_), parse_duration(args.grace)
    interval, sample = parse_duration(args.interval), parse_duration(args.sample)
    spec = parse_spec(
        {
            "selector": {},
            "evaluationInterval": args.interval,
            "rules": [
                {
                    "name": "idle",
                    "utilizationFloor": {"percent": FLOOR, "for": args.for_, "signal": "gpuUtil"},
                }
            ],
            "actions": {"reclaim": {"rules": ["idle"], "action": "ScaleToZero", "gracePeriod": args.grace}},
        }
    )
    action = spec.actions.reclaim
    assert action is not None
    evaluator = PolicyEvaluator(f"{NS}/idle", spec, namespace=NS)
    store = SeriesStore(
        retention_seconds=2 * (for_s + grace_s), max_points=int(4 * (for_s + grace_s) / sample)
    )
    planner = ReclaimPlanner(action.grace_seconds)
    breaker, cluster = CircuitBreaker(args.max_per_hour), CircuitBreaker(args.cluster_max_per_hour)
    rng = random.Random(args.seed)
    tracks = {name: Track(script) for name, script in day(for_s, grace_s, interval).items()}
    ref = {name: WorkloadRef("apps/v1", "Deployment", name) for name in tracks}
    by_ref = {r: n for n, r in ref.items()}
    origin = 1_900_000_000.0 - 1_900_000_000.0 % 86400  # a midnight
    t = 0.0
    next_eval = 0.0
    while t < 86400:
        now = origin + t
        for name, track in tracks.items():
            works = track.script(t, None if track.warned_at is None else track.warned_at - origin)
            if works:
                track.last_work = t
                if not track.present:
                    track.present = True  # its user runs `gpuwarden restore`
                if track.warned_at is not None:
                    track.worked_since_warning = True
            if track.present:
                util = rng.uniform(70, 100) if works else max(0.0, rng.gauss(2, 1))
                store.add(SeriesKey(NS, name, f"GPU-{name}"), Point(now, gpu_util=util))
        if t >= next_eval:
            next_eval += interval
            views = [PodView(NS, n, {}, {}) for n, tr in tracks.items() if tr.present]
            evaluation = evaluator.evaluate(views, store, now)
            pods = [PodId(NS, v.name) for v in views]
            series = {p: store.series_of(*p) for p in pods}
            active: set[PodId] = set()
            if not args.findings_only:
                active = recently_active(series, action, spec.rules, now, interval)
            idle = idle_workloads(action, evaluation.active, {ref[p.name]: [p.name] for p in pods}, active)
            for step in planner.plan(idle, now):
                track = tracks[by_ref[step.workload]]
                if step.kind is ReclaimStepKind.WARN:
                    track.warned_at, track.worked_since_warning = now, False
                elif step.kind is ReclaimStepKind.CANCEL:
                    track.cancelled += 1
                    track.warned_at, track.held = None, False
                elif not (breaker.allows(now) and cluster.allows(now)):
                    track.held = True  # due, and held back: it stays due until the breaker closes
                else:
                    breaker.record(now)
                    cluster.record(now)
                    planner.finish(step.workload)
                    if track.worked_since_warning or track.script(t, None):
                        track.false.append(t)
                    track.reclaims.append((track.last_work + sample, t, track.held))
                    track.present, track.warned_at, track.held = False, None, False
        t += sample
    return tracks


def missed(track: Track, bound: float) -> int:
    """Idle stretches of the script at least ``bound`` long that no reclaim ended (sampled per minute)."""
    stretches: list[tuple[float, float]] = []
    start: float | None = None
    for m in range(0, 1441):
        t = m * MINUTE
        idle = m < 1440 and not track.script(t, None)
        if idle and start is None:
            start = t
        elif not idle and start is not None:
            stretches.append((start, t))
            start = None
    reclaimed_in = [at for _, at, _ in track.reclaims]
    return sum(
        1 for a, b in stretches if b - a >= bound + MINUTE and not any(a <= r <= b for r in reclaimed_in)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--for", dest="for_", default="10m", help="the idle rule's for (%(default)s)")
    parser.add_argument("--grace", default="10m", help="the reclaim's gracePeriod (%(default)s)")
    parser.add_argument("--interval", default="10s", help="evaluationInterval (%(default)s)")
    parser.add_argument("--sample", default="10s", help="seconds between readings (%(default)s)")
    parser.add_argument("--max-per-hour", type=int, default=5, help="the policy's maxPerHour (%(default)s)")
    parser.add_argument("--cluster-max-per-hour", type=int, default=20, help="(%(default)s)")
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument(
        "--findings-only",
        action="store_true",
        help="the ablation: idle by the findings alone, without the last interval's readings",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    tracks = run(args)
    elapsed = time.perf_counter() - started
    for_s, grace_s, interval = (
        parse_duration(args.for_),
        parse_duration(args.grace),
        parse_duration(args.interval),
    )
    bound = for_s + grace_s + interval
    print(
        f"one day, {len(tracks)} workloads, for {args.for_}, gracePeriod {args.grace}, evaluation every"
        f" {args.interval}; bound for + grace + one evaluation = {format_duration(bound)};"
        f" played in {elapsed:.1f} s"
    )
    head = "idle→reclaim, each (* held by a breaker; ! work lost)"
    print(f"{'workload':26} {'reclaims':>8} {head:>54} {'false':>5} {'cancelled':>9} {'missed':>6}")
    delays: list[float] = []
    held: list[float] = []
    for name, track in tracks.items():
        shown = []
        for since, at, was_held in track.reclaims:
            if at in track.false:
                shown.append("!")
                continue
            (held if was_held else delays).append(at - since)
            shown.append(format_duration(round(at - since)) + ("*" if was_held else ""))
        print(
            f"{name:26} {len(track.reclaims):>8} {', '.join(shown) or '-':>54} {len(track.false):>5}"
            f" {track.cancelled:>9} {missed(track, bound):>6}"
        )
    total_false = sum(len(t.false) for t in tracks.values())
    over = [d for d in delays if d > bound]
    cancelled = sum(t.cancelled for t in tracks.values())
    print(
        f"total: {sum(len(t.reclaims) for t in tracks.values())} reclaims ({len(held)} held by a breaker"
        f" first), {total_false} false, {cancelled} warnings cancelled by work; idle→reclaim of those not"
        f" held: median {format_duration(round(statistics.median(delays)))}, max"
        f" {format_duration(round(max(delays)))} (bound {format_duration(bound)}, {len(over)} over)"
    )
    return 1 if total_false or over else 0


if __name__ == "__main__":
    sys.exit(main())

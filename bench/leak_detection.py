"""Benchmark of leak detection: how soon a leak is found, and how long a non-leak is flagged.

Not a test: it prints the table in docs/benchmarks.md. Every trace is one GPU's
memory for an hour (a 141Gi card), generated with seeded noise; each is judged
three ways against the example policy's rule,
``memoryGrowth: {rate: 100Mi/m, window: 30m, minFit: 0.8}``:

- **gpuwarden, 1 s**: the engine (a :class:`PolicyEvaluator`) fed a sample
  every second, as the agent sends them, and evaluated every 10 s
  (``evaluationInterval: 10s``);
- **gpuwarden, 30 s**: the same, fed one sample every 30 s (what a Prometheus
  scrape of DCGM exporter keeps);
- **deriv**: ``deriv(gpu_memory_used_bytes[30m]) * 60 > 100Mi``, the rule a
  DCGM-exporter user writes, on the 30 s samples, evaluated every 30 s with no
  ``for``. ``deriv`` is computed as Prometheus 2.x defines it: the least-squares
  slope of the samples with timestamps in ``[t - 30m, t]``, x relative to ``t``,
  at least two samples.
- **predict_linear**: ``predict_linear(gpu_memory_used_bytes[5m], 600) > 141Gi``
  (the card full within 10 minutes on the last 5 minutes' line), the same way:
  the least-squares line's value at ``t`` plus 600 s of its slope.

For a leak the figure is the delay from the leak's onset to the first firing
(minutes; median and worst over the seeds), and the share of its time to full
(from the onset, before noise) still ahead when the worst seed fired; for every
other shape, the minutes flagged (a finding active, or the rule true), summed over
the hour (median and worst over the seeds).

    .venv/bin/python bench/leak_detection.py                 # the table (~1 minute)
    .venv/bin/python bench/leak_detection.py --seeds 1 --trace "sawtooth 20-40Gi/10m" --timeline
    .venv/bin/python bench/leak_detection.py --promtool      # both PromQL rules against promtool, 3 traces
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.policy import PodView, Point, PolicyEvaluator, SeriesKey, SeriesStore, Transition
from gpuwarden.policy.humanize import approx_duration
from gpuwarden.policy.rules.growth import MemoryGrowth
from gpuwarden.policy.spec.model import LabelSelector, PolicySpec

T0 = 1_750_000_000.0
MI = 2**20
GI = 2**30
CARD = 141 * GI
HOUR = 3600
EVALUATION_SECONDS = 10
SCRAPE_SECONDS = 30
RATE = 100 * MI / 60
RULE = MemoryGrowth(name="leak", rate_bytes_per_second=RATE, window_seconds=1800, min_fit=0.8)
SPEC = PolicySpec(selector=LabelSelector(), rules=(RULE,))
KEY = SeriesKey("bench", "job-0", "GPU-0")

Shape = Callable[[float], float]
"""Memory used (bytes) at ``t`` seconds into the trace, before noise."""


@dataclass(frozen=True)
class Trace:
    name: str
    shape: Shape
    leak_from: float | None = None
    """When the leak starts (seconds), for a leak; None for a shape that is not one."""
    noise_bytes: float = 4 * MI
    """Standard deviation of the Gaussian noise on each reading."""


def leak(
    start: float, per_minute: float, at: float = 0.0, load: float = 0.0, load_for: float = 30.0
) -> Shape:
    """Flat at ``start``, maybe a load of ``load`` bytes over ``load_for`` s; a leak from ``at``."""

    def shape(t: float) -> float:
        loaded = start + load * min(1.0, t / load_for) if load else start
        return loaded + per_minute / 60 * max(0.0, t - at)

    return shape


def staircase(start: float, step: float, every: float, steps: int, at: float = 0.0) -> Shape:
    """``steps`` steps of ``step`` bytes ``every`` seconds, the first at ``at``; then flat."""
    return lambda t: start + step * (min(steps, math.floor((t - at) / every) + 1) if t >= at else 0)


def sawtooth(low: float, high: float, period: float, phase: float = 0.0) -> Shape:
    """Ramps from ``low`` to ``high`` over each period, then frees back to ``low``."""
    return lambda t: low + (high - low) * (((t + phase) % period) / period)


def square(low: float, high: float, period: float) -> Shape:
    """Allocates at once half-way through each period, frees at its end."""
    return lambda t: high if (t % period) >= period / 2 else low


def sine(mid: float, amplitude: float, period: float) -> Shape:
    """A smooth periodic load (a diurnal-like batch size), starting at its lowest."""
    return lambda t: mid - amplitude * math.cos(2 * math.pi * t / period)


FAST_RATES = (5, 15, 30, 60)
"""Gi per minute: leaks that fill the card in 2 to 28 minutes."""
FAST_STARTS = ((2, 0), (40, 307), (80, 1203))
"""(Gi used, seconds flat before the leak): from the job's start, and after 5 or 20 flat minutes."""


def fast_leak(per_minute: int, start: int, at: float, noise: float) -> Trace:
    """``per_minute`` Gi/m from ``start`` Gi after ``at`` flat seconds; 4Mi of noise unless ``noise``."""
    name = f"leak {per_minute}Gi/m from {start}Gi" + (f" at {at / 60:.0f}m" if at else "")
    if noise:
        name += f", noise {noise / GI:.0f}Gi"
    return Trace(name, leak(start * GI, per_minute * GI, at=at), leak_from=at, noise_bytes=noise or 4 * MI)


TRACES: tuple[Trace, ...] = (
    Trace("leak 150Mi/m (x1.5)", leak(20 * GI, 150 * MI), leak_from=0),
    Trace("leak 200Mi/m (x2)", leak(20 * GI, 200 * MI), leak_from=0),
    Trace("leak 500Mi/m (x5)", leak(20 * GI, 500 * MI), leak_from=0),
    Trace("leak 2Gi/m (x20)", leak(20 * GI, 2 * GI), leak_from=0),
    Trace("leak 150Mi/m (x1.5), noise 1Gi", leak(20 * GI, 150 * MI), leak_from=0, noise_bytes=GI),
    Trace("leak 200Mi/m (x2), noise 1Gi", leak(20 * GI, 200 * MI), leak_from=0, noise_bytes=GI),
    Trace("leak 500Mi/m (x5), noise 1Gi", leak(20 * GI, 500 * MI), leak_from=0, noise_bytes=GI),
    Trace("leak 2Gi/m (x20), noise 1Gi", leak(20 * GI, 2 * GI), leak_from=0, noise_bytes=GI),
    Trace("leak 104Mi/m, noise 43Mi", leak(20 * GI, 104 * MI), leak_from=0, noise_bytes=43 * MI),
    Trace("the same, 0.9Gi from full", leak(CARD - 0.9 * GI, 104 * MI), leak_from=0, noise_bytes=43 * MI),
    Trace("leak 200Mi/m after a 100Gi load", leak(4 * GI, 200 * MI, at=60, load=100 * GI), leak_from=60),
    Trace("leak 200Mi/m from minute 30", leak(40 * GI, 200 * MI, at=1800), leak_from=1800),
    *(
        fast_leak(rate, start, at, noise)
        for rate in FAST_RATES
        for start, at in FAST_STARTS
        for noise in (0, GI)
    ),
    Trace("staircase 4x16Gi/90s, then flat", staircase(4 * GI, 16 * GI, 90, 4)),
    Trace("the same, noise 256Mi", staircase(4 * GI, 16 * GI, 90, 4), noise_bytes=256 * MI),
    Trace("staircase 8x4Gi/30s, then flat", staircase(8 * GI, 4 * GI, 30, 8)),
    Trace("staircase 6x2Gi/150s, then flat", staircase(8 * GI, 2 * GI, 150, 6)),
    Trace("staircase 8x2Gi/150s, then flat", staircase(8 * GI, 2 * GI, 150, 8)),
    Trace("staircase 3x8Gi/5m at minute 20", staircase(30 * GI, 8 * GI, 300, 3, at=1200)),
    # Steps four times the readings' noise: split between buckets and blurred, they are barely jumps.
    Trace(
        "staircase 6x288Mi/70s at minute 40, noise 64Mi",
        staircase(8 * GI, 288 * MI, 70, 6, at=2400),
        noise_bytes=64 * MI,
    ),
    Trace("model loaded once at minute 10", staircase(2 * GI, 60 * GI, 1, 1, at=600)),
    Trace("sawtooth 20-40Gi/10m", sawtooth(20 * GI, 40 * GI, 600)),
    Trace("the same, from mid-tooth", sawtooth(20 * GI, 40 * GI, 600, phase=400)),
    Trace("sawtooth 10-30Gi/3m", sawtooth(10 * GI, 30 * GI, 180)),
    Trace("the same, noise 256Mi", sawtooth(10 * GI, 30 * GI, 180), noise_bytes=256 * MI),
    Trace("sawtooth 8-12Gi/30s", sawtooth(8 * GI, 12 * GI, 30)),
    Trace("square 20/40Gi, 10m period", square(20 * GI, 40 * GI, 600)),
    Trace("sine 30±10Gi, 20m period", sine(30 * GI, 10 * GI, 1200)),
    Trace("flat 60Gi, noise 1Gi", lambda t: 60 * GI, noise_bytes=GI),
)


def readings(trace: Trace, seed: int) -> list[float]:
    """One reading per second for the hour, noisy, clipped to the card."""
    rng = random.Random(seed)
    return [
        min(CARD, max(0.0, trace.shape(float(t)) + rng.gauss(0, trace.noise_bytes))) for t in range(HOUR + 1)
    ]


@dataclass
class Flags:
    """When a detector fired: its first firing, and the seconds it spent flagged."""

    first: float | None
    flagged_seconds: float
    timeline: str
    """One character a minute: ``x`` flagged at the minute's end, ``.`` not."""


def run_engine(values: Sequence[float], every: int, spec: PolicySpec = SPEC, seconds: int = HOUR) -> Flags:
    """The engine on one sample every ``every`` seconds of ``values`` (bytes used, one a second) for
    ``seconds``, evaluated every 10 s; when its finding was active (``spec``: the example rule's)."""
    store = SeriesStore(retention_seconds=2400, max_points=4000)
    evaluator = PolicyEvaluator("bench/leak", spec)
    pods = [PodView(KEY.namespace, KEY.pod)]
    first: float | None = None
    active_since: float | None = None
    flagged = 0.0
    marks: list[str] = []
    for t in range(seconds + 1):
        if t % every == 0:
            store.add(KEY, Point(T0 + t, mem_used=values[t], mem_total=CARD))
        if t % EVALUATION_SECONDS:
            continue
        for step in evaluator.evaluate(pods, store, T0 + t).transitions:
            if step.transition is Transition.STARTED:
                active_since = float(t)
                first = float(t) if first is None else first
            elif step.transition is Transition.RESOLVED and active_since is not None:
                flagged += t - active_since
                active_since = None
        if t % 60 == 0 and t:
            marks.append("x" if active_since is not None else ".")
    if active_since is not None:
        flagged += seconds - active_since
    return Flags(first, flagged, "".join(marks))


def _regression(
    times: Sequence[float], values: Sequence[float], at: float, range_seconds: float
) -> tuple[float, float] | None:
    """PromQL's least-squares line through the samples in ``[at - range, at]``: (slope, its value at ``at``).

    As Prometheus 2.x computes it (``linearRegression`` in promql/functions.go), x relative to ``at``;
    None with fewer than two samples.
    """
    points = [(t - at, v) for t, v in zip(times, values, strict=True) if at - range_seconds <= t <= at]
    if len(points) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    variance = sum((x - mean_x) ** 2 for x, _ in points)
    slope = covariance / variance
    return slope, mean_y - slope * mean_x


def deriv(times: Sequence[float], values: Sequence[float], at: float, range_seconds: float) -> float | None:
    """PromQL ``deriv(v[range])`` at ``at``: the least-squares slope of the samples in range."""
    line = _regression(times, values, at, range_seconds)
    return None if line is None else line[0]


def predict_linear(
    times: Sequence[float], values: Sequence[float], at: float, range_seconds: float, ahead: float
) -> float | None:
    """PromQL ``predict_linear(v[range], ahead)`` at ``at``: the least-squares line ``ahead`` s on."""
    line = _regression(times, values, at, range_seconds)
    return None if line is None else line[1] + line[0] * ahead


@dataclass(frozen=True)
class PromRule:
    """A PromQL alert as a DCGM-exporter user writes it, and the same computed here."""

    expr: str
    fires: Callable[[Sequence[float], Sequence[float], float], bool]
    """Whether it fires at ``at`` on the scraped ``(times, values)``."""


DERIV = PromRule(
    f"deriv(gpu_memory_used_bytes[30m]) * 60 > {100 * MI}",
    lambda times, values, at: (
        (d := deriv(times, values, at, RULE.window_seconds)) is not None and d * 60 > 100 * MI
    ),
)
PREDICT_LINEAR = PromRule(
    f"predict_linear(gpu_memory_used_bytes[5m], 600) > {CARD}",
    lambda times, values, at: (p := predict_linear(times, values, at, 300, 600)) is not None and p > CARD,
)


def run_promql(values: Sequence[float], rule: PromRule) -> Flags:
    """``rule`` on 30 s samples, evaluated every 30 s, no ``for``."""
    times = [float(t) for t in range(0, HOUR + 1, SCRAPE_SECONDS)]
    scraped = [values[int(t)] for t in times]
    first: float | None = None
    flagged = 0.0
    marks: list[str] = []
    for at in times:
        firing = rule.fires(times, scraped, at)
        if firing:
            first = at if first is None else first
            flagged += SCRAPE_SECONDS if at < HOUR else 0
        if at % 60 == 0 and at:
            marks.append("x" if firing else ".")
    return Flags(first, flagged, "".join(marks))


def promtool_check(trace: Trace, seed: int, rule: PromRule) -> str:
    """``promtool test rules`` on one trace: ``rule`` must fire exactly when :func:`run_promql` says."""
    values = readings(trace, seed)
    scraped = [values[t] for t in range(0, HOUR + 1, SCRAPE_SECONDS)]
    ours = run_promql(values, rule)
    alerts = []
    for minute, mark in enumerate(ours.timeline, start=1):
        expected = "[{exp_labels: {gpu: GPU-0}}]" if mark == "x" else "[]"
        alerts.append(f"      - {{eval_time: {minute}m, alertname: Leak, exp_alerts: {expected}}}")
    rules = f"groups:\n  - name: leak\n    rules:\n      - alert: Leak\n        expr: {rule.expr}\n"
    series = " ".join(repr(v) for v in scraped)
    test = (
        "rule_files: [rules.yaml]\nevaluation_interval: 30s\ntests:\n  - interval: 30s\n"
        f"    input_series:\n      - series: 'gpu_memory_used_bytes{{gpu=\"GPU-0\"}}'\n"
        f"        values: '{series}'\n    alert_rule_test:\n" + "\n".join(alerts) + "\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "rules.yaml").write_text(rules)
        Path(tmp, "test.yaml").write_text(test)
        done = subprocess.run(
            ["promtool", "test", "rules", "test.yaml"], cwd=tmp, capture_output=True, text=True, check=False
        )
    verdict = "agrees" if done.returncode == 0 else "DISAGREES"
    firing = ours.timeline.count("x")
    name = rule.expr.split("(")[0]
    head = f"promtool {verdict} with {name} on {trace.name!r} ({len(alerts)} minutes, {firing} firing)"
    return f"{head}:\n{done.stdout}{done.stderr}"


def time_to_full(trace: Trace) -> float:
    """Seconds from a leak's onset until its noise-free shape fills the card (bisection; leaks only rise)."""
    assert trace.leak_from is not None
    low, high = trace.leak_from, trace.leak_from + 7 * 24 * HOUR
    while high - low > 0.5:
        mid = (low + high) / 2
        low, high = (mid, high) if trace.shape(mid) < CARD else (low, mid)
    return high - trace.leak_from


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def summary(trace: Trace, runs: Sequence[Flags]) -> str:
    """A leak's delay, a non-leak's flagged minutes: the median, and the worst seed when it differs.

    A leak's also says the share of its time to full still ahead when the worst seed fired.
    ``never``: some seed's leak was not found within the hour.
    """
    if trace.leak_from is not None:
        delays = [r.first - trace.leak_from for r in runs if r.first is not None]
        if not delays:
            return "never"
        med, worst = minutes(statistics.median(delays)), minutes(max(delays))
        if len(delays) < len(runs):
            return f"{med} (≤ never)"
        ahead = 1 - max(delays) / time_to_full(trace)
        share = f"{ahead:.0%} ahead" if ahead > 0 else "full first"
        return (med if med == worst else f"{med} (≤ {worst})") + f", {share}"
    flagged = [r.flagged_seconds for r in runs]
    med, worst = minutes(statistics.median(flagged)), minutes(max(flagged))
    if max(flagged) == 0:
        return "0"
    return med if med == worst else f"{med} (≤ {worst})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run every trace (or one) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, default=5, help="noisy copies of each trace")
    parser.add_argument("--trace", help="only the trace of this name")
    parser.add_argument("--timeline", action="store_true", help="print each run's minute-by-minute flags")
    parser.add_argument("--promtool", action="store_true", help="cross-check deriv with promtool and stop")
    args = parser.parse_args(argv)
    traces = [t for t in TRACES if args.trace in (None, t.name)]
    if args.promtool:
        # Each rule where it fires on a shape that is not a leak, and on a fast leak.
        named = ("sawtooth 20-40Gi/10m", "staircase 4x16Gi/90s, then flat", "leak 15Gi/m from 40Gi at 5m")
        for trace in (t for t in TRACES if t.name in named):
            for rule in (DERIV, PREDICT_LINEAR):
                print(promtool_check(trace, 0, rule))
        return 0
    print(
        "rule: memoryGrowth {rate: 100Mi/m, window: 30m, minFit: 0.8} vs deriv(mem[30m])*60 > 100Mi and"
        f" predict_linear(mem[5m], 600) > 141Gi; {len(traces)} traces of 1 h, {args.seeds} seeds each"
    )
    print("| trace | full in | gpuwarden, 1 s | gpuwarden, 30 s | deriv, 30 s | predict_linear, 30 s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for trace in traces:
        columns: list[list[Flags]] = [[], [], [], []]
        for seed in range(args.seeds):
            values = readings(trace, seed)
            columns[0].append(run_engine(values, 1))
            columns[1].append(run_engine(values, SCRAPE_SECONDS))
            columns[2].append(run_promql(values, DERIV))
            columns[3].append(run_promql(values, PREDICT_LINEAR))
        full = "" if trace.leak_from is None else approx_duration(time_to_full(trace))
        print(f"| {trace.name} | {full} | " + " | ".join(summary(trace, runs) for runs in columns) + " |")
        if args.timeline:
            for label, runs in zip(("1s", "30s", "deriv", "plin"), columns, strict=True):
                for r in runs:
                    print(f"    {label:>5} {r.timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

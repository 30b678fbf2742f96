"""Forecast-driven scaling against the reactive scaler, on generated load traces.

Replays load traces (diurnal, ramp, bursty, flat-noisy; generated from seeds, the
held-out ones never used to choose anything) through a simulated Deployment and the
real :class:`~gpuwarden.policy.scaling.decider.ScaleDecider`, once reactive (the rules
alone) and once per forecasting method, and counts per run:

- **under**: under-provisioned replica-minutes, the replicas short of the need while
  they were short (need: ``ceil(load / ceiling)`` within [min, max]; a replica still
  starting does not count as serving);
- **over**: over-provisioned replica-minutes, replicas (starting ones included: they
  hold their GPUs) beyond the need;
- **actions**: scale changes.

The simulation, every 10 s evaluation: the trace gives the load in "replica percent"
(100 = one replica fully busy); it is split evenly over the serving replicas, each
at ``min(100, load / serving)``; a new replica serves ``--startup`` after it is
asked for, at 0% until then; a scale-down removes the newest replica. Each pod's
rules are those of ``examples/gpumonitorpolicy.yaml``'s serving policy, computed
here on the pod's 10 s readings: ``saturated`` (mean over 2m above 95%, clears at
90%) and ``idle-gpu`` (mean over 5m below 20%, clears at 25%), each needing its
whole window of readings; behaviour: up at once, 1 replica a step, 1m apart; down
after 5m, 1 a step, 5m apart; 1..12 replicas. The forecast's load sample is the
sum of the pods' readings (what :func:`~gpuwarden.policy.scaling.predictive.workload_load`
computes from the store), its horizon the observed start-up time.

Methods: ``reactive``; ``holt`` (Holt's linear trend, no damping); ``damped`` (damped
trend); ``seasonal`` (damped trend plus the previous day's change, the default);
``statsmodels`` (statsmodels' damped-trend ``Holt``, refitted by maximum likelihood on
the last 6 hours every 5 buckets; only with ``--statsmodels``, which needs it
installed). Parameters were chosen on the training seeds (``--seeds train``).

    .venv/bin/python bench/forecast_scaling.py                       # held-out seeds, the table
    .venv/bin/python bench/forecast_scaling.py --seeds train --grid  # the parameter search
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

from gpuwarden.policy.scaling.decider import ScaleDecider
from gpuwarden.policy.scaling.forecast import LoadForecast, Smoothing
from gpuwarden.policy.scaling.predictive import Predictor, WorkloadLoad
from gpuwarden.policy.spec.model import (
    MAX_STEPS,
    ScaleAction,
    ScaleDirection,
    ScaleForecast,
    ScaleTargetRef,
    Signal,
)

STEP = 10.0
CEILING, CEILING_CLEAR, CEILING_FOR = 95.0, 90.0, 120.0
FLOOR, FLOOR_CLEAR, FLOOR_FOR = 20.0, 25.0, 300.0
MIN_REPLICAS, MAX_REPLICAS = 1, 12
HOUR, DAY = 3600.0, 86400.0

TRAIN_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = (101, 102, 103, 104, 105)


# --- traces: load in replica percent, one value per STEP ---------------------------------------------


class Noise:
    """Multiplicative noise: AR(1) at the minute scale, plus white noise per sample."""

    def __init__(self, rng: random.Random, minute_sd: float, sample_sd: float) -> None:
        self.rng, self.minute_sd, self.sample_sd = rng, minute_sd, sample_sd
        self.ar = 0.0
        self.rho = 0.9 ** (STEP / 60)  # minute-scale correlation

    def __call__(self) -> float:
        innovation = self.minute_sd * math.sqrt(1 - self.rho**2)
        self.ar = self.rho * self.ar + self.rng.gauss(0, innovation)
        return 1 + self.ar + self.rng.gauss(0, self.sample_sd)


def smoothstep(x: float) -> float:
    x = min(1.0, max(0.0, x))
    return x * x * (3 - 2 * x)


def diurnal(rng: random.Random) -> list[float]:
    """Four days of a service's day: quiet nights, a morning ramp, a lunch dip, an evening decline."""
    noise = Noise(rng, 0.05, 0.03)
    out = []
    for day in range(4):
        peak = 650 * rng.uniform(0.85, 1.15)
        night = 70 * rng.uniform(0.8, 1.2)
        shift = rng.uniform(-20, 20) * 60
        ramp_len = rng.uniform(0.5, 1.0) * HOUR
        for i in range(int(DAY / STEP)):
            h = (i * STEP - shift) / HOUR
            if h < 6.5:
                p = 0.0
            elif h < 6.5 + ramp_len / HOUR:
                p = smoothstep((h - 6.5) / (ramp_len / HOUR))
            elif h < 12:
                p = 1.0
            elif h < 14:
                p = 1 - 0.15 * math.sin(math.pi * (h - 12) / 2)
            elif h < 17.5:
                p = 1.0
            elif h < 22:
                p = 1 - smoothstep((h - 17.5) / 4.5)
            else:
                p = 0.0
            out.append(max(0.0, (night + (peak - night) * p) * noise()))
        _ = day
    return out


def ramp(rng: random.Random) -> list[float]:
    """Twelve hours of plateaus and ramps: a launch, a batch of clients, a campaign."""
    noise = Noise(rng, 0.04, 0.03)
    out: list[float] = []
    level = rng.uniform(100, 200)
    total = int(12 * HOUR / STEP)
    while len(out) < total:
        segments = [
            (level, level, rng.uniform(30, 90)),
            (level, (top := level + rng.uniform(250, 550)), rng.uniform(10, 40)),
            (top, top, rng.uniform(20, 60)),
            (top, (level := rng.uniform(100, 200)), rng.uniform(15, 40)),
        ]
        for start, end, minutes in segments:
            n = int(minutes * 60 / STEP)
            for i in range(n):
                out.append(max(0.0, (start + (end - start) * smoothstep(i / n)) * noise()))
    return out[:total]


def bursty(rng: random.Random) -> list[float]:
    """Twelve hours of a steady base with sudden bursts (a scheduled batch, a retry storm)."""
    noise = Noise(rng, 0.04, 0.03)
    total = int(12 * HOUR / STEP)
    extra = [0.0] * total
    t = rng.expovariate(1 / (40 * 60))
    while t < 12 * HOUR:
        start, size, length = int(t / STEP), rng.uniform(150, 400), rng.uniform(3, 12) * 60
        for i in range(start, min(total, start + int((length + 600) / STEP))):
            tau = (i - start) * STEP
            rise = min(1.0, tau / 30)
            decay = 1.0 if tau < length else math.exp(-(tau - length) / 120)
            extra[i] += size * rise * decay
        t += length + rng.expovariate(1 / (40 * 60))
    base = rng.uniform(150, 250)
    return [max(0.0, (base + e) * noise()) for e in extra]


def flat_noisy(rng: random.Random) -> list[float]:
    """Twelve hours of one level and plenty of noise: two replicas at about 82%, never saturated for long."""
    noise = Noise(rng, 0.07, 0.05)
    level = 165 * rng.uniform(0.97, 1.03)
    return [max(0.0, level * noise()) for _ in range(int(12 * HOUR / STEP))]


TRACES: dict[str, Callable[[random.Random], list[float]]] = {
    "diurnal": diurnal,
    "ramp": ramp,
    "bursty": bursty,
    "flat-noisy": flat_noisy,
}


# --- the simulated Deployment and its pods' rules ------------------------------------------------------


@dataclass
class Pod:
    asked_at: float
    readings: list[float] = field(default_factory=list)
    saturated: bool = False
    idle: bool = False

    def judge(self) -> None:
        """The two rules on this pod's readings, with their windows and hysteresis."""
        n_ceiling, n_floor = int(CEILING_FOR / STEP), int(FLOOR_FOR / STEP)
        r = self.readings
        if len(r) >= n_ceiling:
            mean = sum(r[-n_ceiling:]) / n_ceiling
            self.saturated = mean > CEILING or (self.saturated and mean > CEILING_CLEAR)
        if len(r) >= n_floor:
            mean = sum(r[-n_floor:]) / n_floor
            self.idle = mean < FLOOR or (self.idle and mean < FLOOR_CLEAR)


@dataclass(frozen=True)
class Result:
    under: float
    over: float
    actions: int
    seconds: float


def action(forecast: bool) -> ScaleAction:
    return ScaleAction(
        target_ref=ScaleTargetRef("apps/v1", "Deployment", "llm-server"),
        min_replicas=MIN_REPLICAS,
        max_replicas=MAX_REPLICAS,
        scale_up_on=("saturated",),
        scale_down_on=("idle-gpu",),
        scale_up=ScaleDirection(stabilization_seconds=0, step_replicas=1, cooldown_seconds=60),
        scale_down=ScaleDirection(stabilization_seconds=300, step_replicas=1, cooldown_seconds=300),
        forecast=ScaleForecast("saturated", CEILING, Signal.AUTO, "idle-gpu", FLOOR) if forecast else None,
    )


def needed(load: float) -> int:
    return min(MAX_REPLICAS, max(MIN_REPLICAS, math.ceil(load / CEILING)))


def simulate(
    trace: list[float],
    forecast: Callable[[], LoadForecast] | None,
    startup: float,
    max_uncertainty: float,
) -> Result:
    a = action(forecast is not None)
    if a.forecast is not None:
        a = replace(a, forecast=replace(a.forecast, max_uncertainty=max_uncertainty))
    decider = ScaleDecider()
    if forecast is not None:
        decider.predictor = Predictor()
        decider.predictor.load = forecast()
    pods = [Pod(-startup) for _ in range(needed(trace[0]))]
    under = over = 0.0
    actions = 0
    started = time.perf_counter()
    for i, load in enumerate(trace):
        now = i * STEP
        serving = [p for p in pods if now - p.asked_at >= startup]
        each = min(100.0, load / len(serving)) if serving else 0.0
        for p in pods:
            p.readings.append(each if p in serving else 0.0)
            if len(p.readings) > 64:
                del p.readings[:32]
            p.judge()
        need = needed(load)
        under += max(0, need - len(serving)) * STEP / 60
        over += max(0, len(pods) - need) * STEP / 60
        by_pod = {
            str(j): frozenset(name for name, on in (("saturated", p.saturated), ("idle-gpu", p.idle)) if on)
            for j, p in enumerate(pods)
        }
        sample = WorkloadLoad(each * len(serving), sum(each > 5 for _ in serving), len(pods))
        d = decider.decide(a, len(pods), by_pod, len(pods), now, sample)
        if d.changes:
            decider.record_scale(d, now)
            actions += 1
            if d.desired > len(pods):
                pods.extend(Pod(now) for _ in range(d.desired - len(pods)))
            else:
                del pods[d.desired :]
    return Result(under, over, actions, time.perf_counter() - started)


# --- methods -------------------------------------------------------------------------------------------


class StatsmodelsHolt(LoadForecast):
    """statsmodels' damped-trend Holt, fitted by maximum likelihood on the last 6 hours every
    ``REFIT`` buckets (a fit takes about 0.2-0.4 s here; at every bucket the diurnal runs alone would
    take hours); between fits, the last fit's forecast path, advanced by the buckets since."""

    WINDOW = 360
    REFIT = 5

    def __init__(self) -> None:
        super().__init__(Smoothing(seasonal=False))
        self._values: list[float] = []
        self._fitted: list[float] | None = None
        self._age = 0

    def _push(self, value: float, *, scored: bool) -> None:
        import warnings

        from statsmodels.tsa.holtwinters import Holt

        self._values.append(value)
        del self._values[: -self.WINDOW]
        self._age += 1
        if len(self._values) >= 10 and (self._fitted is None or self._age >= self.REFIT):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence warnings on flat stretches
                fit = Holt(self._values, damped_trend=True, initialization_method="estimated").fit()
            self._fitted = [float(v) for v in fit.forecast(MAX_STEPS + self.REFIT)]
            self._age = 0
        super()._push(value, scored=scored)

    def path(self, steps: int) -> list[float]:
        if self._fitted is None:
            return super().path(steps)
        steps = max(1, min(steps, MAX_STEPS))
        return self._fitted[self._age : self._age + steps]


def methods(with_statsmodels: bool, base: Smoothing) -> dict[str, Callable[[], LoadForecast] | None]:
    out: dict[str, Callable[[], LoadForecast] | None] = {
        "reactive": None,
        "holt": lambda: LoadForecast(replace(base, phi=1.0, seasonal=False)),
        "damped": lambda: LoadForecast(replace(base, seasonal=False)),
        "seasonal": lambda: LoadForecast(base),
    }
    if with_statsmodels:
        out["statsmodels"] = StatsmodelsHolt
    return out


def runs(
    kinds: list[str],
    seeds: tuple[int, ...],
    method: Callable[[], LoadForecast] | None,
    args: argparse.Namespace,
) -> Iterator[tuple[str, Result]]:
    for kind in kinds:
        for seed in seeds:
            trace = TRACES[kind](random.Random(f"{kind}:{seed}"))
            yield kind, simulate(trace, method, args.startup, args.max_uncertainty)


def table(args: argparse.Namespace, seeds: tuple[int, ...]) -> None:
    kinds = list(TRACES)
    print(f"seeds {seeds}; start-up {args.startup:.0f}s; means per run")
    print("| trace | method | under (replica-min) | over (replica-min) | actions | CPU per run |")
    print("| --- | --- | --- | --- | --- | --- |")
    chosen = methods(args.statsmodels, Smoothing())
    if args.methods:
        chosen = {name: chosen[name] for name in args.methods.split(",")}
    for name, method in chosen.items():
        got: dict[str, list[Result]] = {}
        for kind, result in runs(kinds, seeds, method, args):
            got.setdefault(kind, []).append(result)
        for kind in kinds:
            rs = got[kind]
            under = statistics.mean(r.under for r in rs)
            over = statistics.mean(r.over for r in rs)
            acts = statistics.mean(r.actions for r in rs)
            cpu = statistics.mean(r.seconds for r in rs)
            print(f"| {kind} | {name} | {under:.1f} | {over:.1f} | {acts:.1f} | {cpu:.2f} s |", flush=True)


def grid(args: argparse.Namespace, seeds: tuple[int, ...]) -> None:
    """Score parameter sets on the training seeds: under on ramp+diurnal, actions on flat-noisy."""
    kinds = ["ramp", "diurnal", "flat-noisy"]
    traces = {(k, s): TRACES[k](random.Random(f"{k}:{s}")) for k in kinds for s in seeds}
    reactive = {key: simulate(t, None, args.startup, args.max_uncertainty) for key, t in traces.items()}
    base_under = sum(r.under for (k, _), r in reactive.items() if k != "flat-noisy")
    base_actions = sum(r.actions for (k, _), r in reactive.items() if k == "flat-noisy")
    print(f"reactive: under {base_under:.0f}, flat-noisy actions {base_actions}")
    for alpha in (0.3, 0.5, 0.8):
        for beta in (0.05, 0.1, 0.2, 0.3):
            for phi in (0.9, 0.98):
                for width in (20.0, 30.0):
                    params = Smoothing(alpha, beta, phi)
                    got = {
                        key: simulate(t, partial(LoadForecast, params), args.startup, width)
                        for key, t in traces.items()
                    }
                    under = sum(r.under for (k, _), r in got.items() if k != "flat-noisy")
                    over = sum(r.over for (k, _), r in got.items() if k != "flat-noisy")
                    acts = sum(r.actions for (k, _), r in got.items() if k == "flat-noisy")
                    print(
                        f"alpha {alpha} beta {beta} phi {phi} width {width}: under {under:.0f} "
                        f"over {over:.0f} flat-noisy actions {acts}",
                        flush=True,
                    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", choices=["train", "held-out"], default="held-out")
    parser.add_argument("--startup", type=float, default=180.0, help="replica start-up time, seconds")
    parser.add_argument("--max-uncertainty", type=float, default=20.0)
    parser.add_argument("--grid", action="store_true", help="search the smoothing parameters")
    parser.add_argument("--statsmodels", action="store_true", help="add statsmodels' Holt (installed)")
    parser.add_argument("--methods", help="comma-separated: only these methods")
    parser.add_argument("--seed-count", type=int, help="only the first N seeds")
    args = parser.parse_args()
    seeds: tuple[int, ...] = TRAIN_SEEDS if args.seeds == "train" else HELD_OUT_SEEDS
    seeds = seeds[: args.seed_count] if args.seed_count else seeds
    if args.grid:
        grid(args, seeds)
    else:
        table(args, seeds)


if __name__ == "__main__":
    main()

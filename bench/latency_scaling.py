"""Latency-driven scaling against GPU-only scaling, on request traces played through simulated servers.

Replays request traces (steady, ramp, burst, diurnal; a few simulated hours each, generated from
seeds, see below) against a fleet of simulated inference server replicas
(:mod:`gpuwarden.sim.replica`: a FIFO queue, continuous batching, vLLM's metrics, a GPU utilization
that follows the batch), scaled by gpuwarden's real policy engine and scale decider: each policy is a
GPUMonitorPolicy spec parsed by :func:`~gpuwarden.policy.parse_spec`, evaluated by a
:class:`~gpuwarden.policy.PolicyEvaluator` every ``evaluationInterval`` on a
:class:`~gpuwarden.policy.SeriesStore` fed each replica's GPU readings (as the intake stores a node
report's), and scaled by :func:`~gpuwarden.policy.scale_step`, exactly as the operator and local mode
do. Per trace and policy it prints, means over the seeds:

- **minutes over target**: minutes whose requests (by arrival) have a P99 latency above the target;
- **replica-minutes**: every replica that holds a GPU (starting, serving, or draining its last
  requests after a scale-down) for every minute it does;
- **actions**: scale changes made.

The fleet, played faster than real time on the injected clock: requests arrive as a Poisson process
whose rate the trace gives per 10 s, and are spread round-robin over the serving replicas (each
queues its own, as vLLM does). A new replica serves ``--startup`` after it is asked for (loading its
weights: its GPU reads 0% meanwhile); a scale-down removes the newest replica, which finishes the
requests it holds. Every replica is read every 5 s (its mean GPU utilization over those 5 s, from the
model's utilization integral; memory at vLLM's 90% reservation).

Traces are generated from seeds: the policies' thresholds were chosen on the training seeds
(``--seeds train``), the table is printed for the held-out seeds (the default), never looked at
while choosing.

    .venv/bin/python bench/latency_scaling.py                    # held-out seeds, the table
    .venv/bin/python bench/latency_scaling.py --seeds train      # what the thresholds were chosen on
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.policy import (
    Histogram,
    PodId,
    PodView,
    Point,
    PolicyEvaluator,
    ScaleDecider,
    SeriesKey,
    SeriesStore,
    ServiceScrape,
    ServiceStore,
    StepKind,
    horizon_seconds,
    parse_spec,
    scale_step,
    service_metric_names,
)
from gpuwarden.sim.replica import Replica, ReplicaConfig, ReplicaMetrics

BUCKET = 10.0
"""Seconds per trace value (the arrival rate is constant within one)."""
SAMPLE = 5.0
"""Seconds between two GPU readings of a replica."""
MINUTE = 60.0
HOUR = 3600.0
NAMESPACE, APP = "inference", "llm-server"
GPU_MEMORY = 80 * 2**30
MAX_REPLICAS = 16

TRAIN_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = (101, 102, 103, 104, 105)

CONFIG = ReplicaConfig()
CAPACITY = CONFIG.max_batch / (
    (CONFIG.prefill_seconds + (CONFIG.mean_output_tokens - 1) * CONFIG.token_seconds)
    * CONFIG.speed(CONFIG.max_batch)
)
"""Requests a second one replica completes with full batches (about 3.7 with the defaults)."""


# --- traces: arrival rate in requests a second, one value per BUCKET ------------------------------------


class Noise:
    """Multiplicative noise on the rate: AR(1) at the minute scale, plus white noise per bucket."""

    def __init__(self, rng: random.Random, minute_sd: float, bucket_sd: float) -> None:
        self.rng, self.minute_sd, self.bucket_sd = rng, minute_sd, bucket_sd
        self.ar = 0.0
        self.rho = 0.9 ** (BUCKET / MINUTE)

    def __call__(self) -> float:
        self.ar = self.rho * self.ar + self.rng.gauss(0, self.minute_sd * math.sqrt(1 - self.rho**2))
        return max(0.0, 1 + self.ar + self.rng.gauss(0, self.bucket_sd))


def smoothstep(x: float) -> float:
    x = min(1.0, max(0.0, x))
    return x * x * (3 - 2 * x)


def buckets(hours: float) -> int:
    return int(hours * HOUR / BUCKET)


def steady(rng: random.Random) -> list[float]:
    """Three hours at one level, about 2.3 replicas' worth of requests, with noise."""
    noise = Noise(rng, 0.06, 0.04)
    level = 2.3 * CAPACITY * rng.uniform(0.95, 1.05)
    return [level * noise() for _ in range(buckets(3))]


def ramp(rng: random.Random) -> list[float]:
    """Three hours of plateaus and ramps: a launch, a batch of clients, a campaign."""
    noise = Noise(rng, 0.04, 0.03)
    out: list[float] = []
    level = rng.uniform(1.0, 2.0) * CAPACITY
    while len(out) < buckets(3):
        top = level + rng.uniform(2.5, 5.0) * CAPACITY
        segments = [
            (level, level, rng.uniform(15, 40)),
            (level, top, rng.uniform(8, 25)),
            (top, top, rng.uniform(15, 40)),
            (top, (level := rng.uniform(1.0, 2.0) * CAPACITY), rng.uniform(10, 30)),
        ]
        for start, end, minutes in segments:
            n = int(minutes * MINUTE / BUCKET)
            out.extend((start + (end - start) * smoothstep(i / n)) * noise() for i in range(n))
    return out[: buckets(3)]


def burst(rng: random.Random) -> list[float]:
    """Three hours of a steady base with sudden bursts (a scheduled batch, a retry storm)."""
    noise = Noise(rng, 0.04, 0.03)
    total = buckets(3)
    extra = [0.0] * total
    t = rng.expovariate(1 / (25 * MINUTE))
    while t < 3 * HOUR:
        start, size, length = int(t / BUCKET), rng.uniform(1.5, 4.0) * CAPACITY, rng.uniform(4, 12) * MINUTE
        for i in range(start, min(total, start + int((length + 600) / BUCKET))):
            tau = (i - start) * BUCKET
            decay = 1.0 if tau < length else math.exp(-(tau - length) / 120)
            extra[i] += size * min(1.0, tau / 20) * decay
        t += length + rng.expovariate(1 / (25 * MINUTE))
    base = rng.uniform(1.2, 2.0) * CAPACITY
    return [(base + e) * noise() for e in extra]


def diurnal(rng: random.Random) -> list[float]:
    """A service's day compressed into four hours: a quiet night, a morning ramp, a lunch dip, an evening."""
    noise = Noise(rng, 0.05, 0.03)
    peak = rng.uniform(5.0, 7.0) * CAPACITY
    night = rng.uniform(0.4, 0.8) * CAPACITY
    hours_per_bucket = 24 / buckets(4)  # the day's hours that one bucket stands for
    shift = rng.uniform(-0.5, 0.5)
    out = []
    for i in range(buckets(4)):
        h = i * hours_per_bucket - shift
        if h < 6.5:
            p = 0.0
        elif h < 9:
            p = smoothstep((h - 6.5) / 2.5)
        elif h < 12:
            p = 1.0
        elif h < 14:
            p = 1 - 0.2 * math.sin(math.pi * (h - 12) / 2)
        elif h < 17.5:
            p = 1.0
        elif h < 22:
            p = 1 - smoothstep((h - 17.5) / 4.5)
        else:
            p = 0.0
        out.append((night + (peak - night) * p) * noise())
    return out


TRACES: dict[str, Callable[[random.Random], list[float]]] = {
    "steady": steady,
    "ramp": ramp,
    "burst": burst,
    "diurnal": diurnal,
}


def arrivals(trace: list[float], rng: random.Random) -> Iterator[float]:
    """A Poisson process whose rate is the trace's value in each bucket."""
    for i, rate in enumerate(trace):
        if rate <= 0:
            continue
        start, end = i * BUCKET, (i + 1) * BUCKET
        t = start + rng.expovariate(rate)
        while t < end:
            yield t
            t += rng.expovariate(rate)


# --- the policies: GPUMonitorPolicy specs, as a user would write them ----------------------------------


def scale(scale_up_on: list[str], **extra: Any) -> dict[str, Any]:
    """The scale action every policy shares (the example policy's behaviour), up on ``scale_up_on``."""
    return {
        "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
        "minReplicas": 1,
        "maxReplicas": MAX_REPLICAS,
        "scaleUpOn": scale_up_on,
        "scaleDownOn": ["idle-gpu"],
        "scaleUpMinPods": "50%",
        "behavior": {
            "scaleUp": {"stabilizationWindow": "0s", "step": 1, "cooldown": "1m"},
            "scaleDown": {"stabilizationWindow": "5m", "step": 1, "cooldown": "5m"},
        },
        **extra,
    }


# Every policy scales down on the example policy's idle-gpu (examples/gpumonitorpolicy.yaml: below
# 20% for 5m), so they differ only in what scales up. The GPU-only one is the example's `saturated`
# (above 95% for 2m). The service rules' thresholds were chosen on the training seeds (see --seeds).
IDLE = {"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5m", "hysteresis": 5}}
SATURATED = {"name": "saturated", "utilizationCeiling": {"percent": 95, "for": "2m", "hysteresis": 5}}
QUEUEING = {"name": "queueing", "requestQueue": {"limit": 4, "for": "30s", "per": "replica"}}
SLOW = {
    "name": "slow-requests",
    "requestLatency": {"percentile": 99, "threshold": "15s", "window": "1m", "for": "30s"},
}
REQUESTS_PER_REPLICA = 3.0
"""The forecast's capacity of one replica: about 80% of what a full batch completes (CAPACITY)."""


def policy(rules: list[dict[str, Any]], action: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "selector": {"matchLabels": {"app": APP}},
        "evaluationInterval": "10s",
        "rules": [IDLE, *rules],
        "actions": {"events": False, "scale": action},
    }
    if any(k in rule for rule in rules for k in ("requestLatency", "requestQueue")):
        doc["serviceMetrics"] = {"server": "vllm", "interval": "10s"}
    return doc


POLICIES: dict[str, dict[str, Any]] = {
    "utilizationCeiling": policy([SATURATED], scale(["saturated"])),
    "requestQueue": policy([QUEUEING], scale(["queueing"])),
    "requestLatency P99": policy([SLOW], scale(["slow-requests"])),
    "requestLatency P99 + forecast": policy(
        [SLOW],
        scale(
            ["slow-requests"],
            forecast={"load": "requests", "requestsPerReplica": REQUESTS_PER_REPLICA, "maxUncertainty": 25},
        ),
    ),
}


# --- the fleet ----------------------------------------------------------------------------------------


@dataclass
class Pod:
    """One replica: its server model, and when it was asked for and serves."""

    name: str
    gpu: str
    replica: Replica
    asked_at: float
    ready_at: float
    util_integral: float = 0.0


@dataclass
class Result:
    minutes_over: int
    replica_minutes: float
    actions: int
    requests: int
    seconds: float


@dataclass
class Fleet:
    """The replicas of one run, round-robin routing, and the latencies per arrival minute."""

    startup: float
    seed: int
    pods: list[Pod] = field(default_factory=list)
    draining: list[Pod] = field(default_factory=list)
    latencies: dict[int, list[float]] = field(default_factory=dict)
    made: int = 0
    turn: int = 0

    def add(self, now: float, ready_at: float | None = None) -> None:
        self.made += 1
        name = f"{APP}-{self.made}"
        replica = Replica(CONFIG, seed=self.seed * 1000 + self.made)
        self.pods.append(Pod(name, f"GPU-{self.made:08d}", replica, now, now + self.startup))
        if ready_at is not None:
            self.pods[-1].ready_at = ready_at

    def remove_newest(self) -> Pod:
        pod = self.pods.pop()
        if pod.replica.in_flight:
            self.draining.append(pod)
        return pod

    def route(self, t: float) -> None:
        # The oldest replica always serves: the fleet starts ready and a scale-down takes the newest.
        serving = [p for p in self.pods if p.ready_at <= t]
        pod = serving[self.turn % len(serving)]
        self.turn += 1
        request = pod.replica.submit(t)
        self.latencies.setdefault(int(t // MINUTE), []).append(request.finish - t)

    def read(self, now: float) -> Iterator[tuple[SeriesKey, Point]]:
        """Each pod's GPU reading over the last SAMPLE; drained pods leave."""
        for pod in self.pods:
            m = pod.replica.metrics(now)
            util = 100.0 * (m.utilization_seconds - pod.util_integral) / SAMPLE
            pod.util_integral = m.utilization_seconds
            yield (
                SeriesKey(NAMESPACE, pod.name, pod.gpu),
                Point(now, util, None, 0.9 * GPU_MEMORY, GPU_MEMORY),
            )
        for pod in self.draining:
            pod.replica.metrics(now)
        self.draining = [p for p in self.draining if p.replica.in_flight]

    def scrape(self, now: float, names: frozenset[str]) -> Iterator[tuple[PodId, ServiceScrape]]:
        """Each pod's metrics as the agent would send them: only the names asked for, compacted."""
        for pod in self.pods:
            yield PodId(NAMESPACE, pod.name), compact(pod.replica.metrics(now), names)

    def views(self) -> list[PodView]:
        return [PodView(NAMESPACE, p.name, labels={"app": APP}) for p in self.pods]


def compact(m: ReplicaMetrics, names: frozenset[str]) -> ServiceScrape:
    """A replica's metrics as a :class:`ServiceScrape` of the names asked for (one label set each)."""
    return ServiceScrape(
        at=m.at,
        histograms={n: Histogram(h.bounds, h.counts, h.sum) for n, h in m.histograms.items() if n in names},
        counters={n: v for n, v in m.counters.items() if n in names},
        gauges={n: (v,) for n, v in m.gauges.items() if n in names},
    )


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def simulate(trace: list[float], spec_doc: Mapping[str, Any], seed: int, args: argparse.Namespace) -> Result:
    started = time.perf_counter()
    spec = parse_spec(spec_doc)
    evaluator = PolicyEvaluator(f"{NAMESPACE}/llm-serving", spec, namespace=NAMESPACE)
    retention = horizon_seconds(spec)
    store = SeriesStore(retention_seconds=retention, max_points=int(retention / SAMPLE * 1.25) + 16)
    services = ServiceStore(retention_seconds=retention)
    names = service_metric_names(spec)
    source = spec.service_metrics
    scrape_every = (source and source.interval_seconds) or spec.evaluation_interval_seconds
    scrape_due = 0.0
    decider = ScaleDecider()
    action = spec.actions.scale
    assert action is not None
    fleet = Fleet(args.startup, seed)
    # The fleet starts sized for the trace's first minutes at 70% of capacity, and ready.
    first = statistics.mean(trace[: int(MINUTE * 10 / BUCKET)])
    for _ in range(max(1, min(MAX_REPLICAS, math.ceil(first / (0.7 * CAPACITY))))):
        fleet.add(0.0, ready_at=0.0)
    incoming = arrivals(trace, random.Random(f"arrivals:{seed}"))
    pending = next(incoming, None)
    end = len(trace) * BUCKET
    replica_seconds = 0.0
    actions = 0
    now, due = 0.0, 0.0
    requests = 0
    while now < end:
        now += SAMPLE
        while pending is not None and pending < now:
            fleet.route(pending)
            requests += 1
            pending = next(incoming, None)
        replica_seconds += (len(fleet.pods) + len(fleet.draining)) * SAMPLE
        store.extend(fleet.read(now))
        if names and now >= scrape_due:
            scrape_due = now + scrape_every
            for pod_id, scrape in fleet.scrape(now, names):
                services.record(pod_id, scrape)
        if now < due:
            continue
        due = now + spec.evaluation_interval_seconds
        store.prune(now)
        services.prune(now)
        evaluation = evaluator.evaluate(fleet.views(), store, now, services=services)
        step = scale_step(
            decider,
            action,
            len(fleet.pods),
            evaluation.active,
            len(evaluation.matched_pods),
            now,
            evaluation.load,
        )
        if step.kind is StepKind.APPLY:
            desired = step.decision.desired
            while len(fleet.pods) < desired:
                fleet.add(now)
            while len(fleet.pods) > desired:
                gone = fleet.remove_newest()
                store.forget_pod(NAMESPACE, gone.name)
                services.forget_pod(PodId(NAMESPACE, gone.name))
            actions += 1
        if step.kind is not StepKind.HOLD:
            step.settle(made=step.kind is StepKind.APPLY)
    minutes_over = sum(1 for values in fleet.latencies.values() if p99(values) > args.target)
    return Result(minutes_over, replica_seconds / MINUTE, actions, requests, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", choices=["train", "held-out"], default="held-out")
    parser.add_argument("--startup", type=float, default=120.0, help="replica start-up time, seconds")
    parser.add_argument("--target", type=float, default=20.0, help="P99 latency target, seconds")
    parser.add_argument("--traces", help="comma-separated: only these traces")
    parser.add_argument("--policies", help="comma-separated: only these policies")
    args = parser.parse_args()
    seeds = TRAIN_SEEDS if args.seeds == "train" else HELD_OUT_SEEDS
    kinds = args.traces.split(",") if args.traces else list(TRACES)
    chosen = args.policies.split(",") if args.policies else list(POLICIES)
    print(
        f"seeds {seeds}; replica capacity {CAPACITY:.2f} requests/s; start-up {args.startup:.0f} s; "
        f"target: P99 over a minute's requests <= {args.target:.0f} s; means per run"
    )
    print("| trace | policy | minutes over target | replica-minutes | actions | requests | CPU per run |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in kinds:
        traces = {seed: TRACES[kind](random.Random(f"{kind}:{seed}")) for seed in seeds}
        for name in chosen:
            rs = [simulate(traces[seed], POLICIES[name], seed, args) for seed in seeds]
            print(
                f"| {kind} | {name} | {statistics.mean(r.minutes_over for r in rs):.1f} "
                f"| {statistics.mean(r.replica_minutes for r in rs):.0f} "
                f"| {statistics.mean(r.actions for r in rs):.1f} "
                f"| {statistics.mean(r.requests for r in rs):.0f} "
                f"| {statistics.mean(r.seconds for r in rs):.1f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""The scenario's workloads over time: pods and their processes, and Deployments whose replicas come
and go as they are scaled."""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from bisect import bisect_right
from dataclasses import dataclass

from gpuwarden.sim.replica import Replica, ReplicaConfig, ReplicaMetrics
from gpuwarden.sim.signals import Signal
from gpuwarden.sim.spec import DeploymentSpec, Idle, ServiceSpec
from gpuwarden.wire.node import PodRef


@dataclass(frozen=True, slots=True)
class ScenarioProcess:
    """One scripted process, resolved: which GPU it runs on and which pod owns it."""

    pid: int
    command: str
    gpu: str
    share: float
    pod: PodRef
    kernels: bool = True


@dataclass(frozen=True, slots=True)
class ScenarioPod:
    """One scripted pod, with what the demo's selectors need (labels, annotations)."""

    ref: PodRef
    labels: dict[str, str]
    annotations: dict[str, str]
    gpus: tuple[str, ...]
    processes: tuple[ScenarioProcess, ...]
    start: float
    end: float | None
    host_memory: Signal | None

    def active(self, t: float) -> bool:
        """Whether the pod exists at scenario time ``t``."""
        return self.start <= t and (self.end is None or t < self.end)


REPLICA_LOADING_UTILIZATION = 2.0
"""A replica loading its model: a trickle of kernels (weight conversion, warm-up), nothing served."""
REPLICA_LOADING_SHARDS = 8
"""The steps a replica's memory takes while it loads (the first as it appears)."""


class Deployment:
    """A Deployment's replicas over time: each count it was scaled to, and when
    (:meth:`~gpuwarden.sim.scenario.Scenario.scale`)."""

    def __init__(self, spec: DeploymentSpec, seed: int) -> None:
        self.spec = spec
        self.load = Signal.build(seed, f"{spec.namespace}/{spec.name}/load", spec.load, 0.0, 1e9)
        # The replicas the file starts with are up already: they appeared a start-up time before t = 0.
        self.changes: list[tuple[float, int]] = [(-spec.startup, spec.replicas)]
        digest = hashlib.blake2b(f"{seed}/{spec.namespace}/{spec.name}".encode(), digest_size=8).hexdigest()
        self.template_hash = "".join(_POD_NAME_CHARS[int(c, 16)] for c in digest[:9])
        self.pods: dict[tuple[int, float], ScenarioPod] = {}
        """Replica pods by (index, when it appeared): read at every sample, built once."""

    def replicas(self, t: float) -> int:
        """The replicas it is scaled to at ``t`` (those beyond its GPUs stay unscheduled)."""
        i = bisect_right([at for at, _ in self.changes], t) - 1
        return self.changes[max(0, i)][1]

    def since(self, index: int, t: float) -> float | None:
        """When replica ``index`` (0-based) last appeared at or before ``t``; None if it does not exist."""
        if self.replicas(t) <= index:
            return None
        since = self.changes[0][0]
        count = 0
        for at, replicas in self.changes:
            if at > t:
                break
            if count <= index < replicas:
                since = at
            count = replicas
        return since

    def serving(self, t: float) -> int:
        """The replicas that serve at ``t``: scheduled, and up for at least ``startup``."""
        n = min(self.replicas(t), len(self.spec.gpus))
        starts = (self.since(i, t) for i in range(n))
        return sum(1 for since in starts if since is not None and t - since >= self.spec.startup)

    def pod_name(self, index: int) -> str:
        """Replica ``index``'s pod name, as a ReplicaSet names it (``<name>-<hash>-<suffix>``)."""
        suffix = hashlib.blake2b(f"{self.template_hash}/{index}".encode(), digest_size=5).digest()
        return f"{self.spec.name}-{self.template_hash}-{''.join(_POD_NAME_CHARS[b % 27] for b in suffix)}"

    def replica_load(self, index: int, t: float) -> tuple[float, float] | None:
        """Replica ``index``'s (utilization, memory used) at ``t``; None when it does not exist."""
        since = self.since(index, t)
        if since is None:
            return None
        age = t - since
        if age < self.spec.startup:
            shards = math.floor(age / self.spec.startup * REPLICA_LOADING_SHARDS) + 1
            return REPLICA_LOADING_UTILIZATION, self.spec.memory * shards / REPLICA_LOADING_SHARDS
        return min(100.0, self.load(t) / max(1, self.serving(t))), self.spec.memory


def replica_config(spec: ServiceSpec) -> ReplicaConfig:
    """The model's settings for one replica of a served Deployment."""
    return ReplicaConfig(
        max_batch=spec.max_batch,
        prefill_seconds=spec.prefill,
        token_seconds=spec.token_time,
        batch_slowdown=spec.batch_slowdown,
        mean_prompt_tokens=spec.mean_prompt_tokens,
        mean_output_tokens=spec.mean_output_tokens,
        token_spread=spec.token_spread,
    )


def full_batch_rate(config: ReplicaConfig) -> float:
    """Requests a second one replica completes with its batch always full, at the mean output length:
    what a load of 100 (replica percent) asks of it."""
    service = (
        config.prefill_seconds + (config.mean_output_tokens - 1) * config.token_seconds
    ) * config.speed(config.max_batch)
    return config.max_batch / service


class _Backend:
    """One serving replica's model, and when each of its requests finishes (to count what it holds)."""

    __slots__ = ("finishes", "replica")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.finishes: list[float] = []

    def holding(self, t: float) -> int:
        """Requests submitted to it and not finished at ``t`` (waiting or running)."""
        while self.finishes and self.finishes[0] <= t:
            heapq.heappop(self.finishes)
        return len(self.finishes)

    def submit(self, t: float, output_tokens: int) -> None:
        heapq.heappush(self.finishes, self.replica.submit(t, output_tokens=output_tokens).finish)


class Service:
    """A served Deployment's requests, played forward through one simulated replica per serving pod.

    Requests arrive as a Poisson process whose rate follows the Deployment's ``load``
    (:func:`full_batch_rate` at 100), each to the serving replica that holds the fewest (the first
    of those on a tie), as the routers in front of model servers send them (vLLM's production
    stack, llm-d); none serving: the request is lost, as a Service with no ready endpoint refuses
    it. A replica gets its model when it starts serving and loses it, queue and all, when it is
    scaled away. Draws are seeded by the scenario's seed and the Deployment's name: the same
    scenario, scaled the same way at the same times, serves the same requests.

    Unlike the rest of a scenario, this is not a function of ``t``: it is played forward, so
    :meth:`metrics` must be asked at times that never go back.
    """

    def __init__(self, deployment: Deployment, spec: ServiceSpec, seed: int) -> None:
        self.deployment = deployment
        self.config = replica_config(spec)
        self.rate_at_full = full_batch_rate(self.config)
        key = f"{seed}/{deployment.spec.namespace}/{deployment.spec.name}"
        self._seed = key
        self._rng = random.Random(f"{key}/arrivals")
        output = spec.output_tokens or [Idle(kind="idle", level=spec.mean_output_tokens)]
        self._output_mean = Signal.build(
            seed, f"{key}/outputTokens", output, 1.0, float(self.config.max_tokens)
        )
        self._backends: dict[tuple[int, float], _Backend] = {}
        self._next_arrival = 0.0
        self.lost = 0
        """Requests that came when no replica served."""

    def rate(self, t: float) -> float:
        """Requests a second arriving at ``t``."""
        return max(0.0, self.deployment.load(t)) / 100.0 * self.rate_at_full

    def metrics(self, t: float) -> list[tuple[int, ReplicaMetrics]]:
        """Each serving replica's metrics at ``t`` by its index, every request up to ``t`` played."""
        self._play(t)
        return [(index, self._backend(index, since).replica.metrics(t)) for index, since in self._serving(t)]

    def _serving(self, t: float) -> list[tuple[int, float]]:
        d = self.deployment
        out = []
        for index in range(min(d.replicas(t), len(d.spec.gpus))):
            since = d.since(index, t)
            if since is not None and t - since >= d.spec.startup:
                out.append((index, since))
        return out

    def _backend(self, index: int, since: float) -> _Backend:
        backend = self._backends.get((index, since))
        if backend is None:
            digest = hashlib.blake2b(f"{self._seed}/{index}/{since}".encode(), digest_size=8).digest()
            backend = self._backends[index, since] = _Backend(
                Replica(self.config, seed=int.from_bytes(digest))
            )
        return backend

    def _output_tokens(self, t: float) -> int:
        """A request's output length, drawn around the mean at ``t`` (the model's log-normal)."""
        mean = self._output_mean(t)
        spread = self.config.token_spread
        value = self._rng.lognormvariate(math.log(mean) - spread * spread / 2, spread) if spread else mean
        return max(1, min(self.config.max_tokens, round(value)))

    def _play(self, t: float) -> None:
        while self._next_arrival <= t:
            at = self._next_arrival
            backends = [self._backend(index, since) for index, since in self._serving(at)]
            if backends:
                min(backends, key=lambda b: b.holding(at)).submit(at, self._output_tokens(at))
            else:
                self.lost += 1
            rate = self.rate(at)
            # No load: look again a second later (the load may come back).
            self._next_arrival = at + (self._rng.expovariate(rate) if rate > 0 else 1.0)
        for gone in self._backends.keys() - set(self._serving(t)):
            del self._backends[gone]


_POD_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"
"""The alphabet of generated Kubernetes name suffixes (no vowels, no look-alikes)."""

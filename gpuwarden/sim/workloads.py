"""The scenario's workloads over time: pods and their processes, and Deployments whose replicas come
and go as they are scaled."""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from dataclasses import dataclass

from gpuwarden.sim.signals import Signal
from gpuwarden.sim.spec import DeploymentSpec
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


_POD_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"
"""The alphabet of generated Kubernetes name suffixes (no vowels, no look-alikes)."""

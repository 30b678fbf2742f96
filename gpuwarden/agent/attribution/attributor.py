"""Put pod names on a snapshot: who holds each GPU, whose each process is, and their host memory.

Two sources, refreshed together by :meth:`PodAttributor.refresh` and cached between:

- the kubelet's PodResources answer: GPU → containers it was allocated to. This is
  what shows a pod that holds a GPU and runs nothing on it;
- cgroups: process → pod UID and container ID, then UID → pod through a lookup
  (the node's pod list, :class:`~gpuwarden.agent.attribution.nodepods.NodePods`).

Without a lookup, or when it does not know a UID yet, a process in a pod is put on
the container its GPU was allocated to, when that GPU was allocated to exactly one;
a shared GPU (time-slicing, MPS) with several holders then leaves it unattributed
rather than guessed.

GPUs allocated by Dynamic Resource Allocation are in the same answer under their DRA
names; a :class:`~gpuwarden.agent.attribution.dra.DraResolver` turns them into UUIDs on
every refresh, after which they are attributed exactly as device-plugin GPUs (a claim
shared by several containers is a shared GPU).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gpuwarden.agent.attribution.cgroups import CgroupIdentity, CgroupReader
from gpuwarden.agent.attribution.dra import DraResolver
from gpuwarden.agent.attribution.kubelet import Allocations, PodResourcesError, PodResourcesState
from gpuwarden.wire.node import GpuSample, PodHostMemory, PodRef, ProcessSample, Snapshot

log = logging.getLogger(__name__)

_MAX_PODS_PER_GPU = 64  # GpuSample.pods' bound on the wire
_MAX_PODS_WITH_HOST_MEMORY = 1024  # Snapshot.pod_host_memory's bound on the wire

PodKey = tuple[str, str]
"""(namespace, name)"""


class AllocationSource(Protocol):
    """Where GPU allocations come from: :class:`~gpuwarden.agent.attribution.kubelet.PodResourcesClient`."""

    state: PodResourcesState

    async def list(self) -> Allocations:
        """Every pod's allocations; raises PodResourcesError when the kubelet cannot answer."""
        ...


class PodLookup(Protocol):
    """Pod UID → the pod (``container`` empty), or None when not known."""

    def __call__(self, pod_uid: str, /) -> PodRef | None:
        """Look a pod up by UID."""
        ...


@runtime_checkable
class PodDirectory(PodLookup, Protocol):
    """A lookup that re-lists on :meth:`refresh` and also knows container names (``NodePods``)."""

    async def refresh(self) -> None:
        """Re-list if that is due (it decides); raise on failure and keep the previous list."""
        ...

    def container_name(self, container_id: str) -> str | None:
        """The name of the container with this runtime ID."""
        ...


class PodAttributor:
    """Annotates snapshots with pods, from caches that :meth:`refresh` fills.

    ``pod_resources``: the kubelet client, or None where there is no kubelet (local mode).
    ``cgroups``: where to read process cgroups and pod memory (defaults to the host's).
    ``pod_lookup``: pod UID → pod; a :class:`PodDirectory` is refreshed along with the rest.
    ``dra``: resolves DRA-allocated devices to UUIDs; without it they are not attributed.

    Call :meth:`refresh` and :meth:`annotate` from the same event loop: they share caches.
    """

    def __init__(
        self,
        pod_resources: AllocationSource | None,
        *,
        cgroups: CgroupReader | None = None,
        pod_lookup: PodLookup | None = None,
        dra: DraResolver | None = None,
    ) -> None:
        self._pod_resources = pod_resources
        self._dra = dra
        self._cgroups = cgroups or CgroupReader()
        self._lookup = pod_lookup
        self._allocations = Allocations()
        self._host_memory: dict[PodKey, int] = {}
        # pid → where it lives; read once per pid, kept while the pid keeps showing up.
        self._identities: dict[int, CgroupIdentity | None] = {}
        self._pids_seen: set[int] = set()
        # UIDs attributed through the sole-holder rule, so that their host memory can be named.
        self._learned: dict[str, PodRef] = {}
        self._lookup_failing = False  # so that an outage is logged once, not every refresh

    @property
    def pod_resources_state(self) -> PodResourcesState:
        """The kubelet's state as of the last refresh; ``not_asked`` when there is no kubelet client."""
        return self._pod_resources.state if self._pod_resources else PodResourcesState.NOT_ASKED

    @property
    def allocations(self) -> Allocations:
        """The last PodResources answer that succeeded (kept while the kubelet is away)."""
        return self._allocations

    async def refresh(self) -> None:
        """Re-read allocations, the pod list and pod memory; what fails keeps its last value, logged."""
        await self._refresh_allocations()
        if isinstance(self._lookup, PodDirectory):
            try:
                await self._lookup.refresh()
            except Exception as exc:  # any failure of an optional source: keep what it knew
                if not self._lookup_failing:
                    log.warning("pod list: %s; keeping the pods last seen", exc)
                self._lookup_failing = True
            else:
                if self._lookup_failing:
                    log.info("pod list: listing works again")
                self._lookup_failing = False
        # a UID learned through the sole-holder rule stays valid while its pod is on the node
        self._learned = {
            uid: ref
            for uid, ref in self._learned.items()
            if (ref.namespace, ref.name) in self._allocations.containers
        }
        await self._refresh_host_memory()
        # Forget pids that stopped showing up: their numbers may be reused by other processes.
        self._identities = {pid: i for pid, i in self._identities.items() if pid in self._pids_seen}
        self._pids_seen = set()

    async def _refresh_allocations(self) -> None:
        if self._pod_resources is None:
            return
        before = self._pod_resources.state
        try:
            allocations = await self._pod_resources.list()
        except PodResourcesError as exc:
            # once per change of state, not once a second while the kubelet is away
            if exc.state is not before:
                log.warning("PodResources: %s; keeping the allocations last seen", exc)
            allocations = self._allocations
        else:
            if before not in (PodResourcesState.OK, PodResourcesState.NOT_ASKED):
                log.info("PodResources: the kubelet answers again")
        # Resolved again each time, also over the last answer: the ResourceSlices may have
        # come (or changed) since.
        self._allocations = self._dra.resolve(allocations) if self._dra is not None else allocations

    async def _refresh_host_memory(self) -> None:
        # a few hundred small cgroupfs reads: off the loop, like every other file walk
        usage = await asyncio.to_thread(self._cgroups.pod_memory)
        named: dict[PodKey, int] = {}
        for uid, memory in usage.items():
            pod = self._pod_by_uid(uid)
            if pod is not None:
                named[(pod.namespace, pod.name)] = memory
        self._host_memory = named

    def annotate(self, snapshot: Snapshot) -> Snapshot:
        """Return a copy of ``snapshot`` with pods filled in; the input is not changed.

        Uses the caches of the last :meth:`refresh`, plus ``/proc/<pid>/cgroup`` for
        pids it has not seen before (procfs, microseconds, no blocking I/O). What the
        backend already filled in (a scripted scenario names its own pods) is kept.
        """
        gpus = [self._annotate_gpu(gpu) for gpu in snapshot.gpus]
        if snapshot.pod_host_memory:
            return snapshot.model_copy(update={"gpus": gpus})
        return snapshot.model_copy(update={"gpus": gpus, "pod_host_memory": self._host_memory_of(gpus)})

    def _annotate_gpu(self, gpu: GpuSample) -> GpuSample:
        holders = self._allocations.pods_for(gpu.uuid, gpu.index, gpu.mig_id)
        processes = [
            p if p.pod is not None else p.model_copy(update={"pod": self._pod_of(p, holders)})
            for p in gpu.processes
        ]
        pods = gpu.pods or list(holders[:_MAX_PODS_PER_GPU])
        return gpu.model_copy(update={"pods": pods, "processes": processes})

    def _pod_of(self, process: ProcessSample, holders: Sequence[PodRef]) -> PodRef | None:
        identity = self._identity(process.pid)
        if identity is not None and not identity.in_pod:
            return None  # a host process, or a container the kubelet did not start
        uid = identity.pod_uid if identity is not None else None
        pod = self._pod_by_uid(uid) if uid is not None else None
        if pod is not None:
            container = self._container_of(pod, identity, holders)
            # the claim through which this container holds the GPU, when DRA allocated it
            claim = next(
                (
                    h.claim
                    for h in holders
                    if (h.namespace, h.name, h.container) == (pod.namespace, pod.name, container)
                ),
                None,
            )
            return pod.model_copy(update={"container": container, "claim": claim})
        # The sole-holder rule: right unless a container outside the allocation sees the
        # GPU (a privileged pod, NVIDIA_VISIBLE_DEVICES=all); the pod list, when given, settles that.
        if len(holders) != 1:
            return None
        sole = holders[0]
        if uid is not None:
            self._learned.setdefault(uid, sole.model_copy(update={"container": ""}))
        return sole

    def _identity(self, pid: int) -> CgroupIdentity | None:
        self._pids_seen.add(pid)
        if pid not in self._identities:
            self._identities[pid] = self._cgroups.identity(pid)
        return self._identities[pid]

    def _pod_by_uid(self, uid: str) -> PodRef | None:
        pod = self._lookup(uid) if self._lookup is not None else None
        return pod or self._learned.get(uid)

    def _container_of(self, pod: PodRef, identity: CgroupIdentity | None, holders: Sequence[PodRef]) -> str:
        if identity is not None and identity.container_id and isinstance(self._lookup, PodDirectory):
            name = self._lookup.container_name(identity.container_id)
            if name:
                return name
        # Otherwise by elimination: the one container of the pod that holds this GPU,
        # or the pod's only container.
        mine = [h.container for h in holders if (h.namespace, h.name) == (pod.namespace, pod.name)]
        if len(mine) == 1:
            return mine[0]
        containers = self._allocations.containers.get((pod.namespace, pod.name), ())
        return containers[0] if len(containers) == 1 else ""

    def _host_memory_of(self, gpus: Sequence[GpuSample]) -> list[PodHostMemory]:
        # Only pods this snapshot is about: those holding a GPU or running on one.
        keys: dict[PodKey, None] = {}
        for gpu in gpus:
            for ref in (*gpu.pods, *(p.pod for p in gpu.processes if p.pod is not None)):
                keys.setdefault((ref.namespace, ref.name))
        return [
            PodHostMemory(namespace=ns, name=name, memory_bytes=self._host_memory[(ns, name)])
            for ns, name in keys
            if (ns, name) in self._host_memory
        ][:_MAX_PODS_WITH_HOST_MEMORY]

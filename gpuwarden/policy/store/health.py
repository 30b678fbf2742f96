"""What the agents reported about each GPU's health, by GPU: pure bookkeeping, like the series store.

One :class:`GpuRecord` per physical GPU of each node: keyed by the node that reports it and the
GPU's UUID, so what one node's agent says of a UUID never lands on another node's record (a
compromised node naming another's GPU only writes a record of its own). Fed snapshot by snapshot
(:meth:`HealthStore.observe`), oldest first per node:

- **lost**: since when the GPU is off the bus (its own entry, or any MIG device of it, reads
  ``lost``); cleared by the first sample that reads it again;
- **XIDs**: every XID the agent received, with its time (at most :data:`MAX_EVENTS` kept);
- **ECC**: when the uncorrected ECC count rose (the volatile count; the aggregate one where the
  GPU reports no volatile count), and the memory repair state of the latest sample (a row
  remapping failed, a row remapping or page retirement waits for a reset);
- **clock events**: runs of consecutive samples with the same clock event reasons; a run lasts
  until the next sample that reads otherwise, or ends at its last sample when the next one
  came more than :data:`RUN_GAP_SECONDS` later (missing samples never count as throttled);
- **pods**: which pods were on the GPU (allocated to it or running a process on it, on the GPU's
  own entry or one of its MIG devices), and when last.

Bounded in entries whatever the reports say (:class:`Admission` counts what is refused, by
reason): :data:`MAX_GPUS_PER_NODE` GPUs a node and :data:`MAX_GPUS` in all (``tooManyGpus``),
:data:`MAX_DEVICES_PER_GPU` MIG devices a GPU (``tooManyGpus``), :data:`MAX_PODS_PER_GPU` pods on
a GPU at once and as many remembered (``tooManyPods``); a pod the caller does not admit (another
node's, one it does not know) is never put on a GPU. An XID outside the caller's time bounds is
refused (``future``, ``past``): a time that far off is no time of the agent's, and a year ahead
would keep the GPU unhealthy for a year.

Every change worth announcing is also appended to an incident log (:meth:`HealthStore.incidents`),
numbered, for the operator's node view: a lost GPU, an XID, an uncorrected ECC error, a memory
repair that failed or waits, a hardware slowdown that starts. It never reads a clock: ``prune``
is told ``now``.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuwarden.policy.store.intake import pods_of
from gpuwarden.policy.store.series import PodId
from gpuwarden.wire.node import ClockEventReason, DeviceState, GpuSample, Snapshot

__all__ = [
    "HARDWARE_SLOWDOWN",
    "MAX_DEVICES_PER_GPU",
    "MAX_GPUS",
    "MAX_GPUS_PER_NODE",
    "MAX_PODS_PER_GPU",
    "Admission",
    "FoundOn",
    "GpuRecord",
    "HealthStore",
    "Incident",
    "IncidentKind",
    "Run",
]


class FoundOn(Protocol):
    """What :meth:`HealthStore.claim_of` reads of a finding (a :class:`~gpuwarden.policy.findings.Finding`):
    typed by shape because findings sit above the store (findings -> rules -> store)."""

    @property
    def namespace(self) -> str: ...
    @property
    def pod(self) -> str: ...
    @property
    def gpus(self) -> tuple[str, ...]: ...


MAX_EVENTS = 64
"""XIDs and ECC increases kept per GPU (the newest); the rules look back minutes, not days."""
MAX_RUNS = 4096
"""Clock-event runs kept per GPU: at one change a second, more than an hour."""
MAX_INCIDENTS = 4096
"""Incidents kept for readers that fell behind (the operator reads them every second)."""
MAX_GPUS_PER_NODE = 32
"""GPU records a node may have (a node has 8, 16 at most; room for GPUs replaced within the retention)."""
MAX_GPUS = 100_000
"""GPU records in all: a replica takes 2,000 nodes of 8 GPUs (docs/scaling-out.md), with room to spare."""
MAX_DEVICES_PER_GPU = 8
"""MIG devices a GPU may have (an H100 or H200 splits into 7 at most)."""
MAX_PODS_PER_GPU = 64
"""Pods on one GPU at once (as many as a report may name), and pods it remembers having had."""
RUN_GAP_SECONDS = 5.0
"""A gap between two samples longer than this breaks a clock-event run (as it breaks a window)."""

HARDWARE_SLOWDOWN = frozenset(
    {
        ClockEventReason.HW_SLOWDOWN,
        ClockEventReason.HW_THERMAL_SLOWDOWN,
        ClockEventReason.HW_POWER_BRAKE_SLOWDOWN,
    }
)
"""The reasons the hardware itself imposes to protect the GPU (overheating, a power brake): an incident."""


class IncidentKind(enum.StrEnum):
    """What happened to a GPU."""

    LOST = "lost"
    XID = "xid"
    ECC = "ecc"
    MEMORY_REPAIR = "memoryRepair"
    HW_SLOWDOWN = "hwSlowdown"


@dataclass(frozen=True, slots=True)
class Incident:
    """One thing that happened to one GPU, as :meth:`HealthStore.incidents` lists it."""

    seq: int
    node: str
    uuid: str
    index: int
    kind: IncidentKind
    at: float
    xid: int | None = None
    detail: str = ""
    """``ecc``: how many new errors; ``memoryRepair``: which; ``hwSlowdown``: the reasons."""
    pods: tuple[PodId, ...] = ()
    """The pods on the GPU when it happened."""


@dataclass(slots=True)
class Run:
    """Consecutive samples of one GPU with the same clock event reasons (None: not read)."""

    start: float
    end: float
    reasons: tuple[ClockEventReason, ...] | None


@dataclass(slots=True)
class Admission:
    """What the caller lets into the store from one report, and what the store refused of it.

    ``admit`` says whether a pod may be put on the reporting node's GPUs (the operator's ingest
    checks it as it checks readings: a pod of another node, or unknown, is not); XIDs stamped
    outside ``[earliest, latest]`` are refused. ``refused`` counts what was left out, by reason;
    ``devices`` are the device ids (GPU or MIG device UUIDs) whose GPU got no record, so that
    their readings are refused too.
    """

    admit: Callable[[PodId], bool] | None = None
    earliest: float = -math.inf
    latest: float = math.inf
    refused: dict[str, int] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)

    def refuse(self, reason: str, count: int = 1) -> None:
        """Count ``count`` things left out for ``reason``."""
        self.refused[reason] = self.refused.get(reason, 0) + count


@dataclass(slots=True)
class GpuRecord:
    """One physical GPU's health as reported (see the module doc)."""

    uuid: str
    index: int
    node: str
    last_seen: float
    lost_since: float | None = None
    xids: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_EVENTS)
    )
    """(time, code), oldest first."""
    ecc_errors: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_EVENTS)
    )
    """(time, new errors) each time the uncorrected count rose, oldest first."""
    ecc_count: int | None = None
    ecc_volatile: bool = True
    memory_repair: str | None = None
    """``row remapping failed``, ``row remapping pending`` or ``page retirement pending``, while reported."""
    runs: collections.deque[Run] = field(default_factory=lambda: collections.deque(maxlen=MAX_RUNS))
    current: tuple[PodId, ...] = ()
    """The pods on the GPU in its latest sample."""
    pods: dict[PodId, float] = field(default_factory=dict)
    """Pods that were on the GPU before, and when last (oldest first)."""
    devices: set[str] = field(default_factory=set)
    """Its MIG devices' UUIDs (utilization series are keyed by them)."""
    claims: dict[PodId, str] = field(default_factory=dict)
    """The DRA ResourceClaim through which each of the current pods holds it, where the agent named one."""

    def has_device(self, device: str) -> bool:
        """Whether ``device`` is this GPU or one of its MIG devices."""
        return device == self.uuid or device in self.devices

    def pod_seen(self, pod: PodId) -> float | None:
        """When ``pod`` was last on the GPU (its latest sample if it still is), or None."""
        return self.last_seen if pod in self.current else self.pods.get(pod)

    def fresh(self, now: float, stale_after: float) -> bool:
        """Whether the GPU was reported within ``stale_after`` seconds of ``now``."""
        return now - self.last_seen <= stale_after

    def xids_since(self, since: float, codes: Iterable[int]) -> list[tuple[float, int]]:
        """The XIDs of ``codes`` at or after ``since``, oldest first."""
        wanted = set(codes)
        return [(t, code) for t, code in self.xids if t >= since and code in wanted]

    def ecc_since(self, since: float) -> list[tuple[float, int]]:
        """The uncorrected ECC increases at or after ``since``, oldest first."""
        return [(t, n) for t, n in self.ecc_errors if t >= since]

    def throttled_for(
        self, reasons: frozenset[ClockEventReason]
    ) -> tuple[float, frozenset[ClockEventReason]]:
        """How long the GPU has been held by one of ``reasons`` without a break, up to its last sample,
        and which of them it was; ``(0.0, {})`` when the latest sample shows none."""
        since: float | None = None
        seen: set[ClockEventReason] = set()
        later: Run | None = None
        for run in reversed(self.runs):
            held = reasons.intersection(run.reasons or ())
            if not held or (later is not None and later.start - run.end > RUN_GAP_SECONDS):
                break
            since = run.start
            seen |= held
            later = run
        if since is None:
            return 0.0, frozenset()
        return self.last_seen - since, frozenset(seen)

    def throttled_share(
        self, reasons: frozenset[ClockEventReason], start: float, end: float
    ) -> tuple[float, frozenset[ClockEventReason]]:
        """The share of ``[start, end]`` covered by samples in which one of ``reasons`` held (of the time
        covered by samples at all), and which of them; ``(0.0, {})`` without samples there."""
        covered = throttled = 0.0
        seen: set[ClockEventReason] = set()
        runs = self.runs
        for i in range(len(runs) - 1, -1, -1):
            run = runs[i]
            # A run lasts until the next one starts, unless a gap came between them.
            nxt = runs[i + 1] if i + 1 < len(runs) else None
            until = nxt.start if nxt is not None and nxt.start - run.end <= RUN_GAP_SECONDS else run.end
            if until <= start:
                break
            overlap = min(until, end) - max(run.start, start)
            if overlap <= 0:
                continue
            covered += overlap
            held = reasons.intersection(run.reasons or ())
            if held:
                throttled += overlap
                seen |= held
        if covered <= 0:
            return 0.0, frozenset()
        return throttled / covered, frozenset(seen)


def _one_pod(record: GpuRecord, sample: GpuSample) -> tuple[PodId, ...] | None:
    """What :func:`pods_of` would say of a GPU allocated to one pod that runs whatever runs on it, without
    building it again when it is the GPU's current pod; None for anything else (the slow path)."""
    refs = sample.pods
    if len(refs) != 1:
        return None
    namespace, name = refs[0].namespace, refs[0].name
    for proc in sample.processes:
        owner = proc.pod
        if owner is not None and (owner.name != name or owner.namespace != namespace):
            return None
    current = record.current
    if len(current) == 1 and current[0].name == name and current[0].namespace == namespace:
        return current
    return (PodId(namespace, name),)


def _claims(samples: Sequence[GpuSample], on: tuple[PodId, ...]) -> dict[PodId, str]:
    """The claims the samples name for the pods of ``on`` (an admitted pod only: never another node's)."""
    kept = set(on)
    claims: dict[PodId, str] = {}
    for sample in samples:
        for ref in sample.pods:
            if ref.claim is not None and (pod := PodId(ref.namespace, ref.name)) in kept:
                claims[pod] = ref.claim
    return claims


class HealthStore:
    """Every reported GPU's health record by (node, UUID), bounded by age (``retention_seconds``) and
    count (see the module doc)."""

    def __init__(self, retention_seconds: float) -> None:
        if retention_seconds <= 0:
            raise ValueError("retention_seconds must be > 0")
        self.retention_seconds = retention_seconds
        self._nodes: dict[str, dict[str, GpuRecord]] = {}
        """node → GPU UUID → record."""
        self._count = 0
        self._by_pod: dict[PodId, set[tuple[str, str]]] = {}
        """Every GPU (node, UUID) each pod was on (what :meth:`gpus_of` starts from)."""
        self._incidents: collections.deque[Incident] = collections.deque(maxlen=MAX_INCIDENTS)
        self._seq = 0

    def __len__(self) -> int:
        return self._count

    # -- writing ------------------------------------------------------------------------------------

    def observe(
        self,
        snapshot: Snapshot,
        *,
        node: str = "",
        subjects: Callable[[GpuSample], Iterable[PodId]] = pods_of,
        admission: Admission | None = None,
    ) -> None:
        """Take one snapshot of ``node``'s GPUs; a GPU's snapshots not newer than its last are ignored.

        ``subjects`` says who is on a GPU: its pods (local mode's process subjects otherwise);
        ``admission`` what of them may be kept, and what was refused (see :class:`Admission`).
        Runs once per snapshot on the operator's ingest path: the common case (a GPU without MIG
        whose pods and readings did not change) touches a few attributes and allocates nothing.
        """
        t = snapshot.timestamp
        samples = snapshot.gpus
        groups: Iterable[tuple[str, Sequence[GpuSample]]]
        if any(s.mig_id is not None for s in samples):
            by_gpu: dict[str, list[GpuSample]] = {}
            for sample in samples:
                by_gpu.setdefault(sample.uuid, []).append(sample)
            groups = by_gpu.items()
        else:
            groups = [(s.uuid, (s,)) for s in samples]
        gpus = self._nodes.get(node)
        for uuid, group in groups:
            record = gpus.get(uuid) if gpus is not None else None
            if record is None:
                if (gpus is not None and len(gpus) >= MAX_GPUS_PER_NODE) or self._count >= MAX_GPUS:
                    if admission is not None:
                        admission.refuse("tooManyGpus", len(group))
                        admission.devices.update(s.mig_id or s.uuid for s in group)
                    continue
                if gpus is None:
                    gpus = self._nodes[node] = {}
                own = next((s for s in group if s.mig_id is None), group[0])
                record = gpus[uuid] = GpuRecord(uuid=uuid, index=own.index, node=node, last_seen=-math.inf)
                self._count += 1
            if t <= record.last_seen:
                continue  # a replay or a retry: already taken
            self._take(record, group, t, subjects, admission)

    def _take(
        self,
        record: GpuRecord,
        samples: Sequence[GpuSample],
        t: float,
        subjects: Callable[[GpuSample], Iterable[PodId]],
        admission: Admission | None,
    ) -> None:
        own: GpuSample | None
        if len(samples) == 1:
            only = own = samples[0]
            if only.mig_id is not None:
                self._add_device(record, only.mig_id, admission)
            on = _one_pod(record, only) if subjects is pods_of else None
            if on is None:
                on = tuple(subjects(only))
            lost = only.state is DeviceState.LOST
        else:
            own = next((s for s in samples if s.mig_id is None), None)
            seen: dict[PodId, None] = {}
            for sample in samples:
                if sample.mig_id is not None and not self._add_device(record, sample.mig_id, admission):
                    continue
                for pod in subjects(sample):
                    seen[pod] = None
            on = tuple(seen)
            lost = any(s.state is DeviceState.LOST for s in samples)
        if on != record.current:
            on = self._admit(on, admission)
            if on != record.current:
                self._move_pods(record, on)
                # A pod holds a GPU through one claim for its life: read again only when the pods change.
                record.claims = _claims(samples, on)

        if lost and record.lost_since is None:
            record.lost_since = t
            self._incident(record, IncidentKind.LOST, t, pods=on)
        elif not lost:
            record.lost_since = None

        health = own.health if own is not None else None
        if health is not None:
            for xid in health.xids:
                at = xid.timestamp
                if admission is not None and not admission.earliest <= at <= admission.latest:
                    admission.refuse("future" if at > admission.latest else "past")
                    continue
                record.xids.append((at, xid.code))
                self._incident(record, IncidentKind.XID, at, xid=xid.code, pods=on)
        if own is not None and not lost:
            self._take_memory(record, own, t, on)
        reasons = None if health is None or lost else health.clock_event_reasons
        self._take_reasons(record, None if reasons is None else tuple(reasons), t, on)
        record.last_seen = t

    @staticmethod
    def _add_device(record: GpuRecord, device: str, admission: Admission | None) -> bool:
        """Note a MIG device of ``record``; False (refused) past :data:`MAX_DEVICES_PER_GPU`."""
        if device in record.devices:
            return True
        if len(record.devices) >= MAX_DEVICES_PER_GPU:
            if admission is not None:
                admission.refuse("tooManyGpus")
                admission.devices.add(device)
            return False
        record.devices.add(device)
        return True

    @staticmethod
    def _admit(on: tuple[PodId, ...], admission: Admission | None) -> tuple[PodId, ...]:
        """The pods of ``on`` the caller admits, at most :data:`MAX_PODS_PER_GPU` (the rest counted)."""
        admit = admission.admit if admission is not None else None
        kept = on if admit is None else tuple(pod for pod in on if admit(pod))
        if len(kept) > MAX_PODS_PER_GPU:
            if admission is not None:
                admission.refuse("tooManyPods", len(kept) - MAX_PODS_PER_GPU)
            kept = kept[:MAX_PODS_PER_GPU]
        return kept

    def _move_pods(self, record: GpuRecord, on: tuple[PodId, ...]) -> None:
        """The GPU's pods changed: the ones that left keep the time they were last seen on it (the
        :data:`MAX_PODS_PER_GPU` latest)."""
        key = (record.node, record.uuid)
        for pod in record.current:
            if pod not in on:
                record.pods[pod] = record.last_seen
        for pod in on:
            record.pods.pop(pod, None)
            self._by_pod.setdefault(pod, set()).add(key)
        while len(record.pods) > MAX_PODS_PER_GPU:
            # Left in time order: the first is the one that left longest ago.
            gone = next(iter(record.pods))
            del record.pods[gone]
            self._unlink(gone, key)
        record.current = on

    def _unlink(self, pod: PodId, key: tuple[str, str]) -> None:
        gpus = self._by_pod.get(pod)
        if gpus is not None:
            gpus.discard(key)
            if not gpus:
                del self._by_pod[pod]

    def _take_memory(self, record: GpuRecord, own: GpuSample, t: float, on: tuple[PodId, ...]) -> None:
        health = own.health
        count, volatile = own.ecc_uncorrected, True
        if count is None and health is not None:
            count, volatile = health.ecc_uncorrected_aggregate, False
        if count is not None and (count != record.ecc_count or volatile is not record.ecc_volatile):
            before = record.ecc_count if record.ecc_volatile is volatile else None
            if before is not None and count > before:
                record.ecc_errors.append((t, count - before))
                self._incident(record, IncidentKind.ECC, t, detail=str(count - before), pods=on)
            # A count that fell was reset (a driver reload resets the volatile one): start again from it.
            record.ecc_count, record.ecc_volatile = count, volatile
        repair = None
        if health is not None:
            if health.row_remap_failed:
                repair = "row remapping failed"
            elif health.row_remap_pending:
                repair = "row remapping pending"
            elif health.retired_pages_pending:
                repair = "page retirement pending"
        if repair != record.memory_repair:
            if repair is not None:
                self._incident(record, IncidentKind.MEMORY_REPAIR, t, detail=repair, pods=on)
            record.memory_repair = repair

    def _take_reasons(
        self,
        record: GpuRecord,
        reasons: tuple[ClockEventReason, ...] | None,
        t: float,
        on: tuple[PodId, ...],
    ) -> None:
        runs = record.runs
        last = runs[-1] if runs else None
        if last is not None and last.reasons == reasons and t - last.end <= RUN_GAP_SECONDS:
            last.end = t
            return
        slowing = HARDWARE_SLOWDOWN.intersection(reasons or ())
        was = HARDWARE_SLOWDOWN.intersection(last.reasons or ()) if last is not None else frozenset()
        if slowing and not slowing <= was:
            detail = ", ".join(sorted(slowing))
            self._incident(record, IncidentKind.HW_SLOWDOWN, t, detail=detail, pods=on)
        runs.append(Run(t, t, reasons))

    def _incident(
        self,
        record: GpuRecord,
        kind: IncidentKind,
        at: float,
        *,
        xid: int | None = None,
        detail: str = "",
        pods: tuple[PodId, ...] = (),
    ) -> None:
        self._seq += 1
        self._incidents.append(
            Incident(self._seq, record.node, record.uuid, record.index, kind, at, xid, detail, pods)
        )

    def prune(self, now: float) -> None:
        """Forget what is older than ``now - retention_seconds``, and GPUs not reported since then."""
        cutoff = now - self.retention_seconds
        for node in list(self._nodes):
            gpus = self._nodes[node]
            for uuid in [u for u, r in gpus.items() if r.last_seen < cutoff]:
                del gpus[uuid]
                self._count -= 1
            if not gpus:
                del self._nodes[node]
            for record in gpus.values():
                while record.xids and record.xids[0][0] < cutoff:
                    record.xids.popleft()
                while record.ecc_errors and record.ecc_errors[0][0] < cutoff:
                    record.ecc_errors.popleft()
                while len(record.runs) > 1 and record.runs[1].start < cutoff:
                    record.runs.popleft()
                for pod in [p for p, seen in record.pods.items() if seen < cutoff]:
                    del record.pods[pod]
        for pod in list(self._by_pod):
            keys = self._by_pod[pod]
            for key in list(keys):
                on = self._record(key)
                seen = None if on is None else on.pod_seen(pod)
                if seen is None or seen < cutoff:
                    keys.discard(key)
            if not keys:
                del self._by_pod[pod]

    def forget_pod(self, namespace: str, name: str) -> None:
        """A pod was deleted: it is on no GPU any more."""
        pod = PodId(namespace, name)
        for key in self._by_pod.pop(pod, set()):
            record = self._record(key)
            if record is not None:
                record.pods.pop(pod, None)
                record.current = tuple(p for p in record.current if p != pod)

    # -- reading ------------------------------------------------------------------------------------

    def _record(self, key: tuple[str, str]) -> GpuRecord | None:
        gpus = self._nodes.get(key[0])
        return gpus.get(key[1]) if gpus is not None else None

    def gpu(self, device: str, *, node: str = "") -> GpuRecord | None:
        """The record of ``node``'s GPU by its UUID, or by the UUID of one of its MIG devices."""
        gpus = self._nodes.get(node)
        if gpus is None:
            return None
        record = gpus.get(device)
        if record is not None:
            return record
        return next((r for r in gpus.values() if device in r.devices), None)

    def gpu_of(self, namespace: str, name: str, device: str) -> GpuRecord | None:
        """The GPU a pod was on whose UUID, or one of whose MIG devices' UUIDs, is ``device``: only the
        record of the node that reported the pod on it (another node's record of that UUID is not it)."""
        for key in self._by_pod.get(PodId(namespace, name), ()):
            record = self._record(key)
            if record is not None and record.has_device(device):
                return record
        return None

    def claim_of(self, finding: FoundOn) -> str | None:
        """The DRA ResourceClaim through which a finding's pod holds one of its GPUs, as its node said."""
        pod = PodId(finding.namespace, finding.pod)
        for device in finding.gpus:
            record = self.gpu_of(finding.namespace, finding.pod, device)
            if record is not None and (claim := record.claims.get(pod)) is not None:
                return claim
        return None

    def gpus_of(self, namespace: str, name: str, *, since: float) -> list[GpuRecord]:
        """The GPUs a pod was on at or after ``since``, by node and index."""
        pod = PodId(namespace, name)
        records = []
        for key in self._by_pod.get(pod, ()):
            record = self._record(key)
            seen = None if record is None else record.pod_seen(pod)
            if record is not None and seen is not None and seen >= since:
                records.append(record)
        return sorted(records, key=lambda r: (r.node, r.index, r.uuid))

    def gpus_on(self, node: str) -> list[GpuRecord]:
        """Every GPU of a node, by index."""
        return sorted(self._nodes.get(node, {}).values(), key=lambda r: (r.index, r.uuid))

    def nodes(self) -> set[str]:
        """The nodes with at least one GPU record."""
        return set(self._nodes)

    def incidents(self, after: int = 0) -> Iterator[Incident]:
        """The incidents numbered above ``after``, oldest first (those that fell out of the log are gone)."""
        for incident in self._incidents:
            if incident.seq > after:
                yield incident

    @property
    def last_incident(self) -> int:
        """The number of the newest incident (0 before the first)."""
        return self._seq

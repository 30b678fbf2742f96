"""The ledger: each subject's GPU-seconds allocated, used and idle, integrated from its devices' readings.

A *subject* is a pod (or, in local mode, a host process) on one GPU model; a *device* is a GPU, or a
MIG device keyed by its UUID, of one node. The ledger reads a node's snapshot at a time: every
device in it, with the readings of the subjects whose time is counted (those the operator admitted).

The rule, per device and interval (docs/accounting.md says why this split):

- **Intervals.** A device's reading at ``t`` accounts for ``(t0, t]`` since the device's previous
  reading (NVML's utilization describes the sampling period that ends at the reading). A device's
  first reading opens it and accounts for nothing; a reading not newer than the previous one is
  ignored (the series store drops it too).
- **Gaps.** An interval longer than both ``max_gap`` (the series store's gap bound,
  :data:`~gpuwarden.policy.GAP_RECORD_SECONDS`, 5 s: agents sample at 1 s) and
  :data:`GAP_INTERVALS` times the shorter of the device's two previous intervals is a gap, and counts
  nothing: time nobody read is neither allocated nor used nor idle.
- **Physical time.** The interval times the device's share of its GPU (1 for a whole GPU; a MIG
  device's memory as a share of its GPU's memory, :data:`MIG_FALLBACK_FRACTION` when that is not
  known; a GPU in MIG mode, the share none of its MIG devices covers). All of it goes to the
  device's holders, or, with none, to the node's unallocated time.
- **Holders.** The pods the kubelet allocated the device to; with none named (no PodResources
  answer), the pods running on it; in local mode the processes running on it. A pod that runs on a
  device allocated to others holds nothing there.
- **Used.** Each holder's activity as a share of the device (GPM's SM activity where the reading
  has it, else ``gpu_util``: NVML's utilization alone on a device, the sum of the holder's processes'
  per-process SM utilization when shared) times the physical time; when the holders' shares add up
  to more than the device, they are scaled down to it. A reading without an activity takes the
  holder's last one on the device for at most :data:`CARRY_SECONDS`; past that its activity is
  unknown.
- **Allocated.** Each holder's used time, plus an even part of the device's unused time (the
  physical time less what the holders with a known activity used): the holders' allocated seconds
  add up to the device's physical seconds, and nobody's used exceeds its allocated. A holder whose
  activity is unknown is allocated its even part, counted as ``unknown`` (neither used nor idle).
- **Idle** is allocated less used, in the intervals where the holder's used time is under
  ``idle_floor`` percent of its allocated time (:data:`DEFAULT_IDLE_FLOOR`).
- **Held** is the wall-clock time a holder held the device, whatever its share: what a person
  expects beside a share of a shared GPU.
- **Bounds.** With a :class:`Bound` for a pod (what the API says it was allocated, and when it
  started), the pod's allocated seconds of a snapshot are at most its GPUs times the time since its
  previous snapshot (never before its start, never after ``until``); what is over is scaled off its
  seconds and counted in :attr:`Ledger.refused`.

The same readings in the same order give the same totals: plain float sums, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuwarden.policy import (
    GAP_RECORD_SECONDS,
    Point,
    points_from_processes,
    points_from_snapshot,
    process_subject,
)
from gpuwarden.wire.node import DeviceState, GpuSample, Snapshot

DEFAULT_IDLE_FLOOR = 5.0
"""Percent of its allocation under which a holder's interval counts as idle (the SM activity of a
notebook left open, a server with no requests: a few percent of housekeeping kernels)."""
GAP_INTERVALS = 3.0
"""An interval is a gap past this many of the device's recent intervals (and past ``max_gap``): the
policies' adaptive coverage bound (:mod:`gpuwarden.policy.rules.common`)."""
CARRY_SECONDS = 30.0
"""How long a holder's last known activity stands in for readings without one: three of the
agent's default per-process utilization periods (10 s)."""
MIG_FALLBACK_FRACTION = 1 / 7
"""A MIG device's share of its GPU when the parent's memory is not in the snapshot: one compute
slice of seven, the smallest profile."""

_NO_SHARE = 1e-9
"""What is left of a GPU whose MIG devices cover it: rounding, not a share."""

Pod = tuple[str, str]
"""(namespace, name) of a pod; ``("", "pid/<pid>")`` for a host process in local mode."""
_NO_READINGS: Mapping[Pod, Point] = {}


class Device(NamedTuple):
    """What the ledger needs of one device entry of a snapshot (a tuple: the ingest builds one per
    GPU per snapshot, and a frozen dataclass costs several times more to build)."""

    model: str
    """The GPU's product name (``NVIDIA H200``); a MIG device carries its parent's."""
    fraction: float = 1.0
    """The device's share of its GPU: 1, or a MIG device's."""
    holders: tuple[Pod, ...] = ()
    """The pods the device is allocated to, each once; empty: allocated to nobody known."""
    gpu: str = ""
    """The UUID of the GPU (a MIG device's parent's)."""


class Bound(NamedTuple):
    """What the API says a pod was allocated: at most ``gpus`` GPUs, from ``start`` on."""

    gpus: float
    start: float


def devices_of(snapshot: Snapshot, *, processes: bool = False) -> dict[str, Device]:
    """Each readable device of ``snapshot`` by its series' device id (the MIG UUID for a MIG device).

    ``processes``: local mode, where nothing allocates GPUs: a device is held by the host processes
    running on it (as ``("", "pid/<pid>")``, local mode's subjects).
    """
    parents: dict[str, GpuSample] | None = None  # the GPUs by UUID, once a MIG device is met
    sliced: dict[str, float] = {}  # each GPU in MIG mode: its MIG devices' shares together
    devices: dict[str, Device] = {}
    for gpu in snapshot.gpus:
        if gpu.state is not DeviceState.OK:
            continue
        if processes:
            holders = tuple(dict.fromkeys(("", process_subject(p.pid)) for p in gpu.processes))
        elif len(gpu.pods) == 1:  # the common case, without a generator
            ref = gpu.pods[0]
            holders = ((ref.namespace, ref.name),)
        else:
            holders = tuple(dict.fromkeys((p.namespace, p.name) for p in gpu.pods))
        if gpu.mig_id is None:
            devices[gpu.uuid] = Device(gpu.model, 1.0, holders, gpu.uuid)
            continue
        if parents is None:
            parents = {g.uuid: g for g in snapshot.gpus if g.mig_id is None}
        parent = parents.get(gpu.uuid)
        whole, own = (parent.memory_total_bytes if parent else None), gpu.memory_total_bytes
        fraction = min(1.0, own / whole) if whole and own else MIG_FALLBACK_FRACTION
        model = gpu.model or (parent.model if parent else "")
        devices[gpu.mig_id] = Device(model, fraction, holders, gpu.uuid)
        sliced[gpu.uuid] = sliced.get(gpu.uuid, 0.0) + fraction
    for uuid, share in sliced.items():
        # A GPU in MIG mode is its MIG devices: its own entry (the device-wide readings, held by
        # nobody) counts only the share no MIG device covers, so that its devices add up to one GPU.
        itself = devices.get(uuid)
        if itself is None:
            continue
        if itself.fraction - share > _NO_SHARE:
            devices[uuid] = itself._replace(fraction=itself.fraction - share)
        else:
            del devices[uuid]
    return devices


@dataclass(slots=True)
class Usage:
    """GPU-seconds: allocated, used, idle, unknown; and the wall-clock seconds held (see the module doc)."""

    allocated: float = 0.0
    used: float = 0.0
    idle: float = 0.0
    unknown: float = 0.0
    """Allocated seconds whose activity was not known (neither used nor idle); not exported."""
    held: float = 0.0
    """Wall-clock seconds the devices were held, whatever the share; not exported."""

    def add(self, other: Usage, scale: float = 1.0) -> None:
        """Add ``other``'s seconds (times ``scale``) to these."""
        self.allocated += other.allocated * scale
        self.used += other.used * scale
        self.idle += other.idle * scale
        self.unknown += other.unknown * scale
        self.held += other.held * scale

    @property
    def efficiency(self) -> float | None:
        """Used over allocated (at most 1); None with nothing allocated."""
        return min(1.0, self.used / self.allocated) if self.allocated > 0 else None


class Subject(tuple[str, str, str]):
    """(namespace, pod, GPU model): what the ledger totals by."""

    __slots__ = ()

    @property
    def namespace(self) -> str:
        """The pod's namespace (``""`` for a host process in local mode)."""
        return self[0]

    @property
    def pod(self) -> str:
        """The pod's name (``pid/<pid>`` for a host process)."""
        return self[1]

    @property
    def model(self) -> str:
        """The GPU model."""
        return self[2]


@dataclass(slots=True)
class _Device:
    last_t: float
    # The two intervals before the latest reading (inf: none yet). The shorter of two, not the last
    # alone: the interval right after an outage is the outage, and must not excuse the next one.
    step: float = math.inf
    step_before: float = math.inf
    activity: dict[Pod, tuple[float, float]] = field(default_factory=dict)
    """Each holder's last known activity on the device, and when it was read."""
    gpu: str = ""
    """The GPU's UUID (a MIG device's parent's)."""


@dataclass
class Ledger:
    """Per-subject totals integrated from readings (see the module doc for the rules)."""

    idle_floor: float = DEFAULT_IDLE_FLOOR
    """Percent; see the module doc."""
    max_gap: float = GAP_RECORD_SECONDS
    carry_seconds: float = CARRY_SECONDS
    refused: float = 0.0
    """GPU-seconds a pod claimed past its :class:`Bound`, not counted."""
    _devices: dict[tuple[str, str], _Device] = field(default_factory=dict, init=False)
    _totals: dict[Pod, dict[str, Usage]] = field(default_factory=dict, init=False)
    _last: dict[Pod, float] = field(default_factory=dict, init=False)
    """Each pod's latest snapshot time: its bound's interval starts there; silence is judged by it."""
    _unallocated: dict[tuple[str, str], Usage] = field(default_factory=dict, init=False)
    _nodes: dict[tuple[str, str], Usage] = field(default_factory=dict, init=False)

    def observe(
        self,
        node: str,
        t: float,
        devices: Mapping[str, Device],
        readings: Mapping[str, Mapping[Pod, Point]],
        *,
        bound: Callable[[Pod], Bound | None] | None = None,
        until: float = math.inf,
    ) -> None:
        """Account for ``node``'s snapshot at ``t``: each of its ``devices``, with the readings of the
        pods counted there by device id (``readings``). ``bound``: a pod's :class:`Bound`, None where
        the API says nothing; ``until``: no time after it is counted (the receiver's clock)."""
        # What each pod may still be allocated in this snapshot (its bound's), once it is met.
        left: dict[Pod, float] = {}
        last = self._last
        for device_id, device in devices.items():
            points = readings.get(device_id, _NO_READINGS)
            holders = device.holders or tuple(points)
            key = (node, device_id)
            series = self._devices.get(key)
            if series is None:
                series = self._devices[key] = _Device(t, gpu=device.gpu)
                self._activities(series, holders, points, t)
                continue
            if t <= series.last_t:
                continue
            interval = t - series.last_t
            # Comparisons, not min() and max(): this runs for every device of every snapshot.
            recent = series.step if series.step < series.step_before else series.step_before
            series.last_t, series.step, series.step_before = t, interval, series.step
            gap = interval > self.max_gap and (recent == math.inf or interval > GAP_INTERVALS * recent)
            if len(holders) == 1 and len(series.activity) < 2:
                # One holder, the common case: no mapping of activities, no split.
                (holder,) = holders
                point = points.get(holder)
                activity = None if point is None else _activity(point)
                known = series.activity
                if activity is not None:
                    known[holder] = (activity, t)
                else:
                    carried = known.get(holder)
                    if carried is not None and t - carried[1] <= self.carry_seconds:
                        activity = carried[0]
                if gap or point is None:
                    continue
                physical = device.fraction * interval
                if activity is None:
                    self._credit(
                        node,
                        holder,
                        device.model,
                        physical,
                        0.0,
                        0.0,
                        physical,
                        interval,
                        left,
                        bound,
                        t,
                        until,
                    )
                else:
                    used = activity * physical
                    idle = physical - used if activity * 100.0 < self.idle_floor else 0.0
                    self._credit(
                        node, holder, device.model, physical, used, idle, 0.0, interval, left, bound, t, until
                    )
                continue
            activities = self._activities(series, holders, points, t)
            if gap:
                continue
            physical = device.fraction * interval
            if not holders:
                free = self._unallocated.get((node, device.model))
                if free is None:
                    free = self._unallocated[(node, device.model)] = Usage()
                free.allocated += physical
                free.held += interval
                continue
            busy = 0.0
            for activity in activities.values():
                if activity is not None:
                    busy += activity
            scale = 1.0 / busy if busy > 1.0 else 1.0  # the holders' shares never exceed the device
            part = physical * (1.0 - busy * scale) / len(activities)
            floor = self.idle_floor / 100.0
            for pod, activity in activities.items():
                if pod not in points:
                    continue  # not counted here (refused, or a namespace not watched): its part is nobody's
                if activity is None:
                    self._credit(
                        node, pod, device.model, part, 0.0, 0.0, part, interval, left, bound, t, until
                    )
                else:
                    used = activity * scale * physical
                    idle = part if used < floor * (used + part) else 0.0
                    self._credit(
                        node, pod, device.model, used + part, used, idle, 0.0, interval, left, bound, t, until
                    )
        for points in readings.values():
            for pod in points:
                if last.get(pod, -math.inf) < t:
                    last[pod] = t

    def _credit(
        self,
        node: str,
        pod: Pod,
        model: str,
        allocated: float,
        used: float,
        idle: float,
        unknown: float,
        held: float,
        left: dict[Pod, float],
        bound: Callable[[Pod], Bound | None] | None,
        t: float,
        until: float,
    ) -> None:
        """Add one holder's seconds of one device to its totals, held to its bound (``left``: what
        each pod may still be allocated in this snapshot, filled as pods are met)."""
        if bound is not None:
            room = left.get(pod)
            if room is None:
                room = math.inf
                limit = bound(pod)
                if limit is not None:
                    since = self._last.get(pod, -math.inf)
                    end = t if t < until else until
                    begin = since if since > limit.start else limit.start
                    room = limit.gpus * (end - begin) if end > begin else 0.0
            if allocated > room:
                cut = room / allocated
                self.refused += allocated - room
                allocated, used, idle, unknown, held = room, used * cut, idle * cut, unknown * cut, held * cut
            left[pod] = room - allocated
        models = self._totals.get(pod)
        if models is None:
            models = self._totals[pod] = {}
        total = models.get(model)
        if total is None:
            total = models[model] = Usage()
        # Added in place: this runs for every holder of every device of every snapshot.
        total.allocated += allocated
        total.used += used
        total.idle += idle
        total.unknown += unknown
        total.held += held
        total = self._nodes.get((node, model))
        if total is None:
            total = self._nodes[(node, model)] = Usage()
        total.allocated += allocated
        total.used += used
        total.idle += idle

    def _activities(
        self, series: _Device, holders: Iterable[Pod], points: Mapping[Pod, Point], t: float
    ) -> dict[Pod, float | None]:
        """Each holder's activity at ``t`` (see the module doc), carried where the reading has none."""
        known = series.activity
        out: dict[Pod, float | None] = {}
        for pod in holders:
            point = points.get(pod)
            activity = None if point is None else _activity(point)
            if activity is not None:
                known[pod] = (activity, t)
            else:
                last = known.get(pod)
                if last is not None and t - last[1] <= self.carry_seconds:
                    activity = last[0]
            out[pod] = activity
        if len(known) > len(out):  # holders that left the device
            for pod in [p for p in known if p not in out]:
                del known[pod]
        return out

    def totals(self) -> dict[Subject, Usage]:
        """Every subject's totals so far (the Usage objects are the ledger's own: read, do not keep)."""
        return {
            Subject((ns, pod, model)): u
            for (ns, pod), models in self._totals.items()
            for model, u in models.items()
        }

    def unallocated(self) -> dict[tuple[str, str], Usage]:
        """GPU-seconds of the devices no pod held, by (node, GPU model) (the ledger's own: read only)."""
        return self._unallocated

    def nodes(self) -> dict[tuple[str, str], Usage]:
        """The pods' totals by (node, GPU model), forgotten pods' included (the ledger's own: read only)."""
        return self._nodes

    def pods(self) -> list[Pod]:
        """The pods (namespace, name) with totals."""
        return list(self._totals)

    def knows(self, namespace: str, pod: str) -> bool:
        """Whether the pod has been read or has totals here (and was not forgotten since)."""
        return (namespace, pod) in self._last or (namespace, pod) in self._totals

    def pod_totals(self, namespace: str, pod: str) -> dict[str, Usage]:
        """One pod's totals by GPU model (live: read, do not keep)."""
        return self._totals.get((namespace, pod), {})

    def forget(self, namespace: str, pod: str) -> dict[str, Usage]:
        """Drop a pod's totals; its totals by GPU model, for whoever keeps them on."""
        self._last.pop((namespace, pod), None)
        return self._totals.pop((namespace, pod), {})

    def silent_pods(self, before: float) -> list[Pod]:
        """The pods not read at or after ``before`` (gone, or moved away)."""
        return sorted(pod for pod, t in self._last.items() if t < before)

    def forget_devices(self, before: float) -> set[tuple[str, str]]:
        """Drop the devices not read at or after ``before`` (their nodes gone, or moved away); the
        GPUs (node, UUID) of those that stay."""
        for key in [k for k, d in self._devices.items() if d.last_t < before]:
            del self._devices[key]
        return {(node, d.gpu) for (node, _), d in self._devices.items()}


def observe_snapshot(ledger: Ledger, snapshot: Snapshot, *, processes: bool = False) -> None:
    """Local mode: account for every pod's share of its devices in ``snapshot`` (the demo's scripted
    pods), or with ``processes`` every host process's (``watch``)."""
    readings: dict[str, dict[Pod, Point]] = {}
    points = points_from_processes(snapshot) if processes else points_from_snapshot(snapshot)
    for key, point in points:
        readings.setdefault(key.gpu, {})[(key.namespace, key.pod)] = point
    ledger.observe("", snapshot.timestamp, devices_of(snapshot, processes=processes), readings)


def usage_lines(ledger: Ledger, name_of: Callable[[str, str], str]) -> list[str]:
    """One line per subject and GPU model: its wall-clock time held and its GPU-seconds allocated,
    used, idle (``name_of``: a subject's display name from its namespace and pod); one per GPU model
    for the time no subject held; and what was wasted: idle and unallocated."""
    lines = []
    idle = unallocated = physical = 0.0
    for namespace, pod in sorted(ledger.pods()):
        for model, u in sorted(ledger.pod_totals(namespace, pod).items()):
            physical += u.allocated
            idle += u.idle
            if u.efficiency is None or u.unknown >= u.allocated:
                used = "activity unknown"
            else:
                used = f"{u.used:.1f} used ({100 * u.efficiency:.0f}%), {u.idle:.1f} idle"
                if u.unknown > 0:
                    used += f", activity unknown for {u.unknown:.1f}"
            lines.append(
                f"{name_of(namespace, pod)} on {model or 'GPU'}: held {u.held:.0f} s, "
                f"{u.allocated:.1f} GPU-s allocated, {used}"
            )
    free: dict[str, float] = {}
    for (_, model), u in ledger.unallocated().items():
        free[model] = free.get(model, 0.0) + u.allocated
    for model, seconds in sorted(free.items()):
        lines.append(f"unallocated {model or 'GPU'}: {seconds:.1f} GPU-s held by nobody")
        physical += seconds
        unallocated += seconds
    if physical > 0:
        wasted = idle + unallocated
        lines.append(
            f"wasted: {wasted / 3600:.3f} GPU-hours of {physical / 3600:.3f} ({wasted:.1f} GPU-s: "
            f"{idle:.1f} idle, {unallocated:.1f} unallocated)"
        )
    return lines


def _activity(point: Point) -> float | None:
    """The reading's activity as a share of its device (see the module doc), clamped to [0, 1]."""
    value = point.sm_active if point.sm_active is not None else point.gpu_util
    if value is None:
        return None
    share = value / 100.0
    return 1.0 if share > 1.0 else share if share > 0.0 else 0.0

"""The ledger: each subject's GPU-seconds allocated, used and idle, integrated from its readings.

A *subject* is a pod (or, in local mode, a host process) on one GPU model; a *series* is a subject
on one device (a GPU, or a MIG device keyed by its UUID), as the series store keys readings.

The rules, per series, for each reading at ``t`` after the series' previous one at ``t0``:

- **Intervals.** The reading accounts for the interval ``(t0, t]`` (NVML's utilization describes
  the sampling period that ends at the reading). A series' first reading opens it and accounts for
  nothing; a reading not newer than the previous one is ignored (the series store drops it too).
- **Gaps.** An interval longer than both ``max_gap`` (the series store's gap bound,
  :data:`~gpuwarden.policy.GAP_RECORD_SECONDS`, 5 s: agents sample at 1 s) and
  :data:`GAP_INTERVALS` times the shorter of the series' two previous intervals (an agent told to
  sample every 10 s reads every 10 s; the policies' coverage adapts to the sampling the same way)
  is a gap, and counts nothing: time nobody read is neither allocated nor used nor idle. So an
  agent down for an hour costs its pods an hour of accounting, never an hour guessed; a series'
  first interval is judged against ``max_gap`` alone (there is no interval before it).
- **Allocated.** The device's share of its GPU (1 for a whole GPU; a MIG device's memory as a
  share of its GPU's memory, the same snapshot's parent entry; :data:`MIG_FALLBACK_FRACTION` when
  that is not known) split evenly among the pods the kubelet allocated it to (time-slicing hands
  out replicas of one GPU), times the interval. A pod that runs processes on a device it was not
  allocated (a privileged pod that sees every GPU) is allocated nothing there, unless the device
  was allocated to nobody (no PodResources answer): then the pods running on it hold it together.
- **Activity** of the reading, as a share of the device: GPM's SM activity where the reading has
  it (Hopper and later: the share of SM cycles doing work), else ``gpu_util`` (NVML's
  utilization, or on a shared device the sum of the pod's processes' per-process SM utilization,
  which is the pod's share of the device). A reading without it (per-process utilization is read
  every 10 s, the device every second) takes the series' last known activity, for at most
  :data:`CARRY_SECONDS`; past that the interval is allocated with no activity known: neither used
  nor idle.
- **Used** is the activity times the device's share of its GPU times the interval: GPU-seconds of
  work, whichever way the GPU is cut. On a time-sliced GPU a pod may use more than its even share
  (its efficiency then reads over 100%); the pods' used time never exceeds the GPU's.
- **Idle** is the allocated time of the intervals whose activity, relative to the pod's
  allocation (activity times the number of pods allocated the device), is under ``idle_floor``
  percent (:data:`DEFAULT_IDLE_FLOOR`).

The same readings in the same order give the same totals: plain float sums, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuwarden.policy import GAP_RECORD_SECONDS, Point, SeriesKey, points_from_processes, process_subject
from gpuwarden.wire.node import DeviceState, GpuSample, Snapshot

DEFAULT_IDLE_FLOOR = 5.0
"""Percent of its allocation under which a pod's interval counts as idle (the SM activity of a
notebook left open, a server with no requests: a few percent of housekeeping kernels)."""
GAP_INTERVALS = 3.0
"""An interval is a gap past this many of the series' recent intervals (and past ``max_gap``): the
policies' adaptive coverage bound (:mod:`gpuwarden.policy.rules.common`)."""
CARRY_SECONDS = 30.0
"""How long a series' last known activity stands in for readings without one: three of the
agent's default per-process utilization periods (10 s)."""
MIG_FALLBACK_FRACTION = 1 / 7
"""A MIG device's share of its GPU when the parent's memory is not in the snapshot: one compute
slice of seven, the smallest profile."""


class Device(NamedTuple):
    """What the ledger needs of one device entry of a snapshot (a tuple: the ingest builds one per
    GPU per snapshot, and a frozen dataclass costs several times more to build)."""

    model: str
    """The GPU's product name (``NVIDIA H200``); a MIG device carries its parent's."""
    fraction: float = 1.0
    """The device's share of its GPU: 1, or a MIG device's."""
    holders: frozenset[tuple[str, str]] = frozenset()
    """The pods (namespace, name) the device is allocated to; empty: allocated to nobody known."""


def devices_of(snapshot: Snapshot, *, processes: bool = False) -> dict[str, Device]:
    """Each readable device of ``snapshot`` by its series' device id (the MIG UUID for a MIG device).

    ``processes``: local mode, where nothing allocates GPUs: a device is held by the host processes
    running on it (as ``("", "pid/<pid>")``, local mode's subjects), split evenly among them.
    """
    parents: dict[str, GpuSample] | None = None  # the GPUs by UUID, once a MIG device is met
    devices: dict[str, Device] = {}
    for gpu in snapshot.gpus:
        if gpu.state is not DeviceState.OK:
            continue
        if processes:
            holders = frozenset(("", process_subject(p.pid)) for p in gpu.processes)
        elif len(gpu.pods) == 1:  # the common case, without a generator
            ref = gpu.pods[0]
            holders = frozenset(((ref.namespace, ref.name),))
        else:
            holders = frozenset((p.namespace, p.name) for p in gpu.pods)
        if gpu.mig_id is None:
            devices[gpu.uuid] = Device(gpu.model, 1.0, holders)
            continue
        if parents is None:
            parents = {g.uuid: g for g in snapshot.gpus if g.mig_id is None}
        parent = parents.get(gpu.uuid)
        whole, own = (parent.memory_total_bytes if parent else None), gpu.memory_total_bytes
        fraction = min(1.0, own / whole) if whole and own else MIG_FALLBACK_FRACTION
        devices[gpu.mig_id] = Device(gpu.model or (parent.model if parent else ""), fraction, holders)
    return devices


@dataclass(slots=True)
class Usage:
    """GPU-seconds: allocated, used, idle (see the module doc)."""

    allocated: float = 0.0
    used: float = 0.0
    idle: float = 0.0
    unknown: float = 0.0
    """Allocated seconds whose activity was not known (neither used nor idle); not exported."""

    def add(self, other: Usage) -> None:
        """Add ``other``'s seconds to these."""
        self.allocated += other.allocated
        self.used += other.used
        self.idle += other.idle
        self.unknown += other.unknown

    @property
    def efficiency(self) -> float | None:
        """Used over allocated; None with nothing allocated."""
        return self.used / self.allocated if self.allocated > 0 else None


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
class _Series:
    last_t: float
    activity: float | None = None
    activity_t: float = 0.0
    # The two intervals before the latest reading (inf: none yet). The shorter of two, not the last
    # alone: the interval right after an outage is the outage, and must not excuse the next one.
    step: float = math.inf
    step_before: float = math.inf


@dataclass
class Ledger:
    """Per-subject totals integrated from readings (see the module doc for the rules)."""

    idle_floor: float = DEFAULT_IDLE_FLOOR
    """Percent; see the module doc."""
    max_gap: float = GAP_RECORD_SECONDS
    carry_seconds: float = CARRY_SECONDS
    _series: dict[tuple[str, str], dict[str, _Series]] = field(default_factory=dict, init=False)
    _totals: dict[tuple[str, str], dict[str, Usage]] = field(default_factory=dict, init=False)

    def observe(self, key: SeriesKey, point: Point, device: Device) -> None:
        """Account for ``point`` of ``key``'s series on ``device``."""
        pod = (key.namespace, key.pod)
        devices = self._series.get(pod)
        if devices is None:
            devices = self._series[pod] = {}
        series = devices.get(key.gpu)
        t = point.t
        activity = _activity(point)
        if series is None:
            devices[key.gpu] = _Series(t, activity, t)
            return
        if t <= series.last_t:
            return
        interval = t - series.last_t
        # Comparisons, not min() and max(): this runs for every reading the operator stores.
        recent = series.step if series.step < series.step_before else series.step_before
        series.last_t, series.step, series.step_before = t, interval, series.step
        if activity is not None:
            series.activity, series.activity_t = activity, t
        elif series.activity is not None and t - series.activity_t <= self.carry_seconds:
            activity = series.activity
        if interval > self.max_gap and (recent == math.inf or interval > GAP_INTERVALS * recent):
            return
        holders = len(device.holders)
        if pod in device.holders:
            share = device.fraction / holders
        elif not device.holders:
            share = device.fraction  # allocated to nobody known: whoever runs on it holds it
            holders = 1
        else:
            share = 0.0
        models = self._totals.get(pod)
        if models is None:
            models = self._totals[pod] = {}
        total = models.get(device.model)
        if total is None:
            total = models[device.model] = Usage()
        # Added in place: this runs for every reading the operator stores.
        allocated = share * interval
        total.allocated += allocated
        if activity is None:
            total.unknown += allocated
        else:
            total.used += activity * device.fraction * interval
            if share > 0 and activity * holders * 100.0 < self.idle_floor:
                total.idle += allocated

    def totals(self) -> dict[Subject, Usage]:
        """Every subject's totals so far (the Usage objects are the ledger's own: read, do not keep)."""
        return {
            Subject((ns, pod, model)): u
            for (ns, pod), models in self._totals.items()
            for model, u in models.items()
        }

    def pods(self) -> list[tuple[str, str]]:
        """The pods (namespace, name) with totals."""
        return list(self._totals)

    def knows(self, namespace: str, pod: str) -> bool:
        """Whether the pod has a series or totals here (it was read, and not forgotten since)."""
        return (namespace, pod) in self._series or (namespace, pod) in self._totals

    def pod_totals(self, namespace: str, pod: str) -> dict[str, Usage]:
        """One pod's totals by GPU model (live: read, do not keep)."""
        return self._totals.get((namespace, pod), {})

    def forget(self, namespace: str, pod: str) -> dict[str, Usage]:
        """Drop a pod's series and totals; its totals by GPU model, for whoever keeps them on."""
        self._series.pop((namespace, pod), None)
        return self._totals.pop((namespace, pod), {})

    def silent_pods(self, before: float) -> list[tuple[str, str]]:
        """The pods none of whose series was read at or after ``before`` (gone, or moved away)."""
        return sorted(
            pod for pod in self._totals if all(s.last_t < before for s in self._series.get(pod, {}).values())
        )


def observe_processes(ledger: Ledger, snapshot: Snapshot) -> None:
    """Local mode: account for every host process's share of its devices in ``snapshot``."""
    devices = devices_of(snapshot, processes=True)
    for key, point in points_from_processes(snapshot):
        device = devices.get(key.gpu)
        if device is not None:
            ledger.observe(key, point, device)


def usage_lines(ledger: Ledger, name_of: Callable[[str, str], str]) -> list[str]:
    """One line per subject and GPU model: its GPU-seconds allocated, used, idle (``name_of``: a
    subject's display name from its namespace and pod)."""
    lines = []
    for namespace, pod in sorted(ledger.pods()):
        for model, u in sorted(ledger.pod_totals(namespace, pod).items()):
            if u.efficiency is None or u.unknown >= u.allocated:
                used = "activity unknown"
            else:
                used = f"{u.used:.0f} used ({100 * u.efficiency:.0f}%), {u.idle:.0f} idle"
                if u.unknown > 0:
                    used += f", activity unknown for {u.unknown:.0f}"
            lines.append(
                f"{name_of(namespace, pod)} on {model or 'GPU'}: {u.allocated:.0f} GPU-s held, {used}"
            )
    return lines


def _activity(point: Point) -> float | None:
    """The reading's activity as a share of its device (see the module doc), clamped to [0, 1]."""
    value = point.sm_active if point.sm_active is not None else point.gpu_util
    if value is None:
        return None
    share = value / 100.0
    return 1.0 if share > 1.0 else share if share > 0.0 else 0.0

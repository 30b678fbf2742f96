"""Bounded sliding windows of GPU readings, one series per (namespace, pod, GPU).

The store is the engine's only memory of the past. It is pure bookkeeping: it
never reads a clock (``prune`` is told ``now``) and never does I/O.

Memory per series
-----------------
Each retained point costs **24 bytes**: the timestamp as a float64 and four
readings (gpu_util, sm_active, mem_used, power_w) as float32 columns. The card's
total memory barely ever changes, so only its latest value is kept, once per
series; so is what the gpu_util readings are made of
(:class:`UtilizationSource`: the device's counter, or the subject's processes'
share of a shared GPU), which changes only when a GPU starts or stops being
shared. A series never holds more than ``max_points`` points plus a compaction
slack of ``max(16, max_points // 8)`` (old points are dropped lazily, in
batches, so that each add is amortised O(1)); CPython's arrays over-allocate by
about 6% on growth; a gap index (gaps over 5 s) and about 1 KiB of objects come
on top. Measured (``bench/engine.py``, ``docs/benchmarks.md``): **44.8 KiB for a
1,800-point series** (30 minutes at 1 s; 25.5 bytes a point all told), 48 KiB at
the 1,980 points a 30-minute memoryGrowth window needs retained; at most about
50 KiB for 1,800 points.

**Hook readings** (:class:`HookPoint`: allocated, reserved and host memory from the training
hook, :mod:`gpuwarden.hook`) get three more float32 columns, created on a series' first hooked
point and NaN before it, and the newest point's top allocation sites; a series that never saw one
holds only a ``None`` for them, so they cost nothing where no job is hooked. A hooked 1,800-point
series holds 67 KiB (12 bytes a point more; measured as in docs/benchmarks.md, "The hook's columns").

float32 keeps 24 bits of mantissa: percentages and watts are exact to far
better than a reading's own noise, and memory sizes are kept to within 16 KiB at
141 GB (relative 6e-8), well below anything a memory rule can tell apart.
"""

from __future__ import annotations

import enum
import math
import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from gpuwarden.wire.node import AllocationSite

BYTES_PER_POINT = 24
"""float64 timestamp + four float32 readings."""

GAP_RECORD_SECONDS = 5.0
"""Intervals between consecutive points longer than this are indexed (see :meth:`Window.longest_gap`)."""


class SeriesKey(NamedTuple):
    """Identifies one series: a pod's view of one GPU (or MIG device)."""

    namespace: str
    pod: str
    gpu: str
    """The GPU UUID, or the MIG device UUID for a MIG instance."""


class UtilizationSource(enum.StrEnum):
    """What a series' ``gpu_util`` readings are made of."""

    DEVICE = "device"
    """NVML utilization.gpu: the whole device's counter (a subject alone on its GPU)."""
    PROCESSES = "processes"
    """The sum of the subject's processes' per-process SM utilization (a shared GPU): 0 for a
    process that NVML's per-process reading leaves out, as it ran no kernel in the window."""
    NO_PROCESS = "noProcess"
    """0: the subject runs no process on a shared GPU it was allocated (or reads as running none)."""


class PodId(NamedTuple):
    """A pod by namespace and name."""

    namespace: str
    name: str


@dataclass(slots=True)
class Point:
    """One reading of one series at time ``t`` (seconds since the epoch).

    ``None`` means the reading is not available (not supported, not sampled, not
    attributable), never zero; the store keeps it as NaN.
    """

    t: float
    gpu_util: float | None = None
    """Percent: NVML utilization.gpu, or on a shared GPU the sum of the subject's per-process SM
    utilization (``util_source`` says which)."""
    sm_active: float | None = None
    """GPM SM activity, percent."""
    mem_used: float | None = None
    """Bytes of GPU memory used."""
    mem_total: float | None = None
    """Bytes of GPU memory on the card (or MIG instance)."""
    power_w: float | None = None
    """Power draw in watts."""
    util_source: UtilizationSource = UtilizationSource.DEVICE
    """What ``gpu_util`` is made of."""
    hook: HookPoint | None = None
    """What the subject's training hook read, when it runs one."""


@dataclass(frozen=True, slots=True)
class HookPoint:
    """The training hook's readings of one subject on one GPU at one instant (None: not read)."""

    allocated: float | None = None
    """Bytes live tensors hold on this GPU (torch.cuda.memory_allocated)."""
    reserved: float | None = None
    """Bytes the caching allocator holds on this GPU (torch.cuda.memory_reserved)."""
    host: float | None = None
    """Resident host memory of the subject's hooked processes and their workers, each process once."""
    sites: tuple[AllocationSite, ...] = ()
    """The lines whose allocations grew, in the hook's order: the job's own lines first (tracemalloc on)."""
    host_limit: float | None = None
    """The memory limit ``host`` counts against (the hooked processes' cgroup's); None: not known."""


class Column(enum.IntEnum):
    """The readings a window keeps per point (``mem_total`` is kept once per series)."""

    GPU_UTIL = 0
    SM_ACTIVE = 1
    MEM_USED = 2
    POWER_W = 3
    ALLOCATED = 4
    """Hook columns from here on: present only on a series that saw a hooked point."""
    RESERVED = 5
    HOST = 6


BASE_COLUMNS = 4
"""The columns every series keeps; the rest (:class:`HookColumns`) only once the hook is seen."""

HOOK_BYTES_PER_POINT = 12
"""The three hook columns' float32 readings, on a hooked series only."""


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


class HookColumns:
    """A series' hook readings: allocated, reserved and host memory, aligned with its timestamps."""

    __slots__ = ("cols", "host_limit", "last_allocated", "last_nan", "sites")

    def __init__(self, backfill: int) -> None:
        nans = array("f", [math.nan]) * backfill
        self.cols: tuple[array[float], ...] = (nans, array("f", nans), array("f", nans))
        # Physical index of each column's newest NaN (the backfill's last, or none).
        self.last_nan = [backfill - 1] * 3
        self.last_allocated = -math.inf
        """The time of the newest point with an allocated reading (``memory: auto`` reads it)."""
        self.sites: tuple[AllocationSite, ...] = ()
        """The newest hooked point's allocation sites."""
        self.host_limit: float | None = None
        """The newest host memory limit a hooked point knew (None: none did)."""

    def append(self, hook: HookPoint | None, index: int) -> None:
        """Append one point's readings at physical ``index`` (None: a point the hook did not read)."""
        values = (None, None, None) if hook is None else (hook.allocated, hook.reserved, hook.host)
        for c, (col, v) in enumerate(zip(self.cols, values, strict=True)):
            if v is None or v != v:
                col.append(math.nan)
                self.last_nan[c] = index
            else:
                col.append(v)
        if hook is not None:
            self.sites = hook.sites
            # Kept through readings that do not know it: a pod's RSS sum may pass its limit as the
            # OOM killer strikes, when the time left is nil, not unknown.
            if hook.host_limit is not None:
                self.host_limit = hook.host_limit


class Window:
    """The retained points of one series, oldest first; a bounded, compacting buffer.

    Read it through :meth:`span`, :meth:`times` and :meth:`values`, which work on
    logical indexes (0 is the oldest retained point); write to it only through
    :class:`SeriesStore`. Slices come back as fresh ``array`` copies, so callers
    can run C-speed builtins (``sum``, ``min``, ``map``) over them.

    Two small indexes, kept as points arrive, spare the rules a scan per
    evaluation: where each column last had a missing reading, and every gap
    between consecutive points longer than :data:`GAP_RECORD_SECONDS`.
    """

    __slots__ = (
        "_cols",
        "_gap_end",
        "_gap_len",
        "_head",
        "_hook",
        "_last_nan",
        "_slack",
        "_t",
        "max_points",
        "mem_total",
        "util_source",
    )

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self._slack = max(16, max_points // 8)
        self._t: array[float] = array("d")
        self._cols: tuple[array[float], ...] = tuple(array("f") for _ in range(BASE_COLUMNS))
        self._head = 0  # points before this physical index are dropped, awaiting compaction
        # Physical index of each column's newest NaN; below the head (e.g. -1) means none retained.
        self._last_nan = [-1] * BASE_COLUMNS
        self._hook: HookColumns | None = None  # created by the first hooked point
        # Gaps longer than GAP_RECORD_SECONDS: the timestamp that ended each, and its length.
        self._gap_end: array[float] = array("d")
        self._gap_len: array[float] = array("d")
        self.mem_total: float | None = None
        """The card's total memory from the latest point that reported it."""
        self.util_source = UtilizationSource.DEVICE
        """What the latest ``gpu_util`` reading was made of."""

    def __len__(self) -> int:
        return len(self._t) - self._head

    @property
    def first_time(self) -> float | None:
        """The oldest retained timestamp, or None when empty."""
        return self._t[self._head] if len(self) else None

    @property
    def last_time(self) -> float | None:
        """The newest timestamp, or None when empty."""
        return self._t[-1] if len(self) else None

    def latest_at(self, now: float) -> float | None:
        """The newest timestamp at or before ``now``, or None."""
        if not len(self):
            return None
        last = self._t[-1]
        if last <= now:
            return last
        i = bisect_right(self._t, now, self._head)
        return self._t[i - 1] if i > self._head else None

    def span(self, start: float, end: float) -> tuple[int, int]:
        """Logical index range ``[i0, i1)`` of the points with ``start <= t <= end``."""
        head = self._head
        i0 = bisect_left(self._t, start, head)
        i1 = bisect_right(self._t, end, i0)
        return i0 - head, i1 - head

    def times(self, i0: int, i1: int) -> array[float]:
        """Timestamps of logical points ``[i0, i1)``."""
        return self._t[self._head + i0 : self._head + i1]

    @property
    def hooked(self) -> bool:
        """Whether the series ever had a hooked point (only then are the hook columns kept)."""
        return self._hook is not None

    @property
    def last_allocated(self) -> float:
        """The time of the newest point with the hook's allocated reading; -inf when none."""
        return self._hook.last_allocated if self._hook is not None else -math.inf

    @property
    def host_limit(self) -> float | None:
        """The newest host memory limit a hooked point knew; None when none did, or no hook."""
        return self._hook.host_limit if self._hook is not None else None

    @property
    def sites(self) -> tuple[AllocationSite, ...]:
        """The newest hooked point's allocation sites, in the hook's order (the job's own lines first)."""
        return self._hook.sites if self._hook is not None else ()

    def _column(self, column: Column) -> array[float]:
        if column < BASE_COLUMNS:
            return self._cols[column]
        if self._hook is None:
            raise KeyError(f"{column.name}: no hook readings in this series")
        return self._hook.cols[column - BASE_COLUMNS]

    def values(self, column: Column, i0: int, i1: int) -> array[float]:
        """Readings of one column for logical points ``[i0, i1)``; NaN where not available.

        A hook column of a series that never saw a hooked point raises KeyError (check :attr:`hooked`).
        """
        head = self._head
        if column < BASE_COLUMNS:  # inline: every rule reads through here, several times a series
            return self._cols[column][head + i0 : head + i1]
        return self._column(column)[head + i0 : head + i1]

    def has_missing(self, column: Column, i0: int) -> bool:
        """Whether ``column`` lacks a reading at some logical point from ``i0`` on (O(1))."""
        if column < BASE_COLUMNS:
            return self._last_nan[column] >= self._head + i0
        if self._hook is None:
            return True
        return self._hook.last_nan[column - BASE_COLUMNS] >= self._head + i0

    def reading_before(self, column: Column, i0: int) -> float | None:
        """The time of logical point ``i0 - 1`` if it has a reading of ``column``, else None (O(1)).

        Only that one point is looked at: when it lacks the reading, earlier
        points are not searched (the caller then treats the column as having
        no reading before ``i0``, which is the conservative answer).
        """
        i = self._head + i0 - 1
        if i < self._head or (column >= BASE_COLUMNS and self._hook is None):
            return None
        value = self._column(column)[i]
        return self._t[i] if value == value else None

    def longest_gap(self, after: float, until: float) -> float:
        """The longest interval between consecutive points that ends in ``(after, until]``, if indexed.

        Only intervals over :data:`GAP_RECORD_SECONDS` are indexed: 0.0 means
        every such interval is at most that long.
        """
        j0 = bisect_right(self._gap_end, after)
        j1 = bisect_right(self._gap_end, until, j0)
        return max(self._gap_len[j0:j1], default=0.0)

    def points(self) -> list[Point]:
        """Every retained point, oldest first (slow; for tests, debugging and snapshots)."""
        out = []
        cols = self._cols
        hook = self._hook
        for i in range(self._head, len(self._t)):
            hooked = None
            if hook is not None:
                a, r, h = (_none_if_nan(c[i]) for c in hook.cols)
                if a is not None or r is not None or h is not None:
                    last = i == len(self._t) - 1
                    hooked = HookPoint(a, r, h, hook.sites if last else (), hook.host_limit)
            out.append(
                Point(
                    t=self._t[i],
                    gpu_util=_none_if_nan(cols[Column.GPU_UTIL][i]),
                    sm_active=_none_if_nan(cols[Column.SM_ACTIVE][i]),
                    mem_used=_none_if_nan(cols[Column.MEM_USED][i]),
                    mem_total=self.mem_total,
                    power_w=_none_if_nan(cols[Column.POWER_W][i]),
                    util_source=self.util_source,
                    hook=hooked,
                )
            )
        return out

    def nbytes(self) -> int:
        """Bytes this series holds, allocation slack and object headers included."""
        arrays = (self._t, self._gap_end, self._gap_len, *self._cols)
        size = sys.getsizeof(self) + sys.getsizeof(self._last_nan) + sum(sys.getsizeof(a) for a in arrays)
        if self._hook is not None:
            hook = self._hook
            size += sys.getsizeof(hook) + sys.getsizeof(hook.last_nan) + sys.getsizeof(hook.sites)
            size += sum(sys.getsizeof(a) for a in hook.cols)
        return size

    # -- writing, through SeriesStore only --

    def _append(self, point: Point, cutoff: float) -> int:
        """Append if newer than the last point; drop points older than ``cutoff``.

        Returns -1 when the point was refused (not newer, or not finite), else
        how many points reaching ``max_points`` pushed out (0 or 1). Unrolled and
        local-heavy: it runs once per sample per GPU. A loop over the four columns was measured
        side by side (docs/benchmarks.md, "SeriesStore.add: a loop over the columns"): 1.56x the
        time a point, so it stays unrolled.
        """
        t = point.t
        times = self._t
        last = times[-1] if times else -math.inf
        if not last < t < math.inf:
            return -1
        if t - last > GAP_RECORD_SECONDS and times:
            self._gap_end.append(t)
            self._gap_len.append(t - last)
        index = len(times)
        times.append(t)
        gpu_util, sm_active, mem_used, power_w = self._cols
        last_nan = self._last_nan
        v = point.gpu_util
        if v is None or v != v:
            gpu_util.append(math.nan)
            last_nan[0] = index
        else:
            gpu_util.append(v)
            self.util_source = point.util_source
        v = point.sm_active
        if v is None or v != v:
            sm_active.append(math.nan)
            last_nan[1] = index
        else:
            sm_active.append(v)
        v = point.mem_used
        if v is None or v != v:
            mem_used.append(math.nan)
            last_nan[2] = index
        else:
            mem_used.append(v)
        v = point.power_w
        if v is None or v != v:
            power_w.append(math.nan)
            last_nan[3] = index
        else:
            power_w.append(v)
        if point.mem_total is not None:
            self.mem_total = point.mem_total
        hook = point.hook
        if hook is not None or self._hook is not None:
            if self._hook is None:
                self._hook = HookColumns(index)
            self._hook.append(hook, index)
            if hook is not None and hook.allocated is not None:
                self._hook.last_allocated = t
        evicted = 0
        head = self._head
        if index + 1 - head > self.max_points:
            head = self._head = index + 1 - self.max_points
            evicted = 1
        if times[head] < cutoff:
            self._head = bisect_left(times, cutoff, head)
        if self._head >= self._slack:
            self._compact_if_due()
        return evicted

    def _drop_before(self, cutoff: float) -> int:
        """Drop points older than ``cutoff``; return how many."""
        new_head = bisect_left(self._t, cutoff, self._head)
        dropped = new_head - self._head
        self._head = new_head
        self._compact_if_due()
        return dropped

    def _compact_if_due(self) -> None:
        # Dropping in batches keeps appends amortised O(1) (one memmove per `slack` drops).
        head = self._head
        if head < self._slack and not (head and head == len(self._t)):
            return
        del self._t[:head]
        for c in self._cols:
            del c[:head]
        self._head = 0
        self._last_nan = [i - head for i in self._last_nan]
        if self._hook is not None:
            for c in self._hook.cols:
                del c[:head]
            self._hook.last_nan = [i - head for i in self._hook.last_nan]
        # A gap matters only while the point that ended it is retained.
        first = self._t[0] if self._t else math.inf
        stale = bisect_left(self._gap_end, first)
        if stale:
            del self._gap_end[:stale]
            del self._gap_len[:stale]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters for the operator's own metrics."""

    series: int
    points: int
    ignored: int
    """Points not stored because they were not newer than the series' latest (out of order or duplicate)."""
    evicted: int
    """Points dropped because a series reached ``max_points`` before they aged out."""
    nbytes: int
    """Bytes held by the windows (see :meth:`Window.nbytes`)."""


class SeriesStore:
    """Every tracked series, bounded by age and by count.

    ``retention_seconds`` should cover the longest window any policy needs (see
    :func:`gpuwarden.policy.engine.horizon_seconds`); ``max_points`` caps a series
    whatever its sampling rate (at 1 s sampling, ``retention_seconds`` points).
    Points must arrive in time order per series: a point not newer than the
    series' latest is ignored and counted (a retried or replayed report).
    """

    def __init__(self, retention_seconds: float, max_points: int) -> None:
        if retention_seconds <= 0 or max_points < 1:
            raise ValueError("retention_seconds must be > 0 and max_points >= 1")
        self.retention_seconds = retention_seconds
        self.max_points = max_points
        self._pods: dict[tuple[str, str], dict[str, Window]] = {}
        self._ignored = 0
        self._evicted = 0

    def add(self, key: SeriesKey, point: Point) -> bool:
        """Append ``point`` to ``key``'s series; False (and counted) when it is not newer than the last."""
        namespace, pod, gpu = key
        # Plain tuples as keys: no PodId to build per point.
        gpus = self._pods.get((namespace, pod))
        if gpus is None:
            gpus = self._pods[namespace, pod] = {}
        window = gpus.get(gpu)
        if window is None:
            window = gpus[gpu] = Window(self.max_points)
        outcome = window._append(point, point.t - self.retention_seconds)
        if outcome < 0:
            self._ignored += 1
            if not window:
                self._drop_empty((namespace, pod), gpu)
            return False
        self._evicted += outcome
        return True

    def _drop_empty(self, pod: tuple[str, str], gpu: str) -> None:
        gpus = self._pods[pod]
        del gpus[gpu]
        if not gpus:
            del self._pods[pod]

    def extend(self, items: Iterable[tuple[SeriesKey, Point]]) -> int:
        """Add ``(key, point)`` pairs, as :mod:`gpuwarden.policy.store.intake` yields them;
        return how many."""
        return sum(self.add(key, point) for key, point in items)

    def pods(self) -> list[PodId]:
        """Pods with at least one series, in no particular order."""
        return [PodId(*pod) for pod in self._pods]

    def series_of(self, namespace: str, pod: str) -> list[tuple[SeriesKey, Window]]:
        """The pod's series, ordered by GPU id (empty when the pod has none)."""
        gpus = self._pods.get((namespace, pod))
        if not gpus:
            return []
        return [(SeriesKey(namespace, pod, gpu), gpus[gpu]) for gpu in sorted(gpus)]

    def window(self, key: SeriesKey) -> Window | None:
        """One series, or None."""
        gpus = self._pods.get((key.namespace, key.pod))
        return gpus.get(key.gpu) if gpus else None

    def keys(self) -> Iterator[SeriesKey]:
        """Every series key."""
        for (namespace, pod), gpus in self._pods.items():
            for gpu in gpus:
                yield SeriesKey(namespace, pod, gpu)

    def forget_pod(self, namespace: str, pod: str) -> int:
        """Drop every series of a pod (it was deleted); return how many series went."""
        gpus = self._pods.pop((namespace, pod), None)
        return len(gpus) if gpus else 0

    def prune(self, now: float) -> int:
        """Drop points older than ``now - retention_seconds``, and series left empty; return points dropped.

        ``add`` already ages out a series' old points as new ones arrive; this is
        for series that stopped receiving any (a GPU lost, a node gone quiet).
        """
        cutoff = now - self.retention_seconds
        dropped = 0
        for pod in list(self._pods):
            gpus = self._pods[pod]
            for gpu in list(gpus):
                window = gpus[gpu]
                first = window.first_time
                if first is not None and first < cutoff:
                    dropped += window._drop_before(cutoff)
                if not len(window):
                    del gpus[gpu]
            if not gpus:
                del self._pods[pod]
        return dropped

    def __len__(self) -> int:
        return sum(len(g) for g in self._pods.values())

    def stats(self) -> StoreStats:
        """Current counters and sizes (walks every series: call it per scrape, not per report)."""
        windows = [w for gpus in self._pods.values() for w in gpus.values()]
        return StoreStats(
            series=len(windows),
            points=sum(len(w) for w in windows),
            ignored=self._ignored,
            evicted=self._evicted,
            nbytes=sum(w.nbytes() for w in windows),
        )

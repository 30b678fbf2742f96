"""The trends memoryGrowth keeps between evaluations (the engine's memo of the kind)."""

from __future__ import annotations

from gpuwarden.policy.rules.growth.shape import GpuGrowth, gpu_growth
from gpuwarden.policy.store.series import Column, SeriesKey, Window

_Slot = tuple[SeriesKey, Column, float, float]


class GrowthCache:
    """Memo of per-GPU trends by (series, memory column, span, the span's points).

    A bucket-aligned span only changes when a bucket completes (every 90 s for
    a 30m span), so most evaluations reuse the last trend instead of refitting.
    Entries not used during one :meth:`sweep` period are dropped, so the memo
    never outlives its series by more than one evaluation.
    """

    def __init__(self) -> None:
        self._current: dict[_Slot, tuple[tuple[int, float, float], GpuGrowth | None]]
        self._current = {}
        self._previous: dict[_Slot, tuple[tuple[int, float, float], GpuGrowth | None]]
        self._previous = {}
        self.hits = 0
        self.misses = 0

    def trend(
        self,
        key: SeriesKey,
        window: Window,
        start: float,
        end: float,
        max_gap: float | None,
        column: Column = Column.MEM_USED,
    ) -> GpuGrowth | None:
        """The GPU's trend of ``column`` over ``[start, end]``, computed once per distinct set of points."""
        i0, i1 = window.span(start, end)
        if i0 == i1:
            return None
        times = window.times(i0, i0 + 1)
        signature = (i1 - i0, times[0], window.times(i1 - 1, i1)[0])
        slot = (key, column, start, end)
        entry = self._current.get(slot) or self._previous.get(slot)
        if entry is not None and entry[0] == signature:
            self.hits += 1
            self._current[slot] = entry
            return entry[1]
        self.misses += 1
        trend = gpu_growth(key.gpu, window, start, end, max_gap, column)
        self._current[slot] = (signature, trend)
        return trend

    def sweep(self) -> None:
        """End a period: forget what was not used since the previous sweep."""
        self._previous = self._current
        self._current = {}

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())

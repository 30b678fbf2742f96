"""SeriesStore and Window: ordering, bounds, missing readings, the gap index."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.policy.store.series import (
    BYTES_PER_POINT,
    GAP_RECORD_SECONDS,
    HOOK_BYTES_PER_POINT,
    Column,
    HookPoint,
    PodId,
    Point,
    SeriesKey,
    SeriesStore,
)

KEY = SeriesKey("ns", "pod", "GPU-1")
T0 = 1_750_000_000.0


def test_points_round_trip_with_none_kept_as_missing() -> None:
    store = SeriesStore(retention_seconds=600, max_points=100)
    store.add(KEY, Point(T0, gpu_util=12.5, sm_active=None, mem_used=2**30, mem_total=2**34, power_w=71.0))
    store.add(KEY, Point(T0 + 1, gpu_util=None, sm_active=3.0, mem_used=None, mem_total=None, power_w=None))
    window = store.window(KEY)
    assert window is not None
    first, second = window.points()
    assert (first.gpu_util, first.sm_active, first.mem_used, first.power_w) == (12.5, None, 2**30, 71.0)
    assert (second.gpu_util, second.sm_active, second.mem_used, second.power_w) == (None, 3.0, None, None)
    # The card's total is kept once: the latest reported value.
    assert first.mem_total == second.mem_total == 2**34
    assert window.has_missing(Column.SM_ACTIVE, 0)
    assert not window.has_missing(Column.SM_ACTIVE, 1)
    assert math.isnan(window.values(Column.GPU_UTIL, 1, 2)[0])


def test_out_of_order_and_duplicate_points_are_ignored_and_counted() -> None:
    store = SeriesStore(retention_seconds=600, max_points=100)
    assert store.add(KEY, Point(T0 + 1, gpu_util=1))
    assert not store.add(KEY, Point(T0 + 1, gpu_util=2))  # duplicate (a retried report)
    assert not store.add(KEY, Point(T0, gpu_util=3))  # out of order
    assert not store.add(KEY, Point(math.nan, gpu_util=3))
    assert store.add(KEY, Point(T0 + 2, gpu_util=4))
    window = store.window(KEY)
    assert window is not None
    assert [p.gpu_util for p in window.points()] == [1, 4]
    assert store.stats().ignored == 3


def test_max_points_evicts_oldest_and_counts() -> None:
    store = SeriesStore(retention_seconds=10_000, max_points=50)
    for i in range(200):
        store.add(KEY, Point(T0 + i, gpu_util=float(i)))
    window = store.window(KEY)
    assert window is not None
    assert len(window) == 50
    assert [p.gpu_util for p in window.points()] == [float(i) for i in range(150, 200)]
    assert store.stats().evicted == 150


def test_retention_ages_out_on_add_and_prune_drops_silent_series() -> None:
    store = SeriesStore(retention_seconds=60, max_points=1000)
    other = SeriesKey("ns", "pod", "GPU-2")
    for i in range(120):
        store.add(KEY, Point(T0 + i, gpu_util=1.0))
    store.add(other, Point(T0, gpu_util=1.0))
    window = store.window(KEY)
    assert window is not None
    assert window.first_time == T0 + 59  # newest - retention
    assert len(store) == 2
    store.prune(now=T0 + 119)
    assert store.window(other) is None
    assert store.series_of("ns", "pod") == [(KEY, window)]
    store.prune(now=T0 + 1000)
    assert store.pods() == []


def test_series_of_orders_by_gpu_and_forget_pod() -> None:
    store = SeriesStore(retention_seconds=60, max_points=10)
    for gpu in ("GPU-b", "GPU-a"):
        store.add(SeriesKey("ns", "p", gpu), Point(T0))
    store.add(SeriesKey("ns", "q", "GPU-c"), Point(T0))
    assert [k.gpu for k, _ in store.series_of("ns", "p")] == ["GPU-a", "GPU-b"]
    assert sorted(store.pods()) == [PodId("ns", "p"), PodId("ns", "q")]
    assert store.series_of("ns", "missing") == []
    assert store.forget_pod("ns", "p") == 2
    assert store.pods() == [PodId("ns", "q")]
    assert sorted(store.keys()) == [SeriesKey("ns", "q", "GPU-c")]


def test_span_latest_at_and_gap_index() -> None:
    store = SeriesStore(retention_seconds=10_000, max_points=1000)
    times = [T0 + i for i in range(10)] + [T0 + 30 + i for i in range(10)]  # one 21 s gap
    for t in times:
        store.add(KEY, Point(t, gpu_util=1.0))
    window = store.window(KEY)
    assert window is not None
    assert window.span(T0 + 5, T0 + 32) == (5, 13)
    assert list(window.times(0, 2)) == [T0, T0 + 1]
    assert window.latest_at(T0 + 20) == T0 + 9
    assert window.latest_at(T0 - 1) is None
    assert window.longest_gap(T0, T0 + 40) == 21.0
    assert window.longest_gap(T0 + 30, T0 + 40) == 0.0  # the gap ended at T0+30, not after it


def test_memory_per_point_is_as_documented() -> None:
    store = SeriesStore(retention_seconds=1800, max_points=1800)
    for i in range(1800):
        store.add(KEY, Point(T0 + i, gpu_util=1, sm_active=2, mem_used=3, mem_total=4, power_w=5))
    window = store.window(KEY)
    assert window is not None
    # 24 bytes a point, plus array over-allocation (~6%), the compaction slack and ~1 KiB of objects.
    assert BYTES_PER_POINT * 1800 <= window.nbytes() <= BYTES_PER_POINT * 1800 * 1.2 + 1024


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([0.0, -1.0, 0.5, 1.0, 1.0, 1.0, 2.0, 7.0, 40.0]),
            st.none() | st.floats(0, 100),
        ),
        min_size=1,
        max_size=400,
    ),
    max_points=st.integers(1, 80),
    retention=st.floats(5, 120),
)
def test_store_matches_a_plain_list_model(
    steps: list[tuple[float, float | None]], max_points: int, retention: float
) -> None:
    """Whatever arrives, the window holds exactly the newest in-order points within both bounds."""
    store = SeriesStore(retention_seconds=retention, max_points=max_points)
    model: list[tuple[float, float | None]] = []
    t = T0
    for delta, value in steps:
        t += delta
        if not model or t > model[-1][0]:
            model.append((t, value))
            model = [p for p in model if p[0] >= t - retention][-max_points:]
        store.add(KEY, Point(t, gpu_util=value))
    window = store.window(KEY)
    assert window is not None
    assert [(p.t, p.gpu_util) for p in window.points()] == [
        (mt, None if mv is None else float(_f32(mv))) for mt, mv in model
    ]
    # The indexes agree with a scan.
    n = len(window)
    for i0 in range(n):
        expected_missing = any(mv is None for _, mv in model[i0:])
        assert window.has_missing(Column.GPU_UTIL, i0) == expected_missing
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(model)]
    longest = max((g for g in gaps if g > GAP_RECORD_SECONDS), default=0.0)
    assert window.longest_gap(model[0][0], model[-1][0]) == longest


def _f32(x: float) -> float:
    from array import array

    return array("f", [x])[0]


def test_hook_columns_exist_only_on_a_hooked_series_and_cost_as_documented() -> None:
    store = SeriesStore(retention_seconds=1800, max_points=1800)
    plain, hooked = KEY, KEY._replace(gpu="GPU-2")
    for i in range(1800):
        store.add(plain, Point(T0 + i, gpu_util=1, sm_active=2, mem_used=3, mem_total=4, power_w=5))
        hook = HookPoint(allocated=6, reserved=7, host=8) if i >= 100 else None
        store.add(
            hooked, Point(T0 + i, gpu_util=1, sm_active=2, mem_used=3, mem_total=4, power_w=5, hook=hook)
        )
    a, b = store.window(plain), store.window(hooked)
    assert a is not None
    assert b is not None
    assert not a.hooked
    assert a.sites == ()
    assert a.last_allocated == -math.inf
    assert not a.has_missing(Column.MEM_USED, 0)
    assert a.has_missing(Column.ALLOCATED, 0)
    assert b.hooked
    assert b.last_allocated == T0 + 1799
    assert b.has_missing(Column.ALLOCATED, 0)
    assert not b.has_missing(Column.ALLOCATED, 100)
    extra = b.nbytes() - a.nbytes()
    assert HOOK_BYTES_PER_POINT * 1800 <= extra <= HOOK_BYTES_PER_POINT * 1800 * 1.2 + 512


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([0.0, 1.0, 1.0, 2.0, 9.0]), st.none() | st.floats(0, 2**40)),
        min_size=1,
        max_size=300,
    ),
    hooked_from=st.integers(0, 300),
    max_points=st.integers(1, 80),
)
def test_hook_columns_stay_aligned_through_eviction_and_compaction(
    steps: list[tuple[float, float | None]], hooked_from: int, max_points: int
) -> None:
    """Backfilled with NaN before the first hooked point, and dropped with the points they belong to."""
    store = SeriesStore(retention_seconds=10_000, max_points=max_points)
    model: list[tuple[float, float | None]] = []
    t = T0
    for n, (delta, value) in enumerate(steps):
        t += delta
        hook = HookPoint(allocated=value) if n >= hooked_from and value is not None else None
        if not model or t > model[-1][0]:
            model = [*model, (t, None if hook is None else value)][-max_points:]
        store.add(KEY, Point(t, mem_used=1.0, hook=hook))
    window = store.window(KEY)
    assert window is not None
    if not window.hooked:
        assert all(v is None for _, v in model)
        return
    values = window.values(Column.ALLOCATED, 0, len(window))
    assert list(window.times(0, len(window))) == [mt for mt, _ in model]
    assert [None if v != v else v for v in values] == [None if mv is None else _f32(mv) for _, mv in model]
    for i0 in range(len(window)):
        assert window.has_missing(Column.ALLOCATED, i0) == any(mv is None for _, mv in model[i0:])

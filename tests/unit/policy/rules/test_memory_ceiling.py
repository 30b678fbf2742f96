"""memoryCeiling: the level memory stayed above, per GPU, percent or bytes, with hysteresis."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.policy.rules.common import WindowParams
from gpuwarden.policy.rules.memory_ceiling import MemoryCeiling, evaluate_memory_ceiling
from gpuwarden.policy.store.series import PodId, Point, SeriesKey, SeriesStore

T0 = 1_750_000_000.0
POD = PodId("ns", "pod")
PARAMS = WindowParams()
GI = 2**30
CARD = 80 * GI
NEAR_OOM = MemoryCeiling(name="near-oom", for_seconds=60, percent=90)


def feed(
    store: SeriesStore,
    gpu: str,
    seconds: int,
    used: Callable[[int], float | None],
    total: float | None = CARD,
) -> float:
    key = SeriesKey(POD.namespace, POD.name, gpu)
    for i in range(seconds):
        store.add(key, Point(T0 + i, mem_used=used(i), mem_total=total))
    return T0 + seconds - 1


def new_store() -> SeriesStore:
    return SeriesStore(retention_seconds=3600, max_points=3600)


def test_holds_when_memory_stayed_above_the_limit_for_the_window() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 120, lambda i: 0.95 * CARD)
    out = evaluate_memory_ceiling(NEAR_OOM, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.unit == "percent"
    assert out.value is not None
    assert abs(out.value - 95) < 1e-3
    assert out.message == "GPU memory stayed above 95% of the card (76Gi of 80Gi) for 1m, limit 90%"


def test_one_dip_in_the_window_is_enough_to_not_hold() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 120, lambda i: 0.89 * CARD if i == 100 else 0.95 * CARD)
    out = evaluate_memory_ceiling(NEAR_OOM, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert not out.holds
    assert not out.clears


def test_bytes_limit_and_its_clear_line() -> None:
    rule = MemoryCeiling(name="big", for_seconds=60, bytes=60 * GI, hysteresis=10)
    store = new_store()
    now = feed(store, "GPU-1", 120, lambda i: 61 * GI, total=None)  # bytes mode needs no total
    out = evaluate_memory_ceiling(rule, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.unit == "bytes"
    assert out.value == 61 * GI
    assert out.message == "GPU memory stayed above 61Gi for 1m, limit 60Gi"
    store2 = new_store()
    now = feed(store2, "GPU-1", 120, lambda i: 53 * GI)
    assert evaluate_memory_ceiling(rule, POD, store2.series_of("ns", "pod"), now, PARAMS).clears  # <= 54Gi


def test_percent_needs_the_cards_total() -> None:
    store = new_store()
    now = feed(store, "GPU-1", 120, lambda i: 79 * GI, total=None)
    assert evaluate_memory_ceiling(NEAR_OOM, POD, store.series_of("ns", "pod"), now, PARAMS).value is None


def test_worst_gpu_speaks_for_the_pod_and_is_named() -> None:
    store = new_store()
    feed(store, "GPU-1", 120, lambda i: 0.5 * CARD)
    feed(store, "GPU-2", 120, lambda i: 0.97 * CARD)
    now = feed(store, "GPU-3", 120, lambda i: 0.93 * CARD)
    out = evaluate_memory_ceiling(NEAR_OOM, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.gpus == ("GPU-2", "GPU-3")
    assert out.value is not None
    assert abs(out.value - 97) < 1e-3
    assert "on 2 of 3 GPUs" in out.message
    assert not out.clears


def test_a_gap_on_one_gpu_does_not_hide_another_full_card() -> None:
    store = new_store()
    feed(store, "GPU-1", 120, lambda i: None if 80 < i < 100 else 0.99 * CARD)
    now = feed(store, "GPU-2", 120, lambda i: 0.95 * CARD)
    out = evaluate_memory_ceiling(NEAR_OOM, POD, store.series_of("ns", "pod"), now, PARAMS)
    assert out.holds
    assert out.gpus == ("GPU-2",)


@settings(max_examples=40, deadline=None)
@given(
    levels=st.lists(st.floats(0, 100), min_size=61, max_size=61),
    limit=st.floats(50, 99),
)
def test_holds_exactly_when_the_lowest_reading_is_over_the_limit(levels: list[float], limit: float) -> None:
    store = new_store()
    now = feed(store, "GPU-1", 61, lambda i: levels[i] / 100 * CARD)
    rule = MemoryCeiling(name="m", for_seconds=60, percent=limit)
    out = evaluate_memory_ceiling(rule, POD, store.series_of("ns", "pod"), now, PARAMS)
    low = min(levels)
    assert out.value is not None
    assert abs(out.value - low) < 1e-4
    if low > limit + 1e-4:
        assert out.holds
    if low < limit - 1e-4:
        assert not out.holds
    assert not (out.holds and out.clears)

"""The operator process's memory: the collector's pace (frozen start-up, young collections every
50,000 allocations, a full one every 5 minutes), and the heap trim: pages the C heap freed go back
to the system (glibc) as soon as a burst has freed enough of them, and at least every minute."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.operator.memory import (
    CHECK_SECONDS,
    FULL_COLLECTION_SECONDS,
    TRIM_SECONDS,
    YOUNG_THRESHOLD,
    GlibcHeap,
    keep_memory,
    pace_collector,
)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class CountingHeap(GlibcHeap):
    """The real heap, its trims counted."""

    trims = 0

    def trim(self) -> None:
        self.trims += 1
        super().trim()


def _open() -> CountingHeap:
    heap = CountingHeap.open()
    assert isinstance(heap, CountingHeap), "glibc ≥ 2.33 (mallinfo2), as the operator image has"
    return heap


def _burst() -> tuple[list[bytearray], bytearray]:
    """~120 MiB of 2 KiB buffers from glibc's heap (not Python's small-object arenas, not their own
    mmap), and one kept at the top, which stops glibc from shrinking the heap by itself, as a live
    store's buffers do."""
    return [bytearray(2048) for _ in range(60_000)], bytearray(2048)


class Cycle:
    """Garbage only the cyclic collector frees."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was, afterwards."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    if enabled:
        gc.enable()


def test_freed_heap_pages_are_returned_to_the_system() -> None:
    heap = _open()
    buffers, pin = _burst()
    held = _rss_mib()
    assert heap.use().in_use > 120 * 2**20
    del buffers
    freed = _rss_mib()
    assert heap.use().free > 100 * 2**20  # glibc holds what was freed...
    heap.trim()
    trimmed = _rss_mib()
    assert held - freed < 20  # ...and freeing alone gives (almost) nothing back
    assert freed - trimmed > 60  # of the ~120 MiB freed, the trim returns most
    del pin


@pytest.mark.looptime
async def test_a_burst_is_given_back_at_the_next_check_not_the_next_minute() -> None:
    heap = _open()
    keeping = asyncio.create_task(keep_memory(heap))
    try:
        await asyncio.sleep(0)  # the trim at start
        assert heap.trims == 1
        buffers, pin = _burst()
        await asyncio.sleep(CHECK_SECONDS)  # held, not freed: nothing to give back
        assert heap.trims == 1
        del buffers
        freed = _rss_mib()
        await asyncio.sleep(CHECK_SECONDS)  # looptime's fake clock: the next check
        assert heap.trims == 2
        assert freed - _rss_mib() > 60
        del pin
    finally:
        keeping.cancel()


@pytest.mark.looptime
async def test_without_a_burst_the_heap_is_trimmed_once_a_minute() -> None:
    heap = _open()
    keeping = asyncio.create_task(keep_memory(heap))
    try:
        await asyncio.sleep(TRIM_SECONDS - CHECK_SECONDS / 2)  # 29 checks, too little freed for a trim
        assert heap.trims == 1
        await asyncio.sleep(CHECK_SECONDS)
        assert heap.trims == 2
    finally:
        keeping.cancel()


def test_pacing_collects_start_ups_garbage_then_freezes_the_rest(collector: None) -> None:
    garbage, lasting = Cycle(), Cycle()
    gone = weakref.ref(garbage)
    del garbage
    pace_collector()
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert not any(o is lasting for o in gc.get_objects())  # frozen: no collection walks it again
    _, middle, old = gc.get_threshold()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)


@pytest.mark.looptime
async def test_every_generation_is_collected_every_five_minutes(collector: None) -> None:
    gc.disable()  # no collection but keep_memory's
    keeping = asyncio.create_task(keep_memory(None))
    try:
        cycle = Cycle()
        gone = weakref.ref(cycle)
        del cycle
        await asyncio.sleep(FULL_COLLECTION_SECONDS - CHECK_SECONDS / 2)
        assert gone() is not None
        await asyncio.sleep(CHECK_SECONDS)
        assert gone() is None
    finally:
        keeping.cancel()

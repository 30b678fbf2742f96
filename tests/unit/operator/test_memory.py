"""The operator process's memory: the collector's pace (frozen start-up, young collections every
50,000 allocations, a full one every 5 minutes); the heap trim: pages the C heap freed go back
to the system (glibc) as soon as a burst has freed enough of them, and at least every minute; and the
operator image's allocator (jemalloc for every object), which gives back what small objects freed
where pymalloc keeps it."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuwarden
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


ROOT = Path(gpuwarden.__file__).resolve().parents[1]

CHURN = """
import ctypes
from gpuwarden.operator.memory import GlibcHeap, jemalloc_loaded

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

# Small objects, one in 500 kept (a pod's state among a request's garbage), the rest freed.
kept, freed = [], []
for i in range(400_000):
    (kept if i % 500 == 0 else freed).append((i, i + 0.5))
held = rss()
del freed
if jemalloc_loaded():
    # What jemalloc's decay does within seconds of the frees, now.
    ctypes.CDLL(None).mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
print(jemalloc_loaded(), GlibcHeap.open() is None, held - rss())
"""


def _image_allocator() -> dict[str, str]:
    """The allocator's variables as Dockerfile.operator sets them."""
    text = (ROOT / "Dockerfile.operator").read_text()
    found = dict(re.findall(r"^(?:ENV)?\s+(LD_PRELOAD|PYTHONMALLOC)=(\S+?)(?: \\)?$", text, re.M))
    assert found == {"LD_PRELOAD": "libjemalloc.so.2", "PYTHONMALLOC": "malloc"}, found
    return found


def _churn(variables: dict[str, str]) -> tuple[bool, bool, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC")} | variables
    done = subprocess.run(
        [sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    # The loader's complaint, if libjemalloc2 is missing, comes on stderr: shown, not skipped.
    assert done.returncode == 0, done.stderr
    assert "cannot be preloaded" not in done.stderr, done.stderr
    loaded, no_glibc_heap, given_back = done.stdout.split()
    return loaded == "True", no_glibc_heap == "True", float(given_back)


def test_the_operator_images_allocator_gives_back_what_small_objects_freed() -> None:
    """~45 MiB of small objects freed around 800 kept: jemalloc (the image's) returns most of their
    pages; pymalloc keeps nearly all, each of its 1 MiB arenas held by a kept object or two; and
    jemalloc preloaded alone changes nothing, the objects still being pymalloc's."""
    image = _image_allocator()
    loaded, no_glibc_heap, given_back = _churn(image)
    assert loaded
    assert no_glibc_heap  # keep_memory trims no heap that holds nothing
    assert given_back > 30, given_back
    loaded, no_glibc_heap, given_back = _churn({})
    assert not loaded
    assert not no_glibc_heap
    assert given_back < 10, given_back
    _, _, given_back = _churn({"LD_PRELOAD": image["LD_PRELOAD"]})
    assert given_back < 15, given_back

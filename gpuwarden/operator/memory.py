"""The operator process's memory: the cyclic collector's pace, and, where glibc allocates, the C
heap's free memory given back to the system as soon as there is enough of it.

**The collector.** Each report allocates a few hundred containers that die within the request. At
CPython's default pace (a young collection every 700 allocations) a collection often catches them
alive and promotes them, and the promotions set off full collections, each walking every live
object: with a fleet's state (a million objects) that was 9 full collections a minute of a quarter
second each, 7% of a core in the collector and the server stalled meanwhile (bench/soak.py's
``gc_seconds``). Reports make next to no cyclic garbage (those full collections found ~7 objects a
minute), so :func:`pace_collector` lets the young generation grow to :data:`YOUNG_THRESHOLD` before
a collection, and freezes what exists at start-up (modules, classes, the composition's objects, all
living as long as the process) out of every collection. At that pace the full collections CPython
sets off itself all but stop (the soak's hour had 11, all periodic); :func:`keep_memory` runs one every
:data:`FULL_COLLECTION_SECONDS`, so that cyclic garbage among long-lived objects (a closed
connection's, say) waits minutes at most.

**The heap.** The operator image allocates every object with jemalloc (``LD_PRELOAD`` of Debian's
``libjemalloc2`` and ``PYTHONMALLOC=malloc``, Dockerfile.operator), which gives freed pages back by
itself; pymalloc, CPython's own, keeps each 1 MiB arena while any object in it lives, and with the
fleet's churning state the soak's arenas crept up all hour (docs/operator.md, "Memory"). Elsewhere
(a virtual environment) glibc's heap holds what is not pymalloc's, and glibc keeps the pages of freed
blocks resident until asked (``malloc_trim``): a burst (the server falling behind for a minute, then
catching up) leaves tens of MiB free but resident. So :func:`keep_memory` reads that heap often, which
is cheap (``mallinfo2``), and trims it once enough has been freed since the last trim, and at least
every :data:`TRIM_SECONDS`.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from typing import NamedTuple

__all__ = ["GlibcHeap", "HeapUse", "jemalloc_loaded", "keep_memory", "pace_collector"]

YOUNG_THRESHOLD = 50_000
"""Allocations (less deallocations) of containers between two young collections; CPython's is 700.
The older generations keep CPython's pace (a collection every 10 of the one below)."""

FULL_COLLECTION_SECONDS = 300.0
"""How often every generation is collected (~0.46 s each with the soak's state), then trimmed."""

CHECK_SECONDS = 2.0
"""How often the heap's free memory is read."""

TRIM_BYTES = 4 * 2**20
"""Free memory gained since the last trim that is worth a trim now (a trim costs milliseconds)."""

TRIM_SECONDS = 60.0
"""The longest between two trims, whatever was freed."""


def pace_collector() -> None:
    """At start-up, once the process's lasting objects are built: freeze them out of the collector,
    and collect the young generation every :data:`YOUNG_THRESHOLD` allocations."""
    gc.collect()  # start-up's garbage, before freezing the rest
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


class HeapUse(NamedTuple):
    """glibc's account of its heap, in bytes: ``in_use`` (allocated by the program), ``free`` (held
    by malloc, resident or already given back), ``mmapped`` (large blocks mapped on their own)."""

    in_use: int
    free: int
    mmapped: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost",
        )
    ]  # fmt: skip


def jemalloc_loaded() -> bool:
    """Whether the process allocates with jemalloc (the operator image preloads it): its ``mallctl``
    is then among the process's symbols."""
    return hasattr(ctypes.CDLL(None), "mallctl")


class GlibcHeap:
    """glibc's ``mallinfo2`` and ``malloc_trim``, looked up once. :meth:`open` is None where there
    is no glibc (or one older than 2.33, without ``mallinfo2``), or where jemalloc replaced its
    ``malloc``: nothing to trim there."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self._malloc_trim = libc.malloc_trim
        self._malloc_trim.argtypes = [ctypes.c_size_t]

    @classmethod
    def open(cls) -> GlibcHeap | None:
        if jemalloc_loaded():
            return None  # glibc's heap holds nothing: jemalloc gives its free pages back itself
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        try:
            return cls(ctypes.CDLL(name))
        except (OSError, AttributeError):
            return None

    def use(self) -> HeapUse:
        info = self._mallinfo2()
        return HeapUse(info.uordblks, info.fordblks + info.fsmblks, info.hblkhd)

    def trim(self) -> None:
        """Give every whole free page back (not only the heap's top: glibc ≥ 2.8 returns the free
        pages inside the heap too)."""
        self._malloc_trim(0)


async def keep_memory(
    heap: GlibcHeap | None,
    *,
    check_every: float = CHECK_SECONDS,
    trim_bytes: int = TRIM_BYTES,
    trim_every: float = TRIM_SECONDS,
    collect_every: float = FULL_COLLECTION_SECONDS,
) -> None:
    """Forever: every ``collect_every`` seconds a full collection; every ``check_every`` seconds read
    ``heap``'s free memory, and trim it after a full collection, when ``trim_bytes`` more are free
    than after the last trim, or ``trim_every`` seconds after the last trim. Without a ``heap`` (no
    glibc), only the collections.

    The free memory counted after a trim includes the pages just given back (glibc still counts
    them free), hence a difference from the lowest since, rather than a bound."""
    if heap is not None:
        heap.trim()
    lowest = heap.use().free if heap is not None else 0
    trimmed = collected = 0.0  # seconds since the last trim, and since the last full collection
    while True:
        await asyncio.sleep(check_every)
        trimmed += check_every
        collected += check_every
        if collected >= collect_every:
            gc.collect()
            collected, trimmed = 0.0, trim_every  # a trim now: the collection freed what it found
        if heap is None:
            continue
        free = heap.use().free
        if free - lowest >= trim_bytes or trimmed >= trim_every:
            heap.trim()
            lowest, trimmed = heap.use().free, 0.0
        elif free < lowest:
            lowest = free  # reused since: what is freed from now on counts from here

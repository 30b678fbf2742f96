"""The operator's heap trim: pages the C heap freed go back to the system (glibc)."""

from __future__ import annotations

from pathlib import Path

from gpuwarden.operator.services import trim_heap


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_freed_heap_pages_are_returned_to_the_system() -> None:
    # 2 KiB buffers come from glibc's heap (not Python's small-object arenas, not their own mmap);
    # one kept at the top stops glibc from shrinking the heap by itself, as a live store's do.
    buffers = [bytearray(2048) for _ in range(60_000)]
    pin = bytearray(2048)
    held = _rss_mib()
    del buffers
    freed = _rss_mib()
    assert trim_heap()
    trimmed = _rss_mib()
    assert held - freed < 20  # freeing alone gives (almost) nothing back
    assert freed - trimmed > 60  # of the ~120 MiB freed, the trim returns most
    del pin

"""The benches' server processes on the allocator the operator image runs (or another, named).

The operator image preloads jemalloc and sets ``PYTHONMALLOC=malloc`` (Dockerfile.operator); a bench
that measures the operator's CPU or memory runs its server the same way unless told otherwise
(``--allocator pymalloc``: the interpreter's own, for a side by side), and stops rather than measure
another allocator than the one asked for.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ALLOCATORS: dict[str, dict[str, str]] = {
    # What Dockerfile.operator sets: every object from jemalloc, preloaded (Debian's libjemalloc2).
    "jemalloc": {"LD_PRELOAD": "libjemalloc.so.2", "PYTHONMALLOC": "malloc"},
    # The interpreter's own: pymalloc's 1 MiB arenas for small objects, glibc's malloc for the rest.
    "pymalloc": {},
}
"""The server's allocator (``--allocator``): the variables its environment gets."""


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allocator",
        choices=sorted(ALLOCATORS),
        default="jemalloc",
        help="the server's allocator: jemalloc, as the operator image runs (the default), or the "
        "interpreter's own pymalloc",
    )


def start_server(process: Any, allocator: str, port_queue: Any, timeout: float) -> int:
    """Start the bench's server ``process`` (a spawned one) on ``allocator``, the variables of
    :data:`ALLOCATORS` in its environment alone (not the load's processes'); once it sends its port on
    ``port_queue``, check that it allocates as asked, and return the port."""
    saved = dict(os.environ)
    os.environ.update(ALLOCATORS[allocator])
    try:
        process.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    port = int(port_queue.get(timeout=timeout))
    jemalloc = "/libjemalloc" in Path(f"/proc/{process.pid}/maps").read_text()
    if jemalloc != (allocator == "jemalloc"):
        raise SystemExit(
            f"bench: the server does not run on {allocator} (jemalloc: apt install libjemalloc2)"
        )
    return port

"""What one tracemalloc reading of the hook costs by the number of live traced blocks.

Not a test: a benchmark, recorded in docs/benchmarks.md ("The training hook on the H200"). For each
size, a fresh :class:`~gpuwarden.hook.AllocationTracker` starts tracing, takes its baseline, then
``N / 3`` small JSON documents (about three blocks each) are made and kept, and one ``sites()``
(what ``StepHook.step()`` runs at each reading with tracemalloc on) is timed, with the count of
traced blocks beside it. The ratios between sizes are the point: the cost grows with what a job
allocated since tracing started, not with the step.

    .venv/bin/python bench/hook_reading.py
    .venv/bin/python bench/hook_reading.py --blocks 10000,100000,300000 --frames 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwarden.hook import AllocationTracker


def one_reading(blocks: int, frames: int) -> tuple[int, float]:
    """(traced blocks, seconds of one ``sites()``) with about ``blocks`` kept since the baseline."""
    tracker = AllocationTracker(frames=frames)
    tracker.start()
    try:
        tracker.sites()
        kept = [json.loads('{"a": [1, 2]}') for _ in range(blocks // 3)]
        start = time.perf_counter()
        tracker.sites()
        seconds = time.perf_counter() - start
        traced = len(tracemalloc.take_snapshot().traces)
    finally:
        tracker.stop()
    assert len(kept) == blocks // 3
    return traced, seconds


def main() -> None:
    """Print one line per size and the cost per block, as JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", default="10000,100000,300000", help="kept blocks, comma-separated")
    parser.add_argument("--frames", type=int, default=4, help="tracemalloc's depth (the hook's default: 4)")
    args = parser.parse_args()
    first: float | None = None
    for blocks in (int(b) for b in args.blocks.split(",")):
        traced, seconds = one_reading(blocks, args.frames)
        per_block = seconds / traced
        first = first or per_block
        row = {
            "tracedBlocks": traced,
            "readingMs": round(seconds * 1000),
            "usPerBlock": round(per_block * 1e6, 2),
        }
        print(json.dumps({**row, "perBlockVsFirst": round(per_block / first, 2)}))


if __name__ == "__main__":
    main()

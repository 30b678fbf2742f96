"""What one tracemalloc reading of the hook costs, with the job's set-up forgotten and with it kept.

Not a test: a benchmark, recorded in docs/benchmarks.md ("The training hook on the H200"). A reading
walks every block traced, so its cost follows what was allocated since tracing started, not the
step. A job that turns tracing on (``StepHook(tracemalloc=True)``) before it builds its model and
initialises CUDA has traced hundreds of thousands of blocks by its first step: the tracker, when it
started tracing, clears those traces at its first reading.

For each ``--setup`` size, side by side in one process, twice:

- ``forgotten``: the tracker starts tracing, the set-up's ``N`` blocks are made and kept, then the
  tracker's first readings (clear, baseline), ``--kept`` blocks more, and one timed reading;
- ``kept``: the same, but tracing was started before the tracker (as ``python -X tracemalloc`` or a
  profiler would), so the tracker may not clear and the reading walks the set-up too.

    .venv/bin/python bench/hook_reading.py
    .venv/bin/python bench/hook_reading.py --setup 10000,100000,300000 --kept 3000 --frames 4
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


def documents(blocks: int) -> list[object]:
    """About ``blocks`` live traced blocks: small JSON documents of three blocks each."""
    return [json.loads('{"a": [1, 2]}') for _ in range(blocks // 3)]


def one_reading(setup: int, kept: int, frames: int, forget: bool) -> tuple[int, float]:
    """(traced blocks, seconds of one ``sites()``) after ``setup`` blocks and ``kept`` more."""
    if not forget:
        tracemalloc.start(frames)
    # Never paced: each call here must read.
    tracker = AllocationTracker(frames=frames, clock=lambda: 0.0)
    tracker.start()
    try:
        model = documents(setup)
        tracker.sites()
        tracker.sites()
        leak = documents(kept)
        start = time.perf_counter()
        tracker.sites()
        seconds = time.perf_counter() - start
        traced = len(tracemalloc.take_snapshot().traces)
    finally:
        tracker.stop()
        tracemalloc.stop()
    assert len(model) + len(leak) == setup // 3 + kept // 3
    return traced, seconds


def main() -> None:
    """Print one JSON line per set-up size and round: both readings and their ratio."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setup", default="10000,100000,300000", help="set-up blocks, comma-separated")
    parser.add_argument("--kept", type=int, default=3000, help="blocks kept after the baseline (a leak)")
    parser.add_argument("--frames", type=int, default=4, help="tracemalloc's depth (the hook's default: 4)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for setup in (int(b) for b in args.setup.split(",")):
        for round_ in range(1, args.rounds + 1):
            kept_traced, kept_s = one_reading(setup, args.kept, args.frames, forget=False)
            forgot_traced, forgot_s = one_reading(setup, args.kept, args.frames, forget=True)
            row = {
                "setupBlocks": setup,
                "round": round_,
                "keptTraced": kept_traced,
                "keptMs": round(kept_s * 1000, 1),
                "forgottenTraced": forgot_traced,
                "forgottenMs": round(forgot_s * 1000, 1),
                "keptOverForgotten": round(kept_s / forgot_s, 1),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

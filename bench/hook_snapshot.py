"""What reading GPU bytes by line and writing a snapshot cost the hook, on a snapshot in torch's format.

Not a test: it prints figures for docs/benchmarks.md ("GPU bytes by line and snapshots"). It builds a
``torch.cuda.memory._snapshot()``-shaped dict (``--blocks`` live blocks, each with a Python stack of
``--frames`` frames, and ``--traces`` history events with stacks, as ``max_entries`` bounds them),
plays it through :class:`~gpuwarden.hook.history.ScriptedHistory`, and times what the hook does with
it: one reading's grouping by line (:func:`~gpuwarden.hook.history.by_line`), and a snapshot written
by :class:`~gpuwarden.hook.history.SnapshotWriter` (pickled and written on its thread), with the
longest pause a busy Python loop saw meanwhile (pickling holds the interpreter's lock). What torch
takes to build the dict (``_snapshot()``) is not here: that needs the GPU machine
(tests/gpu/test_hook_snapshot_gpu.py).

    python3 bench/hook_snapshot.py --blocks 20000 --frames 40 --traces 100000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwarden.hook.history import LineRecorder, ScriptedHistory, SnapshotWriter, by_line
from gpuwarden.hook.sites import CodeKinds

LIBRARY = str(Path(statistics.__file__).parent / "site-packages" / "torch" / "nn" / "modules" / "module.py")


def stack(depth: int, job_line: int) -> list[dict[str, Any]]:
    """A block's frames, innermost first: torch's and transformers' frames, then the job's line."""
    frames = [{"filename": LIBRARY, "line": 1700 + i, "name": "_call_impl"} for i in range(depth - 2)]
    frames.append({"filename": "/work/job/train.py", "line": job_line, "name": "compute_loss"})
    frames.append({"filename": "/work/job/train.py", "line": 200, "name": "main"})
    return frames


def snapshot(blocks: int, depth: int, traces: int) -> dict[str, Any]:
    """A snapshot in torch's format: one segment per 64 blocks, every block live with its own stack."""
    segments = []
    for s in range(0, blocks, 64):
        held = [
            {
                "address": (s + i) << 21,
                "size": 2**21,
                "requested_size": 2**21,
                "state": "active_allocated",
                "frames": stack(depth, 35 if (s + i) % 4 else 41),
            }
            for i in range(min(64, blocks - s))
        ]
        segments.append(
            {"device": 0, "address": s << 21, "total_size": len(held) << 21, "stream": 0, "blocks": held}
        )
    events = [
        {"action": "alloc", "addr": i << 21, "size": 2**21, "stream": 0, "frames": stack(depth, 35)}
        for i in range(traces)
    ]
    return {"segments": segments, "device_traces": [events]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=20_000, help="live blocks")
    parser.add_argument("--frames", type=int, default=40, help="Python frames a block's stack holds")
    parser.add_argument("--traces", type=int, default=10_000, help="history events (max_entries)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = snapshot(args.blocks, args.frames, args.traces)
    recorder = LineRecorder(ScriptedHistory(iter(lambda: data, None)), cwd="/work/job")
    kinds = CodeKinds()
    grouping = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        lines = by_line(data, kinds)
        grouping.append(time.perf_counter() - start)
    print(f"{args.blocks} live blocks of {args.frames} frames, {args.traces} history events")
    median = statistics.median(grouping) * 1e3
    print(f"by line: {median:.1f} ms a reading (median of {args.repeat}); {len(lines)} lines")
    with tempfile.TemporaryDirectory() as out:
        writer = SnapshotWriter(recorder, Path(out), max_files=args.repeat, max_bytes=2**40)
        sizes, pauses = [], []
        for i in range(args.repeat):
            writer.request(i)
            longest, last = 0.0, time.perf_counter()
            while writer._thread is not None and writer._thread.is_alive():
                sum(range(1000))  # a step's Python work, a few microseconds
                now = time.perf_counter()
                longest, last = max(longest, now - last), now
            writer.wait()
            (answer,) = writer.done()
            sizes.append(answer.size_bytes or 0)
            pauses.append(longest)
        print(
            f"snapshot: {statistics.median(writer.seconds) * 1e3:.0f} ms on its thread"
            f" (median of {args.repeat}),"
            f" {statistics.median(sizes) / 2**20:.1f} MiB pickled; the loop's longest pause meanwhile"
            f" {statistics.median(pauses) * 1e3:.0f} ms (median), {max(pauses) * 1e3:.0f} ms (most)"
        )


if __name__ == "__main__":
    main()

"""The lines of the training code whose live host allocations grow, from tracemalloc snapshots.

Each snapshot is grouped by the innermost frame that is the job's own code: outside the standard
library, site-packages and gpuwarden, so an object created deep inside torch or transformers is
credited to the training script's line that called them. Every group is compared with the first
snapshot (the baseline). The sites are the lines that grew, the job's own lines first, each kind
ranked by the blocks it added (a leak keeps one more object or more every step, however small),
then by bytes: under a framework (a Trainer, Lightning) the objects a kept graph holds inside the
model's forward lie deeper than the recorded stack and would outrank, by bytes and by blocks, the
one tensor a step that the job's own line keeps.

tracemalloc sees what Python's allocators hand out (objects, lists, bytes), not what a C++ library
allocates with ``malloc`` or on the GPU: a tensor kept by ``losses.append(loss)`` shows as its Python
object, one block more per step at the line that made it, and as the list's growth at the append.
Tracing costs on every allocation while it is on, and more with a deeper stack (``frames``); a
reading costs in proportion to the blocks traced, so the tracker forgets what the job allocated before
its first reading (imports, the model, CUDA's set-up: hundreds of thousands of blocks) and reads no
more often than keeps its own cost within ``budget`` of the job's time. See docs/hook.md, "What it
costs".
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from gpuwarden.hook.message import MAX_SITES, Site

DEFAULT_FRAMES = 4
"""Stack depth each traced allocation keeps: enough to reach the job's line from a tensor made on it
or inside its own module's ``forward`` (``model(x)`` is three frames into torch.nn); every frame
more costs on each allocation (2.4x a Python-heavy step at 4, 5.7x at 8: docs/benchmarks.md)."""


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(p for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages")))
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


GPUWARDEN_PREFIX = os.path.join(str(Path(__file__).resolve().parent.parent), "")
"""The hook's own memory (its baseline, its caches) is called from the job's line too: left out."""
HOOK_READS_THROUGH = (os.path.join("torch", "cuda", "memory.py"),)
"""Library files the hook's reading allocates in, deeper than ``frames`` below the hook's own frame:
``torch.cuda.memory_stats`` builds a flattened dict of tuples each call, which Python's free lists keep
(traced as live) and which showed on the H200 as a growing site of its own. Left out as the hook's."""


GENERATED = ("<frozen", "<string>")
"""Code with no file of its own counts as a library's: the stdlib's frozen modules, and what
``exec`` compiled from a string, such as the ``__init__`` dataclasses generate (on the H200, a Trainer's
kept graph grew 617 blocks a few minutes in at ``<string>:5``: transformers' ModelOutput)."""


class CodeKinds:
    """Whose code a file is: ``job`` (the training code), ``library`` (stdlib, site-packages, generated
    code) or ``hook`` (gpuwarden, and what it reads through); remembered per file name."""

    def __init__(self) -> None:
        self._prefixes = _library_prefixes()
        self._kind: dict[str, str] = {}

    def kind_of(self, filename: str) -> str:
        """``job``, ``library`` or ``hook`` (see the class doc)."""
        kind = self._kind.get(filename)
        if kind is None:
            real = os.path.realpath(filename)
            if real.startswith(GPUWARDEN_PREFIX) or real.endswith(HOOK_READS_THROUGH):
                kind = "hook"
            elif filename.startswith(GENERATED) or real.startswith(self._prefixes):
                kind = "library"
            else:
                kind = "job"
            self._kind[filename] = kind
        return kind


DEFAULT_BUDGET = 0.01
"""The share of the job's wall time the tracker may spend reading: after a reading that took ``c``
seconds, the next comes ``c / budget`` later at the earliest, and the readings between repeat the last
sites. A leak's line does not move between readings, and its rule looks at minutes."""


class AllocationTracker:
    """tracemalloc snapshots compared with a baseline; :meth:`sites` names the lines that grew.

    ``frames`` applies when this tracker starts tracing (``tracemalloc.start(frames)``). :meth:`start`
    starts tracing unless something else already did (and :meth:`stop` then leaves it on).

    When this tracker started tracing, its first :meth:`sites` clears the traces (what the job allocated
    before its first step costs every reading and never tells a leak) and the second takes the
    baseline; when tracing was on already, the traces are not ours to clear and the first takes the
    baseline. ``budget`` and ``clock`` pace the readings (see :data:`DEFAULT_BUDGET`).
    """

    def __init__(
        self,
        frames: int = DEFAULT_FRAMES,
        top: int = MAX_SITES,
        cwd: str | None = None,
        budget: float = DEFAULT_BUDGET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"budget must be in (0, 1], not {budget}")
        self.frames = frames
        self.top = top
        self.budget = budget
        self._clock = clock
        self._cwd = os.path.join(cwd or os.getcwd(), "")
        self._kinds = CodeKinds()
        self._baseline: dict[tuple[str, int], tuple[int, int]] | None = None
        self._started = False
        self._cleared = True
        self._due = 0.0
        self._last: tuple[Site, ...] = ()

    def start(self) -> None:
        """Start tracing (if not on already); the next :meth:`sites` begins afresh (see the class doc)."""
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
            self._started = True
        self._cleared = not self._started
        self._baseline = None
        self._due = 0.0
        self._last = ()

    def stop(self) -> None:
        """Stop tracing if :meth:`start` started it."""
        if self._started:
            tracemalloc.stop()
            self._started = False
        self._baseline = None

    def _kind_of(self, filename: str) -> str:
        return self._kinds.kind_of(filename)

    def _grouped(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(file, line) -> (bytes, blocks) of what is live now, by the innermost frame of the job's code."""
        snapshot = tracemalloc.take_snapshot()
        groups: dict[tuple[str, int], tuple[int, int]] = {}
        for stat in snapshot.statistics("traceback"):
            kinds = [self._kind_of(frame.filename) for frame in stat.traceback]
            if "hook" in kinds:
                continue
            # The innermost frame of the job's code; when the stack is deeper than ``frames`` (the
            # job's line lies beyond it, e.g. under Trainer.train), the outermost frame recorded.
            index = max((i for i, kind in enumerate(kinds) if kind == "job"), default=0)
            frame = stat.traceback[index]  # the oldest frame is first
            key = (frame.filename, frame.lineno)
            size, count = groups.get(key, (0, 0))
            groups[key] = (size + stat.size, count + stat.count)
        return groups

    def _rank(self, key: tuple[str, int], size: int, count: int) -> tuple[bool, int, int]:
        """The sort key of a grown line: the job's own first, then the blocks it added, then bytes."""
        assert self._baseline is not None
        size0, count0 = self._baseline.get(key, (0, 0))
        return (self._kind_of(key[0]) == "job", count - count0, size - size0)

    def _display(self, filename: str) -> str:
        return filename[len(self._cwd) :] if filename.startswith(self._cwd) else filename

    def sites(self) -> tuple[Site, ...]:
        """The lines whose live allocations grew since the baseline, most telling first (module doc).

        Empty before the baseline (see the class doc) or when not tracing; between paced readings,
        the last reading's sites.
        """
        if not tracemalloc.is_tracing():
            return ()
        if not self._cleared:
            tracemalloc.clear_traces()
            self._cleared = True
            return ()
        start = self._clock()
        if start < self._due:
            return self._last
        groups = self._grouped()
        if self._baseline is None:
            self._baseline = groups
            self._last = ()
        else:
            ranked = []
            for key, (size, count) in groups.items():
                rank = self._rank(key, size, count)
                if rank[2] > 0:
                    ranked.append((rank, Site(self._display(key[0]), key[1], size, rank[2], count)))
            ranked.sort(key=lambda pair: pair[0], reverse=True)
            self._last = tuple(site for _, site in ranked[: self.top])
        end = self._clock()
        self._due = end + (end - start) / self.budget
        return self._last

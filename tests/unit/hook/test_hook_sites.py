"""AllocationTracker on real Python loops: the line that keeps objects alive is named, with a growing
count; a line that allocates and frees is not; an object made inside the stdlib is credited to the
line that called it; the job's own lines rank before the libraries', a line that keeps a block every
step before one that grew once; what was allocated before the first reading is forgotten; readings
are paced by their own cost."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwarden.hook import AllocationTracker, Site

HERE = Path(__file__)


def unpaced() -> float:
    """A clock that never moves: every reading costs nothing, so none is skipped for the budget."""
    return 0.0


def begin(tracker: AllocationTracker) -> None:
    """The tracker's first readings: the set-up forgotten, then the baseline (no sites yet)."""
    assert tracker.sites() == ()
    assert tracker.sites() == ()


def line_of(tag: str) -> int:
    """The line of this file whose comment is ``# <tag>``."""
    lines = HERE.read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {tag}"))


def at(sites: tuple[Site, ...], tag: str) -> Site | None:
    line = line_of(tag)
    return next((s for s in sites if s.file.endswith(HERE.name) and s.line == line), None)


@pytest.fixture
def tracker() -> Iterator[AllocationTracker]:
    assert not tracemalloc.is_tracing()
    t = AllocationTracker(cwd=str(HERE.parent), clock=unpaced)
    t.start()
    yield t
    t.stop()
    assert not tracemalloc.is_tracing()


def keep(kept: list[bytearray], n: int) -> None:
    for _ in range(n):
        kept.append(bytearray(1000))  # keeps


def test_the_line_that_keeps_objects_is_named_with_a_growing_count(tracker: AllocationTracker) -> None:
    kept: list[bytearray] = []
    begin(tracker)
    keep(kept, 100)
    first = at(tracker.sites(), "keeps")
    keep(kept, 100)
    second = at(tracker.sites(), "keeps")
    assert first is not None
    assert second is not None
    assert first.file == HERE.name  # relative to the working directory
    assert first.count >= 100
    assert second.count >= first.count + 100
    assert second.growth_bytes >= 200 * 1000 > first.growth_bytes >= 100 * 1000
    assert second.size_bytes >= second.growth_bytes


def test_a_line_that_allocates_and_frees_is_not_named(tracker: AllocationTracker) -> None:
    begin(tracker)
    total = 0
    for _ in range(1000):
        scratch = bytearray(1000)  # frees
        total += len(scratch)
        del scratch
    assert at(tracker.sites(), "frees") is None
    assert total == 1_000_000


def test_an_object_made_inside_the_stdlib_is_credited_to_the_calling_line() -> None:
    # Deep enough for json's pure-Python scanner too (the C one may be swapped out by an earlier test's
    # import): the crediting rule is under test here, the depth limit in the next test.
    tracker = AllocationTracker(cwd=str(HERE.parent), frames=16, clock=unpaced)
    tracker.start()
    try:
        begin(tracker)
        kept = [json.loads('{"loss": [1.5, 2.5, 3.5], "step": 1}') for _ in range(200)]  # calls json
        sites = tracker.sites()
    finally:
        tracker.stop()
    site = at(sites, "calls json")
    assert site is not None
    assert site.count >= 200
    assert not any("json" in s.file for s in sites), sites  # never json/decoder.py
    assert len(kept) == 200


def test_beyond_the_recorded_depth_the_outermost_recorded_frame_stands_for_the_job() -> None:
    tracker = AllocationTracker(frames=1, clock=unpaced)
    tracker.start()
    try:
        begin(tracker)
        kept = [json.loads('{"loss": [1.5, 2.5], "step": 1}') for _ in range(200)]
        sites = tracker.sites()
    finally:
        tracker.stop()
    assert any(s.file.endswith(("json/decoder.py", "json/__init__.py")) and s.count >= 200 for s in sites)
    assert len(kept) == 200


def test_lines_that_added_as_many_blocks_rank_by_bytes(tracker: AllocationTracker) -> None:
    begin(tracker)
    small = [bytearray(100) for _ in range(50)]  # small
    large = [bytearray(10_000) for _ in range(50)]  # large
    lines = [s.line for s in tracker.sites()]
    assert lines.index(line_of("large")) < lines.index(line_of("small"))
    assert len(small) == len(large)


def test_a_line_that_keeps_a_block_every_step_outranks_one_that_grew_once(
    tracker: AllocationTracker,
) -> None:
    # A leak keeps one small object a step; a cache filled once holds more bytes in one block.
    begin(tracker)
    cache = bytearray(4 * 2**20)  # filled once
    kept: list[bytearray] = []
    keep(kept, 300)
    sites = tracker.sites()
    lines = [s.line for s in sites]
    assert lines.index(line_of("keeps")) < lines.index(line_of("filled once")), sites
    assert len(cache) == 4 * 2**20


def framework_step(step: Callable[[], None]) -> list[object]:
    """What a framework's step does around the job's own code: it keeps objects deep inside itself
    (json's scanner stands for a kept graph's forward objects) and calls the job's step."""
    step()
    return [json.loads('{"hidden": [0.5, 1.5, 2.5, 3.5], "attention": [1, 2, 3]}') for _ in range(20)]


def test_the_jobs_own_line_outranks_a_library_line_that_grew_more() -> None:
    # One frame: json's objects are credited to json's own line (no job frame recorded), as a kept
    # graph's objects under Trainer.train are credited to torch's and transformers' lines. They grow
    # more, by bytes and by blocks, than the one object a step the job's own line keeps.
    tracker = AllocationTracker(cwd=str(HERE.parent), frames=1, clock=unpaced)
    tracker.start()
    history: list[object] = []
    graph: list[object] = []
    try:
        begin(tracker)
        for _ in range(100):
            graph.extend(framework_step(lambda: history.append(bytearray(50))))  # the job's leak
        sites = tracker.sites()
    finally:
        tracker.stop()
    library = [s for s in sites if s.file.endswith(("json/decoder.py", "json/__init__.py"))]
    assert library, sites
    assert max(s.count for s in library) > 1000  # it grew more blocks
    assert max(s.growth_bytes for s in library) > 10 * sites[0].growth_bytes  # and more bytes
    assert (sites[0].file, sites[0].line) == (HERE.name, line_of("the job's leak")), sites
    assert sites[0].count >= 100
    assert len(history) == 100
    assert len(graph) == 2000


@dataclasses.dataclass
class Output:
    """Its ``__init__`` is compiled from a string by dataclasses, as transformers' ModelOutput's is,
    and makes the list there."""

    logits: list[float] = dataclasses.field(default_factory=list)


def test_code_compiled_from_a_string_is_no_line_of_the_jobs(tracker: AllocationTracker) -> None:
    begin(tracker)
    kept = [Output() for _ in range(300)]  # outputs
    sites = tracker.sites()
    assert not [s for s in sites if s.file == "<string>"], sites
    assert sites[0].line == line_of("outputs")
    assert len(kept) == 300


def test_tracing_started_elsewhere_is_left_on() -> None:
    tracemalloc.start(4)
    try:
        tracker = AllocationTracker()
        tracker.start()
        tracker.stop()
        assert tracemalloc.is_tracing()
    finally:
        tracemalloc.stop()


def test_what_the_job_allocated_before_its_first_reading_is_forgotten(tracker: AllocationTracker) -> None:
    setup = [bytearray(100) for _ in range(20_000)]  # set-up
    assert len(tracemalloc.take_snapshot().traces) >= 20_000
    begin(tracker)
    # A reading walks every traced block: the set-up's are no longer traced, so they cost none.
    assert len(tracemalloc.take_snapshot().traces) < 2_000
    kept: list[bytearray] = []
    keep(kept, 100)
    sites = tracker.sites()
    assert at(sites, "keeps") is not None
    assert at(sites, "set-up") is None
    del setup  # freeing untraced blocks is no growth or shrinkage anywhere
    assert at(tracker.sites(), "keeps") is not None


def test_traces_started_elsewhere_are_not_cleared() -> None:
    tracemalloc.start(4)
    try:
        theirs = [bytearray(100) for _ in range(5_000)]  # theirs
        tracker = AllocationTracker(cwd=str(HERE.parent), clock=unpaced)
        tracker.start()
        assert tracker.sites() == ()  # the baseline at once: nothing to forget
        assert len(tracemalloc.take_snapshot().traces) >= 5_000
        kept: list[bytearray] = []
        keep(kept, 100)
        assert at(tracker.sites(), "keeps") is not None
        tracker.stop()
    finally:
        tracemalloc.stop()
    assert len(theirs) == 5_000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_reading_that_costs_c_seconds_is_the_last_for_c_over_budget_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    tracker = AllocationTracker(cwd=str(HERE.parent), budget=0.01, clock=clock)
    snapshot = tracker._grouped
    snapshots = 0

    def costly() -> dict[tuple[str, int], tuple[int, int]]:
        nonlocal snapshots
        snapshots += 1
        clock.now += 1.0  # each snapshot takes a second
        return snapshot()

    monkeypatch.setattr(tracker, "_grouped", costly)
    tracker.start()
    try:
        tracker.sites()  # the set-up forgotten: no snapshot
        tracker.sites()  # the baseline, 0 to 1 s: the next is due at 1 + 1 / 0.01
        kept: list[bytearray] = []
        keep(kept, 100)
        clock.now = 100.0
        assert tracker.sites() == ()  # not yet: the baseline's result again
        assert snapshots == 1
        clock.now = 101.0
        first = at(tracker.sites(), "keeps")
        assert first is not None
        keep(kept, 100)
        clock.now = 150.0
        assert at(tracker.sites(), "keeps") == first  # repeated, not re-read
        assert snapshots == 2
        clock.now = 202.0
        latest = at(tracker.sites(), "keeps")
        assert snapshots == 3
        assert latest is not None
        assert latest.count >= first.count + 100
    finally:
        tracker.stop()


@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5])
def test_a_budget_outside_zero_to_one_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="budget must be in"):
        AllocationTracker(budget=budget)


def test_what_the_hook_reads_through_torch_cuda_memory_is_left_out(
    tracker: AllocationTracker, tmp_path: Path
) -> None:
    # A stand-in at torch/cuda/memory.py's path whose calls keep what they allocate, as
    # memory_stats' tuples stay traced in Python's free lists (the site the H200 run showed).
    module = tmp_path / "torch" / "cuda" / "memory.py"
    module.parent.mkdir(parents=True)
    module.write_text("KEPT = []\n\ndef memory_stats():\n    KEPT.append([0.5] * 50)\n    return {}\n")
    spec = importlib.util.spec_from_file_location("stand_in_torch_cuda_memory", module)
    assert spec is not None
    assert spec.loader is not None
    stats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stats)
    begin(tracker)
    kept: list[bytearray] = []
    for _ in range(100):
        stats.memory_stats()  # reads through
    keep(kept, 100)
    sites = tracker.sites()
    assert at(sites, "keeps") is not None
    assert not [s for s in sites if s.file.endswith("memory.py") or s.line == line_of("reads through")], sites
    assert len(stats.KEPT) == 100

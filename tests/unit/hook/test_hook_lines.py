"""End to end on CPU: a real hook's tracemalloc sites, under a stand-in framework that keeps more
objects than the job, travel the wire to the engine, and the Event names the job's own line first."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml
from hook_socket_support import LineServer

from gpuwarden.hook import DeviceMemory, HookClient, ScriptedMemory, StepHook
from gpuwarden.local.display import announcement_line, elapsed_clock
from gpuwarden.local.policies import LocalPolicy, for_processes
from gpuwarden.local.rows import Announcement
from gpuwarden.local.session import Session
from gpuwarden.local.subjects import SubjectKind
from gpuwarden.policy.parse import parse_spec
from gpuwarden.wire.hook import parse_message
from gpuwarden.wire.node import AllocationSite, GpuSample, HookSample, ProcessSample, Snapshot

HERE = Path(__file__)
T0 = 1_800_000_000.0
POLICY = """\
spec:
  selector: {}
  evaluationInterval: 10s
  rules:
    - name: tensor-leak
      memoryGrowth: {rate: 100Mi/m}
"""


def framework_step(step: Callable[[], None]) -> list[object]:
    """A framework's step around the job's code: it keeps objects deep inside a library (json's,
    standing for the forward objects a kept graph holds) and calls the job's step."""
    step()
    return [json.loads('{"hidden": [0.5, 1.5, 2.5, 3.5], "attention": [1, 2, 3]}') for _ in range(20)]


def sites_of_a_real_hook(tmp_path: Path) -> list[AllocationSite]:
    """The sites of the last line a real StepHook sent (tracemalloc at 1 frame, so json's objects
    are credited to json, as a kept graph's are to torch under Trainer.train at 4), as the agent
    parses it."""
    server = LineServer(tmp_path / "hook.sock")
    hook = StepHook(
        interval=0.0,
        memory=ScriptedMemory([[DeviceMemory("GPU-a", allocated_bytes=1 << 30)]]),
        tracemalloc=True,
        frames=1,
        client=HookClient(str(server.path)),
        clock=lambda: 0.0,  # no reading is paced away
    )
    history: list[object] = []
    graph: list[object] = []
    try:
        for _ in range(50):
            graph.extend(framework_step(lambda: history.append(bytearray(50))))  # the job's leak
            hook.step()
    finally:
        hook.close()
        conn = server.accept()
        lines = list(iter(conn.line, b""))  # to the end: close() sent a last reading
        server.close()
    assert len(history) == 50
    return parse_message(lines[-1]).sites


def gpu(i: int, sites: list[AllocationSite]) -> GpuSample:
    """The job's process, its live tensors growing 400Mi/m, with the real hook's sites."""
    allocated = 10 * 2**30 + 400 * 2**20 * i // 60
    hook = HookSample(timestamp=T0 + i, allocated_bytes=allocated, reserved_bytes=24 << 30, sites=sites)
    return GpuSample(
        uuid="GPU-a",
        index=0,
        utilization_gpu=90.0,
        memory_used_bytes=25 << 30,
        memory_total_bytes=80 << 30,
        processes=[ProcessSample(pid=77, used_memory_bytes=25 << 30, command="python train.py", hook=hook)],
    )


def test_the_event_names_the_jobs_own_line_before_the_librarys_that_grew_more(tmp_path: Path) -> None:
    sites = sites_of_a_real_hook(tmp_path)
    library = [s for s in sites if s.file.endswith(("json/decoder.py", "json/__init__.py"))]
    assert library, sites
    assert max(s.growth_bytes for s in library) > 10 * sites[0].growth_bytes  # it grew far more
    policy = LocalPolicy("p", None, parse_spec(yaml.safe_load(POLICY)["spec"]))
    session = Session([for_processes(policy)], subjects=SubjectKind.PROCESSES)
    started: list[Announcement] = []
    for i in range(300):
        started += session.observe(Snapshot(timestamp=T0 + i, gpus=[gpu(i, sites)])).announcements
    (announced,) = started
    text = announcement_line(announced, elapsed_clock(T0))
    source = HERE.read_text().splitlines()
    job_line = next(n for n, t in enumerate(source, 1) if t.endswith("# the job's leak"))
    _, lines = text.split("; top growing lines: ")
    assert lines.startswith(f"{HERE.parent.name}/{HERE.name}:{job_line} +"), text
    assert "json/" in lines  # the library's lines still come, after

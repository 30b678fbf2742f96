"""What local mode prints for a finding that is announced again: a reminder, or a re-description."""

from __future__ import annotations

import io
import re

import yaml

from gpuwarden.local.display import PlainDisplay, elapsed_clock
from gpuwarden.local.policies import LocalPolicy, for_processes
from gpuwarden.local.session import Session
from gpuwarden.local.subjects import SubjectKind
from gpuwarden.policy.parse import parse_spec
from gpuwarden.wire.node import GpuSample, ProcessSample, Snapshot

T0 = 1_800_000_000.0
GI = 2**30
CARD = 141 * GI
POLICY = """\
spec:
  selector: {}
  evaluationInterval: 10s
  actions: {renotifyInterval: 10m}
  rules:
    - name: leak
      memoryGrowth: {rate: 100Mi/m, memory: device}
"""


def leaking(i: int) -> GpuSample:
    """One process whose GPU memory grows 2Gi/m from 90Gi: its card full in 25m30s."""
    used = 90 * GI + 2 * GI * i // 60
    return GpuSample(
        uuid="GPU-a",
        index=0,
        utilization_gpu=90.0,
        memory_used_bytes=used,
        memory_total_bytes=CARD,
        processes=[ProcessSample(pid=77, used_memory_bytes=used, command="python train.py")],
    )


def test_a_changed_reason_prints_changed_and_a_reminder_prints_still() -> None:
    """Found as a leak 21 minutes from full; re-announced under GPUMemoryExhaustionImminent once within
    16 minutes (a re-description: CHANGED, with the reason it had), then reminded after the 10-minute
    renotify interval under the same reason (STILL). The reason change once printed STILL too."""
    policy = LocalPolicy("p", None, parse_spec(yaml.safe_load(POLICY)["spec"]))
    session = Session([for_processes(policy)], subjects=SubjectKind.PROCESSES)
    out = io.StringIO()
    display = PlainDisplay(out, elapsed_clock(T0), status_every=None)
    for i in range(22 * 60):
        display.show(session.observe(Snapshot(timestamp=T0 + i, gpus=[leaking(i)])))
    printed = out.getvalue()
    verbs = re.findall(r"^\[[\d:]+\] (\w+) +leak pid 77 .* on GPU 0: (\w+): ", printed, re.M)
    assert verbs == [
        ("STARTED", "GPUMemoryLeakSuspected"),
        ("CHANGED", "GPUMemoryExhaustionImminent"),
        ("STILL", "GPUMemoryExhaustionImminent"),
    ], printed
    (changed,) = [line for line in printed.splitlines() if " CHANGED " in line]
    assert changed.endswith("; the card (141Gi) is full in 16m (was GPUMemoryLeakSuspected)"), changed

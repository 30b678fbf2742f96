"""End to end, the training hook: a hooked process → the agent's socket → the operator → Event text.

The hook client is the real library (``gpuwarden.hook.StepHook``) in a process of its own; only its
CUDA allocator readings are scripted (``ScriptedMemory``: no GPU here), chosen explicitly. Its host
memory is real (it keeps 1 MiB more every fifth of a second, written, so resident) and so is
tracemalloc, which must name the line that keeps it. The agent plays a scripted GPU whose only process
is that client's PID, so the kernel's ``SO_PEERCRED`` attribution is what ties the readings to pod
``train-0``. Its device memory is flat at the allocator's reserved 30 GiB while allocated memory grows
5 MiB a reading (once a second): the picture of a leak hidden under the cache.

- ``tensor-leak`` (``memory`` left at ``auto``: allocated where a hook reports it) fires, says it
  judged allocated memory, and names the client's leaking line.
- ``device-growth`` (``memory: device``) watches the same process and never fires: NVML's figure is flat.
- ``host-leak`` (``memory: host``) fires on the client's resident memory.

The client opts in to the agent's requests (docs/hook.md, "In a cluster"), its allocator's history
scripted too (``ScriptedHistory``: the leaking line keeps 64 MiB more at each reading): on
``tensor-leak``'s finding the operator asks, through its answers to the agent's reports, that the hook
record, then (``snapshotBefore`` far enough that the card's hours to full count as near) write a
snapshot; each reply is an Event on the pod, the snapshot's naming the file the client wrote and the
leaking line.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from controlplane import ControlPlane
from operator_support import gpu, monitor_policy, pod, prepare, wait_until

pytestmark = pytest.mark.integration

GPU_UUID = "GPU-hook0000-0000-4000-8000-000000000000"
LABELS = {"app": "trainer"}

CLIENT = """\
import os, sys, time
from gpuwarden.hook import DeviceMemory, HookClient, ScriptedMemory, StepHook
from gpuwarden.hook.history import ScriptedHistory, block, segments

MIB = 2**20


def allocator():
    reading = 0
    while True:
        reading += 1
        allocated = (2048 + 5 * reading) * MIB
        yield [DeviceMemory(sys.argv[2], allocated_bytes=allocated, reserved_bytes=30 * 1024 * MIB)]


def history():
    kept = []
    while True:
        # The innermost frame a library's (torch's, in site-packages), as in a model's forward pass.
        torch = (os.path.join(os.path.dirname(os.__file__), "site-packages", "torch", "nn", "linear.py"), 125)
        kept.append(block(64 * MIB, torch, ("train.py", 35)))
        yield segments(*kept)


client = HookClient(sys.argv[1])
hook = StepHook(
    interval=1.0,
    memory=ScriptedMemory(allocator()),
    tracemalloc=True,
    client=client,
    snapshots=sys.argv[3],
    history=ScriptedHistory(history()),
)
kept = []
print("ready", flush=True)
while True:
    kept.append(b"\\x01" * MIB)  # the leak
    hook.step()
    time.sleep(0.2)
"""
LEAK_LINE = next(n for n, line in enumerate(CLIENT.splitlines(), 1) if line.endswith("# the leak"))

RULES = [
    {
        "name": "tensor-leak",
        "memoryGrowth": {"rate": "100Mi/m", "window": "1m", "minFit": 0.8, "snapshotBefore": "24h"},
    },
    {"name": "device-growth", "memoryGrowth": {"memory": "device", "rate": "100Mi/m", "window": "1m"}},
    {"name": "host-leak", "memoryGrowth": {"memory": "host", "rate": "100Mi/m", "window": "1m"}},
]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The hooked process, started before the agent so that its PID can be written in the scenario; it
    writes its snapshots into ``tmp_path/snaps``."""
    script = tmp_path / "hook_client.py"
    script.write_text(CLIENT)
    socket = tmp_path / "hook" / "hook.sock"
    socket.parent.mkdir(mode=0o755)
    (tmp_path / "snaps").mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(socket), GPU_UUID, str(tmp_path / "snaps")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc, socket
    finally:
        proc.kill()
        proc.wait()


def test_the_hook_readings_reach_the_events_with_the_memory_judged_and_the_leaking_line(
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    client: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, socket = client
    setup = prepare(control_plane, tmp_path_factory, "hook", gpu_pods=["train-0"], labels=LABELS)
    setup.apply(monitor_policy(setup.namespace, "training", RULES, selector={"matchLabels": LABELS}))
    card = gpu(GPU_UUID, 0, [{"kind": "idle", "level": 70, "noise": 2}], [{"kind": "idle", "level": "30Gi"}])
    scenario = setup.scenario("hooked", [card], [pod(setup.namespace, "train-0", GPU_UUID, LABELS, proc.pid)])
    with setup.operator() as operator:
        operator.wait_ready()
        with setup.agent(scenario, operator, hook_socket=socket) as agent:

            def reasons() -> dict[str, str] | None:
                found = {v["rule"]: v.get("message", "") for v in setup.violations("training")}
                return found if {"tensor-leak", "host-leak"} <= found.keys() else None

            def snapshot() -> list[str] | None:
                said = [e["message"] for e in setup.events("Pod", "train-0", "GPUMemorySnapshot")]
                return said or None

            violations = wait_until(
                reasons,
                timeout=180,
                what="tensor-leak and host-leak in the policy's status",
                alive=agent.alive,
            )
            leak = violations["tensor-leak"]
            assert "allocated memory (live tensors, not the cache) grows" in leak, leak
            assert f"hook_client.py:{LEAK_LINE} +" in leak, leak
            assert "host memory" in violations["host-leak"], violations["host-leak"]
            assert "device-growth" not in violations, violations
            assert agent.metrics().get("gpuwarden_agent_hook_processes") == 1.0
            # The finding's asks, relayed by the agent: recording, then (30 s of history later) a snapshot.
            [said] = wait_until(snapshot, timeout=120, what="a GPUMemorySnapshot Event", alive=agent.alive)
    recording = [e["message"] for e in setup.events("Pod", "train-0", "GPUMemoryRecording")]
    assert len(recording) == 1, recording
    assert recording[0].startswith(f"pid {proc.pid}: recording the allocator's history"), recording
    snaps = sorted((tmp_path / "snaps").glob("gpuwarden-snapshot-*.pickle"))
    assert len(snaps) == 1, snaps
    assert said.startswith(f"pid {proc.pid} wrote {snaps[0]} ("), said
    assert "top lines: train.py:35 holds " in said, said
    events = [e["message"] for e in setup.events("Pod", "train-0", "GPUMemoryLeakSuspected")]
    assert any(f"hook_client.py:{LEAK_LINE} +" in m for m in events), events
    assert not any("GPU memory grows" in m for m in events), events
    host = [e["message"] for e in setup.events("Pod", "train-0", "HostMemoryLeakSuspected")]
    assert any("host memory (the hooked processes and their workers) grows" in m for m in host), host

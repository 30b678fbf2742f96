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
import sys, time
from gpuwarden.hook import DeviceMemory, HookClient, ScriptedMemory, StepHook

MIB = 2**20


def allocator():
    reading = 0
    while True:
        reading += 1
        allocated = (2048 + 5 * reading) * MIB
        yield [DeviceMemory(sys.argv[2], allocated_bytes=allocated, reserved_bytes=30 * 1024 * MIB)]


client = HookClient(sys.argv[1])
hook = StepHook(interval=1.0, memory=ScriptedMemory(allocator()), tracemalloc=True, client=client)
kept = []
print("ready", flush=True)
while True:
    kept.append(b"\\x01" * MIB)  # the leak
    hook.step()
    time.sleep(0.2)
"""
LEAK_LINE = next(n for n, line in enumerate(CLIENT.splitlines(), 1) if line.endswith("# the leak"))

RULES = [
    {"name": "tensor-leak", "memoryGrowth": {"rate": "100Mi/m", "window": "1m", "minFit": 0.8}},
    {"name": "device-growth", "memoryGrowth": {"memory": "device", "rate": "100Mi/m", "window": "1m"}},
    {"name": "host-leak", "memoryGrowth": {"memory": "host", "rate": "100Mi/m", "window": "1m"}},
]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The hooked process, started before the agent so that its PID can be written in the scenario."""
    script = tmp_path / "hook_client.py"
    script.write_text(CLIENT)
    socket = tmp_path / "hook" / "hook.sock"
    socket.parent.mkdir(mode=0o755)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(socket), GPU_UUID], stdout=subprocess.PIPE, text=True, cwd=tmp_path
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
    events = [e["message"] for e in setup.events("Pod", "train-0", "GPUMemoryLeakSuspected")]
    assert any(f"hook_client.py:{LEAK_LINE} +" in m for m in events), events
    assert not any("GPU memory grows" in m for m in events), events
    host = [e["message"] for e in setup.events("Pod", "train-0", "HostMemoryLeakSuspected")]
    assert any("host memory (the hooked processes and their workers) grows" in m for m in host), host

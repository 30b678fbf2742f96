"""`gpuwarden watch`: no silent fallback without a driver, a scenario watched like the demo, /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from driver_support import nvml_works
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden import cli
from gpuwarden.agent import nvml
from gpuwarden.agent.backend import BackendError
from gpuwarden.agent.scripted import ScriptedBackend
from gpuwarden.local.display import announcement_line, elapsed_clock, render_table, summary_lines
from gpuwarden.local.metrics import FindingCollector
from gpuwarden.local.policies import LocalPolicy, for_processes
from gpuwarden.local.rows import Announcement
from gpuwarden.local.session import Session
from gpuwarden.local.subjects import COMMAND_WIDTH, SubjectKind, short_command
from gpuwarden.local.watch import EXIT_NO_GPU, WatchConfig, default_hook_socket, watch
from gpuwarden.policy.parse import parse_spec
from gpuwarden.wire.node import AllocationSite, GpuSample, HookSample, ProcessSample, Snapshot

REPO = Path(__file__).resolve().parents[3]
EXAMPLE_POLICY = REPO / "examples" / "gpumonitorpolicy.yaml"

# Short windows, so that e2e-fast (whose conditions show within 10 s) fires in seconds of
# scenario time; namespaced and selecting one app, to show that watch sets both aside.
FAST_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: fast, namespace: inference}
spec:
  selector: {matchLabels: {app: llm-server}}
  evaluationInterval: 1s
  rules:
    - name: idle-gpu
      utilizationFloor: {percent: 20, for: 10s}
    - name: saturated
      utilizationCeiling: {percent: 95, for: 10s}
    - name: leak
      memoryGrowth: {rate: 100Mi/m, window: 1m, minFit: 0.8}
  actions:
    scale:
      targetRef: {apiVersion: apps/v1, kind: Deployment, name: llm-server}
      maxReplicas: 3
      scaleUpOn: [saturated]
"""


@pytest.fixture
def fast_policy(tmp_path: Path) -> Path:
    path = tmp_path / "fast.yaml"
    path.write_text(FAST_POLICY)
    return path


@pytest.mark.skipif(nvml_works(), reason="this host has an NVIDIA driver: watch would read its GPUs")
def test_without_a_driver_watch_says_so_and_exits_3() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "watch",
            "--policy",
            str(EXAMPLE_POLICY),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_NO_GPU == 3
    assert "NVML" in done.stderr
    assert "--scenario FILE" in done.stderr
    assert done.stdout == ""  # nothing was watched, not even a scenario


class BrokenNvml:
    name = "nvml"

    def __init__(self, **kwargs: Any) -> None:
        pass

    def open(self) -> None:
        raise BackendError("NVML found no GPUs on this host")

    def close(self) -> None:
        pass


def test_nvml_that_cannot_start_exits_3_on_any_host(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(nvml, "NvmlBackend", BrokenNvml)
    assert cli.main(["watch", "--policy", str(EXAMPLE_POLICY), "--listen", "127.0.0.1:0"]) == 3
    err = capsys.readouterr().err
    assert "NVML found no GPUs on this host" in err
    assert "--scenario FILE" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speed", "10"], "--speed only applies to --scenario"),
        (["--listen", "9400"], r"expected \[HOST\]:PORT"),
        (["--scenario", "no-such-scenario"], "no-such-scenario: cannot read"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["watch", "--policy", str(EXAMPLE_POLICY), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_watch_listens_for_hooks_where_the_environment_says_else_where_it_can(socket_dir: Path) -> None:
    assert default_hook_socket({"GPUWARDEN_HOOK_SOCKET": "/a/h.sock"}) == "/a/h.sock"
    assert default_hook_socket({"GPUWARDEN_HOOK_SOCKET": ""}) == ""  # none
    writable = socket_dir / "gpuwarden" / "hook.sock"  # its directory does not exist; ours is writable
    assert default_hook_socket({}, preferred=writable) == str(writable)
    nowhere = socket_dir / "no" / "such" / "hook.sock"
    assert default_hook_socket({"XDG_RUNTIME_DIR": "/run/user/1000"}, preferred=nowhere) == (
        "/run/user/1000/gpuwarden/hook.sock"
    )
    assert default_hook_socket({}, preferred=nowhere) == "/tmp/gpuwarden/hook.sock"


def test_watching_a_scenario_finds_what_the_demo_finds(
    fast_policy: Path, tmp_path: Path, socket_dir: Path
) -> None:
    plot = tmp_path / "watch.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "watch",
            f"--policy={fast_policy}",
            "--scenario=e2e-fast",
            "--speed=20",
            "--duration=90s",
            "--listen=127.0.0.1:0",
            f"--plot={plot}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "note: policy inference/fast: its namespace and selector speak of pods" in out
    assert "note: policy inference/fast: scale action ignored" in out
    # Where a job's hook should connect ($GPUWARDEN_HOOK_SOCKET, set for every test by conftest.py).
    assert f"Training hooks: listening on {socket_dir / 'hook.sock'}" in out
    # Subjects are processes, by PID and command line.
    assert re.search(
        r"STARTED idle-gpu pid 41237 python -m ipykernel_launcher on GPU 0: GPUUnderutilized", out
    )
    assert re.search(r"STARTED saturated pid 70533 python -m vllm\S* .* on GPU 3: GPUSaturated", out)
    # The server's 68-character command line is cut at 60 in lines; the summary has it whole, once.
    vllm = "python -m vllm.entrypoints.openai.api_server --model llama-3-70b-awq"
    short = "pid 70533 python -m vllm.entrypoints.openai.api_server --model llam..."
    assert f"STARTED saturated {short} on GPU 3: GPUSaturated" in out
    assert vllm not in out[: out.index("Summary:")]
    summary = out[out.index("Summary:") :]
    assert f"  GPU 3  {short}\n           in full: pid 70533 {vllm}\n" in summary
    assert summary.count(vllm) == 1
    assert re.search(
        r"STARTED leak pid 52810 python train.py .* on GPU 1: GPUMemoryLeakSuspected: GPU memory grows", out
    )
    assert "pid 60114" not in "".join(line for line in out.splitlines() if "STARTED" in line)
    assert "SCALE" not in out
    assert re.search(r"Summary: watched 4 GPUs for 1m3\ds", out)
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


SHARED_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: shared}
spec:
  selector: {}
  evaluationInterval: 5s
  rules:
    - name: idle
      utilizationFloor: {percent: 10, for: 1m}
    - name: saturated
      utilizationCeiling: {percent: 90, for: 1m}
"""


def test_an_idle_process_beside_a_busy_one_on_a_shared_gpu_is_found(tmp_path: Path) -> None:
    # shared-gpu: on GPU 0, pid 51001 saturates the SMs and pid 51002 holds 10Gi and runs no kernel
    # (NVML's per-process reading leaves it out). On GPU 1 nothing can be read per process.
    policy = tmp_path / "shared.yaml"
    policy.write_text(SHARED_POLICY)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "watch",
            f"--policy={policy}",
            "--scenario=shared-gpu",
            "--speed=20",
            "--duration=90s",
            "--listen=127.0.0.1:0",
            "--plain",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    started = [line for line in out.splitlines() if "STARTED" in line]
    assert any(
        re.search(r"STARTED idle pid 51002 python -m ipykernel_launcher on GPU 0: GPUUnderutilized: ", line)
        and line.endswith("mean per-process SM utilization 0% over 1m, floor 10%")
        for line in started
    ), out
    assert any(
        re.search(
            r"STARTED saturated pid 51001 .* on GPU 0: GPUSaturated: mean per-process SM utilization 9\d%",
            line,
        )
        for line in started
    ), out
    assert not [line for line in started if "idle pid 51001" in line]
    # No per-process reading: neither process is judged, and neither is called idle.
    assert not [line for line in started if "pid 5200" in line]
    # The status lines list each process under its GPU, with its own share.
    assert "]   pid 51002 python -m ipykernel_launcher: util 0%, mem 10Gi; findings: none\n" in out
    assert "]   pid 52001 python -m ipykernel_launcher: util -, mem 10Gi; findings: none\n" in out
    # The summary's GPU time per process (docs/accounting.md). GPU 0 is time-sliced between 51001 (98%
    # of the SMs) and 51002 (no kernel) for the 90 s: 51001 is allocated what it used and half of the
    # rest, 51002 the other half, all idle; the two add up to the GPU's 90 s, and both held it 90 s.
    usage = out[out.index("GPU time per process") :]

    def held(pid: int) -> tuple[float, float, str]:
        match = re.search(
            rf"pid {pid} .* on NVIDIA H200: held (\d+) s, ([\d.]+) GPU-s allocated, (.*)", usage
        )
        assert match, usage
        return float(match[1]), float(match[2]), match[3]

    busy_held, busy, busy_rest = held(51001)
    idle_held, idle, idle_rest = held(51002)
    assert 88 <= busy_held <= 90
    assert 88 <= idle_held <= 90
    assert busy + idle == pytest.approx(busy_held, abs=0.2)
    used = re.match(r"([\d.]+) used \((\d+)%\), 0.0 idle$", busy_rest)
    assert used, busy_rest
    assert 0.97 * busy <= float(used[1]) <= busy  # never above what it was allocated
    assert 0 < idle <= 2
    assert idle_rest == f"0.0 used (0%), {idle:.1f} idle"
    # GPU 1 has no per-process readings: its processes' activity is unknown, never taken for idle;
    # each is allocated half of it.
    assert held(52001)[1:] == (45.0, "activity unknown")
    assert held(52002)[1:] == (45.0, "activity unknown")
    assert re.search(
        r"wasted: 0.000 GPU-hours of 0.050 \([\d.]+ GPU-s: [\d.]+ idle, 0.0 unallocated\)", usage
    )


async def test_metrics_while_watching_and_sigint_stops_with_a_summary(fast_policy: Path) -> None:
    async with asyncio.timeout(90):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuwarden",
            "watch",
            f"--policy={fast_policy}",
            "--scenario=e2e-fast",
            "--speed=10",
            "--listen=127.0.0.1:0",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert process.stdout is not None
        lines: list[str] = []

        async def until(pattern: str) -> re.Match[str]:
            while not (match := re.search(pattern, lines[-1] if lines else "")):
                line = await process.stdout.readline()  # type: ignore[union-attr]
                assert line, "watch exited early:\n" + "".join(lines)
                lines.append(line.decode())
            return match

        try:
            address = (await until(r"/metrics on (\S+);")).group(1)
            await until(r"STARTED idle-gpu pid 41237")
            async with aiohttp.ClientSession() as http, http.get(f"http://{address}/metrics") as response:
                body = await response.text()
            assert re.search(
                r'gpuwarden_local_finding_active\{[^}]*pod="pid/41237"[^}]*rule="idle-gpu"', body
            )
            # The process's short command is a label too (never the whole line: see FindingCollector).
            command = 'command="python -m ipykernel_launcher"'
            assert re.search(rf'gpuwarden_local_finding_active\{{{command},[^}}]*pod="pid/41237"', body)
            assert 'gpuwarden_agent_info{backend="scripted"' in body
            assert "gpuwarden_process_gpu_memory_used_bytes{" in body
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGINT)
            rest = (await process.stdout.read()).decode()
            code = await process.wait()
    assert code == 0, "".join(lines) + rest
    assert "Summary: watched 4 GPUs" in rest
    assert "idle-gpu (GPUUnderutilized) since" in rest


def test_processes_are_subjects_named_on_one_line() -> None:
    policy = LocalPolicy("p", None, parse_spec(yaml.safe_load(FAST_POLICY)["spec"]))
    session = Session([for_processes(policy)], subjects=SubjectKind.PROCESSES)
    gpu = GpuSample(
        uuid="GPU-a",
        index=0,
        utilization_gpu=50.0,
        memory_used_bytes=10 * 2**30,
        memory_total_bytes=80 * 2**30,
        processes=[
            ProcessSample(pid=11, used_memory_bytes=2**30, sm_util=10.0, command="python -c\nimport torch\n"),
            ProcessSample(pid=12, used_memory_bytes=3 * 2**30, sm_util=30.0, command=""),
        ],
    )
    step = session.observe(Snapshot(timestamp=1_800_000_000.0, gpus=[gpu]))
    (row,) = step.rows
    assert row.subjects == ("pid 11 python -c import torch", "pid 12")
    # Each process on a shared GPU is judged on its own share.
    ((_, mine_window),) = session.store.series_of("", "pid/11")
    ((_, their_window),) = session.store.series_of("", "pid/12")
    mine, theirs = mine_window.points()[-1], their_window.points()[-1]
    assert (mine.mem_used, mine.gpu_util) == (2**30, 10.0)
    assert (theirs.mem_used, theirs.gpu_util) == (3 * 2**30, 30.0)


TORCH = (
    "/usr/bin/python3 -c import time, torch\n"
    "x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
    "while True:\n    time.sleep(1)\n"
)
"""What a torch test child's /proc/<pid>/cmdline reads as (NUL-separated arguments joined by spaces)."""


@pytest.mark.parametrize(
    ("command", "short"),
    [
        ("", ""),
        ("python train.py --lr 3e-4", "python train.py --lr 3e-4"),
        ("/opt/conda/bin/python  train.py\n", "python train.py"),
        (TORCH, "python3 -c import time, torch x = torch.empty(1 << 30, dt..."),
        ("x" * 61, "x" * 57 + "..."),
        ("x" * 60, "x" * 60),
    ],
)
def test_a_command_is_its_executables_basename_and_arguments_cut_at_60(command: str, short: str) -> None:
    assert short_command(command) == short
    assert len(short_command(command)) <= COMMAND_WIDTH == 60


def _torch_gpu(pid: int, util: float = 1.0) -> GpuSample:
    return GpuSample(
        uuid="GPU-a",
        index=0,
        utilization_gpu=util,
        memory_used_bytes=10 * 2**30,
        memory_total_bytes=80 * 2**30,
        processes=[ProcessSample(pid=pid, used_memory_bytes=2**30, sm_util=util, command=TORCH)],
    )


def test_a_long_command_line_is_short_in_lines_table_and_labels_and_whole_once_in_the_summary() -> None:
    policy = LocalPolicy("p", None, parse_spec(yaml.safe_load(FAST_POLICY)["spec"]))
    session = Session([for_processes(policy)], subjects=SubjectKind.PROCESSES)
    short = "pid 474 python3 -c import time, torch x = torch.empty(1 << 30, dt..."
    started: list[Announcement] = []
    for t in range(15):  # idle through the policy's 10s window: the idle-gpu finding starts
        step = session.observe(Snapshot(timestamp=1_800_000_000.0 + t, gpus=[_torch_gpu(474)]))
        assert step.rows[0].subjects == (short,)
        started += step.announcements
    (announced,) = started
    line = announcement_line(announced, elapsed_clock(1_800_000_000.0))
    assert re.match(rf"\[00:\d\d\] STARTED idle-gpu {re.escape(short)} on GPU 0: GPUUnderutilized: ", line)
    assert "\n" not in line
    assert "while True" not in line
    (table_row,) = render_table(step.rows, "t", subject_header="process")[2:]
    assert table_row.startswith("GPU 0   pid 474 python3 -c import time, torch~ ")  # the column is 38

    registry = CollectorRegistry()
    registry.register(FindingCollector(session.active, session.command))
    body = generate_latest(registry).decode()
    assert 'command="python3 -c import time, torch x = torch.empty(1 << 30, dt...",' in body
    assert 'pod="pid/474"' in body
    assert "while True" not in body

    summary = summary_lines(session.history, [], elapsed_clock(1_800_000_000.0))
    whole = "pid 474 /usr/bin/python3 -c import time, torch x = torch.empty(1 << 30, dtype=torch.uint8, "
    whole += "device='cuda') while True: time.sleep(1)"
    assert summary[:2] == [f"  GPU 0  {short}", f"           in full: {whole}"]
    assert sum(whole in s for s in summary) == 1


def test_a_pid_that_runs_something_else_is_named_again() -> None:
    policy = LocalPolicy("p", None, parse_spec(yaml.safe_load(FAST_POLICY)["spec"]))
    session = Session([for_processes(policy)], subjects=SubjectKind.PROCESSES)
    session.observe(Snapshot(timestamp=1_800_000_000.0, gpus=[_torch_gpu(474)]))
    gpu = _torch_gpu(474).model_copy(
        update={"processes": [ProcessSample(pid=474, used_memory_bytes=1, command="/bin/sleep 9")]}
    )
    (row,) = session.observe(Snapshot(timestamp=1_800_000_001.0, gpus=[gpu])).rows
    assert row.subjects == ("pid 474 sleep 9",)
    assert session.command("", "pid/474") == "sleep 9"


async def test_a_second_ctrl_c_while_the_summary_and_plot_are_written_cuts_neither(
    fast_policy: Path, tmp_path: Path
) -> None:
    # A user who presses Ctrl-C twice: the second arrives while the summary is printed and the plot drawn
    # (drawing takes a second or so). It must not become a KeyboardInterrupt that drops them with exit 0.
    plot = tmp_path / "watch.png"
    async with asyncio.timeout(90):
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gpuwarden", "watch", f"--policy={fast_policy}", "--scenario=e2e-fast"),
            *("--speed=10", "--listen=127.0.0.1:0", "--plain", f"--plot={plot}"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert process.stdout is not None
        out: list[str] = []
        while not any("STARTED idle-gpu" in line for line in out):
            line = (await process.stdout.readline()).decode()
            assert line, "watch exited early:\n" + "".join(out)
            out.append(line)
        process.send_signal(signal.SIGINT)
        while not any(line.startswith("Summary:") for line in out):
            line = (await process.stdout.readline()).decode()
            assert line, "watch exited without a summary:\n" + "".join(out)
            out.append(line)
        process.send_signal(signal.SIGINT)
        rest = (await process.stdout.read()).decode()
        code = await process.wait()
    assert code == 0, "".join(out) + rest
    assert f"Plot: {plot}" in rest, "".join(out) + rest
    assert plot.stat().st_size > 0


HOOK_GPU = "GPU-0d3f5a1e-7c21-4b8e-9a0f-3e1d2c4b5a60"


class RecordingDisplay:
    """A display that lets the test wait for what watch shows."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.steps = 0
        self._changed = asyncio.Event()

    def show(self, step: Any, title: str = "") -> None:
        self.steps += 1
        self._changed.set()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._changed.set()

    def close(self) -> None:
        pass

    async def changed(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def note_matching(self, pattern: str) -> re.Match[str]:
        while not (found := [m for n in self.notes if (m := re.search(pattern, n))]):
            await self.changed()
        return found[0]


async def test_watch_puts_what_a_hook_on_this_host_says_on_its_process(
    fast_policy: Path, tmp_path: Path, socket_dir: Path
) -> None:
    """watch in this process, on a scenario whose process is this one; this process is the hook."""
    scenario = tmp_path / "hooked.yaml"
    pod = {"namespace": "ml", "name": "job", "gpus": [HOOK_GPU], "processes": [{"pid": os.getpid()}]}
    gpu = {
        "uuid": HOOK_GPU,
        "memoryTotal": "80Gi",
        "utilization": [{"kind": "idle", "level": 50}],
        "memory": [{"kind": "idle", "level": "9Gi"}],
    }
    scenario.write_text(yaml.safe_dump({"name": "hooked", "duration": "1h", "gpus": [gpu], "pods": [pod]}))
    hook_socket = socket_dir / "hook.sock"
    args = cli.build_parser(["watch"]).parse_args(
        [
            *("watch", f"--policy={fast_policy}", f"--scenario={scenario}", "--listen=127.0.0.1:0"),
            *("--interval=100ms", f"--hook-socket={hook_socket}", "--plain"),
        ]
    )
    config = WatchConfig.from_args(args)
    assert config.scenario is not None
    backend = ScriptedBackend(config.scenario)
    backend.open()
    display = RecordingDisplay()
    watching = asyncio.create_task(watch(config, backend, out=display))
    try:
        async with asyncio.timeout(30):
            await display.note_matching(f"Training hooks: listening on {hook_socket} ")
            address = (await display.note_matching(r"/metrics on (\S+);")).group(1)
            _, writer = await asyncio.open_unix_connection(str(hook_socket))
            device = {"uuid": HOOK_GPU, "allocatedBytes": 7 * 2**30}
            writer.write(json.dumps({"v": 1, "timestamp": time.time(), "devices": [device]}).encode() + b"\n")
            allocated: list[tuple[dict[str, str], float]] = []
            while not allocated:
                await display.changed()  # one more snapshot through the sampler's stages
                async with aiohttp.ClientSession() as http, http.get(f"http://{address}/metrics") as response:
                    body = await response.text()
                allocated = [
                    (sample.labels, sample.value)
                    for family in text_string_to_metric_families(body)
                    for sample in family.samples
                    if sample.name == "gpuwarden_process_gpu_memory_allocated_bytes"
                ]
            ((labels, value),) = allocated
            assert (labels["uuid"], labels["pid"], value) == (HOOK_GPU, str(os.getpid()), 7 * 2**30)
            assert "gpuwarden_agent_hook_messages_total 1.0" in body
            writer.close()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert not hook_socket.exists()


HOOK_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: hooked}
spec:
  selector: {}
  evaluationInterval: 10s
  rules:
    - name: tensor-leak
      memoryGrowth: {rate: 100Mi/m, window: 10m, memory: allocated}
"""


def _hooked_gpu(i: int) -> GpuSample:
    """A training process whose hook reports live tensors growing 200Mi/m over a 24Gi cache."""
    allocated = 10 * 2**30 + 200 * 2**20 * i // 60
    sites = [
        AllocationSite(file="/job/train.py", line=88, size_bytes=60 << 20, growth_bytes=50 << 20, count=1200)
    ]
    hook = HookSample(
        timestamp=1_800_000_000.0 + i, allocated_bytes=allocated, reserved_bytes=24 << 30, sites=sites
    )
    return GpuSample(
        uuid="GPU-a",
        index=0,
        utilization_gpu=90.0,
        memory_used_bytes=25 << 30,
        memory_total_bytes=80 << 30,
        processes=[ProcessSample(pid=77, used_memory_bytes=25 << 30, command="python train.py", hook=hook)],
    )


def test_a_hooked_process_shows_its_tensors_and_cache_and_its_finding_names_the_lines() -> None:
    policy = LocalPolicy("p", None, parse_spec(yaml.safe_load(HOOK_POLICY)["spec"]))
    session = Session([for_processes(policy)], subjects=SubjectKind.PROCESSES)
    started: list[Announcement] = []
    for i in range(300):
        step = session.observe(Snapshot(timestamp=1_800_000_000.0 + i, gpus=[_hooked_gpu(i)]))
        started += step.announcements
    (announced,) = started
    line = announcement_line(announced, elapsed_clock(1_800_000_000.0))
    assert "STARTED tensor-leak pid 77 python train.py on GPU 0: GPUMemoryLeakSuspected: " in line
    assert "allocated memory (live tensors, not the cache) grows 200Mi/m over 4m" in line
    assert line.endswith("; top growing lines: job/train.py:88 +50Mi (1,200 blocks)")
    (row,) = render_table(step.rows, "t", subject_header="process")[2:]
    assert "25Gi/80Gi (31%) alloc 11Gi, cache 24Gi tensor-leak" in row

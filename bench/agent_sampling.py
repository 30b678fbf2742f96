"""Benchmark of the agent's sampling on a real GPU: per-sample cost, and the agent's CPU and memory.

Not a test: it prints figures for docs/benchmarks.md ("Agent sampling (H200)"). Run it
on a GPU machine:

    python3 bench/agent_sampling.py --out agent-sampling.json
    python3 bench/agent_sampling.py --loop-seconds 10       # a quick look

Phases:

1. **One device sample** per GPU: ``NvmlBackend.sample_devices`` (what the agent pays:
   NVML plus mapping, error handling, pydantic models) against the raw NVML calls it
   makes per sample (the floor: the same calls on the same handles, results discarded), timed
   side by side in alternating blocks in the same process. Also the whole
   ``Sampler.sample_once`` (the Snapshot too), each raw call on its own, and one
   ``nvmlDeviceGetProcessUtilization`` round (the agent's lower-rate read).
2. **nvidia-smi**: one ``nvidia-smi --query-gpu=... --format=csv`` call for the same
   fields, as a scraper that shells out would pay.
3. **The agent**: ``gpuwarden agent`` as a child process at 1 Hz and at 10 Hz device
   sampling (per-process utilization every 10 s, no operator), its CPU time over wall
   time and its resident memory after a warm-up; one /metrics scrape is kept
   (``--metrics-out``) so that it can be linted with promtool.
4. **Resident memory by stage**: a fresh process importing what the agent imports,
   then initialising NVML, opening the backend (GPM buffers) and sampling.

``--phases`` picks some (``device,smi,agent,rss``); ``--agent-env`` runs the agent
with extra environment (e.g. ``MALLOC_ARENA_MAX=2``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.agent.snapshots import Sampler, SnapshotRing

SMI_FIELDS = (
    "utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw,clocks.sm,"
    "ecc.errors.uncorrected.volatile.total"
)


class _GpmFloor:
    """GPM as the backend reads it: a sample, then metrics against the previous one, buffers alternating."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        self.request = nvml.c_nvmlGpmMetricsGet_t()
        self.ids = [
            nvml.NVML_GPM_METRIC_SM_UTIL,
            nvml.NVML_GPM_METRIC_SM_OCCUPANCY,
            nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
            nvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
        ]
        self.next = 0
        nvml.nvmlGpmSampleGet(handle, self.samples[1])

    def sample_get(self) -> None:
        """nvmlGpmSampleGet into the buffer not holding the previous sample."""
        self.nvml.nvmlGpmSampleGet(self.handle, self.samples[self.next])

    def metrics_get(self) -> None:
        """nvmlGpmMetricsGet between the previous sample and the one just taken."""
        nvml, request = self.nvml, self.request
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.ids)
        request.sample1, request.sample2 = self.samples[self.next ^ 1], self.samples[self.next]
        for i, metric in enumerate(self.ids):
            request.metrics[i].metricId = metric
        nvml.nvmlGpmMetricsGet(request)
        self.next ^= 1


PER_MINUTE = ("mig_mode",)
"""Raw calls the backend makes once a minute, not per sample: timed, but not part of the floor."""


def raw_calls(backend: NvmlBackend) -> list[tuple[str, Callable[[], object]]]:
    """The NVML calls ``sample_devices`` makes, per GPU, named, as bare closures.

    Calls NVML refuses as not supported are left out, as the backend leaves them out
    after its first sample. The floor is these minus :data:`PER_MINUTE`.
    """
    nvml: Any = backend.nvml
    calls: list[tuple[str, Callable[[], object]]] = []
    for device in backend._gpus:  # the backend's own handles, so both sides read the same devices
        h = device.handle
        candidates: list[tuple[str, Callable[[], object]]] = [
            ("mig_mode", partial(nvml.nvmlDeviceGetMigMode, h)),
            ("utilization", partial(nvml.nvmlDeviceGetUtilizationRates, h)),
            ("memory_v2", partial(nvml.nvmlDeviceGetMemoryInfo, h, version=nvml.nvmlMemory_v2)),
            ("temperature", partial(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)),
            ("power", partial(nvml.nvmlDeviceGetPowerUsage, h)),
            ("clock_sm", partial(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)),
            (
                "ecc_uncorrected",
                partial(
                    nvml.nvmlDeviceGetTotalEccErrors,
                    h,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC,
                ),
            ),
            ("compute_procs", partial(nvml.nvmlDeviceGetComputeRunningProcesses, h)),
        ]
        if device.gpm is not None:
            gpm = _GpmFloor(nvml, h)
            candidates += [("gpm_sample_get", gpm.sample_get), ("gpm_metrics_get", gpm.metrics_get)]
        for name, call in candidates:
            try:
                call()
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    continue
            calls.append((f"{name}[{device.index}]", call))
    return calls


def per_call(calls: list[tuple[str, Callable[[], object]]], repeats: int) -> dict[str, dict[str, float]]:
    """Median and p99 (µs) of each raw call on its own; GPM's two calls are timed as a pair's halves."""
    out: dict[str, dict[str, float]] = {}
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    for _ in range(repeats):
        for name, call in calls:  # in order, so each GPM metrics call follows its sample
            t0 = time.perf_counter_ns()
            call()
            times[name].append((time.perf_counter_ns() - t0) / 1e3)
    for name, values in times.items():
        values.sort()
        out[name] = {
            "median_us": round(statistics.median(values), 2),
            "p99_us": round(values[int(len(values) * 0.99)], 2),
        }
    return out


RSS_CHILD = r"""
import json, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
out = {"python": rss()}
import gpuwarden.agent.command  # everything the agent imports
out["agent_imports"] = rss()
import pynvml
pynvml.nvmlInit()
out["nvml_init"] = rss()
from gpuwarden.agent.nvml import NvmlBackend
backend = NvmlBackend()
backend.open()
out["backend_open_gpm_buffers"] = rss()
for _ in range(60):
    backend.sample_devices(time.time())
out["after_60_device_samples"] = rss()
backend.sample_process_utilization(time.time())
out["after_process_utilization"] = rss()
print(json.dumps(out))
"""


def rss_stages() -> dict[str, float]:
    """Resident memory (MiB) of a fresh process after each stage of what the agent loads."""
    done = subprocess.run([sys.executable, "-c", RSS_CHILD], check=True, capture_output=True, text=True)
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def interleaved(
    variants: dict[str, Callable[[], object]], *, blocks: int, per_block: int
) -> dict[str, dict[str, float]]:
    """Median and p99 of per-call time (µs) for each variant, in alternating blocks."""
    per_block_us: dict[str, list[float]] = {name: [] for name in variants}
    per_call_us: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            begin = time.perf_counter_ns()
            for _ in range(per_block):
                t0 = time.perf_counter_ns()
                fn()
                per_call_us[name].append((time.perf_counter_ns() - t0) / 1e3)
            per_block_us[name].append((time.perf_counter_ns() - begin) / 1e3 / per_block)
    out = {}
    for name in variants:
        calls = sorted(per_call_us[name])
        out[name] = {
            "median_us": round(statistics.median(calls), 2),
            "p99_us": round(calls[int(len(calls) * 0.99)], 2),
            "block_mean_median_us": round(statistics.median(per_block_us[name]), 2),
        }
    return out


def nvidia_smi(runs: int) -> dict[str, float] | None:
    """Wall time of one nvidia-smi query for the agent's fields, in ms."""
    argv = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"]
    try:
        subprocess.run(argv, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"nvidia-smi unavailable: {exc}", file=sys.stderr)
        return None
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(times), 2), "max_ms": round(max(times), 2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def agent_loop(
    interval: str,
    seconds: float,
    warmup: float,
    metrics_out: Path | None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``gpuwarden agent`` (plus ``extra`` flags); measure its CPU share and memory over ``seconds``."""
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "gpuwarden",
        "agent",
        "--node-name=bench",
        f"--listen=127.0.0.1:{port}",
        f"--sample-interval={interval}",
        "--process-interval=10s",
        "--log-level=warning",
        *extra,
    ]
    child = subprocess.Popen(argv, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:  # a benchmark harness, not a test: polling readiness is fine here
            if child.poll() is not None:
                raise RuntimeError(f"the agent exited with {child.returncode}")
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        time.sleep(warmup)
        cpu0, wall0 = _proc_cpu_seconds(child.pid), time.monotonic()
        time.sleep(seconds)
        cpu1, wall1 = _proc_cpu_seconds(child.pid), time.monotonic()
        rss_kib = _proc_status_kib(child.pid, "VmRSS")
        hwm_kib = _proc_status_kib(child.pid, "VmHWM")
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            body = response.read()
        if metrics_out is not None:
            metrics_out.write_bytes(body)
        stop0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=30)
        samples = [
            float(line.split()[-1])
            for line in body.decode().splitlines()
            if line.startswith("gpuwarden_agent_samples_total")
        ]
        return {
            "interval": interval,
            "env": env or {},
            "seconds": round(wall1 - wall0, 2),
            "cpu_share_of_one_core": round((cpu1 - cpu0) / (wall1 - wall0), 5),
            "rss_mib": round(rss_kib / 1024, 1),
            "peak_rss_mib": round(hwm_kib / 1024, 1),
            "ready_after_s": round(ready_s, 2),
            "samples_total": samples[0] if samples else None,
            "exit_code_after_sigterm": code,
            "shutdown_s": round(time.monotonic() - stop0, 2),
        }
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def device_phase(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Phase 1: one device sample against the NVML floor, each raw call, per-process utilization."""
    backend = NvmlBackend()
    backend.open()
    gpus = len(backend.devices())
    nvml: Any = backend.nvml
    result["driver"] = nvml.nvmlSystemGetDriverVersion()
    result["nvml_version"] = nvml.nvmlSystemGetNVMLVersion()
    result["gpus"] = [dataclasses.asdict(d) for d in backend.devices()]
    sampler = Sampler(backend, SnapshotRing())
    every = raw_calls(backend)
    floor = [(name, call) for name, call in every if name.split("[")[0] not in PER_MINUTE]
    result["raw_calls_per_sample"] = [name for name, _ in floor]

    def raw() -> None:
        for _, call in floor:
            call()

    backend.sample_devices(time.time())  # warm: not-supported calls found, GPM primed
    timed = interleaved(
        {
            "nvml_floor": raw,
            "sample_devices": lambda: backend.sample_devices(time.time()),
            "sample_once": lambda: sampler.sample_once(with_processes=False),
        },
        blocks=args.blocks,
        per_block=args.per_block,
    )
    for figures in timed.values():
        figures["per_gpu_median_us"] = round(figures["median_us"] / gpus, 2)
    result["device_sample"] = timed
    result["overhead_x"] = round(timed["sample_devices"]["median_us"] / timed["nvml_floor"]["median_us"], 2)
    result["raw_call"] = per_call(every, args.blocks * args.per_block // 4)

    process_times = []
    for _ in range(20):
        t0 = time.perf_counter()
        backend.sample_process_utilization(time.time())
        process_times.append((time.perf_counter() - t0) * 1e3)
    result["process_utilization_ms"] = {
        "median": round(statistics.median(process_times), 3),
        "max": round(max(process_times), 3),
    }
    backend.close()


def main() -> int:
    """Run the chosen phases and print a summary; ``--out`` keeps the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--phases", default="device,smi,agent,rss", help="comma-separated: device,smi,agent,rss"
    )
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--per-block", type=int, default=250)
    parser.add_argument("--smi-runs", type=int, default=20)
    parser.add_argument("--agent-intervals", default="1s,100ms", help="device sampling intervals to run at")
    parser.add_argument("--loop-seconds", type=float, default=30.0)
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--agent-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--metrics-out", type=Path, help="keep the first agent run's /metrics here")
    args = parser.parse_args()
    phases = set(args.phases.split(","))

    result: dict[str, Any] = {"python": sys.version.split()[0], "argv": sys.argv[1:]}
    if "device" in phases:
        device_phase(args, result)
    if "smi" in phases:
        result["nvidia_smi_query"] = nvidia_smi(args.smi_runs)
    if "rss" in phases:
        result["rss_mib_by_stage"] = rss_stages()
    if "agent" in phases:
        env = dict(item.split("=", 1) for item in args.agent_env)
        result["agent"] = [
            agent_loop(
                interval,
                args.loop_seconds,
                args.warmup_seconds,
                args.metrics_out if i == 0 else None,
                env=env,
            )
            for i, interval in enumerate(args.agent_intervals.split(","))
        ]

    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    if "device_sample" in result:
        d = result["device_sample"]
        print("\n| what | median µs | p99 µs |\n| --- | --- | --- |")
        for name in ("nvml_floor", "sample_devices", "sample_once"):
            print(f"| {name} | {d[name]['median_us']} | {d[name]['p99_us']} |")
        print(f"overhead over the NVML floor: {result['overhead_x']}x")
    for run in result.get("agent", []):
        print(
            f"agent at {run['interval']}: {run['cpu_share_of_one_core'] * 100:.2f}% of a core, "
            f"RSS {run['rss_mib']} MiB (peak {run['peak_rss_mib']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

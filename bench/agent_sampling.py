"""Benchmark of the agent's sampling on a real GPU: per-sample cost, and the agent's CPU and memory.

Not a test: it prints figures for docs/benchmarks.md ("Agent sampling (H200)"). Run it
on a GPU machine:

    python3 bench/agent_sampling.py --out agent-sampling.json
    python3 bench/agent_sampling.py --loop-seconds 10       # a quick look

Phases:

1. **One device sample** per GPU: ``NvmlBackend.sample_devices`` (what the agent pays:
   NVML plus mapping, error handling, pydantic models) against the raw NVML calls it
   makes (the floor: the same calls on the same handles, results discarded), timed
   side by side in alternating blocks in the same process. Also the whole
   ``Sampler.sample_once`` (the Snapshot too), and one
   ``nvmlDeviceGetProcessUtilization`` round (the agent's lower-rate read).
2. **nvidia-smi**: one ``nvidia-smi --query-gpu=... --format=csv`` call for the same
   fields, as a scraper that shells out would pay.
3. **The agent**: ``gpuwarden agent`` as a child process at 1 Hz and at 10 Hz device
   sampling (per-process utilization every 10 s, no operator), its CPU time over wall
   time and its resident memory after a warm-up; one /metrics scrape is kept
   (``--metrics-out``) so that it can be linted with promtool.
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

    def __call__(self) -> None:
        nvml, request = self.nvml, self.request
        current, previous = self.samples[self.next], self.samples[self.next ^ 1]
        nvml.nvmlGpmSampleGet(self.handle, current)
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.ids)
        request.sample1, request.sample2 = previous, current
        for i, metric in enumerate(self.ids):
            request.metrics[i].metricId = metric
        nvml.nvmlGpmMetricsGet(request)
        self.next ^= 1


def raw_calls(backend: NvmlBackend) -> list[Callable[[], object]]:
    """The NVML calls one ``sample_devices`` makes, per GPU, as bare closures (the floor).

    Calls NVML refuses as not supported are left out, as the backend leaves them out
    after its first sample.
    """
    nvml: Any = backend.nvml
    calls: list[Callable[[], object]] = []
    for device in backend._gpus:  # the backend's own handles, so both sides read the same devices
        h = device.handle
        candidates: list[Callable[[], object]] = [
            partial(nvml.nvmlDeviceGetMigMode, h),
            partial(nvml.nvmlDeviceGetUtilizationRates, h),
            partial(nvml.nvmlDeviceGetMemoryInfo, h, version=nvml.nvmlMemory_v2),
            partial(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
            partial(nvml.nvmlDeviceGetPowerUsage, h),
            partial(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
            partial(
                nvml.nvmlDeviceGetTotalEccErrors,
                h,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            ),
            partial(nvml.nvmlDeviceGetComputeRunningProcesses, h),
        ]
        if device.gpm is not None:
            candidates.append(_GpmFloor(nvml, h))
        for call in candidates:
            try:
                call()
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    continue
            calls.append(call)
    return calls


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
    interval: str, seconds: float, warmup: float, metrics_out: Path | None, extra: tuple[str, ...] = ()
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
    child = subprocess.Popen(argv)
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


def main() -> int:
    """Run every phase and print a summary; ``--out`` keeps the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--per-block", type=int, default=250)
    parser.add_argument("--smi-runs", type=int, default=20)
    parser.add_argument("--loop-seconds", type=float, default=30.0)
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--metrics-out", type=Path)
    args = parser.parse_args()

    backend = NvmlBackend()
    backend.open()
    gpus = len(backend.devices())
    nvml: Any = backend.nvml
    result: dict[str, Any] = {
        "driver": nvml.nvmlSystemGetDriverVersion(),
        "nvml_version": nvml.nvmlSystemGetNVMLVersion(),
        "gpus": [dataclasses.asdict(d) for d in backend.devices()],
        "python": sys.version.split()[0],
    }
    ring = SnapshotRing()
    sampler = Sampler(backend, ring)
    floor = raw_calls(backend)
    result["raw_calls_per_sample"] = len(floor)

    def raw() -> None:
        for call in floor:
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

    result["nvidia_smi_query"] = nvidia_smi(args.smi_runs)
    result["agent"] = [
        agent_loop("1s", args.loop_seconds, args.warmup_seconds, args.metrics_out),
        agent_loop("100ms", args.loop_seconds, args.warmup_seconds, None),
    ]

    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    d = result["device_sample"]
    print("\n| what | median µs | p99 µs |\n| --- | --- | --- |")
    for name in ("nvml_floor", "sample_devices", "sample_once"):
        print(f"| {name} ({gpus} GPU) | {d[name]['median_us']} | {d[name]['p99_us']} |")
    print(f"overhead over the NVML floor: {result['overhead_x']}x")
    for run in result["agent"]:
        print(
            f"agent at {run['interval']}: {run['cpu_share_of_one_core'] * 100:.2f}% of a core, "
            f"RSS {run['rss_mib']} MiB (peak {run['peak_rss_mib']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

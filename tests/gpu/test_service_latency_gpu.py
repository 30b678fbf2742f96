"""`gpuwarden watch --service-metrics` on a real model served on the GPU: as the requests sent at once
grow, the server's P99 latency passes the policy's limit, and watch flags requestLatency with the
P99 the client measured itself, within the histogram's bucket resolution.

Run on a GPU machine, never in CI (no driver there); it needs torch and transformers, and nothing
from the internet (the model is GPT-2's shape, randomly initialised):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_service_latency_gpu.py -s

The server (tests/gpu/served_model.py) answers one request at a time, in arrival order, so with
``c`` requests kept in flight each waits for the ``c - 1`` before it: latency ~ ``c`` x a request's
own time ``s``, measured first, alone. The limit is the first of vLLM's bucket bounds at or above
3 ``s``, so P99 passes it at 4 at once; the generator doubles the requests kept in flight (1, 2, 4,
8, ...) every :data:`LEVEL_SECONDS` until watch's STARTED line comes. The client's P99 over the
window that line speaks of must then fall in the bucket of watch's, or one of its neighbours
(where the window's edges, a scrape apart, cut).

CPU dry run (no GPU, no NVML: the tiny model on the CPU and watch reading a scripted scenario's
GPUs, which only the GPU rules would judge): ``GPUWARDEN_SERVED_DEVICE=cpu``, same command.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gpuwarden.sim.replica import E2E_LATENCY, HISTOGRAM_BOUNDS

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("GPUWARDEN_SERVED_DEVICE", "cuda")
CPU_DRY_RUN = DEVICE == "cpu"
MODEL_FLAGS = ["--layers=2", "--hidden=128", "--heads=2"] if CPU_DRY_RUN else []
TOKENS = 32
"""New tokens per request: a few hundred milliseconds of generate on an H200."""
ALONE = 5
"""Requests timed one after another to measure ``s``."""
LEVEL_SECONDS = 20.0
"""Each concurrency level runs this long (the rule's window and ``for`` fit in it)."""
MAX_CONCURRENCY = 64
WINDOW = 15
"""The rule's window, seconds."""
FOR = 5
INTERVAL = 2
"""The policy's evaluationInterval and scrape interval, seconds."""
SERVER_START = 300.0
"""Seconds the server may take to build and warm the model."""
BOUNDS = HISTOGRAM_BOUNDS[E2E_LATENCY]

POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {{name: served}}
spec:
  selector: {{}}
  evaluationInterval: {interval}s
  serviceMetrics: {{interval: {interval}s}}
  rules:
    - name: slow-requests
      requestLatency:
        {{server: vllm, percentile: 99, window: {window}s, threshold: {limit_ms}ms, for: {for_}s}}
"""


def limit_for(alone: float) -> float:
    """The first of the e2e histogram's bounds at or above three requests' time."""
    return next(b for b in BOUNDS if b >= 3 * alone)


def bucket(value: float) -> int:
    """The index of the bucket ``value`` falls in (le is inclusive)."""
    return next(i for i, b in enumerate(BOUNDS) if value <= b)


def client_p99(done: list[tuple[float, float]], start: float, end: float) -> float:
    """P99 of the latencies of requests answered in ``[start, end]`` (nearest rank)."""
    latencies = sorted(latency for at, latency in done if start <= at <= end)
    assert latencies, f"no request answered between {start} and {end}"
    return latencies[max(0, math.ceil(0.99 * len(latencies)) - 1)]


async def started(process: asyncio.subprocess.Process, seen: list[str]) -> tuple[float, str]:
    """The monotonic time watch's requestLatency STARTED line was read, and the line."""
    assert process.stdout is not None
    while line := (await process.stdout.readline()).decode():
        seen.append(line)
        if re.search(r"STARTED slow-requests", line):
            return time.monotonic(), line
    raise AssertionError("watch ended before slow-requests STARTED:\n" + "".join(seen))


async def one(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """One completion: when it was answered (monotonic) and its latency as the client saw it."""
    sent = time.monotonic()
    async with http.post(f"{url}/v1/completions", json={"max_tokens": TOKENS}) as response:
        assert response.status == 200, await response.text()
        await response.read()
    answered = time.monotonic()
    return answered, answered - sent


async def keep_in_flight(
    http: aiohttp.ClientSession, url: str, level: list[int], done: list[tuple[float, float]]
) -> None:
    """One client of a closed loop: a request, its answer, the next, while its rank is below the level."""
    rank = level[1]
    level[1] += 1
    while rank < level[0]:
        done.append(await one(http, url))
    level[1] -= 1


def test_watch_flags_p99_latency_as_the_client_measures_it(tmp_path: Path) -> None:
    # Run by asyncio itself: the GPU machine's Python has pytest, not pytest-asyncio.
    asyncio.run(flagged_as_measured(tmp_path))


async def flagged_as_measured(tmp_path: Path) -> None:
    """The test's body: the server, the load, watch, and the comparison."""
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("served_model.py")),
        f"--device={DEVICE}",
        *MODEL_FLAGS,
        stdout=asyncio.subprocess.PIPE,
    )
    watch: asyncio.subprocess.Process | None = None
    seen: list[str] = []
    try:
        assert server.stdout is not None
        async with asyncio.timeout(SERVER_START):
            line = (await server.stdout.readline()).decode()
        match = re.search(r"listening on (\S+)", line)
        assert match, f"the served model did not start: {line!r}"
        url = f"http://{match.group(1)}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            s = statistics.median([(await one(http, url))[1] for _ in range(ALONE)])
            limit = limit_for(s)
            policy = tmp_path / "policy.yaml"
            policy.write_text(
                POLICY.format(interval=INTERVAL, window=WINDOW, limit_ms=round(limit * 1000), for_=FOR)
            )
            argv = ["-m", "gpuwarden", "watch", f"--policy={policy}", f"--service-metrics={url}/metrics"]
            argv += ["--listen=127.0.0.1:0", "--plain", "--duration=10m", "--hook-socket="]
            if CPU_DRY_RUN:
                argv += ["--scenario=e2e-fast"]
            watch = await asyncio.create_subprocess_exec(
                sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            flagged = asyncio.create_task(started(watch, seen))
            done: list[tuple[float, float]] = []
            level = [1, 0]  # [requests to keep in flight, clients running]
            clients: list[asyncio.Task[None]] = []
            while not flagged.done():
                assert level[0] <= MAX_CONCURRENCY, f"P99 never passed {limit}s:\n" + "".join(seen)
                clients += [
                    asyncio.create_task(keep_in_flight(http, url, level, done))
                    for _ in range(level[0] - level[1])
                ]
                await asyncio.wait([flagged], timeout=LEVEL_SECONDS)
                if not flagged.done():
                    level[0] *= 2
            at, line = flagged.result()
            level[0] = 0  # the clients stop after their request in flight
            await asyncio.gather(*clients)
    finally:
        if watch is not None and watch.returncode is None:
            watch.send_signal(signal.SIGINT)
            await watch.communicate()  # drains what it still writes: no blocked pipe
        server.send_signal(signal.SIGTERM)
        await server.communicate()

    # The percentile watch names, and its value against the client's own over the same window.
    match = re.search(r"P99 latency ([0-9.]+)(ms|s)\b", line)
    assert match, line
    flagged_p99 = float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)
    assert flagged_p99 > limit
    # Watch judged a scrape at most an interval (and its own evaluation) before the line was read.
    measured = client_p99(done, at - WINDOW - 2 * INTERVAL, at)
    print(
        f"\nalone {s:.3f}s, limit {limit}s; watch: {line.strip()}\n"
        f"client P99 over the window: {measured:.3f}s; buckets {bucket(measured)} and {bucket(flagged_p99)}"
    )
    assert abs(bucket(measured) - bucket(flagged_p99)) <= 1, (measured, flagged_p99)
    assert measured > limit or bucket(measured) == bucket(limit)

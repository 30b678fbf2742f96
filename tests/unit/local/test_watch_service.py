"""`gpuwarden watch --service-metrics URL`: a real `gpuwarden sim-server` scraped at the policy's pace
and judged by the service rules, beside a scripted node's GPUs.

Without a GPU on the machine (as on CI), watch judges the server alone.

The server (aiohttp's TestServer on a loopback port, in this process) serves one request at a time,
0.1 s each, so requests kept in flight wait for each other: with six at once each takes ~0.6 s, in
vLLM's (0.5 s, 0.8 s] bucket, above the policy's 500ms; one at a time 0.1 s, in its first bucket
(up to 0.3 s, read as 297ms at P99), below 500ms less the 10% hysteresis. watch runs as the command
does, a subprocess, on real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from driver_support import nvml_works

from gpuwarden.sim.replica import ReplicaConfig
from gpuwarden.simserver.server import MetricsFault, SimServer, build_app

ONE_AT_A_TIME = ReplicaConfig(max_batch=1, prefill_seconds=0.04, token_seconds=0.012, batch_slowdown=0.0)
TOKENS = 6  # 0.1 s a request

LATENCY_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: serving}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: slow-requests
      requestLatency: {server: vllm, percentile: 99, window: 5s, threshold: 500ms, for: 2s}
    - name: queue
      requestQueue: {server: vllm, limit: 2, for: 2s}
    - name: idle-gpu
      utilizationFloor: {percent: 20, for: 10s}
"""


@contextlib.asynccontextmanager
async def sim_server(fault: MetricsFault | None = None) -> AsyncIterator[str]:
    async with TestServer(build_app(SimServer(ONE_AT_A_TIME), fault=fault), host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/")


@contextlib.asynccontextmanager
async def watching(
    policy: Path, url: str, *, scenario: str | None = "e2e-fast"
) -> AsyncIterator[Callable[[str], asyncio.Future[re.Match[str]]]]:
    """watch on a scenario's GPUs (None: this host's) and ``url``'s metrics; yields ``until(pattern)``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpuwarden",
        "watch",
        f"--policy={policy}",
        *([f"--scenario={scenario}"] if scenario is not None else []),
        f"--service-metrics={url}/metrics",
        "--listen=127.0.0.1:0",
        "--plain",
        "--hook-socket=",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []

    async def read_until(pattern: str) -> re.Match[str]:
        while True:
            for line in lines:
                if match := re.search(pattern, line):
                    lines.remove(line)
                    return match
            line = (await process.stdout.readline()).decode()  # type: ignore[union-attr]
            assert line, "watch exited early:\n" + "".join(lines)
            lines.append(line)

    try:
        yield lambda pattern: asyncio.ensure_future(read_until(pattern))
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        await process.communicate()


async def keep_in_flight(http: aiohttp.ClientSession, url: str, level: list[int], rank: int) -> None:
    """A closed-loop client: a request, its answer, the next, while ``rank`` is below the level."""
    while rank < level[0]:
        async with http.post(f"{url}/v1/completions", json={"max_tokens": TOKENS}) as response:
            assert response.status == 200
            await response.read()


@pytest.fixture
def latency_policy(tmp_path: Path) -> Path:
    path = tmp_path / "serving.yaml"
    path.write_text(LATENCY_POLICY)
    return path


async def test_latency_and_queue_past_their_limits_are_flagged_and_latency_clears_when_it_falls(
    latency_policy: Path,
) -> None:
    async with asyncio.timeout(90), sim_server() as url, watching(latency_policy, url) as until:
        address = (await until(r"/metrics on (\S+);")).group(1)
        await until(r"Service metrics: http://\S+/metrics every 1s")
        subject = f"service/{url.removeprefix('http://')}"
        level = [6]
        async with aiohttp.ClientSession() as http:
            clients = [asyncio.create_task(keep_in_flight(http, url, level, rank)) for rank in range(6)]
            line = (await until(rf"STARTED slow-requests {re.escape(subject)}\b.*")).group(0)
            # One served, five waiting (a gauge, where the latency was a histogram).
            queue = (await until(rf"STARTED queue {re.escape(subject)}: RequestQueueLong: .*")).group(0)
            async with http.get(f"http://{address}/metrics") as response:
                body = await response.text()
            level[0] = 1  # one at a time: 0.1 s each
            cleared = (await until(rf"CLEARED slow-requests {re.escape(subject)}\b.*")).group(0)
            level[0] = 0
            await asyncio.gather(*clients)
    # Six at once, 0.1 s each: ~0.6 s, in vLLM's (0.5, 0.8] bucket.
    p99 = re.search(r"P99 latency ([0-9.]+)(ms|s)\b", line)
    assert p99, line
    value = float(p99.group(1)) / (1000 if p99.group(2) == "ms" else 1)
    assert 0.5 <= value <= 0.8, line
    assert re.search(
        rf'gpuwarden_local_finding_active\{{[^}}]*pod="{re.escape(subject)}"[^}}]*rule="slow-requests"', body
    )
    assert "P99" in cleared
    waiting = re.search(r"([0-9.]+) waiting requests", queue)
    assert waiting, queue
    assert 3 <= float(waiting.group(1)) <= 5, queue


@pytest.mark.skipif(nvml_works(), reason="this host has an NVIDIA driver: watch would read its GPUs too")
async def test_without_a_gpu_watch_judges_the_server_alone(latency_policy: Path) -> None:
    # It exited 3 here before, the docs' own example included: a server's metrics need no GPU to judge.
    async with (
        asyncio.timeout(90),
        sim_server() as url,
        watching(latency_policy, url, scenario=None) as until,
    ):
        await until(r"note: no GPU to read here \(NVML .*\); judging only the service metrics")
        await until(r"Service metrics: http://\S+/metrics every 1s")
        subject = f"service/{url.removeprefix('http://')}"
        level = [6]
        async with aiohttp.ClientSession() as http:
            clients = [asyncio.create_task(keep_in_flight(http, url, level, rank)) for rank in range(6)]
            await until(rf"STARTED slow-requests {re.escape(subject)}\b.*")
            level[0] = 0
            await asyncio.gather(*clients)


async def test_a_hanging_endpoint_is_a_failed_scrape_and_the_gpus_are_still_judged(
    latency_policy: Path,
) -> None:
    async with (
        asyncio.timeout(90),
        sim_server(MetricsFault.HANG) as url,
        watching(latency_policy, url) as until,
    ):
        await until(rf"WARNING .*scraping {re.escape(url)}/metrics: Timeout")
        # e2e-fast's idle notebook, on its 10 s floor: sampling went on while the scrapes hung.
        await until(r"STARTED idle-gpu pid 41237")


@pytest.mark.parametrize(
    ("flag", "policy", "message"),
    [
        ("--service-metrics=ftp://host/metrics", LATENCY_POLICY, "expected an http:// or https:// URL"),
        (
            "--service-metrics=http://127.0.0.1:1/metrics",
            LATENCY_POLICY.split("    - name: slow-requests")[0]
            + "    - name: idle-gpu\n      utilizationFloor: {percent: 20, for: 10s}\n",
            "no policy has a service rule",
        ),
    ],
)
def test_bad_service_flags_exit_2(tmp_path: Path, flag: str, policy: str, message: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy)
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "watch", f"--policy={path}", "--scenario=e2e-fast", flag],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr

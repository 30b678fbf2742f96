"""``gpuwarden sim-server``: the simulated replica behind real HTTP, in real time.

Requests go through aiohttp's real server (TestServer on a loopback port) or the command itself
(a subprocess); the exposition is read back with prometheus_client's parser and ``promtool``.
Service times are a few tens of milliseconds, so each test takes well under a second of waiting.
"""

from __future__ import annotations

import asyncio
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from promtool_support import promtool

from gpuwarden.sim.replica import (
    E2E_LATENCY,
    GENERATION_TOKENS,
    HISTOGRAM_BOUNDS,
    INTER_TOKEN_LATENCY,
    KV_CACHE_USAGE,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    TIME_TO_FIRST_TOKEN,
    ReplicaConfig,
)
from gpuwarden.simserver.server import HUGE_BYTES, MetricsFault, SimServer, build_app

# One request at a time, 0.1 s each (prefill 40 ms + 5 tokens after the first at 12 ms): four
# concurrent requests finish at about 0.1, 0.2, 0.3 and 0.4 s.
ONE_AT_A_TIME = ReplicaConfig(max_batch=1, prefill_seconds=0.04, token_seconds=0.012, batch_slowdown=0.0)
TOKENS = 6
SERVICE = 0.04 + (TOKENS - 1) * 0.012


async def serving(server: SimServer, fault: MetricsFault | None = None) -> AsyncIterator[str]:
    async with TestServer(build_app(server, fault=fault), host="127.0.0.1") as test_server:
        yield str(test_server.make_url(""))


@pytest.fixture
async def one_at_a_time() -> AsyncIterator[tuple[SimServer, str]]:
    server = SimServer(ONE_AT_A_TIME, model="tiny")
    async for url in serving(server):
        yield server, url


async def complete(http: aiohttp.ClientSession, url: str, **body: object) -> tuple[float, dict[str, object]]:
    """One completion: (the latency the client measured, the answer)."""
    started = time.monotonic()
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    return time.monotonic() - started, answer


async def metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return await response.text()


def samples(text: str) -> dict[str, list[Sample]]:
    """Every family's samples by family name, parsed by prometheus_client."""
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def value(text: str, name: str) -> float:
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return sample.value


async def test_requests_queue_behind_a_full_batch_and_the_client_waits_the_simulated_latency(
    one_at_a_time: tuple[SimServer, str],
) -> None:
    _, url = one_at_a_time
    async with aiohttp.ClientSession() as http:
        body = {"prompt": "say something", "max_tokens": TOKENS}
        requests = [asyncio.create_task(complete(http, url, **body)) for _ in range(4)]
        # While they are in (the scrapes' round trips pace the wait): one in the batch, three waiting.
        async with asyncio.timeout(5):
            while value(text := await metrics(http, url), REQUESTS_WAITING) < 3:
                pass
        assert value(text, REQUESTS_RUNNING) == 1
        assert value(text, REQUESTS_WAITING) == 3
        done = await asyncio.gather(*requests)
    measured = sorted(latency for latency, _ in done)
    # FIFO, one at a time: the k-th waits for the k-1 before it. The client hears each answer no
    # sooner than the model says, and not much later (the HTTP round trip on a busy machine).
    for k, latency in enumerate(measured, start=1):
        assert k * SERVICE - 0.02 <= latency <= k * SERVICE + 0.15, (k, measured)
    answer = done[0][1]
    assert answer["object"] == "text_completion"
    assert answer["model"] == "tiny"
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": TOKENS, "total_tokens": 2 + TOKENS}


async def test_the_exposition_is_vllms_and_equals_the_models_own_figures(
    one_at_a_time: tuple[SimServer, str],
) -> None:
    server, url = one_at_a_time
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(
            *(complete(http, url, prompt="a prompt of six words here", max_tokens=TOKENS) for _ in range(3))
        )
        text = await metrics(http, url)
    families = samples(text)
    model = server.replica.metrics(server.clock())
    for name in (E2E_LATENCY, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY):
        buckets = [s for s in families[name] if s.name == f"{name}_bucket"]
        assert {s.labels["model_name"] for s in buckets} == {"tiny"}
        bounds = tuple(float(s.labels["le"]) for s in buckets)
        assert bounds == HISTOGRAM_BOUNDS[name]
        assert tuple(s.value for s in buckets) == model.histograms[name].counts
        (total,) = [s.value for s in families[name] if s.name == f"{name}_sum"]
        assert total == pytest.approx(model.histograms[name].sum)
    # Three requests of 0.1 s, one at a time: 0.1, 0.2 and 0.3 s, in the buckets up to 0.3 s.
    e2e = {float(s.labels["le"]): s.value for s in families[E2E_LATENCY] if s.name.endswith("_bucket")}
    assert e2e[0.3] == 3
    assert e2e[math.inf] == 3
    # One inter-token observation per token after the first, as vLLM makes them.
    assert model.histograms[INTER_TOKEN_LATENCY].count == 3 * (TOKENS - 1)
    (success,) = [s for s in families[REQUEST_SUCCESS.removesuffix("_total")] if s.name == REQUEST_SUCCESS]
    assert success.labels == {"model_name": "tiny", "finished_reason": "length"}
    assert success.value == 3
    # The tokens it served, as vLLM counts them (what a report's cost per million tokens divides by).
    assert (value(text, PROMPT_TOKENS), value(text, GENERATION_TOKENS)) == (3 * 6, 3 * TOKENS)
    assert model.counters[PROMPT_TOKENS] == 3 * 6
    assert model.counters[GENERATION_TOKENS] == 3 * TOKENS
    assert value(text, REQUESTS_WAITING) == 0
    assert value(text, KV_CACHE_USAGE) == 0
    checked = await asyncio.to_thread(
        subprocess.run, [promtool(), "check", "metrics"], input=text, capture_output=True, text=True
    )
    # promtool parses it (exit 1 would be an error) and lints one thing only: vLLM's names have
    # colons, which Prometheus keeps for recording rules (exit 3: lint problems).
    problems = checked.stdout.splitlines() + checked.stderr.splitlines()
    assert checked.returncode == 3, problems
    assert problems
    assert all(p.endswith("metric names should not contain ':'") for p in problems), problems


async def test_a_request_whose_client_left_is_counted_when_the_model_finishes_it(
    one_at_a_time: tuple[SimServer, str],
) -> None:
    server, url = one_at_a_time
    impatient = aiohttp.ClientTimeout(total=SERVICE / 4)
    async with aiohttp.ClientSession(timeout=impatient) as http:
        with pytest.raises(TimeoutError):
            await complete(http, url, max_tokens=TOKENS)
    assert server.replica.in_flight == 1
    async with aiohttp.ClientSession() as http, asyncio.timeout(5):
        # The HTTP round trip paces this wait; the model finishes the request 0.1 s after it came.
        while value(text := await metrics(http, url), REQUEST_SUCCESS) < 1:
            pass
    assert value(text, E2E_LATENCY + "_count") == 1
    assert value(text, REQUESTS_RUNNING) == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({"max_tokens": 0}, "max_tokens must be an integer from 1 to 4096"),
        ({"max_tokens": "ten"}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"prompt": {"text": "hi"}}, "prompt must be a string or a list of token ids"),
        ({"prompt": "x " * 5000}, "the prompt has 5000 tokens"),
    ],
)
async def test_a_bad_completion_gets_400_with_the_reason(
    one_at_a_time: tuple[SimServer, str], body: object, message: str
) -> None:
    server, url = one_at_a_time
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert message in error["message"]
    assert server.replica.in_flight == 0


async def test_not_prometheus_fault_answers_a_page_the_parser_refuses() -> None:
    async for url in serving(SimServer(ONE_AT_A_TIME), MetricsFault.NOT_PROMETHEUS):
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            assert response.status == 200
            assert response.content_type == "text/html"
            text = await response.text()
    with pytest.raises(ValueError):  # noqa: PT011 (the parser's own error, whatever its message)
        list(text_string_to_metric_families(text))


async def test_huge_fault_streams_ten_mib_of_samples_without_a_length() -> None:
    async for url in serving(SimServer(ONE_AT_A_TIME), MetricsFault.HUGE):
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            assert response.status == 200
            assert "Content-Length" not in response.headers
            head = await response.content.read(1024)
            size = len(head)
            async for chunk in response.content.iter_chunked(1 << 16):
                size += len(chunk)
    assert size >= HUGE_BYTES
    assert size < HUGE_BYTES + (1 << 20)
    families = list(text_string_to_metric_families(head.decode().rsplit("\n", 1)[0]))
    assert families[0].name == "sim_padding"


async def test_hang_fault_never_answers_and_the_rest_still_serves() -> None:
    async for url in serving(SimServer(ONE_AT_A_TIME), MetricsFault.HANG):
        async with aiohttp.ClientSession() as http:
            hanging = asyncio.create_task(http.get(f"{url}/metrics"))
            latency, _ = await complete(http, url, max_tokens=TOKENS)
            assert not hanging.done()
            hanging.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hanging
    assert latency < SERVICE + 0.15


async def test_the_command_serves_until_sigterm() -> None:
    async with asyncio.timeout(30):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuwarden",
            "sim-server",
            "--listen=127.0.0.1:0",
            "--served-model-name=cli-model",
            "--max-num-seqs=2",
            "--prefill-time=10ms",
            "--token-time=5ms",
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None
        log: list[str] = []
        try:
            while not (match := re.search(r"listening on (\S+);", log[-1] if log else "")):
                line = await process.stderr.readline()
                assert line, "sim-server exited early:\n" + "".join(log)
                log.append(line.decode())
            url = f"http://{match.group(1)}"
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/health") as response:
                    assert response.status == 200
                _, answer = await complete(http, url, max_tokens=3)
                text = await metrics(http, url)
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            log.append((await process.stderr.read()).decode())
            code = await process.wait()
    assert code == 0, "".join(log)
    assert answer["model"] == "cli-model"
    assert value(text, REQUEST_SUCCESS) == 1
    assert "2 served at once" in log[0]

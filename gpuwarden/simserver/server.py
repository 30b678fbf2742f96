"""The simulated inference server's HTTP app: completions in real time, vLLM's metrics.

One process is one replica (:class:`~gpuwarden.sim.replica.Replica`). ``POST /v1/completions``
submits the request to the model at the clock's time; the model fixes its timings at once (FIFO
queue, continuous batching), and the answer goes out when the clock reaches the request's finish.
``GET /metrics`` first settles every request the model has finished by then, whether or not its
client stayed to hear the answer (a server's histograms count what it served, not what was read),
observing each into real ``prometheus_client`` metrics under vLLM's names and bucket bounds:

- ``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds`` (one observation per output token after the first, as vLLM
  makes): histograms with :data:`~gpuwarden.sim.replica.HISTOGRAM_BOUNDS`;
- ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0..1): gauges, read from the model at scrape time;
- ``vllm:request_success_total``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``:
  counters (a request's tokens counted when it finishes).

Every series carries ``model_name``, as vLLM's do. So the exposition equals what
:meth:`~gpuwarden.sim.replica.Replica.metrics` says at the same instant.

A :class:`MetricsFault` makes ``/metrics`` misbehave on purpose, for the tests of whoever scrapes
it: hang, answer 10 MiB, or answer a page that is not Prometheus text.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler

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
    Replica,
    ReplicaConfig,
    Request,
)

log = logging.getLogger(__name__)

__all__ = [
    "HUGE_BYTES",
    "SERVER",
    "TEXT_FORMAT",
    "MetricsFault",
    "SimServer",
    "build_app",
]

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
"""The text format that every Prometheus version reads: what :attr:`MetricsFault.HUGE` answers in."""

HUGE_BYTES = 10 * 1024 * 1024
"""What ``/metrics`` answers with :attr:`MetricsFault.HUGE`, at least: 10 MiB."""

HUGE_CHUNK_LINES = 4096
"""Lines written at a time while answering :attr:`MetricsFault.HUGE` (never the whole body in memory)."""

NOT_PROMETHEUS = (
    "<!DOCTYPE html>\n<html><head><title>Sign in</title></head>\n"
    "<body><form action=/login method=post>user: <input name=user></form></body></html>\n"
)
"""What ``/metrics`` answers with :attr:`MetricsFault.NOT_PROMETHEUS`: a login page, as a proxy in
front of a server might give."""

TEXT_PER_TOKEN = " lorem"
"""A completion's text: this once per output token (the content is not what is simulated)."""


class MetricsFault(enum.StrEnum):
    """How ``/metrics`` misbehaves when asked to (``--metrics-fault``)."""

    HANG = "hang"
    """Accept the request and never answer."""
    HUGE = "huge"
    """Answer at least :data:`HUGE_BYTES` of well-formed samples, streamed without a length."""
    NOT_PROMETHEUS = "not-prometheus"
    """Answer an HTML page with status 200."""


class SimServer:
    """One simulated replica and its vLLM-named metrics, on ``clock`` (seconds, never backwards).

    The clock is the model's: :meth:`submit` and :meth:`settle` read it, so a request's timings
    and the metrics are those of the model at the clock's time. The default is the monotonic clock,
    for a server answering in real time.
    """

    def __init__(
        self,
        config: ReplicaConfig | None = None,
        *,
        model: str = "sim-llm",
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica = Replica(config, seed=seed)
        self.model = model
        self.clock = clock
        self.registry = CollectorRegistry()
        self._ids = itertools.count(1)
        self._order = itertools.count()
        # Submitted, not yet observed: (finish, submission order, request), earliest finish first.
        self._pending: list[tuple[float, int, Request]] = []

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, ["model_name"], registry=self.registry, buckets=HISTOGRAM_BOUNDS[name]
            ).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=self.registry).labels(model)

        self._e2e = histogram(E2E_LATENCY, "Histogram of end to end request latency in seconds.")
        self._ttft = histogram(TIME_TO_FIRST_TOKEN, "Histogram of time to first token in seconds.")
        self._itl = histogram(INTER_TOKEN_LATENCY, "Histogram of inter-token latency in seconds.")
        self._running = gauge(REQUESTS_RUNNING, "Number of requests in model execution batches.")
        self._waiting = gauge(REQUESTS_WAITING, "Number of requests waiting to be processed.")
        self._kv_cache = gauge(KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.")
        # prometheus_client names a counter without its _total and adds it back when exposing.
        self._success = Counter(
            REQUEST_SUCCESS.removesuffix("_total"),
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        ).labels(model, "length")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name.removesuffix("_total"), doc, ["model_name"], registry=self.registry).labels(
                model
            )

        self._prompt_tokens = counter(PROMPT_TOKENS, "Number of prefill tokens processed.")
        self._generation_tokens = counter(GENERATION_TOKENS, "Number of generation tokens processed.")

    def submit(self, *, prompt_tokens: int | None = None, output_tokens: int | None = None) -> Request:
        """A request arriving now: its timings, fixed by the model (token counts it is not given drawn)."""
        request = self.replica.submit(self.clock(), prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        heapq.heappush(self._pending, (request.finish, next(self._order), request))
        return request

    def settle(self) -> None:
        """Observe every request finished by now, and read the gauges from the model."""
        now = self.clock()
        while self._pending and self._pending[0][0] <= now:
            _, _, request = heapq.heappop(self._pending)
            self._e2e.observe(request.latency)
            self._ttft.observe(request.time_to_first_token)
            if request.output_tokens > 1:
                itl = request.inter_token_latency
                for _ in range(request.output_tokens - 1):
                    self._itl.observe(itl)
            self._success.inc()
            self._prompt_tokens.inc(request.prompt_tokens)
            self._generation_tokens.inc(request.output_tokens)
        gauges = self.replica.metrics(now).gauges
        self._running.set(gauges[REQUESTS_RUNNING])
        self._waiting.set(gauges[REQUESTS_WAITING])
        self._kv_cache.set(gauges[KV_CACHE_USAGE])

    def next_id(self) -> str:
        """A completion's id, ``cmpl-<n>``."""
        return f"cmpl-{next(self._ids)}"


SERVER = web.AppKey("sim_server", SimServer)
FAULT = web.AppKey("metrics_fault", str)


def build_app(server: SimServer, *, fault: MetricsFault | None = None) -> web.Application:
    """The app: ``POST /v1/completions``, ``GET /metrics`` (as ``fault`` says), ``GET /health``."""
    app = web.Application()
    app[SERVER] = server
    app[FAULT] = "" if fault is None else fault.value
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    return app


async def _completions(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    try:
        body = await request.json()
        prompt_tokens, output_tokens = _read_completion(body, server.replica.config.max_tokens)
    except (ValueError, json.JSONDecodeError) as exc:
        return _error(400, str(exc))
    simulated = server.submit(prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    # The simulated service itself: the model says when this request is done; answer then.
    await asyncio.sleep(max(0.0, simulated.finish - server.clock()))
    server.settle()
    usage = {
        "prompt_tokens": simulated.prompt_tokens,
        "completion_tokens": simulated.output_tokens,
        "total_tokens": simulated.prompt_tokens + simulated.output_tokens,
    }
    return web.json_response(
        {
            "id": server.next_id(),
            "object": "text_completion",
            "created": int(time.time()),
            "model": server.model,
            "choices": [
                {
                    "index": 0,
                    "text": TEXT_PER_TOKEN * simulated.output_tokens,
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
        }
    )


def _read_completion(body: Any, max_tokens: int) -> tuple[int | None, int | None]:
    """(prompt tokens, output tokens) from an OpenAI completion request; ``ValueError`` says what is wrong.

    The prompt's tokens are its words (a list of token ids counts as itself); none given, the
    model draws them. ``max_tokens`` is the output's length (a simulated request always runs to it).
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    prompt = body.get("prompt")
    prompt_tokens: int | None
    if prompt is None:
        prompt_tokens = None
    elif isinstance(prompt, str):
        prompt_tokens = len(prompt.split())
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        prompt_tokens = len(prompt)
    else:
        raise ValueError("prompt must be a string or a list of token ids")
    output = body.get("max_tokens")
    if output is not None and (
        isinstance(output, bool) or not isinstance(output, int) or not 1 <= output <= max_tokens
    ):
        raise ValueError(f"max_tokens must be an integer from 1 to {max_tokens}, not {output!r}")
    if prompt_tokens is not None and prompt_tokens > max_tokens:
        raise ValueError(f"the prompt has {prompt_tokens} tokens, more than the {max_tokens} allowed")
    return prompt_tokens, output


def _error(status: int, message: str) -> web.Response:
    """An OpenAI-style error body."""
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )


async def _metrics(request: web.Request) -> web.StreamResponse:
    fault = request.app[FAULT]
    if fault == MetricsFault.HANG:
        await asyncio.Event().wait()
    if fault == MetricsFault.NOT_PROMETHEUS:
        return web.Response(text=NOT_PROMETHEUS, content_type="text/html")
    if fault == MetricsFault.HUGE:
        return await _huge(request)
    server = request.app[SERVER]
    server.settle()
    # prometheus_client's handler, as the agent's and the operator's, and vLLM's own: the format asked
    # for, gzipped if accepted. Asked for OpenMetrics (Prometheus does), it writes the names' colons as
    # underscores in the sample lines, as vLLM does (prometheus/client_python#1177).
    return await make_aiohttp_handler(server.registry)(request)


async def _huge(request: web.Request) -> web.StreamResponse:
    """At least :data:`HUGE_BYTES` of one gauge's samples, whole lines, written a chunk at a time.

    Chunked, with no ``Content-Length``: a scraper learns the size only by reading, so what is
    tested is that it stops reading at its cap.
    """
    response = web.StreamResponse(headers={"Content-Type": TEXT_FORMAT})
    response.enable_chunked_encoding()
    await response.prepare(request)
    header = b"# HELP sim_padding One series per line, to make the page large.\n# TYPE sim_padding gauge\n"
    written = line = 0
    try:
        await response.write(header)
        written = len(header)
        while written < HUGE_BYTES:
            chunk = b"".join(b'sim_padding{line="%09d"} 0\n' % (line + i) for i in range(HUGE_CHUNK_LINES))
            await response.write(chunk)
            written += len(chunk)
            line += HUGE_CHUNK_LINES
        await response.write_eof()
    except ConnectionResetError:
        # The scraper hung up at its cap, as it should: nothing to answer any more.
        log.debug("/metrics: the reader left after %d bytes", written)
    return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")

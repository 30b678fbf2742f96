"""A real causal LM behind a small HTTP server with vLLM's metrics, for test_service_latency_gpu.py.

    python tests/gpu/served_model.py [--device cuda] [--layers 12] [--hidden 768] [--heads 12]

The model is GPT-2's architecture (small: 12 layers, 768 wide, ~124M parameters) built from a
``transformers`` config and randomly initialised, so nothing is downloaded; what is measured is
the time ``generate`` takes, not what it writes. Requests are served one at a time, in arrival
order (``generate`` runs in a worker thread, so ``/metrics`` answers while it works): a request's
latency is its wait in the queue plus its own generation, and it grows with the number of
requests sent at once.

- ``POST /v1/completions`` ``{"max_tokens": N}``: N new tokens exactly, after a short random prompt;
- ``GET /metrics``: real ``prometheus_client`` objects under vLLM's names and bucket bounds:
  ``vllm:e2e_request_latency_seconds`` (arrival to answer) and ``vllm:request_queue_time_seconds``
  histograms, ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` gauges,
  ``vllm:request_success_total``.

It prints ``listening on HOST:PORT`` once the model is loaded and warmed up.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import torch
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from transformers import GPT2Config, GPT2LMHeadModel

from gpuwarden.sim.replica import (
    E2E_LATENCY,
    HISTOGRAM_BOUNDS,
    REQUEST_SUCCESS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
)

QUEUE_TIME = "vllm:request_queue_time_seconds"
PROMPT_TOKENS = 16
MAX_TOKENS = 512


@dataclass
class _Request:
    tokens: int
    arrival: float
    done: asyncio.Future[float] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Served:
    """The model, its FIFO queue, and its metrics."""

    def __init__(self, model: GPT2LMHeadModel, device: torch.device, name: str) -> None:
        self.model = model
        self.device = device
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.e2e = Histogram(
            E2E_LATENCY,
            "End to end request latency.",
            labels,
            registry=self.registry,
            buckets=HISTOGRAM_BOUNDS[E2E_LATENCY],
        ).labels(name)
        self.queue_time = Histogram(
            QUEUE_TIME,
            "Time spent waiting.",
            labels,
            registry=self.registry,
            buckets=HISTOGRAM_BOUNDS[E2E_LATENCY],
        ).labels(name)
        self.running = Gauge(REQUESTS_RUNNING, "Requests generating.", labels, registry=self.registry).labels(
            name
        )
        self.waiting = Gauge(REQUESTS_WAITING, "Requests waiting.", labels, registry=self.registry).labels(
            name
        )
        self.success = Counter(
            REQUEST_SUCCESS.removesuffix("_total"), "Requests served.", labels, registry=self.registry
        ).labels(name)
        self.queue: asyncio.Queue[_Request] = asyncio.Queue()

    def generate(self, tokens: int) -> None:
        """``tokens`` new tokens after a random prompt, no early stop."""
        prompt = torch.randint(0, self.model.config.vocab_size, (1, PROMPT_TOKENS), device=self.device)
        with torch.inference_mode():
            self.model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def work(self) -> None:
        """Serve the queue, one request at a time."""
        while True:
            request = await self.queue.get()
            self.waiting.set(self.queue.qsize())
            self.running.set(1)
            self.queue_time.observe(time.monotonic() - request.arrival)
            try:
                await asyncio.to_thread(self.generate, request.tokens)
            except Exception as exc:  # the request fails; the server goes on
                self.running.set(0)
                request.done.set_exception(exc)
                continue
            latency = time.monotonic() - request.arrival
            self.e2e.observe(latency)
            self.success.inc()
            self.running.set(0)
            request.done.set_result(latency)


SERVED = web.AppKey("served", Served)


async def completions(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    body = await request.json()
    tokens = body.get("max_tokens", 16) if isinstance(body, dict) else None
    if not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        return web.json_response({"error": {"message": f"max_tokens: 1 to {MAX_TOKENS}"}}, status=400)
    job = _Request(tokens, time.monotonic())
    served.queue.put_nowait(job)
    served.waiting.set(served.queue.qsize())
    latency = await asyncio.shield(job.done)
    return web.json_response(
        {"object": "text_completion", "usage": {"completion_tokens": tokens}, "latency": latency}
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[SERVED].registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def main(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=1024)
    torch.manual_seed(0)
    # float32: the model is small enough that kernel launches, not arithmetic, set its pace.
    model = GPT2LMHeadModel(config).to(device).eval()
    served = Served(model, device, args.model_name)
    served.generate(8)  # warm-up: kernels, caches, the allocator
    app = web.Application()
    app[SERVED] = served
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"listening on {host}:{port}", flush=True)
    worker = asyncio.create_task(served.work())
    try:
        await asyncio.Event().wait()
    finally:
        worker.cancel()
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model-name", default="gpt2-random")
    asyncio.run(main(parser.parse_args()))

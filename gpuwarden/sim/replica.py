"""A simulated inference server: one replica's queue, continuous batching, and vLLM's metrics.

A replica serves at most ``max_batch`` requests at once; the rest wait in a FIFO queue. A request
admitted beside ``b`` others runs at the speed of a batch of ``b + 1``: its time to first token and
its inter-token latency grow mildly with the batch, as a continuous-batching server's do. Its
latency is the wait plus that service. Arrivals are the caller's; every method takes the time
(``now``), so the model has no clock of its own and runs as fast as its caller plays it.

Because the queue is FIFO and a request's speed is fixed when it is admitted, each request's
timings are known the moment it is submitted (they depend only on the requests before it):
:meth:`Replica.submit` returns them, which is what lets a server answer a request after its
simulated latency. :meth:`Replica.metrics` reads, at any later time, what a vLLM server would
export then: cumulative histograms with vLLM's own bucket bounds, the running/waiting gauges, the
KV-cache usage, the success and token counters, and the integral of the GPU's utilization.

The GPU utilization follows the batch, not the latency: 0 when idle, ``utilization_at_one`` with one
request running, 1 with a full batch, and no higher however long the queue grows. That is what a
GPU-only scaling policy sees of a real server: busy once batches fill, blind to the queue.

Same config, seed and calls, same figures: the only randomness (each request's prompt and output
token counts, when the caller does not give them) comes from a ``random.Random`` seeded per replica
and drawn once per submitted request, in submission order.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "E2E_LATENCY",
    "GENERATION_TOKENS",
    "HISTOGRAM_BOUNDS",
    "INTER_TOKEN_LATENCY",
    "KV_CACHE_USAGE",
    "PROMPT_TOKENS",
    "REQUESTS_RUNNING",
    "REQUESTS_WAITING",
    "REQUEST_SUCCESS",
    "TIME_TO_FIRST_TOKEN",
    "CumulativeHistogram",
    "Replica",
    "ReplicaConfig",
    "ReplicaMetrics",
    "Request",
]

E2E_LATENCY = "vllm:e2e_request_latency_seconds"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
REQUEST_SUCCESS = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"

# vLLM's own bucket upper bounds (vllm/v1/metrics/loggers.py), so that a percentile read from the
# simulated histograms is as coarse as one read from a real server's.
_E2E_BOUNDS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
)
_E2E_BOUNDS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BOUNDS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_TTFT_BOUNDS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BOUNDS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
)
_ITL_BOUNDS += (10.0, 20.0, 40.0, 80.0)

HISTOGRAM_BOUNDS: Mapping[str, tuple[float, ...]] = {
    E2E_LATENCY: (*_E2E_BOUNDS, math.inf),
    TIME_TO_FIRST_TOKEN: (*_TTFT_BOUNDS, math.inf),
    INTER_TOKEN_LATENCY: (*_ITL_BOUNDS, math.inf),
}
"""Each histogram's ascending upper bounds (``le``), the last ``math.inf``."""


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """How fast one replica serves, and what its requests look like when the caller does not say.

    The defaults are a mid-sized model on one GPU: about 0.1 s to the first token and 20 ms a token
    alone, 60% slower with a full batch of 16; a request of 128 output tokens then takes about
    2.6 s alone and 4.3 s in a full batch, so a saturated replica completes about 3.7 requests a second.
    """

    max_batch: int = 16
    """Requests served at once (vLLM's ``--max-num-seqs``); the rest wait."""
    prefill_seconds: float = 0.1
    """Time to first token of a request admitted alone."""
    token_seconds: float = 0.02
    """Inter-token latency of a request admitted alone."""
    batch_slowdown: float = 0.6
    """How much slower a full batch is than one request, on both prefill and tokens (0.6: 60%)."""
    mean_prompt_tokens: int = 512
    mean_output_tokens: int = 128
    token_spread: float = 0.5
    """Sigma of the log-normal that token counts are drawn from (0: every request the mean)."""
    max_tokens: int = 4096
    """The most tokens a drawn prompt or output has (a server's max model length)."""
    kv_cache_tokens: int = 16384
    """Tokens the KV cache holds: its usage is the running requests' prompt and generated tokens
    over this."""
    utilization_at_one: float = 0.3
    """GPU utilization (0..1) with one request running; it rises linearly to 1 at a full batch."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {self.max_batch}")
        for name in ("prefill_seconds", "token_seconds", "batch_slowdown", "token_spread"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)}")
        for name in ("mean_prompt_tokens", "mean_output_tokens", "max_tokens", "kv_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 0 <= self.utilization_at_one <= 1:
            raise ValueError(f"utilization_at_one must be within 0..1, not {self.utilization_at_one}")

    def speed(self, batch: int) -> float:
        """The slowdown factor of a batch of ``batch`` requests: 1 alone, ``1 + batch_slowdown`` full."""
        if self.max_batch == 1:
            return 1.0
        return 1.0 + self.batch_slowdown * (min(batch, self.max_batch) - 1) / (self.max_batch - 1)

    def utilization(self, running: int) -> float:
        """The GPU's utilization (0..1) while ``running`` requests are in its batch."""
        if running <= 0:
            return 0.0
        if self.max_batch == 1:
            return 1.0
        share = (min(running, self.max_batch) - 1) / (self.max_batch - 1)
        return self.utilization_at_one + (1.0 - self.utilization_at_one) * share


@dataclass(frozen=True, slots=True)
class Request:
    """One request's timings (unix-like seconds on the caller's clock) and sizes."""

    arrival: float
    start: float
    """When it entered the batch (``arrival`` when a slot was free)."""
    first_token: float
    finish: float
    prompt_tokens: int
    output_tokens: int
    batch: int
    """The batch it ran in when admitted, itself included."""

    @property
    def latency(self) -> float:
        """End-to-end latency: waiting plus service."""
        return self.finish - self.arrival

    @property
    def queue_time(self) -> float:
        """Time spent waiting for a slot."""
        return self.start - self.arrival

    @property
    def time_to_first_token(self) -> float:
        """From arrival to the first token: waiting plus prefill."""
        return self.first_token - self.arrival

    @property
    def inter_token_latency(self) -> float:
        """The time between two of its output tokens (0 for a one-token output)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    def generated(self, now: float) -> int:
        """Output tokens produced by ``now``."""
        if now < self.first_token:
            return 0
        if now >= self.finish or self.output_tokens <= 1:
            return self.output_tokens
        return 1 + int((now - self.first_token) / self.inter_token_latency)


@dataclass(frozen=True, slots=True)
class CumulativeHistogram:
    """A Prometheus histogram as exposed: cumulative counts per upper bound, and the sum."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        """Observations in all (the ``+Inf`` bucket)."""
        return self.counts[-1] if self.counts else 0.0


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """What one replica exports at ``at``, under vLLM's metric names."""

    at: float
    histograms: Mapping[str, CumulativeHistogram] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    gauges: Mapping[str, float] = field(default_factory=dict)
    utilization_seconds: float = 0.0
    """The integral of the GPU's utilization (0..1) over time since the replica began: over a
    window, its increase divided by the window's length is the mean utilization, as NVML gives it."""


class _Buckets:
    """A histogram being filled: one count per bucket (not cumulative), and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float, times: float = 1.0) -> None:
        # le is inclusive: a value on a bound belongs to that bound's bucket.
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def cumulative(self) -> CumulativeHistogram:
        running, counts = 0.0, []
        for c in self.counts:
            running += c
            counts.append(running)
        return CumulativeHistogram(self.bounds, tuple(counts), self.sum)


class Replica:
    """One simulated server replica, played by its caller's clock (see the module docstring).

    Times passed to :meth:`submit` and :meth:`metrics` must never go backwards.
    """

    def __init__(self, config: ReplicaConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or ReplicaConfig()
        self._rng = random.Random(seed)
        # When each batch slot is next free: a request takes the earliest, FIFO.
        self._slots = [-math.inf] * self.config.max_batch
        self._now = -math.inf
        self._queued: deque[Request] = deque()  # submitted, not yet started (starts ascending)
        self._running: list[Request] = []  # started, not finished as of _now (at most max_batch)
        self._succeeded = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._utilization_seconds = 0.0
        self._histograms = {name: _Buckets(bounds) for name, bounds in HISTOGRAM_BOUNDS.items()}

    def submit(
        self, now: float, *, prompt_tokens: int | None = None, output_tokens: int | None = None
    ) -> Request:
        """A request arriving at ``now``: its timings, fixed from here on.

        Token counts not given are drawn from the config's log-normal, in this order: prompt, output.
        """
        self._advance(now)
        cfg = self.config
        prompt = prompt_tokens if prompt_tokens is not None else self._draw(cfg.mean_prompt_tokens)
        output = output_tokens if output_tokens is not None else self._draw(cfg.mean_output_tokens)
        if prompt < 0 or output < 1:
            raise ValueError(
                f"a request needs prompt_tokens >= 0 and output_tokens >= 1, not {prompt}, {output}"
            )
        slot = min(range(len(self._slots)), key=self._slots.__getitem__)
        start = max(now, self._slots[slot])
        # The requests admitted before this one and still running when it starts share its batch.
        batch = 1 + sum(1 for i, free in enumerate(self._slots) if i != slot and free > start)
        speed = cfg.speed(batch)
        first_token = start + cfg.prefill_seconds * speed
        finish = first_token + (output - 1) * cfg.token_seconds * speed
        # A zero-length service would free the slot at the very instant it was taken; keep it busy
        # a hair so that the slot order stays FIFO.
        finish = max(finish, math.nextafter(start, math.inf))
        self._slots[slot] = finish
        request = Request(now, start, first_token, finish, prompt, output, batch)
        if start > now:
            self._queued.append(request)
        else:
            self._running.append(request)
        return request

    def metrics(self, now: float) -> ReplicaMetrics:
        """What the replica exports at ``now``.

        A request enters the three histograms, the success counter and the token counters when it
        finishes (a simplification: vLLM observes its time to first token at the first token, and
        counts its prompt then and its tokens as they are generated).
        """
        self._advance(now)
        kv_tokens = sum(r.prompt_tokens + r.generated(now) for r in self._running)
        return ReplicaMetrics(
            at=now,
            histograms={name: h.cumulative() for name, h in self._histograms.items()},
            counters={
                REQUEST_SUCCESS: float(self._succeeded),
                PROMPT_TOKENS: float(self._prompt_tokens),
                GENERATION_TOKENS: float(self._generation_tokens),
            },
            gauges={
                REQUESTS_RUNNING: float(len(self._running)),
                REQUESTS_WAITING: float(len(self._queued)),
                KV_CACHE_USAGE: min(1.0, kv_tokens / self.config.kv_cache_tokens),
            },
            utilization_seconds=self._utilization_seconds,
        )

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished as of the last call's time."""
        return len(self._queued) + len(self._running)

    def _draw(self, mean: int) -> int:
        spread = self.config.token_spread
        # mu chosen so that the log-normal's mean is `mean` (before rounding and clipping).
        value = self._rng.lognormvariate(math.log(mean) - spread * spread / 2, spread) if spread else mean
        return max(1, min(self.config.max_tokens, round(value)))

    def _advance(self, now: float) -> None:
        """Play every start and finish up to ``now``, integrating the GPU's utilization between them."""
        if now < self._now:
            raise ValueError(f"time went backwards: {now} after {self._now}")
        cursor = self._now
        while True:
            next_start = self._queued[0].start if self._queued else math.inf
            next_finish = min((r.finish for r in self._running), default=math.inf)
            at = min(next_start, next_finish)
            if at > now:
                break
            self._integrate(cursor, at)
            cursor = at
            # Finishes before starts at one instant: the slot a start takes is the one just freed.
            if next_finish <= next_start:
                done = [r for r in self._running if r.finish <= at]
                self._running = [r for r in self._running if r.finish > at]
                for request in done:
                    self._complete(request)
            else:
                self._running.append(self._queued.popleft())
        self._integrate(cursor, now)
        self._now = now

    def _integrate(self, start: float, end: float) -> None:
        if end > start > -math.inf:
            self._utilization_seconds += self.config.utilization(len(self._running)) * (end - start)

    def _complete(self, request: Request) -> None:
        self._succeeded += 1
        self._prompt_tokens += request.prompt_tokens
        self._generation_tokens += request.output_tokens
        self._histograms[E2E_LATENCY].observe(request.latency)
        self._histograms[TIME_TO_FIRST_TOKEN].observe(request.time_to_first_token)
        # vLLM observes one inter-token latency per token after the first.
        if request.output_tokens > 1:
            self._histograms[INTER_TOKEN_LATENCY].observe(
                request.inter_token_latency, request.output_tokens - 1
            )

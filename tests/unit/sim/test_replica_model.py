"""The simulated inference server's queueing model: Little's law, load past capacity, vLLM's metrics."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest

from gpuwarden.sim.replica import (
    E2E_LATENCY,
    HISTOGRAM_BOUNDS,
    INTER_TOKEN_LATENCY,
    KV_CACHE_USAGE,
    REQUEST_SUCCESS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    TIME_TO_FIRST_TOKEN,
    Replica,
    ReplicaConfig,
    ReplicaMetrics,
    Request,
)


def poisson(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` a second over ``duration`` seconds."""
    rng, t = random.Random(seed), 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def play(
    rate: float, duration: float, seed: int = 7, every: float = 1.0
) -> tuple[list[Request], list[ReplicaMetrics]]:
    """Poisson arrivals for ``duration`` seconds, metrics read every ``every`` seconds until all finish."""
    replica, requests, reads = Replica(seed=seed), [], []
    arrivals = deque(poisson(rate, duration, seed))
    t = 0.0
    while arrivals or replica.in_flight:
        t += every
        while arrivals and arrivals[0] <= t:
            requests.append(replica.submit(arrivals.popleft()))
        reads.append(replica.metrics(t))
    return requests, reads


def test_a_request_alone_runs_at_the_configured_speed() -> None:
    replica = Replica(ReplicaConfig(prefill_seconds=0.1, token_seconds=0.02))
    request = replica.submit(10.0, prompt_tokens=100, output_tokens=51)
    assert request.queue_time == 0
    assert request.time_to_first_token == pytest.approx(0.1)
    assert request.inter_token_latency == pytest.approx(0.02)
    assert request.latency == pytest.approx(0.1 + 50 * 0.02)


def test_littles_law_holds() -> None:
    # Under capacity (about 3.7 requests/s saturated) but loaded enough that requests queue at times.
    rate, duration, step = 3.0, 3000.0, 0.05
    requests, reads = play(rate, duration, every=step)
    # The time-average number in the system, sampled finely until the last request left...
    in_system = [m.gauges[REQUESTS_RUNNING] + m.gauges[REQUESTS_WAITING] for m in reads]
    span = reads[-1].at
    mean_in_system = sum(in_system) / len(in_system)
    # ... equals the arrival rate times the mean time in the system (L = lambda * W).
    throughput = len(requests) / span
    mean_latency = sum(r.latency for r in requests) / len(requests)
    assert any(r.queue_time > 0 for r in requests), "the load never queued: the test would prove little"
    assert mean_in_system == pytest.approx(throughput * mean_latency, rel=0.05)


def test_latency_rises_with_load_past_capacity() -> None:
    p99 = {}
    for rate in (1.0, 3.0, 4.5, 6.0):
        requests, _ = play(rate, 1200.0)
        latencies = sorted(r.latency for r in requests)
        p99[rate] = latencies[int(0.99 * len(latencies))]
    assert p99[1.0] < p99[3.0] < p99[4.5] < p99[6.0]
    # Past capacity the queue grows without bound: minutes, not seconds.
    assert p99[6.0] > 60 * p99[1.0]


def test_the_batch_slows_tokens_mildly_and_is_capped() -> None:
    config = ReplicaConfig(max_batch=4, token_seconds=0.02, batch_slowdown=0.5)
    replica = Replica(config)
    requests = [replica.submit(0.0, prompt_tokens=10, output_tokens=100) for _ in range(6)]
    assert [r.batch for r in requests[:4]] == [1, 2, 3, 4]
    assert requests[0].inter_token_latency == pytest.approx(0.02)
    assert requests[3].inter_token_latency == pytest.approx(0.03)
    # The fifth and sixth wait for the first two slots to free, in arrival order.
    assert requests[4].start == requests[0].finish
    assert requests[5].start == requests[1].finish
    gauges = replica.metrics(0.5).gauges
    assert (gauges[REQUESTS_RUNNING], gauges[REQUESTS_WAITING]) == (4.0, 2.0)


def test_histograms_counters_and_gauges_read_as_vllm_exports_them() -> None:
    requests, reads = play(3.0, 600.0)
    before, after = reads[300], reads[-1]  # at 301 s, and once every request has finished
    assert after.counters[REQUEST_SUCCESS] == len(requests)
    assert after.gauges[REQUESTS_RUNNING] == after.gauges[REQUESTS_WAITING] == 0
    for name in (E2E_LATENCY, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY):
        h = after.histograms[name]
        assert h.bounds == HISTOGRAM_BOUNDS[name]
        assert h.bounds[-1] == math.inf
        assert list(h.counts) == sorted(h.counts), "cumulative buckets never decrease"
        assert all(b <= a for b, a in zip(before.histograms[name].counts, h.counts, strict=True))
    e2e = after.histograms[E2E_LATENCY]
    assert e2e.count == len(requests)
    assert e2e.sum == pytest.approx(sum(r.latency for r in requests))
    # le is inclusive, as Prometheus's is: the 2.5 s bucket holds every latency up to 2.5 s.
    within = sum(1 for r in requests if r.latency <= 2.5)
    assert e2e.counts[HISTOGRAM_BOUNDS[E2E_LATENCY].index(2.5)] == within
    itl = after.histograms[INTER_TOKEN_LATENCY]
    assert itl.count == sum(r.output_tokens - 1 for r in requests)


def test_counters_and_utilization_never_decrease() -> None:
    replica = Replica(seed=3)
    arrivals = iter(poisson(4.0, 600.0, 3))
    last_success, last_busy, t = 0.0, 0.0, 0.0
    pending = next(arrivals, None)
    while t < 700.0:
        t += 0.7
        while pending is not None and pending <= t:
            replica.submit(pending)
            pending = next(arrivals, None)
        m = replica.metrics(t)
        assert m.counters[REQUEST_SUCCESS] >= last_success
        assert m.utilization_seconds >= last_busy
        assert 0.0 <= m.gauges[KV_CACHE_USAGE] <= 1.0
        last_success, last_busy = m.counters[REQUEST_SUCCESS], m.utilization_seconds


def test_utilization_follows_the_batch_not_the_queue() -> None:
    def mean_utilization(rate: float) -> float:
        _, reads = play(rate, 1200.0)
        start, end = reads[599], reads[1199]  # at 600 s and 1200 s, arrivals still coming
        return (end.utilization_seconds - start.utilization_seconds) / 600.0

    light, loaded, saturated, swamped = (mean_utilization(r) for r in (0.3, 2.0, 6.0, 12.0))
    assert light < 0.35 < loaded < saturated
    # Once batches are full the GPU reads 100% however long the queue: it cannot tell 6/s from 12/s.
    assert saturated == pytest.approx(1.0, abs=0.01)
    assert swamped == pytest.approx(1.0, abs=0.01)


def test_deterministic_for_a_seed() -> None:
    requests_a, reads_a = play(3.0, 300.0, seed=11)
    requests_b, reads_b = play(3.0, 300.0, seed=11)
    assert requests_a == requests_b
    assert reads_a == reads_b
    other, _ = play(3.0, 300.0, seed=12)
    assert other != requests_a


def test_time_never_goes_backwards() -> None:
    replica = Replica()
    replica.submit(5.0)
    with pytest.raises(ValueError, match="backwards"):
        replica.metrics(4.0)


@pytest.mark.parametrize(
    "bad",
    [{"max_batch": 0}, {"token_seconds": -1.0}, {"utilization_at_one": 1.5}, {"kv_cache_tokens": 0}],
)
def test_config_rejects_nonsense(bad: dict[str, float]) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        ReplicaConfig(**bad)  # type: ignore[arg-type]

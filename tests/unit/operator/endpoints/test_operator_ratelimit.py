"""Per-node token buckets."""

from __future__ import annotations

import pytest

from gpuwarden.operator.endpoints.ratelimit import NodeRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refusal_with_the_wait_until_the_next_token() -> None:
    clock = Clock()
    limiter = NodeRateLimiter(rate=2.0, burst=3.0, clock=clock)
    assert [limiter.acquire("n1") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("n1") == pytest.approx(0.5)
    clock.now += 0.5
    assert limiter.acquire("n1") == 0.0
    assert limiter.acquire("n1") == pytest.approx(0.5)


def test_nodes_have_their_own_buckets() -> None:
    limiter = NodeRateLimiter(rate=1.0, burst=1.0, clock=Clock())
    assert limiter.acquire("a") == 0.0
    assert limiter.acquire("a") > 0
    assert limiter.acquire("b") == 0.0


def test_sustained_rate_is_the_configured_one() -> None:
    clock = Clock()
    limiter = NodeRateLimiter(rate=20.0, burst=20.0, clock=clock)
    allowed = 0
    for _ in range(1000):  # 100 requests a second for 10 s
        clock.now += 0.01
        allowed += limiter.acquire("n") == 0.0
    assert 20 * 10 <= allowed <= 20 * 10 + 20


def test_refused_requests_do_not_consume_tokens() -> None:
    clock = Clock()
    limiter = NodeRateLimiter(rate=1.0, burst=1.0, clock=clock)
    limiter.acquire("n")
    for _ in range(10):
        assert limiter.acquire("n") > 0
    clock.now += 1.0
    assert limiter.acquire("n") == 0.0


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert NodeRateLimiter.retry_after(0.01) == "1"
    assert NodeRateLimiter.retry_after(1.2) == "2"


def test_the_map_is_bounded_and_forgets_the_least_recently_heard() -> None:
    clock = Clock()
    limiter = NodeRateLimiter(rate=1.0, burst=1.0, clock=clock, max_nodes=3)
    for node in ("a", "b", "c"):
        limiter.acquire(node)
    limiter.acquire("a")  # heard again: "b" is now the least recent
    for i in range(10_000):  # none of them has refilled: the bound holds all the same
        limiter.acquire(f"flood-{i}")
        assert len(limiter) <= 3
    assert limiter.acquire("flood-9999") > 0  # the newest is still limited


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError, match="rate"):
        NodeRateLimiter(rate=0, burst=1, clock=Clock())

"""ReportSender against a real HTTP server standing in for the operator, on fake loop time.

The operator here is an aiohttp app on a real 127.0.0.1 port that can be stopped and
started again on the same port; the sender's HTTP session is traced, so the tests
await what happened (a request answered, a connection refused) instead of sleeping.
Backoff and intervals run on looptime's fake clock: a 30 s backoff takes no real time,
and the loop times at which requests arrive are exact.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuwarden.agent.metrics import DROP_REASONS, ERROR_REASONS
from gpuwarden.agent.sender import MAX_REDIRECTS, ReportSender
from gpuwarden.agent.snapshots import Sampler, SnapshotRing
from gpuwarden.wire.node import (
    MAX_SNAPSHOTS_PER_REPORT,
    REFUSALS,
    SCHEMA_VERSION,
    GpuSample,
    NodeReport,
    ProcessUtilization,
    ReportError,
    Snapshot,
    dump_report,
    parse_report,
)

T0 = 1_700_000_000.0


def snap(i: int) -> Snapshot:
    """Snapshot number ``i``; its timestamp tells the tests which one arrived."""
    return Snapshot(timestamp=T0 + i, gpus=[GpuSample(uuid="GPU-0", index=0, utilization_gpu=float(i % 100))])


def numbers(reports: list[NodeReport]) -> list[int]:
    return [int(s.timestamp - T0) for r in reports for s in r.snapshots]


@dataclass
class Request:
    at: float
    report: NodeReport
    body: bytes
    authorization: str | None
    status: int


@dataclass
class Operator:
    """The operator's ingestion endpoint: scripted answers, every request recorded."""

    port: int = 0
    answers: deque[tuple[int, dict[str, str]]] = field(default_factory=deque)
    max_snapshots: int | None = None  # answer 413 above this many
    refused: dict[str, int] = field(default_factory=dict)  # what a 200 says it did not store
    owner: str | None = None  # a sharded replica's hint: a 421 names this URL
    requests: list[Request] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    runner: web.AppRunner | None = None

    @property
    def delivered(self) -> list[NodeReport]:
        return [r.report for r in self.requests if 200 <= r.status < 300]

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/reports", self._ingest)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        self.runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/reports"

    async def _ingest(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            report = parse_report(body)  # what the real operator does first
        except ReportError as exc:
            raise AssertionError(f"the sender sent an invalid report: {exc}") from exc
        status, headers = self.answers.popleft() if self.answers else (200, {})
        if self.max_snapshots is not None and len(report.snapshots) > self.max_snapshots:
            status = 413
        loop = asyncio.get_running_loop()
        self.requests.append(Request(loop.time(), report, body, request.headers.get("Authorization"), status))
        async with self.changed:
            self.changed.notify_all()
        if status == 200:
            answer = {"accepted": len(report.snapshots), "duplicate": False, "refused": self.refused}
            return web.json_response(answer, headers=headers)
        if status == 421 and self.owner is not None:
            return web.json_response({"reason": "NotOwner", "owner": "op-b", "url": self.owner}, status=421)
        return web.Response(status=status, headers=headers, text=f"answered {status}")

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        async with self.changed:
            await self.changed.wait_for(predicate)


class Trace:
    """What the sender's HTTP session did, as awaitable conditions."""

    def __init__(self) -> None:
        self.failures = 0
        self.changed = asyncio.Condition()
        self.config = aiohttp.TraceConfig()
        self.config.on_request_exception.append(self._failed)

    async def _failed(self, session: aiohttp.ClientSession, context: SimpleNamespace, params: Any) -> None:
        self.failures += 1
        async with self.changed:
            self.changed.notify_all()

    async def wait_for_failures(self, n: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.failures >= n)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(trace_configs=[self.config])


@pytest.fixture
async def operator() -> AsyncIterator[Operator]:
    op = Operator()
    await op.start()
    yield op
    if op.runner is not None:
        await op.stop()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-1\n")
    return path


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def trace() -> Trace:
    return Trace()


@pytest.fixture
def make_sender(
    operator: Operator, token: Path, registry: CollectorRegistry, trace: Trace
) -> Iterator[Callable[..., ReportSender]]:
    tasks: list[asyncio.Task[None]] = []

    def make(*, start: bool = True, **kwargs: Any) -> ReportSender:
        options: dict[str, Any] = {
            "registry": registry,
            "session_factory": trace.session,
            "rng": random.Random(7),
            **kwargs,
        }
        sender = ReportSender(operator.url, "gpu-node-1", token, **options)
        if start:
            tasks.append(asyncio.create_task(sender.run()))
        return sender

    yield make
    for task in tasks:
        task.cancel()


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_metrics_are_there_before_anything_happens(registry: CollectorRegistry) -> None:
    ReportSender("http://operator/v1/reports", "n", None, registry=registry, buffer_limit=42)

    assert metric(registry, "gpuwarden_agent_report_buffer_snapshots") == 0
    assert metric(registry, "gpuwarden_agent_report_buffer_limit") == 42
    assert metric(registry, "gpuwarden_agent_reports_sent_total") == 0
    for reason in DROP_REASONS:
        assert metric(registry, "gpuwarden_agent_report_dropped_snapshots_total", reason=reason) == 0
    for reason in ERROR_REASONS:
        assert metric(registry, "gpuwarden_agent_report_errors_total", reason=reason) == 0
    for reason in REFUSALS:
        assert metric(registry, "gpuwarden_agent_report_refused_readings_total", reason=reason) == 0


@pytest.mark.looptime
async def test_delivers_in_order_what_was_submitted_before_and_after_it_started(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    sender = make_sender(start=False, interval=2.0)
    for i in range(3):
        sender.submit(snap(i))
    assert metric(registry, "gpuwarden_agent_report_buffer_snapshots") == 3
    task = asyncio.create_task(sender.run())
    try:
        await operator.wait_for(lambda: len(operator.delivered) == 1)
        sender.submit(snap(3))
        await operator.wait_for(lambda: len(operator.delivered) == 2)
        await sender.flush()  # returns once the sender has taken the answer in
    finally:
        task.cancel()

    first, second = operator.requests
    # What waited for run goes at once; what came within the interval, when the interval is over.
    assert first.at - start == pytest.approx(0.0, abs=1e-3)
    assert second.at - start == pytest.approx(2.0)
    assert [r.seq for r in operator.delivered] == [0, 1]
    assert numbers(operator.delivered) == [0, 1, 2, 3]
    assert {(r.node, r.agent_id, r.schema_version) for r in operator.delivered} == {
        ("gpu-node-1", sender.agent_id, SCHEMA_VERSION)
    }
    assert first.authorization == "Bearer token-1"
    assert metric(registry, "gpuwarden_agent_reports_sent_total") == 2
    assert metric(registry, "gpuwarden_agent_report_buffer_snapshots") == 0


@pytest.mark.looptime
async def test_a_submitted_snapshot_is_sent_at_once_not_on_an_interval(
    operator: Operator, make_sender: Callable[..., ReportSender]
) -> None:
    loop = asyncio.get_running_loop()
    sender = make_sender(interval=5.0)
    submitted = loop.time()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    assert loop.time() - submitted == pytest.approx(0.0, abs=1e-3)
    assert operator.requests[0].at == pytest.approx(submitted, abs=1e-3)

    # Long after: the next one is not held to a grid of intervals either.
    loop.call_at(submitted + 7.3, sender.submit, snap(1))
    await operator.wait_for(lambda: len(operator.delivered) == 2)
    assert operator.requests[1].at - submitted == pytest.approx(7.3, abs=1e-3)


@pytest.mark.looptime
async def test_submits_within_an_interval_of_a_report_go_together_when_it_is_over(
    operator: Operator, make_sender: Callable[..., ReportSender]
) -> None:
    """The documented rule: the first goes at once; what follows within the interval waits for its end."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sender = make_sender(interval=2.0)
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)
    sender.submit(snap(1))  # right after the first report: inside its interval
    loop.call_at(start + 1.5, sender.submit, snap(2))  # later, still inside it
    loop.call_at(start + 4.5, sender.submit, snap(3))  # after the second report's interval
    loop.call_at(start + 5.0, sender.submit, snap(4))  # inside the third's
    await operator.wait_for(lambda: len(operator.delivered) == 4)

    assert [r.at - start for r in operator.requests] == pytest.approx([0.0, 2.0, 4.5, 6.5], abs=1e-3)
    assert [numbers([r.report]) for r in operator.requests] == [[0], [1, 2], [3], [4]]


@pytest.mark.looptime
async def test_what_arrives_during_a_backoff_goes_in_one_report_after_the_retry(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.answers.append((503, {"Retry-After": "3"}))
    loop = asyncio.get_running_loop()
    start = loop.time()
    sender = make_sender(interval=1.0)
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.requests) == 1)
    for i in (1, 2, 3):
        loop.call_at(start + 0.5 * i, sender.submit, snap(i))  # during the 3 s backoff
    await operator.wait_for(lambda: len(operator.delivered) == 2)

    assert [(r.status, numbers([r.report])) for r in operator.requests] == [
        (503, [0]),
        (200, [0]),
        (200, [1, 2, 3]),
    ]
    # the round that ended with the retry started at 0, more than an interval ago
    assert [r.at - start for r in operator.requests] == pytest.approx([0.0, 3.0, 3.0], abs=1e-3)
    assert [r.seq for r in operator.delivered] == [0, 1]


@pytest.mark.looptime
async def test_with_the_agents_default_interval_each_sample_leaves_when_it_is_taken(
    operator: Operator, make_sender: Callable[..., ReportSender]
) -> None:
    """The real sampler at 1 Hz into the sender as the agent wires them: no report waits for a tick."""
    loop = asyncio.get_running_loop()
    sender = make_sender()  # DEFAULT_REPORT_INTERVAL
    sampler = Sampler(
        _OneGpu(), SnapshotRing(), interval=1.0, deliver=sender.submit, clock=lambda: T0 + loop.time()
    )
    sampling = asyncio.create_task(sampler.run())
    try:
        await operator.wait_for(lambda: len(operator.delivered) == 5)
    finally:
        sampling.cancel()

    taken = [s.timestamp - T0 for r in operator.delivered for s in r.snapshots]
    assert [len(r.snapshots) for r in operator.delivered] == [1] * 5
    assert [r.at for r in operator.requests] == pytest.approx(taken, abs=1e-3)
    assert [b - a for a, b in itertools.pairwise(taken)] == pytest.approx([1.0] * 4, abs=1e-3)


class _OneGpu:
    """A backend of one idle GPU, for the sampler."""

    name = "one-gpu"

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def sample_devices(self, now: float) -> list[GpuSample]:
        return [GpuSample(uuid="GPU-0", index=0, utilization_gpu=0.0)]

    def sample_process_utilization(self, now: float) -> ProcessUtilization:
        return {}


@pytest.mark.looptime
async def test_body_is_exactly_the_schemas_serialisation(
    operator: Operator, make_sender: Callable[..., ReportSender]
) -> None:
    sender = make_sender()
    snapshots = [snap(i) for i in range(3)]
    for s in snapshots:
        sender.submit(s)
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    expected = NodeReport(
        schema_version=SCHEMA_VERSION, node="gpu-node-1", agent_id=sender.agent_id, seq=0, snapshots=snapshots
    )
    assert operator.requests[0].body == dump_report(expected)


@pytest.mark.looptime
async def test_operator_down_buffers_then_replays_everything_in_order(
    operator: Operator, make_sender: Callable[..., ReportSender], trace: Trace, registry: CollectorRegistry
) -> None:
    await operator.stop()
    sender = make_sender(start=False, buffer_limit=100)
    run = asyncio.create_task(sender.run())
    try:
        for i in range(5):
            sender.submit(snap(i))
        await trace.wait_for_failures(3)
        for i in range(5, 12):
            sender.submit(snap(i))
        await trace.wait_for_failures(8)

        assert not run.done()  # still trying, still accepting
        assert sender.buffered == 12
        assert metric(registry, "gpuwarden_agent_report_buffer_snapshots") == 12
        assert (metric(registry, "gpuwarden_agent_report_errors_total", reason="connection") or 0) >= 8

        await operator.start()  # same port
        await operator.wait_for(lambda: sum(len(r.snapshots) for r in operator.delivered) == 12)
        await sender.flush()
    finally:
        run.cancel()

    assert numbers(operator.delivered) == list(range(12))  # nothing lost, nothing twice, in order
    seqs = [r.seq for r in operator.delivered]
    assert seqs == sorted(set(seqs))
    assert metric(registry, "gpuwarden_agent_report_dropped_snapshots_total", reason="buffer_full") == 0
    assert metric(registry, "gpuwarden_agent_report_buffer_snapshots") == 0


@pytest.mark.looptime
async def test_beyond_the_bound_the_oldest_are_dropped_and_counted(
    operator: Operator, make_sender: Callable[..., ReportSender], trace: Trace, registry: CollectorRegistry
) -> None:
    await operator.stop()
    sender = make_sender(buffer_limit=4)
    for i in range(3):
        sender.submit(snap(i))
    await trace.wait_for_failures(2)  # a report of 0..2 is now in flight, being retried
    for i in range(3, 9):
        sender.submit(snap(i))
    assert sender.buffered == 4
    assert metric(registry, "gpuwarden_agent_report_dropped_snapshots_total", reason="buffer_full") == 5

    await operator.start()
    await operator.wait_for(lambda: sum(len(r.snapshots) for r in operator.delivered) == 4)

    assert numbers(operator.delivered) == [5, 6, 7, 8]
    seqs = [r.seq for r in operator.delivered]
    assert seqs == sorted(set(seqs))


@pytest.mark.looptime
async def test_token_is_reread_for_every_report(
    operator: Operator, make_sender: Callable[..., ReportSender], token: Path
) -> None:
    sender = make_sender()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.requests) == 1)
    await asyncio.to_thread(token.write_text, "token-2\n")  # the kubelet rotated it
    sender.submit(snap(1))
    await operator.wait_for(lambda: len(operator.requests) == 2)

    assert [r.authorization for r in operator.requests] == ["Bearer token-1", "Bearer token-2"]


@pytest.mark.looptime
async def test_401_is_retried_with_the_rotated_token(
    operator: Operator, make_sender: Callable[..., ReportSender], token: Path, registry: CollectorRegistry
) -> None:
    operator.answers.append((401, {}))
    sender = make_sender()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.requests) == 1)
    await asyncio.to_thread(token.write_text, "token-2\n")
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    assert [(r.status, r.report.seq, r.authorization) for r in operator.requests] == [
        (401, 0, "Bearer token-1"),
        (200, 0, "Bearer token-2"),
    ]
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="unauthorized") == 1


@pytest.mark.looptime
async def test_a_bad_report_is_dropped_counted_and_not_retried(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.answers.append((400, {}))
    sender = make_sender()
    for i in range(3):
        sender.submit(snap(i))
    await operator.wait_for(lambda: len(operator.requests) == 1)
    sender.submit(snap(3))
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    assert [(r.status, r.report.seq, numbers([r.report])) for r in operator.requests] == [
        (400, 0, [0, 1, 2]),
        (200, 1, [3]),
    ]
    assert metric(registry, "gpuwarden_agent_report_dropped_snapshots_total", reason="rejected") == 3
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="rejected") == 1


@pytest.mark.looptime
async def test_readings_the_operator_refused_are_counted_logged_once_and_not_retried(
    operator: Operator,
    make_sender: Callable[..., ReportSender],
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    operator.refused = {"future": 2, "foreignPod": 1}
    sender = make_sender()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)
    sender.submit(snap(1))
    await operator.wait_for(lambda: len(operator.delivered) == 2)
    await sender.flush()

    assert numbers(operator.delivered) == [0, 1]  # delivered once each: a retry cannot help
    assert metric(registry, "gpuwarden_agent_report_refused_readings_total", reason="future") == 4
    assert metric(registry, "gpuwarden_agent_report_refused_readings_total", reason="foreignPod") == 2
    warnings = [r for r in caplog.records if "refused readings" in r.getMessage()]
    assert len(warnings) == 1  # the first of a streak


@pytest.mark.looptime
async def test_429_is_retried_after_retry_after(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.answers.append((429, {"Retry-After": "7"}))
    sender = make_sender()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    throttled, accepted = operator.requests
    assert accepted.at - throttled.at == pytest.approx(7.0)
    assert (throttled.status, accepted.status) == (429, 200)
    assert throttled.body == accepted.body  # the same report, same seq: the operator can dedupe
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="throttled") == 1


@pytest.mark.looptime
async def test_retries_back_off_exponentially_with_full_jitter_capped(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.answers.extend([(503, {})] * 8)
    sender = make_sender(backoff_base=0.5, backoff_cap=4.0, rng=random.Random(42))
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    times = [r.at for r in operator.requests]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    same_draws = random.Random(42)
    expected = [same_draws.uniform(0, min(4.0, 0.5 * 2**k)) for k in range(8)]
    assert gaps == pytest.approx(expected, abs=1e-3)
    assert all(g <= 4.0 for g in gaps)
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="server_error") == 8
    assert {r.report.seq for r in operator.requests} == {0}


@pytest.mark.looptime
async def test_other_answers_are_retried(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.answers.extend([(302, {"Location": "/elsewhere"}), (408, {}), (403, {})])
    sender = make_sender()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)

    assert [r.status for r in operator.requests] == [302, 408, 403, 200]
    for reason in ("unexpected_status", "server_error", "unauthorized"):
        assert metric(registry, "gpuwarden_agent_report_errors_total", reason=reason) == 1


async def test_a_421_is_followed_to_the_owner_at_once_until_the_owner_fails(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    owner = Operator()
    await owner.start()
    try:
        operator.owner = owner.url
        operator.answers.extend([(421, {}), (421, {})])
        sender = make_sender()
        sender.submit(snap(0))
        await owner.wait_for(lambda: len(owner.delivered) == 1)
        (misdirected,) = operator.requests
        assert misdirected.body == owner.requests[0].body  # the same report, same seq
        assert owner.requests[0].at - misdirected.at < 0.5  # at once, no backoff
        sender.submit(snap(1))
        await owner.wait_for(lambda: len(owner.delivered) == 2)
        assert len(operator.requests) == 1  # remembered: straight to the owner

        # The owner goes away: back to the Service, which names the owner again.
        await owner.stop()
        sender.submit(snap(2))
        # (The owner is still away when the Service names it; then the Service takes the report.)
        await operator.wait_for(lambda: len(operator.delivered) == 1)
        assert [r.status for r in operator.requests] == [421, 421, 200]
        assert numbers([r.report for r in operator.requests]) == [0, 2, 2]
    finally:
        if owner.runner is not None:
            await owner.stop()
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="misdirected") == 2
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="connection") == 2


@pytest.mark.looptime
async def test_421s_without_a_url_or_in_a_loop_back_off(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.answers.append((421, {}))  # no hint: like a 503
    operator.owner = None
    sender = make_sender()
    sender.submit(snap(0))
    await operator.wait_for(lambda: len(operator.delivered) == 1)
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="misdirected") == 1
    # Two replicas naming each other: MAX_REDIRECTS followed, then a backoff.
    operator.owner = operator.url
    operator.answers.extend([(421, {})] * (MAX_REDIRECTS + 1))
    sender.submit(snap(1))
    await operator.wait_for(lambda: len(operator.delivered) == 2)
    times = [r.at for r in operator.requests[2:]]
    assert times[MAX_REDIRECTS] - times[0] < 0.01  # followed at once
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="misdirected") == 2 + MAX_REDIRECTS


@pytest.mark.looptime
async def test_too_large_reports_are_split_and_stay_small(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    operator.max_snapshots = 3
    sender = make_sender(start=False)
    for i in range(8):
        sender.submit(snap(i))
    task = asyncio.create_task(sender.run())
    try:
        await operator.wait_for(lambda: sum(len(r.snapshots) for r in operator.delivered) == 8)
        sender.submit(snap(8))
        sender.submit(snap(9))
        sender.submit(snap(10))
        await operator.wait_for(lambda: sum(len(r.snapshots) for r in operator.delivered) == 11)
    finally:
        task.cancel()

    assert [(r.status, len(r.report.snapshots)) for r in operator.requests] == [
        (413, 8),
        (413, 4),
        (200, 2),
        (200, 2),
        (200, 2),
        (200, 2),
        (200, 2),  # later reports stay within what the operator took
        (200, 1),
    ]
    assert numbers(operator.delivered) == list(range(11))
    assert [r.seq for r in operator.delivered] == [0, 1, 2, 3, 4, 5]
    assert metric(registry, "gpuwarden_agent_report_errors_total", reason="too_large") == 2


@pytest.mark.looptime
async def test_reports_stay_under_the_body_limit(
    operator: Operator, make_sender: Callable[..., ReportSender], registry: CollectorRegistry
) -> None:
    part = len(snap(0).model_dump_json(by_alias=True, exclude_none=True)) + 1  # and a comma
    limit = 1024 + 3 * part  # the envelope's allowance and three snapshots
    sender = make_sender(start=False, max_report_bytes=limit)
    for i in range(8):
        sender.submit(snap(i))
    task = asyncio.create_task(sender.run())
    try:
        await operator.wait_for(lambda: sum(len(r.snapshots) for r in operator.delivered) == 8)
    finally:
        task.cancel()

    assert [(r.status, len(r.report.snapshots)) for r in operator.requests] == [(200, 3), (200, 3), (200, 2)]
    assert all(len(r.body) <= limit for r in operator.requests)
    assert len({r.at for r in operator.requests}) == 1  # one round, back to back
    assert numbers(operator.delivered) == list(range(8))


@pytest.mark.looptime
async def test_a_backlog_goes_out_in_full_reports_back_to_back(
    operator: Operator, make_sender: Callable[..., ReportSender]
) -> None:
    extra = 150
    sender = make_sender(start=False, buffer_limit=MAX_SNAPSHOTS_PER_REPORT + extra)
    for i in range(MAX_SNAPSHOTS_PER_REPORT + extra):
        sender.submit(snap(i))
    task = asyncio.create_task(sender.run())
    try:
        await operator.wait_for(lambda: len(operator.delivered) == 2)
    finally:
        task.cancel()

    first, second = operator.requests
    assert [len(r.report.snapshots) for r in (first, second)] == [MAX_SNAPSHOTS_PER_REPORT, extra]
    assert second.at == pytest.approx(first.at)  # the rest of a backlog does not wait a tick
    assert numbers(operator.delivered) == list(range(MAX_SNAPSHOTS_PER_REPORT + extra))


@pytest.mark.looptime
async def test_unreadable_token_is_an_error_not_a_crash(
    operator: Operator, make_sender: Callable[..., ReportSender], token: Path, registry: CollectorRegistry
) -> None:
    await asyncio.to_thread(token.unlink)
    sender = make_sender()
    sender.submit(snap(0))
    loop = asyncio.get_running_loop()
    # Nothing reaches the operator, so there is no event to await: let 30 s of fake
    # time pass, enough for several rounds of backoff (at most 0.5 + 1 + 2 s for three).
    await asyncio.sleep(30)
    assert loop.time() >= 30
    assert operator.requests == []
    assert (metric(registry, "gpuwarden_agent_report_errors_total", reason="token") or 0) >= 3

    await asyncio.to_thread(token.write_text, "token-3\n")
    await operator.wait_for(lambda: len(operator.delivered) == 1)
    await sender.flush()
    assert operator.requests[0].authorization == "Bearer token-3"
    assert sender.buffered == 0


@pytest.mark.looptime
async def test_flush_at_shutdown_delivers_what_run_left(
    operator: Operator, make_sender: Callable[..., ReportSender], trace: Trace, registry: CollectorRegistry
) -> None:
    await operator.stop()
    sender = make_sender(start=False)
    run = asyncio.create_task(sender.run())
    for i in range(4):
        sender.submit(snap(i))
    await trace.wait_for_failures(2)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    sender.submit(snap(4))  # the sampler's last tick
    await operator.start()

    await asyncio.wait_for(sender.flush(), timeout=5)

    assert numbers(operator.delivered) == [0, 1, 2, 3, 4]
    assert sender.buffered == 0
    assert metric(registry, "gpuwarden_agent_report_buffer_snapshots") == 0


def test_submit_needs_no_loop_and_never_blocks(registry: CollectorRegistry) -> None:
    sender = ReportSender("http://operator/v1/reports", "n", None, registry=registry, buffer_limit=2)
    for i in range(5):
        sender.submit(snap(i))
    assert sender.buffered == 2
    assert metric(registry, "gpuwarden_agent_report_dropped_snapshots_total", reason="buffer_full") == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval": 0},
        {"buffer_limit": 0},
        {"backoff_base": 0},
        {"backoff_base": 2.0, "backoff_cap": 1.0},
        {"max_report_bytes": 1000},
    ],
)
def test_rejects_nonsense_settings(registry: CollectorRegistry, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        ReportSender("http://operator/v1/reports", "n", None, registry=registry, **kwargs)

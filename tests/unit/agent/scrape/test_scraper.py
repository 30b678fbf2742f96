"""The scraper against real HTTP servers on 127.0.0.1 standing in for pods: good pages, a hung endpoint,
10 MiB, a web page, errors; the plan held to the agent's pod list; every outcome counted."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from gpuwarden.agent.metrics import ScrapeMetrics
from gpuwarden.agent.scrape import ListedPod, Scraper
from gpuwarden.agent.scrape.compact import ScrapeFailed, compact
from gpuwarden.agent.scrape.fetch import fetch
from gpuwarden.agent.scrape.scraper import MAX_BACKOFF, MAX_BACKOFF_SECONDS, _delay, _session
from gpuwarden.wire.scrape import ScrapeFailure, ScrapePlan, ScrapeTarget, ServiceSample, dump_plan

LATENCY = "vllm:e2e_request_latency_seconds"
WAITING = "vllm:num_requests_waiting"
MiB = 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# Just under the cap (about 810 kB) and valid: 9,000 series of one gauge, for the parser to chew on.
# Built once, so that serving it costs the event loop (which the test server shares) nothing to speak of.
BIG_PAGE = (
    f"# TYPE {WAITING} gauge\n"
    + "\n".join(f'{WAITING}{{model_name="m{i}",replica="{i % 7}",pad="{"x" * 20}"}} {i}' for i in range(9000))
    + "\n"
)


def vllm_page() -> bytes:
    registry = CollectorRegistry()
    latency = Histogram(LATENCY, "e2e", ["model_name"], buckets=(0.5, 1.0, 2.0), registry=registry)
    for value in (0.2, 0.7, 1.5, 3.0):
        latency.labels("llama").observe(value)
    Gauge(WAITING, "waiting", registry=registry).set(2)
    return generate_latest(registry)


@dataclass
class Pods:
    """One HTTP server whose paths behave as the pods of the tests do."""

    port: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hits: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    huge_done: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        routes: dict[str, Handler] = {
            "/metrics": self.metrics,
            "/hang": self.hang,
            "/huge": self.huge,
            "/huge-declared": self.huge_declared,
            "/text": self.text,
            "/missing": self.missing,
            "/redirect": self.redirect,
            "/gzip": self.gzipped,
            "/big": self.big,
        }
        for path, handler in routes.items():
            app.router.add_get(path, self.counted(path, handler))
        return app

    def counted(self, path: str, handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            self.hits[path] = self.hits.get(path, 0) + 1
            return await handler(request)

        return wrapped

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=vllm_page(), content_type="text/plain", charset="utf-8")

    async def hang(self, request: web.Request) -> web.Response:
        await self.release.wait()  # answers only when the test ends
        return web.Response(text="late")

    async def huge(self, request: web.Request) -> web.StreamResponse:
        # 10 MiB of valid-looking lines, streamed without a Content-Length
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        line = b"# HELP filler a line of filler to make the page large enough to refuse\n" * 1024
        self.sent["/huge"] = 0
        try:
            while self.sent["/huge"] < 10 * MiB:
                await response.write(line)
                self.sent["/huge"] += len(line)
        except ConnectionError:
            pass  # the agent stopped reading and closed
        finally:
            self.huge_done.set()
        return response

    async def huge_declared(self, request: web.Request) -> web.Response:
        return web.Response(body=b"#\n" * (5 * MiB), content_type="text/plain")

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(text=BIG_PAGE, content_type="text/plain")

    async def text(self, request: web.Request) -> web.Response:
        return web.Response(text="<html><body>It works!</body></html>", content_type="text/html")

    async def missing(self, request: web.Request) -> web.Response:
        return web.Response(status=404, text="no metrics here")

    async def redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/metrics")

    async def gzipped(self, request: web.Request) -> web.Response:
        return web.Response(
            body=gzip.compress(vllm_page()),
            headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"},
        )


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    state = Pods()
    runner = web.AppRunner(state.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = runner.addresses[0][1]
    yield state
    state.release.set()
    await runner.cleanup()


def target(pods: Pods, name: str, path: str, *, ip: str = "127.0.0.1", interval: float = 1.0) -> ScrapeTarget:
    return ScrapeTarget(
        namespace="serving",
        name=name,
        uid=f"uid-{name}",
        ip=ip,
        port=pods.port,
        path=path,
        metrics=[LATENCY, WAITING],
        interval_seconds=interval,
    )


def listing(*names: str, ips: frozenset[str] = frozenset({"127.0.0.1"})) -> Callable[[str], ListedPod | None]:
    pods = {f"uid-{n}": ListedPod("serving", n, ips) for n in names}
    return pods.get


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


async def collect(
    scraper: Scraper, want: Callable[[dict[str, list[ServiceSample]]], bool]
) -> dict[str, list[ServiceSample]]:
    """Drain the scraper, as the snapshots do, until ``want`` holds of what came (10 s at most)."""
    got: dict[str, list[ServiceSample]] = {}
    async with asyncio.timeout(10):
        while not want(got):
            for sample in scraper.drain():
                got.setdefault(sample.name, []).append(sample)
            await asyncio.sleep(0.02)
    return got


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


async def running(scraper: Scraper) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(scraper.run())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_good_pod_is_scraped_at_its_interval_and_compacted(
    pods: Pods, registry: CollectorRegistry
) -> None:
    scraper = Scraper(listing("good"), ScrapeMetrics(registry))
    task = await running(scraper)
    scraper.set_plan(ScrapePlan(targets=[target(pods, "good", "/metrics")]))
    got = await collect(scraper, lambda g: len(g.get("good", [])) >= 2)
    await stop(task)
    first, second = got["good"][:2]
    assert first.error is None
    (histogram,) = first.histograms
    assert (histogram.name, histogram.bounds, histogram.counts, histogram.count) == (
        LATENCY,
        [0.5, 1.0, 2.0],
        [1, 2, 3],
        4,
    )
    assert [(g.name, g.values) for g in first.gauges] == [(WAITING, [2.0])]
    assert 0.9 < second.at - first.at < 1.5  # its interval, 1 s
    assert value(registry, "gpuwarden_agent_service_scrapes_total", result="ok") >= 2
    assert value(registry, "gpuwarden_agent_service_targets") == 1


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/hang", ScrapeFailure.TIMEOUT),
        ("/huge", ScrapeFailure.TOO_LARGE),
        ("/huge-declared", ScrapeFailure.TOO_LARGE),
        ("/text", ScrapeFailure.NOT_PROMETHEUS),
        ("/gzip", ScrapeFailure.NOT_PROMETHEUS),
        ("/missing", ScrapeFailure.HTTP_STATUS),
        ("/redirect", ScrapeFailure.HTTP_STATUS),
    ],
)
async def test_a_bad_endpoint_is_refused_with_its_reason(
    pods: Pods, path: str, reason: ScrapeFailure
) -> None:
    async with _session() as session:
        started = time.monotonic()
        with pytest.raises(ScrapeFailed) as failed:
            await fetch_compacted(session, f"http://127.0.0.1:{pods.port}{path}")
        took = time.monotonic() - started
    assert failed.value.reason is reason
    assert took < 1.5  # the timeout is 0.5 s; the others are refused as soon as they are read
    if path == "/redirect":
        assert pods.hits.get("/metrics") is None  # not followed


async def fetch_compacted(session: aiohttp.ClientSession, url: str) -> None:
    page = await fetch(session, url, seconds=0.5, max_bytes=MiB)
    compact(page.text, page.content_type, [LATENCY])


async def test_ten_mebibytes_are_not_read_past_the_cap(pods: Pods) -> None:
    async with _session() as session:
        with pytest.raises(ScrapeFailed) as failed:
            await fetch(session, f"http://127.0.0.1:{pods.port}/huge", seconds=5, max_bytes=MiB)
    assert failed.value.reason is ScrapeFailure.TOO_LARGE
    # What the server could push before the agent hung up: the cap, a chunk, and the sockets' buffers.
    async with asyncio.timeout(5):
        await pods.huge_done.wait()
    assert pods.sent["/huge"] < 10 * MiB


async def test_an_unreachable_pod_is_refused(pods: Pods) -> None:
    async with _session() as session:
        with pytest.raises(ScrapeFailed) as failed:
            await fetch(session, "http://127.0.0.1:1/metrics", seconds=1, max_bytes=MiB)
    assert failed.value.reason is ScrapeFailure.UNREACHABLE


async def test_hung_and_huge_pods_do_not_slow_the_good_ones(pods: Pods, registry: CollectorRegistry) -> None:
    scraper = Scraper(listing("good", "hung", "huge", "text", "big"), ScrapeMetrics(registry), concurrency=4)
    task = await running(scraper)
    plan = [
        target(pods, "good", "/metrics"),
        target(pods, "hung", "/hang"),
        target(pods, "huge", "/huge"),
        target(pods, "text", "/text"),
        target(pods, "big", "/big"),
    ]
    # What parsing the big page costs here, on this loop, now: the lag a tick would see were the
    # scraper to parse on the loop (about 200 ms on the 2-core VM under load, 60 ms on a fast core).
    parse = min(timed(lambda: compact(BIG_PAGE, "text/plain", [WAITING])) for _ in range(2))
    lags: list[float] = []
    ticking = asyncio.get_running_loop().create_task(ticker(lags))
    scraper.set_plan(ScrapePlan(targets=plan))
    got = await collect(
        scraper, lambda g: len(g.get("good", [])) >= 4 and "hung" in g and len(g.get("big", [])) >= 3
    )
    await stop(task)
    await stop(ticking)
    # The event loop (the agent's sampler, hook socket, /metrics and reports share it) stayed free while
    # the big page was parsed three times and the others failed. Judged by the third-worst tick, against
    # the parse's own cost: parsed on the loop, three ticks are late by a whole parse; in its thread the
    # parser yields the GIL every 5 ms, and one descheduling of a loaded CI machine (a 208 ms tick was
    # seen once) is one tick, not three.
    worst = sorted(lags, reverse=True)
    print(
        f"\nevent loop lag while scraping: worst ticks {[round(lag * 1000, 1) for lag in worst[:3]]} ms "
        f"over {len(lags)}; the page parsed on the loop takes {parse * 1000:.1f} ms"
    )
    assert worst[2] < parse / 2
    (big,) = got["big"][:1]
    assert big.error is None
    assert len(big.gauges[0].values) == 16
    good = got["good"]
    assert all(s.error is None for s in good)
    gaps = [b.at - a.at for a, b in itertools.pairwise(good)]
    assert max(gaps) < 1.3, gaps  # every second, as if the others were not there
    assert got["hung"][0].error is ScrapeFailure.TIMEOUT
    assert got["huge"][0].error is ScrapeFailure.TOO_LARGE
    assert got["text"][0].error is ScrapeFailure.NOT_PROMETHEUS
    for result in ("timeout", "too_large", "not_prometheus"):
        assert value(registry, "gpuwarden_agent_service_scrapes_total", result=result) >= 1


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


async def ticker(lags: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(0.01)
        lags.append(loop.time() - before - 0.01)


async def test_a_target_not_on_the_agents_pod_list_is_never_scraped(
    pods: Pods, registry: CollectorRegistry
) -> None:
    scraper = Scraper(listing("good", "moved", ips=frozenset({"127.0.0.1"})), ScrapeMetrics(registry))
    task = await running(scraper)
    plan = ScrapePlan(
        targets=[
            target(pods, "good", "/metrics"),
            target(pods, "stranger", "/metrics"),  # no such pod on this node
            target(pods, "moved", "/metrics", ip="127.0.0.2"),  # the pod is here, that IP is not its
        ]
    )
    for _ in range(3):  # the plan comes with every answer: counted once
        scraper.set_plan(plan)
    got = await collect(scraper, lambda g: "good" in g)
    await stop(task)
    assert set(got) == {"good"}
    assert [t.name for t in scraper.targets] == ["good"]
    assert value(registry, "gpuwarden_agent_service_targets_refused_total", reason="unlisted") == 1
    assert value(registry, "gpuwarden_agent_service_targets_refused_total", reason="address") == 1
    assert pods.hits.get("/metrics") == 1


async def test_the_plan_comes_as_the_answers_json_and_an_invalid_one_keeps_the_last(
    pods: Pods, registry: CollectorRegistry
) -> None:
    scraper = Scraper(listing("good"), ScrapeMetrics(registry))
    scraper.accept_plan(json.loads(dump_plan(ScrapePlan(targets=[target(pods, "good", "/metrics")]))))
    assert [t.name for t in scraper.targets] == ["good"]
    scraper.accept_plan({"targets": [{"namespace": "serving", "ip": "not an ip"}]})
    assert [t.name for t in scraper.targets] == ["good"]
    assert value(registry, "gpuwarden_agent_service_targets_refused_total", reason="invalid_plan") == 1
    scraper.accept_plan(None)  # an operator that sends no plan: nothing to scrape
    assert scraper.targets == []


def test_a_failing_target_backs_off_doubling_within_bounds() -> None:
    assert [_delay(2.0, n) for n in range(7)] == [2.0, 2.0, 4.0, 8.0, 16.0, 32.0, 32.0]
    assert _delay(1.0, 10) == MAX_BACKOFF
    assert _delay(60.0, 10) == MAX_BACKOFF_SECONDS
    assert _delay(600.0, 10) == 600.0  # never below its own interval

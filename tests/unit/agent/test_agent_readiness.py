"""The agent's ``/readyz`` means fresh samples: a sampler that stalls (an NVML call that never returns)
or fails at every tick turns the pod unready once no snapshot came for :func:`stale_after`, and ready
again with the next one. The ring's clock is the test's; the sampler, the ring and the app are real."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from test_snapshots import EPOCH, FakeBackend

from gpuwarden.agent.http import build_app, stale_after
from gpuwarden.agent.snapshots import Sampler, SnapshotRing
from gpuwarden.wire.node import GpuSample

INTERVAL = 1.0


class StallingBackend(FakeBackend):
    """Blocks in ``sample_devices`` while ``stalled``, as a hung NVML call blocks the worker thread."""

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.Event()
        self.running.set()
        self.entered = threading.Event()

    def sample_devices(self, now: float) -> list[GpuSample]:
        self.entered.set()
        self.running.wait()
        return super().sample_devices(now)


class World:
    def __init__(self) -> None:
        self.now = 0.0
        self.backend = StallingBackend()
        self.ring = SnapshotRing(clock=lambda: self.now)
        self.sampler = Sampler(self.backend, self.ring, interval=INTERVAL, clock=lambda: EPOCH + self.now)


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
async def client(world: World) -> AsyncIterator[TestClient[Any, Any]]:
    app = build_app(CollectorRegistry(), world.ring, stale_after=stale_after(INTERVAL))
    async with TestClient(TestServer(app)) as client:
        yield client


async def readyz(client: TestClient[Any, Any]) -> tuple[int, str]:
    response = await client.get("/readyz")
    return response.status, await response.text()


def test_unready_after_five_intervals_never_sooner_than_ten_seconds() -> None:
    assert stale_after(1.0) == 10.0
    assert stale_after(0.5) == 10.0
    assert stale_after(5.0) == 25.0


async def test_a_stalled_sampler_turns_the_agent_unready_and_the_next_sample_ready(
    world: World, client: TestClient[Any, Any]
) -> None:
    assert await readyz(client) == (503, "no sample taken yet\n")
    await world.sampler.step(with_processes=True)
    assert (await readyz(client))[0] == 200

    world.backend.running.clear()
    world.backend.entered.clear()
    stuck = asyncio.create_task(world.sampler.step(with_processes=False))
    await asyncio.to_thread(world.backend.entered.wait)  # the worker thread is inside the "NVML call"
    world.now += stale_after(INTERVAL)
    assert (await readyz(client))[0] == 200  # at the limit: still ready
    world.now += 1
    status, text = await readyz(client)
    assert status == 503
    assert text == "no new sample for 11 s (unready after 10 s): sampling is stalled or failing\n"

    world.backend.running.set()
    assert await stuck is not None
    assert (await readyz(client))[0] == 200


async def test_a_sampler_failing_at_every_tick_turns_it_unready(
    world: World, client: TestClient[Any, Any]
) -> None:
    await world.sampler.step(with_processes=True)
    world.backend.fail_devices = True
    for _ in range(11):
        world.now += INTERVAL
        assert await world.sampler.step(with_processes=False) is None
    assert (await readyz(client))[0] == 503


async def test_local_mode_without_a_limit_stays_ready_after_the_first_sample(world: World) -> None:
    async with TestClient(TestServer(build_app(CollectorRegistry(), world.ring))) as client:
        await world.sampler.step(with_processes=True)
        world.now += 3600
        assert (await readyz(client))[0] == 200

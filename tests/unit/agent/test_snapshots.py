"""The sampling loop: its schedule (on fake loop time), error accounting, and the snapshot ring."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gpuwarden.agent.snapshots import Sampler, SnapshotRing
from gpuwarden.wire.node import (
    DeviceState,
    GpuSample,
    PodRef,
    ProcessSample,
    ProcessUtilization,
    Snapshot,
    merge_process_utilization,
)

EPOCH = 1_800_000_000.0
UUID = "GPU-00000000-0000-4000-8000-000000000000"


class FakeBackend:
    """Records when it was asked for what, in the sampler's clock."""

    name = "fake"

    def __init__(self, state: DeviceState = DeviceState.OK) -> None:
        self.state = state
        self.device_calls: list[float] = []
        self.process_calls: list[float] = []
        self.fail_devices = False
        self.fail_processes = False

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def sample_devices(self, now: float) -> list[GpuSample]:
        self.device_calls.append(now - EPOCH)
        if self.fail_devices:
            raise RuntimeError("driver went away")
        return [
            GpuSample(
                uuid=UUID,
                index=0,
                state=self.state,
                utilization_gpu=50.0 if self.state is DeviceState.OK else None,
                processes=[ProcessSample(pid=10), ProcessSample(pid=11)],
            )
        ]

    def sample_process_utilization(self, now: float) -> ProcessUtilization:
        self.process_calls.append(now - EPOCH)
        if self.fail_processes:
            raise RuntimeError("too slow")
        return {UUID: {10: 33.0}}


class Events:
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.durations: list[float] = []

    def sampled(self, seconds: float) -> None:
        self.durations.append(seconds)

    def error(self, kind: str) -> None:
        self.errors[kind] += 1


def make_sampler(
    backend: FakeBackend, ring: SnapshotRing | None = None, **kwargs: object
) -> tuple[Sampler, Events, SnapshotRing]:
    loop = asyncio.get_running_loop()
    events = Events()
    ring = SnapshotRing() if ring is None else ring
    sampler = Sampler(
        backend,
        ring,
        events=events,
        clock=lambda: EPOCH + loop.time(),
        **kwargs,  # type: ignore[arg-type]
    )
    return sampler, events, ring


async def run_for(sampler: Sampler, seconds: float) -> None:
    task = asyncio.create_task(sampler.run())
    await asyncio.sleep(seconds)  # fake time: this is the time passing, not a wait for an event
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.looptime(start=0)
async def test_devices_every_interval_and_processes_at_their_own_lower_rate() -> None:
    backend = FakeBackend()
    sampler, events, ring = make_sampler(backend, interval=1.0, process_interval=10.0)
    await run_for(sampler, 35.5)
    assert backend.device_calls == [float(t) for t in range(36)]
    assert backend.process_calls == [0.0, 10.0, 20.0, 30.0]
    assert len(events.durations) == 36
    with_util = [s for s in ring.recent() if s.gpus[0].processes[0].sm_util is not None]
    assert [s.timestamp - EPOCH for s in with_util] == [0.0, 10.0, 20.0, 30.0]
    # a PID the per-process reading of its GPU leaves out ran no kernel in the window: 0, not unknown
    assert [s.gpus[0].processes[1].sm_util for s in with_util] == [0.0] * 4
    # between per-process readings, nothing is known of either process's SM utilization
    assert all(p.sm_util is None for s in ring.recent() if s not in with_util for p in s.gpus[0].processes)
    assert ring.process_utilization == {UUID: {10: 33.0}}


@pytest.mark.looptime(start=0)
async def test_a_slow_tick_skips_the_ticks_it_overran_instead_of_bunching_up() -> None:
    backend = FakeBackend()
    sampler, _, _ = make_sampler(backend, interval=1.0, process_interval=10.0)
    original = sampler.step
    started: list[float] = []
    loop = asyncio.get_running_loop()

    async def slow_step(*, with_processes: bool) -> Snapshot | None:
        started.append(loop.time())
        if len(started) == 3:
            await asyncio.sleep(2.5)  # NVML hung for 2.5 intervals
        return await original(with_processes=with_processes)

    sampler.step = slow_step  # type: ignore[method-assign]
    await run_for(sampler, 8.5)
    assert started == [0.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0]


@pytest.mark.looptime(start=0)
async def test_the_ring_keeps_the_latest_snapshots_and_signals_the_first() -> None:
    backend = FakeBackend()
    ring = SnapshotRing(capacity=5)
    assert not ring.ready
    assert ring.latest() is None
    sampler, _, _ = make_sampler(backend, ring, interval=1.0)
    task = asyncio.create_task(sampler.run())
    await ring.first_sample.wait()
    assert ring.ready
    await asyncio.sleep(9.5)
    task.cancel()
    assert len(ring) == 5
    assert [s.timestamp - EPOCH for s in ring.recent()] == [5.0, 6.0, 7.0, 8.0, 9.0]
    latest = ring.latest()
    assert latest is not None
    assert latest.timestamp == EPOCH + 9.0


def test_a_ring_needs_room() -> None:
    with pytest.raises(ValueError, match="at least one"):
        SnapshotRing(capacity=0)


@pytest.mark.looptime(start=0)
async def test_snapshots_are_attributed_kept_and_delivered_in_order() -> None:
    backend = FakeBackend()
    delivered: list[Snapshot] = []
    pod = PodRef(namespace="ml", name="train-0")

    def annotate(snapshot: Snapshot) -> Snapshot:
        return snapshot.model_copy(
            update={"gpus": [g.model_copy(update={"pods": [pod]}) for g in snapshot.gpus]}
        )

    sampler, events, ring = make_sampler(backend, annotate=annotate, deliver=delivered.append)
    await run_for(sampler, 2.5)
    assert [s.timestamp - EPOCH for s in delivered] == [0.0, 1.0, 2.0]
    assert all(s.gpus[0].pods == [pod] for s in delivered)
    assert ring.recent() == delivered
    assert not events.errors


@pytest.mark.looptime(start=0)
async def test_failures_are_counted_by_kind_and_the_loop_carries_on() -> None:
    backend = FakeBackend()
    delivered: list[Snapshot] = []

    def annotate(snapshot: Snapshot) -> Snapshot:
        raise RuntimeError("kubelet confused")

    def deliver(snapshot: Snapshot) -> None:
        delivered.append(snapshot)
        raise RuntimeError("sender confused")

    sampler, events, ring = make_sampler(
        backend, annotate=annotate, deliver=deliver, interval=1.0, process_interval=2.0
    )
    backend.fail_processes = True
    await run_for(sampler, 3.5)
    # unattributed but true readings are still kept and sent
    assert len(ring) == 4
    assert len(delivered) == 4
    assert all(s.gpus[0].processes[0].sm_util is None for s in ring.recent())
    assert events.errors == Counter(attribution=4, deliver=4, process_utilization=2)

    backend.fail_devices = True
    sampler2, events2, ring2 = make_sampler(backend)
    await run_for(sampler2, 2.5)
    assert events2.errors["sample"] == 3
    assert len(ring2) == 0
    assert not ring2.ready


@pytest.mark.looptime(start=0)
@pytest.mark.parametrize(
    ("state", "kind"), [(DeviceState.LOST, "gpu_lost"), (DeviceState.UNKNOWN, "gpu_unknown")]
)
async def test_devices_in_a_bad_state_are_counted_once_per_sample(state: DeviceState, kind: str) -> None:
    sampler, events, ring = make_sampler(FakeBackend(state))
    await run_for(sampler, 4.5)
    assert events.errors == Counter({kind: 5})
    latest = ring.latest()
    assert latest is not None
    assert latest.gpus[0].state is state


def test_merge_reads_a_pid_left_out_of_a_good_reading_as_0_and_an_unread_device_as_unknown() -> None:
    gpus = [
        GpuSample(uuid=UUID, index=0, processes=[ProcessSample(pid=1), ProcessSample(pid=2)]),
        GpuSample(uuid="GPU-parent", index=1, mig_id="MIG-a", processes=[ProcessSample(pid=3)]),
        GpuSample(uuid="GPU-other", index=2, processes=[ProcessSample(pid=4)]),
        GpuSample(uuid="GPU-quiet", index=3, processes=[ProcessSample(pid=5)]),
    ]
    merged = merge_process_utilization(gpus, {UUID: {1: 12.5}, "MIG-a": {3: 80.0}, "GPU-quiet": {}})
    # pid 2 ran no kernel in the window (NVML lists only those that did): 0%. GPU-other was not
    # read at all: unknown. GPU-quiet was read and nothing ran there (NVML_ERROR_NOT_FOUND).
    assert [[p.sm_util for p in g.processes] for g in merged] == [[12.5, 0.0], [80.0], [None], [0.0]]
    assert merged[2] is gpus[2]


def test_intervals_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Sampler(FakeBackend(), SnapshotRing(), interval=0)

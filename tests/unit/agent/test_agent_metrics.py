"""The agent's /metrics, /healthz and /readyz: names, labels, units, lint, and stale series."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promtool_support import promtool

from gpuwarden.agent.attribution.kubelet import PodResourcesState
from gpuwarden.agent.hookattach import attach_hook
from gpuwarden.agent.hooksocket import REFUSALS as HOOK_REFUSALS
from gpuwarden.agent.hooksocket import HookReading, HookReadings
from gpuwarden.agent.http import background_task, build_app
from gpuwarden.agent.metrics import HookMetrics, PodResourcesCollector, build_registry
from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend
from gpuwarden.agent.snapshots import ERROR_KINDS, Sampler, SnapshotRing
from gpuwarden.sim.scenario import parse_scenario
from gpuwarden.wire.hook import parse_message
from gpuwarden.wire.node import DeviceState, GpuSample, Snapshot

GI = 2**30
ORIGIN = 1_800_000_000.0
UUID0 = "GPU-00000000-0000-4000-8000-000000000000"
UUID1 = "GPU-11111111-1111-4111-8111-111111111111"

SCENARIO: dict[str, Any] = {
    "name": "metrics",
    "duration": "5m",
    "gpus": [
        {
            "uuid": UUID0,
            "memoryTotal": "80Gi",
            "utilization": [{"kind": "idle", "level": 40}],
            "memory": [{"kind": "idle", "level": "10Gi"}],
            "reservedMemory": "1Gi",
        },
        {
            "uuid": UUID1,
            "memoryTotal": "80Gi",
            "gpm": False,
            "utilization": [{"kind": "idle", "level": 2}],
            "memory": [{"kind": "idle", "level": "1Gi"}],
            "health": [{"kind": "lost", "at": "2m"}],
        },
    ],
    "pods": [
        {
            "namespace": "ml",
            "name": "stays",
            "container": "main",
            "gpus": [UUID0],
            "processes": [{"pid": 10}],
            "hostMemory": [{"kind": "idle", "level": "2Gi"}],
        },
        {"namespace": "ml", "name": "leaves", "gpus": [UUID0], "processes": [{"pid": 20}], "until": "1m"},
    ],
}


def sample_at(ring: SnapshotRing, t: float, *, with_processes: bool = True) -> Snapshot:
    """What the sampler would keep at scenario time t."""
    scenario = parse_scenario(SCENARIO)
    snapshot = scenario.snapshot(t, origin=ORIGIN)
    if not with_processes:
        snapshot = snapshot.model_copy(
            update={
                "gpus": [
                    g.model_copy(
                        update={"processes": [p.model_copy(update={"sm_util": None}) for p in g.processes]}
                    )
                    for g in snapshot.gpus
                ]
            }
        )
    else:
        ring.record_process_utilization(scenario.process_utilization(t))
    ring.append(snapshot)
    return snapshot


def scrape(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name (as exposed, with _total etc.) → [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def series(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> list[float]:
    return [v for labels, v in metrics.get(name, []) if all(labels.get(k) == m for k, m in match.items())]


@pytest.fixture
def ring() -> SnapshotRing:
    return SnapshotRing()


@pytest.fixture
def registry(ring: SnapshotRing) -> CollectorRegistry:
    return build_registry(ring, backend="scripted", node="node-a")[0]


def test_before_the_first_sample_only_the_agents_own_series_exist(registry: CollectorRegistry) -> None:
    metrics = scrape(registry)
    assert not any(name.startswith(("gpuwarden_gpu_", "gpuwarden_process_")) for name in metrics)
    # every error kind reads 0 before the first error, so rate() works from the start
    assert {labels["kind"]: v for labels, v in metrics["gpuwarden_agent_errors_total"]} == dict.fromkeys(
        ERROR_KINDS, 0.0
    )
    assert series(metrics, "gpuwarden_agent_sample_duration_seconds_count") == [0.0]
    assert series(metrics, "gpuwarden_agent_info", backend="scripted", node="node-a") == [1.0]
    assert "gpuwarden_agent_last_sample_timestamp_seconds" not in metrics


def test_device_series_are_in_base_units_and_labelled_by_gpu_and_pod(
    ring: SnapshotRing, registry: CollectorRegistry
) -> None:
    sample_at(ring, 30)
    metrics = scrape(registry)
    gpu0 = {"uuid": UUID0, "index": "0", "model": "NVIDIA H200", "mig_id": ""}
    # GPU 0 is time-sliced between two pods: one series per pod, each with the device's reading
    for pod, container in (("stays", "main"), ("leaves", "")):
        labels = {**gpu0, "namespace": "ml", "pod": pod, "container": container}
        assert series(metrics, "gpuwarden_gpu_utilization_ratio", **labels) == [pytest.approx(0.40)]
        assert series(metrics, "gpuwarden_gpu_sm_active_ratio", **labels) == [pytest.approx(0.34)]
        assert series(metrics, "gpuwarden_gpu_memory_used_bytes", **labels) == [10 * GI]
        assert series(metrics, "gpuwarden_gpu_memory_total_bytes", **labels) == [80 * GI]
        assert series(metrics, "gpuwarden_gpu_up", **labels, state="ok") == [1.0]
        assert series(metrics, "gpuwarden_gpu_sm_clock_hertz", **labels) == [1980e6]
        assert series(metrics, "gpuwarden_gpu_ecc_uncorrected_errors_total", **labels) == [0.0]
        (watts,) = series(metrics, "gpuwarden_gpu_power_watts", **labels)
        assert 90 < watts < 700
        (celsius,) = series(metrics, "gpuwarden_gpu_temperature_celsius", **labels)
        assert 30 < celsius < 60
    # GPU 1 holds no pod: empty pod labels; no GPM there: no SM activity series at all
    assert series(metrics, "gpuwarden_gpu_up", uuid=UUID1, pod="", namespace="", state="ok") == [1.0]
    assert series(metrics, "gpuwarden_gpu_sm_active_ratio", uuid=UUID1) == []
    assert series(metrics, "gpuwarden_agent_last_sample_timestamp_seconds") == [ORIGIN + 30]


def test_process_and_pod_series(ring: SnapshotRing, registry: CollectorRegistry) -> None:
    sample_at(ring, 30)
    metrics = scrape(registry)
    stays = {"uuid": UUID0, "pid": "10", "namespace": "ml", "pod": "stays", "container": "main"}
    leaves = {"uuid": UUID0, "pid": "20", "namespace": "ml", "pod": "leaves", "container": ""}
    assert series(metrics, "gpuwarden_process_gpu_memory_used_bytes", **stays) == [4.5 * GI]
    assert series(metrics, "gpuwarden_process_gpu_memory_used_bytes", **leaves) == [4.5 * GI]
    assert series(metrics, "gpuwarden_process_sm_utilization_ratio", **stays) == [pytest.approx(0.2)]
    assert series(metrics, "gpuwarden_pod_host_memory_bytes", namespace="ml", pod="stays") == [2 * GI]


def test_per_process_utilization_shows_the_last_reading_between_reads(
    ring: SnapshotRing, registry: CollectorRegistry
) -> None:
    sample_at(ring, 30, with_processes=True)
    sample_at(ring, 31, with_processes=False)
    stays = {"uuid": UUID0, "pid": "10", "pod": "stays"}
    assert series(scrape(registry), "gpuwarden_process_sm_utilization_ratio", **stays) == [pytest.approx(0.2)]
    # A process the last reading of its GPU left out ran no kernel: 0 until the next reading, not no series.
    ring.record_process_utilization({UUID0: {10: 20.0}})
    leaves = {"uuid": UUID0, "pid": "20", "pod": "leaves"}
    assert series(scrape(registry), "gpuwarden_process_sm_utilization_ratio", **leaves) == [0.0]
    ring.record_process_utilization({})  # the GPU could not be read: no series
    assert series(scrape(registry), "gpuwarden_process_sm_utilization_ratio", **leaves) == []


def test_series_of_a_pod_that_left_vanish(ring: SnapshotRing, registry: CollectorRegistry) -> None:
    sample_at(ring, 30)
    before = scrape(registry)
    assert series(before, "gpuwarden_gpu_utilization_ratio", pod="leaves")
    assert series(before, "gpuwarden_process_gpu_memory_used_bytes", pod="leaves")
    sample_at(ring, 90)
    after = scrape(registry)
    for name, values in after.items():
        assert not [labels for labels, _ in values if labels.get("pod") == "leaves"], name
    assert series(after, "gpuwarden_gpu_utilization_ratio", pod="stays") == [pytest.approx(0.40)]


def test_a_lost_gpu_is_down_with_its_state_and_has_no_readings(
    ring: SnapshotRing, registry: CollectorRegistry
) -> None:
    sample_at(ring, 150)
    metrics = scrape(registry)
    assert series(metrics, "gpuwarden_gpu_up", uuid=UUID1, state="lost") == [0.0]
    for name in (
        "gpuwarden_gpu_utilization_ratio",
        "gpuwarden_gpu_memory_used_bytes",
        "gpuwarden_gpu_power_watts",
    ):
        assert series(metrics, name, uuid=UUID1) == [], name


def test_unknown_state_reads_down_with_what_could_be_read(
    ring: SnapshotRing, registry: CollectorRegistry
) -> None:
    gpu = GpuSample(uuid=UUID0, index=0, state=DeviceState.UNKNOWN, memory_used_bytes=5, power_watts=None)
    ring.append(Snapshot(timestamp=ORIGIN, gpus=[gpu]))
    metrics = scrape(registry)
    assert series(metrics, "gpuwarden_gpu_up", uuid=UUID0, state="unknown") == [0.0]
    assert series(metrics, "gpuwarden_gpu_memory_used_bytes", uuid=UUID0) == [5.0]
    assert series(metrics, "gpuwarden_gpu_power_watts", uuid=UUID0) == []


def test_promtool_accepts_the_exposition(ring: SnapshotRing) -> None:
    registry, agent = build_registry(ring, backend="scripted", node="node-a")
    agent.error("sample")
    agent.sampled(0.0021)
    for t in (30, 150):  # with pods, time-slicing, and a lost GPU
        sample_at(ring, t)
        result = subprocess.run(
            [promtool(), "check", "metrics"],
            input=generate_latest(registry),
            capture_output=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


class CountingBackend(ScriptedBackend):
    def __init__(self) -> None:
        super().__init__(parse_scenario(SCENARIO), origin=ORIGIN)
        self.calls = 0

    def sample_devices(self, now: float) -> list[GpuSample]:
        self.calls += 1
        return super().sample_devices(now)


async def test_a_scrape_never_calls_the_backend(ring: SnapshotRing, registry: CollectorRegistry) -> None:
    backend = CountingBackend()
    sampler = Sampler(backend, ring, annotate=ScenarioAttributor(backend).annotate, clock=lambda: ORIGIN + 30)
    await sampler.step(with_processes=True)
    assert backend.calls == 1
    for _ in range(5):
        assert series(scrape(registry), "gpuwarden_gpu_up", pod="stays") == [1.0]
    assert backend.calls == 1


@pytest.fixture
async def client(ring: SnapshotRing, registry: CollectorRegistry) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(build_app(registry, ring))) as client:
        yield client


async def test_healthz_is_always_ok_and_readyz_waits_for_the_first_sample(
    client: TestClient[Any, Any], ring: SnapshotRing
) -> None:
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 503
    sample_at(ring, 1)
    assert (await client.get("/readyz")).status == 200


async def test_metrics_endpoint_serves_the_text_format(
    client: TestClient[Any, Any], ring: SnapshotRing
) -> None:
    sample_at(ring, 30)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    body = await response.text()
    assert 'gpuwarden_gpu_up{container="main"' in body


async def test_background_tasks_run_with_the_app_and_report_an_early_end(
    ring: SnapshotRing, registry: CollectorRegistry
) -> None:
    started = asyncio.Event()
    stopped = asyncio.Event()
    crashed = asyncio.Event()
    ended: list[tuple[str, str]] = []

    def on_exit(name: str, error: BaseException | None) -> None:
        ended.append((name, repr(error)))
        crashed.set()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    async def crashes() -> None:
        raise RuntimeError("boom")

    app = build_app(
        registry,
        ring,
        background=[
            background_task("forever", forever, on_exit=on_exit),
            background_task("crashes", crashes, on_exit=on_exit),
        ],
    )
    async with TestClient(TestServer(app)):
        await started.wait()
        await crashed.wait()
        assert ended == [("crashes", "RuntimeError('boom')")]
        assert not stopped.is_set()
    assert stopped.is_set()
    assert ended == [("crashes", "RuntimeError('boom')")]  # a cancelled task is no "early end"


def test_the_pod_resources_state_is_one_series_per_state_the_current_one_1() -> None:
    state = [PodResourcesState.NOT_ASKED]
    registry = CollectorRegistry()
    registry.register(PodResourcesCollector(lambda: state[0]))

    def current() -> dict[str, float]:
        (family,) = text_string_to_metric_families(generate_latest(registry).decode())
        assert family.name == "gpuwarden_agent_pod_resources_state"
        return {s.labels["state"]: s.value for s in family.samples}

    assert current() == {s.value: float(s is PodResourcesState.NOT_ASKED) for s in PodResourcesState}
    state[0] = PodResourcesState.SOCKET_MISSING  # the kubelet socket not mounted
    assert current()["socket_missing"] == 1.0
    assert sum(current().values()) == 1.0
    state[0] = PodResourcesState.OK
    assert current()["ok"] == 1.0
    assert current()["socket_missing"] == 0.0


# ------------------------------------------------------------------------------------------ hook


def hooked(ring: SnapshotRing, t: float) -> Snapshot:
    """The scenario at t, pid 10 with a hook reading on GPU 0 (what the hook stage attaches)."""
    snapshot = sample_at(ring, t)
    message = parse_message(
        f'{{"v": 1, "timestamp": {snapshot.timestamp}, "hostRssBytes": {GI}, '
        f'"devices": [{{"uuid": "{UUID0}", "allocatedBytes": {3 * GI}, "reservedBytes": {4 * GI}}}]}}'
    )
    reading = HookReading(pid=10, uid=0, message=message, received_at=snapshot.timestamp)
    with_hook = attach_hook(snapshot, {10: reading}, snapshot.timestamp)
    ring.append(with_hook)
    return with_hook


def test_a_hooked_process_has_its_allocators_memory_with_the_process_labels(
    ring: SnapshotRing, registry: CollectorRegistry
) -> None:
    hooked(ring, 30)
    metrics = scrape(registry)
    stays = {"uuid": UUID0, "index": "0", "mig_id": "", "pid": "10", "namespace": "ml", "pod": "stays"}
    assert series(metrics, "gpuwarden_process_gpu_memory_allocated_bytes", **stays) == [3 * GI]
    assert series(metrics, "gpuwarden_process_gpu_memory_reserved_bytes", **stays) == [4 * GI]
    used = {labels["pid"]: labels for labels, _ in metrics["gpuwarden_process_gpu_memory_used_bytes"]}
    ((allocated_labels, _),) = metrics["gpuwarden_process_gpu_memory_allocated_bytes"]
    assert allocated_labels == used["10"]  # the same series identity as NVML's reading of it
    assert series(metrics, "gpuwarden_process_gpu_memory_allocated_bytes", pid="20") == []  # no hook
    sample_at(ring, 31)  # the hook stopped speaking: its series go with the next snapshot
    assert "gpuwarden_process_gpu_memory_allocated_bytes" not in scrape(registry)


def test_hook_counters_exist_at_zero_and_count_fresh_processes(ring: SnapshotRing) -> None:
    registry, _ = build_registry(ring, backend="scripted", node="node-a")
    readings = HookReadings()
    clock = [ORIGIN]
    hook = HookMetrics(registry, readings, lambda: clock[0])
    metrics = scrape(registry)
    assert series(metrics, "gpuwarden_agent_hook_messages_total") == [0.0]
    assert {labels["reason"]: v for labels, v in metrics["gpuwarden_agent_hook_refused_total"]} == {
        reason: 0.0 for reason in HOOK_REFUSALS
    }
    assert series(metrics, "gpuwarden_agent_hook_processes") == [0.0]
    message = parse_message(f'{{"v": 1, "timestamp": {ORIGIN}}}')
    readings.put(HookReading(pid=10, uid=0, message=message, received_at=ORIGIN))
    hook.accepted()
    hook.refused("rate")
    metrics = scrape(registry)
    assert series(metrics, "gpuwarden_agent_hook_messages_total") == [1.0]
    assert series(metrics, "gpuwarden_agent_hook_refused_total", reason="rate") == [1.0]
    assert series(metrics, "gpuwarden_agent_hook_processes") == [1.0]
    clock[0] = ORIGIN + 61
    assert series(scrape(registry), "gpuwarden_agent_hook_processes") == [0.0]


def test_promtool_accepts_the_exposition_with_hooks(ring: SnapshotRing) -> None:
    registry, _ = build_registry(ring, backend="scripted", node="node-a")
    HookMetrics(registry, HookReadings(), lambda: ORIGIN).refused("malformed")
    hooked(ring, 30)
    result = subprocess.run(
        [promtool(), "check", "metrics"], input=generate_latest(registry), capture_output=True, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert b"gpuwarden_process_gpu_memory_allocated_bytes{" in generate_latest(registry)

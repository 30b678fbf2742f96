"""GPU health in the agent: the XID event thread and the per-sample readings (against a fake pynvml),
the scripted xid/ecc/throttle pieces, and the health series on /metrics.

The fake adds NVML's event API to test_nvml_states' fake: ``nvmlEventSetWait`` blocks on a queue
(for 50 ms at most) as NVML blocks on the driver, and raises NVML_ERROR_TIMEOUT when nothing came.
That real NVML answers so is tests/gpu/test_agent_gpu.py's job (no XID can be injected there).
"""

from __future__ import annotations

import queue
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from promtool_support import promtool
from test_agent_metrics import scrape, series
from test_nvml_states import GPU_IS_LOST, NOT_SUPPORTED, NOW, FakeDevice, FakeNvml, FakeNVMLError

from gpuwarden.agent.health import XID_CRITICAL_ERROR, clock_event_reasons
from gpuwarden.agent.metrics import build_registry
from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.agent.scripted import ScriptedBackend
from gpuwarden.agent.snapshots import SnapshotRing
from gpuwarden.sim.scenario import ScenarioError, parse_scenario
from gpuwarden.wire.node import ClockEventReason, DeviceState, Snapshot

TIMEOUT = 10
HW_SLOWDOWN, HW_THERMAL = 0x08, 0x40


@dataclass
class HealthDevice(FakeDevice):
    supported_events: int = XID_CRITICAL_ERROR | 0x2
    ecc_aggregate: int = 3
    rows: tuple[int, int, int, int] = (2, 1, 0, 0)  # correctable, uncorrectable, pending, failed
    clock_reasons: int = 0
    health_errors: dict[str, int] = field(default_factory=dict)


@dataclass
class EventData:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


class EventNvml(FakeNvml):
    """FakeNvml with NVML's event API and the health readings."""

    NVML_ERROR_TIMEOUT = 10
    NVML_AGGREGATE_ECC = 1

    def __init__(self, devices: list[FakeDevice]) -> None:
        super().__init__(devices)
        self.events: queue.Queue[EventData] = queue.Queue()
        self.waiting = threading.Event()
        self.sets_alive = 0
        self.registered: list[tuple[str, int]] = []

    def _health(self, name: str, d: HealthDevice) -> None:
        self._call(name, d)
        if name in d.health_errors:
            raise FakeNVMLError(d.health_errors[name])

    def nvmlEventSetCreate(self) -> object:
        self.sets_alive += 1
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.sets_alive -= 1

    def nvmlDeviceGetSupportedEventTypes(self, d: HealthDevice) -> int:
        return d.supported_events

    def nvmlDeviceRegisterEvents(self, d: HealthDevice, types: int, event_set: object) -> None:
        self.registered.append((d.uuid, types))

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> EventData:
        if self.events.empty():
            self.waiting.set()  # everything raised so far was taken
        try:
            # At most 50 ms, not the whole timeout: stopping the thread then takes no longer than that.
            return self.events.get(timeout=min(timeout_ms / 1000, 0.05))
        except queue.Empty:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT) from None

    def raise_xid(self, device: Any, code: int) -> None:
        """The driver raises an XID; returns once the event thread took it."""
        self.waiting.clear()
        self.events.put(EventData(device, XID_CRITICAL_ERROR, code))
        assert self.waiting.wait(TIMEOUT), "the event thread did not take the XID"

    def nvmlDeviceGetTotalEccErrors(self, d: FakeDevice, kind: int, counter: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors", d)
        return d.ecc if counter == 0 else getattr(d, "ecc_aggregate", 0)

    def nvmlDeviceGetRemappedRows(self, d: HealthDevice) -> tuple[int, int, int, int]:
        self._health("nvmlDeviceGetRemappedRows", d)
        return d.rows

    def nvmlDeviceGetRetiredPages(self, d: HealthDevice, cause: int) -> list[int]:
        self._health("nvmlDeviceGetRetiredPages", d)
        return [0x1000, 0x2000]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, d: HealthDevice) -> int:
        self._health("nvmlDeviceGetRetiredPagesPendingStatus", d)
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, d: HealthDevice) -> int:
        self._health("nvmlDeviceGetCurrentClocksEventReasons", d)
        return d.clock_reasons


def hgpu(n: int, **kwargs: Any) -> HealthDevice:
    return HealthDevice(uuid=f"GPU-{n:08d}-0000-0000-0000-000000000000", **kwargs)


def opened(devices: list[FakeDevice]) -> tuple[NvmlBackend, EventNvml]:
    fake = EventNvml(devices)
    backend = NvmlBackend(nvml=fake, proc_root=Path("/nonexistent"))
    backend.open()
    return backend, fake


@pytest.fixture
def backend_of() -> Any:
    opened_backends: list[NvmlBackend] = []

    def open_(devices: list[FakeDevice]) -> tuple[NvmlBackend, EventNvml]:
        backend, fake = opened(devices)
        opened_backends.append(backend)
        return backend, fake

    yield open_
    for backend in opened_backends:
        backend.close()


# -- NVML ---------------------------------------------------------------------------------------


def test_clock_event_reasons_are_named_and_unknown_bits_left_out() -> None:
    assert clock_event_reasons(HW_SLOWDOWN | HW_THERMAL | 0x400) == [
        ClockEventReason.HW_SLOWDOWN,
        ClockEventReason.HW_THERMAL_SLOWDOWN,
    ]
    assert clock_event_reasons(0) == []


def test_memory_errors_and_clock_events_are_read_with_each_sample(backend_of: Any) -> None:
    device = hgpu(0, clock_reasons=0x20 | 0x01, ecc=1)  # idle and software thermal slowdown
    backend, _ = backend_of([device])
    (sample,) = backend.sample_devices(NOW)
    health = sample.health
    assert health is not None
    assert sample.ecc_uncorrected == 1  # volatile, as before
    assert health.ecc_uncorrected_aggregate == 3
    assert (health.remapped_rows_uncorrectable, health.row_remap_pending, health.row_remap_failed) == (
        1,
        False,
        False,
    )
    assert (health.retired_pages_double_bit, health.retired_pages_pending) == (2, False)
    assert health.clock_event_reasons == [ClockEventReason.GPU_IDLE, ClockEventReason.SW_THERMAL_SLOWDOWN]
    assert health.xids == []


def test_unsupported_health_readings_are_absent_and_not_asked_again(backend_of: Any) -> None:
    # Hopper has no page retirement (row remapping replaced it): NVML says NOT_SUPPORTED.
    device = hgpu(
        0,
        health_errors={
            "nvmlDeviceGetRetiredPages": NOT_SUPPORTED,
            "nvmlDeviceGetRetiredPagesPendingStatus": NOT_SUPPORTED,
        },
    )
    backend, fake = backend_of([device])
    for t in range(3):
        (sample,) = backend.sample_devices(NOW + t)
        assert sample.state is DeviceState.OK
        assert sample.health is not None
        assert sample.health.retired_pages_double_bit is None
        assert sample.health.retired_pages_pending is None
    assert fake.count("nvmlDeviceGetRetiredPages") == 1


def test_a_gpu_lost_while_reading_health_is_lost(backend_of: Any) -> None:
    device = hgpu(0)
    backend, _ = backend_of([device])
    device.health_errors["nvmlDeviceGetCurrentClocksEventReasons"] = GPU_IS_LOST
    (sample,) = backend.sample_devices(NOW)
    assert sample.state is DeviceState.LOST
    assert sample.health is None


def test_an_xid_rides_the_next_sample_of_its_gpu_once(backend_of: Any) -> None:
    first, second = hgpu(0), hgpu(1)
    backend, fake = backend_of([first, second])
    assert backend.xids is not None
    assert backend.xids.running
    assert fake.registered == [(first.uuid, XID_CRITICAL_ERROR), (second.uuid, XID_CRITICAL_ERROR)]
    fake.raise_xid(second, 13)
    fake.raise_xid(second, 43)
    a, b = backend.sample_devices(NOW)
    assert a.health is not None
    assert a.health.xids == []
    assert b.health is not None
    assert [x.code for x in b.health.xids] == [13, 43]
    assert all(x.timestamp > 0 for x in b.health.xids)
    a, b = backend.sample_devices(NOW + 1)
    assert b.health is not None
    assert b.health.xids == []


def test_the_xid_of_a_gpu_that_fell_off_the_bus_rides_its_lost_entry(backend_of: Any) -> None:
    device = hgpu(0)
    backend, fake = backend_of([device])
    device.errors["nvmlDeviceGetUtilizationRates"] = GPU_IS_LOST
    fake.raise_xid(device, 79)
    (sample,) = backend.sample_devices(NOW)
    assert sample.state is DeviceState.LOST
    assert sample.health is not None
    assert [x.code for x in sample.health.xids] == [79]


def test_xids_go_on_the_gpus_own_entry_not_its_mig_devices(backend_of: Any) -> None:
    mig = FakeDevice(uuid="MIG-aaaa", gpu_instance_id=1)
    parent = hgpu(0, mig_mode=1, migs={0: mig})
    backend, fake = backend_of([parent])
    fake.raise_xid(parent, 48)
    whole, part = backend.sample_devices(NOW)
    assert (whole.mig_id, part.mig_id) == (None, "MIG-aaaa")
    assert whole.health is not None
    assert [x.code for x in whole.health.xids] == [48]
    assert part.health is None  # device-wide readings are the GPU's


def test_a_gpu_without_xid_events_is_noted_and_the_others_get_theirs(backend_of: Any) -> None:
    without, with_ = hgpu(0, supported_events=0x2), hgpu(1)
    backend, fake = backend_of([without, with_])
    assert backend.xids is not None
    assert backend.xids.notes == {without.uuid: "not supported by this GPU", with_.uuid: "registered"}
    fake.raise_xid(with_, 79)
    _, b = backend.sample_devices(NOW)
    assert b.health is not None
    assert [x.code for x in b.health.xids] == [79]


def test_no_gpu_with_xid_events_means_no_thread(backend_of: Any) -> None:
    backend, fake = backend_of([hgpu(0, supported_events=0)])
    assert backend.xids is not None
    assert not backend.xids.running
    assert fake.sets_alive == 0


def test_close_stops_the_event_thread_before_nvml_shuts_down() -> None:
    backend, fake = opened([hgpu(0)])
    watcher = backend.xids
    assert watcher is not None
    assert watcher.running
    backend.close()
    assert not watcher.running
    assert fake.sets_alive == 0
    assert fake.shut_down


# -- scripted -----------------------------------------------------------------------------------

UUID = "GPU-00000000-0000-4000-8000-000000000000"


def scripted(health: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "health",
        "duration": "5m",
        "gpus": [
            {
                "uuid": UUID,
                "memoryTotal": "80Gi",
                "utilization": [{"kind": "idle", "level": 50}],
                "memory": [{"kind": "idle", "level": "10Gi"}],
                "health": health,
            }
        ],
        "pods": [{"namespace": "ml", "name": "job-0", "gpus": [UUID], "processes": [{"pid": 7}]}],
    }


def test_scripted_ecc_and_throttle_hold_from_their_at_until_the_next() -> None:
    scenario = parse_scenario(
        scripted(
            [
                {"kind": "ecc", "at": "10s", "uncorrected": 2, "remappedRows": 1, "remapPending": True},
                {"kind": "throttle", "at": "20s", "reasons": ["hwThermalSlowdown", "swPowerCap"]},
                {"kind": "throttle", "at": "30s", "reasons": []},
                {"kind": "ecc", "at": "40s", "uncorrected": 2, "remapFailed": True},
            ]
        )
    )

    def at(t: float) -> Any:
        (sample,) = scenario.gpu_samples(t)
        return sample

    assert at(9).ecc_uncorrected == 0
    assert at(9).health.row_remap_pending is False
    assert at(10).ecc_uncorrected == 2
    assert at(10).health.ecc_uncorrected_aggregate == 2
    assert (at(10).health.remapped_rows_uncorrectable, at(10).health.row_remap_pending) == (1, True)
    assert at(19).health.clock_event_reasons == []
    assert at(25).health.clock_event_reasons == [
        ClockEventReason.HW_THERMAL_SLOWDOWN,
        ClockEventReason.SW_POWER_CAP,
    ]
    assert at(30).health.clock_event_reasons == []
    assert (at(40).health.row_remap_pending, at(40).health.row_remap_failed) == (False, True)


def test_scripted_xids_ride_exactly_one_sample_however_it_is_sampled() -> None:
    spec = scripted(
        [
            {"kind": "xid", "at": "0s", "code": 13},
            {"kind": "xid", "at": "5s", "code": 79},
            {"kind": "lost", "at": "5s"},
            {"kind": "xid", "at": "5500ms", "code": 45},
        ]
    )
    origin = 1_000.0
    backend = ScriptedBackend(parse_scenario(spec), origin=origin)
    backend.open()
    seen: list[tuple[float, int, float, str]] = []
    for t in (0.0, 1.0, 4.2, 5.0, 5.9, 7.0, 8.0):  # irregular, as a late tick makes it
        (sample,) = backend.sample_devices(origin + t)
        for xid in sample.health.xids if sample.health is not None else ():
            seen.append((t, xid.code, xid.timestamp, sample.state.value))
    assert seen == [
        (0.0, 13, origin, "ok"),
        (5.0, 79, origin + 5, "lost"),
        (5.9, 45, origin + 5.5, "lost"),
    ]


def test_an_unknown_throttle_reason_is_refused_with_its_field() -> None:
    with pytest.raises(ScenarioError, match=r"gpus\.0\.health\.0\.throttle\.reasons\.0"):
        parse_scenario(scripted([{"kind": "throttle", "at": "0s", "reasons": ["tooHot"]}]))


# -- /metrics -----------------------------------------------------------------------------------


def test_health_series_and_xid_counts_on_metrics() -> None:
    spec = scripted(
        [
            {"kind": "xid", "at": "1s", "code": 48},
            {"kind": "ecc", "at": "1s", "uncorrected": 1, "remapPending": True},
            {"kind": "throttle", "at": "2s", "reasons": ["hwSlowdown"]},
            {"kind": "xid", "at": "3s", "code": 48},
        ]
    )
    scenario = parse_scenario(spec)
    backend = ScriptedBackend(scenario, origin=1_000.0)
    backend.open()
    ring = SnapshotRing()
    registry, metrics = build_registry(ring, backend="scripted", node="n")
    for t in range(5):
        snapshot = scenario.annotate(
            Snapshot(timestamp=1_000.0 + t, gpus=backend.sample_devices(1_000.0 + t)), t
        )
        ring.append(snapshot)
        metrics.count_xids(snapshot)
    scraped = scrape(registry)
    gpu = {"uuid": UUID, "index": "0"}
    assert series(scraped, "gpuwarden_gpu_xid_errors_total", **gpu, xid="48") == [2.0]
    pod = {**gpu, "namespace": "ml", "pod": "job-0"}
    assert series(scraped, "gpuwarden_gpu_clock_event_active", **pod, reason="hwSlowdown") == [1.0]
    assert series(scraped, "gpuwarden_gpu_clock_event_active", **pod, reason="swPowerCap") == [0.0]
    assert len(series(scraped, "gpuwarden_gpu_clock_event_active", **pod)) == 9  # every reason, a state set
    assert series(scraped, "gpuwarden_gpu_ecc_uncorrected_aggregate_errors_total", **pod) == [1.0]
    assert series(scraped, "gpuwarden_gpu_memory_repair_pending", **pod, mechanism="row_remap") == [1.0]
    assert series(scraped, "gpuwarden_gpu_row_remap_failed", **pod) == [0.0]
    assert series(scraped, "gpuwarden_gpu_remapped_rows", **pod, cause="uncorrectable") == [0.0]
    assert series(scraped, "gpuwarden_gpu_retired_pages", **pod) == []  # not read: no series, never 0
    result = subprocess.run(
        [promtool(), "check", "metrics"], input=generate_latest(registry), capture_output=True, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()

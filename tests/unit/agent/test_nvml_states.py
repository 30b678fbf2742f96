"""The NVML backend's mapping of NVML answers to samples, against a fake pynvml module.

This checks the mapping only (errors → states, units, MIG, GPM pairing, per-process
timestamps); that the real NVML answers as assumed is tests/gpu/test_agent_gpu.py's job.
The fake has pynvml's names and NVML's error codes (nvml.h).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.agent.backend import BackendError
from gpuwarden.agent.nvml import NvmlBackend, nvml_mig_devices, nvml_minor_numbers
from gpuwarden.wire.node import DeviceState, GpuSample, merge_process_utilization

SUCCESS = 0
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIBRARY_NOT_FOUND = 12
UNKNOWN = 999

GIB = 2**30
NOW = 1_800_000_000.0


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class UtilSample:
    pid: int
    timeStamp: int
    smUtil: int


@dataclass
class FakeDevice:
    uuid: str
    name: str = "NVIDIA H200"
    util: int = 42
    used: int = 10 * GIB
    total: int = 141 * GIB
    temperature: int = 51
    power_mw: int = 123_456
    clock: int = 1980
    ecc: int = 0
    procs: list[Proc] = field(default_factory=list)
    util_samples: list[UtilSample] = field(default_factory=list)
    mps_procs: list[Proc] = field(default_factory=list)
    mig_mode: int | None = None  # None: not MIG-capable
    migs: dict[int, FakeDevice] = field(default_factory=dict)
    gpu_instance_id: int = 0
    minor: int = 0
    gi_profile_id: int = 0
    placement_start: int = 0
    gpm: bool = True
    gpm_values: dict[int, float] = field(default_factory=lambda: {2: 61.5, 3: 30.25, 5: 12.0, 10: 48.0})
    gpm_returns: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    """pynvml function name → NVML error code it raises."""


@dataclass
class GpmSample:
    id: int
    device: FakeDevice | None = None
    seq: int = -1


@dataclass
class Metric:
    metricId: int = 0
    nvmlReturn: int = 0
    value: float = 0.0


@dataclass
class MetricsGet:
    version: int = 0
    numMetrics: int = 0
    sample1: Any = None
    sample2: Any = None
    metrics: list[Metric] = field(default_factory=lambda: [Metric() for _ in range(16)])


class FakeNvml:
    """The subset of pynvml the backend uses, with NVML's codes."""

    NVMLError = FakeNVMLError
    NVML_SUCCESS = SUCCESS
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = GPU_IS_LOST
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_SM_OCCUPANCY = 3
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
    NVML_GPM_METRIC_DRAM_BW_UTIL = 10
    nvmlMemory_v2 = 0x02000028
    c_nvmlGpmMetricsGet_t = MetricsGet

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.calls: list[tuple[str, Any]] = []
        self.seq = 0
        self.samples_alive = 0
        self.shut_down = False

    def _call(self, name: str, device: FakeDevice, *args: Any) -> None:
        self.calls.append((name, (device.uuid, *args)))
        if name in device.errors:
            raise FakeNVMLError(device.errors[name])

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlErrorString(self, code: int) -> str:
        return f"error {code}"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        device = self.devices[index]
        self._call("nvmlDeviceGetHandleByIndex", device)
        return device

    def nvmlDeviceGetUUID(self, d: FakeDevice) -> str:
        self._call("nvmlDeviceGetUUID", d)
        return d.uuid

    def nvmlDeviceGetName(self, d: FakeDevice) -> bytes:
        self._call("nvmlDeviceGetName", d)
        return d.name.encode()  # old pynvml answered bytes

    def nvmlDeviceGetUtilizationRates(self, d: FakeDevice) -> Any:
        self._call("nvmlDeviceGetUtilizationRates", d)
        return type("Utilization", (), {"gpu": d.util, "memory": 0})()

    def nvmlDeviceGetMemoryInfo(self, d: FakeDevice, version: int | None = None) -> Any:
        self._call("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", d)
        # v1's "used" includes the driver's reserved memory; v2's does not
        used = d.used if version else d.used + GIB // 2
        return type("Memory", (), {"used": used, "total": d.total})()

    def nvmlDeviceGetTemperature(self, d: FakeDevice, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature", d)
        return d.temperature

    def nvmlDeviceGetPowerUsage(self, d: FakeDevice) -> int:
        self._call("nvmlDeviceGetPowerUsage", d)
        return d.power_mw

    def nvmlDeviceGetClockInfo(self, d: FakeDevice, clock: int) -> int:
        self._call("nvmlDeviceGetClockInfo", d)
        return d.clock

    def nvmlDeviceGetTotalEccErrors(self, d: FakeDevice, kind: int, counter: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors", d)
        return d.ecc

    def nvmlDeviceGetComputeRunningProcesses(self, d: FakeDevice) -> list[Proc]:
        self._call("nvmlDeviceGetComputeRunningProcesses", d)
        return list(d.procs)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, d: FakeDevice) -> list[Proc]:
        self._call("nvmlDeviceGetMPSComputeRunningProcesses", d)
        return list(d.mps_procs)

    def nvmlDeviceGetProcessUtilization(self, d: FakeDevice, since: int) -> list[UtilSample]:
        self._call("nvmlDeviceGetProcessUtilization", d, since)
        newer = [s for s in d.util_samples if s.timeStamp > since]
        if not newer:
            raise FakeNVMLError(NOT_FOUND)
        return newer

    def nvmlDeviceGetMigMode(self, d: FakeDevice) -> list[int]:
        self._call("nvmlDeviceGetMigMode", d)
        if d.mig_mode is None:
            raise FakeNVMLError(NOT_SUPPORTED)
        return [d.mig_mode, d.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, d: FakeDevice) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, d: FakeDevice, slot: int) -> FakeDevice:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex", d, slot)
        if slot not in d.migs:
            raise FakeNVMLError(NOT_FOUND)
        return d.migs[slot]

    def nvmlDeviceGetGpuInstanceId(self, d: FakeDevice) -> int:
        return d.gpu_instance_id

    def nvmlDeviceGetMinorNumber(self, d: FakeDevice) -> int:
        self._call("nvmlDeviceGetMinorNumber", d)
        return d.minor

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        return next(d for d in self.devices if d.uuid == uuid)

    def nvmlDeviceGetGpuInstanceById(self, d: FakeDevice, gpu_instance_id: int) -> FakeDevice:
        self._call("nvmlDeviceGetGpuInstanceById", d, gpu_instance_id)
        return next(m for m in d.migs.values() if m.gpu_instance_id == gpu_instance_id)

    def nvmlGpuInstanceGetInfo(self, instance: FakeDevice) -> Any:
        placement = type("Placement", (), {"start": instance.placement_start, "size": 1})()
        return type("Info", (), {"profileId": instance.gi_profile_id, "placement": placement})()

    def nvmlGpmQueryDeviceSupport(self, d: FakeDevice) -> Any:
        self._call("nvmlGpmQueryDeviceSupport", d)
        return type("Support", (), {"isSupportedDevice": int(d.gpm)})()

    def nvmlGpmSampleAlloc(self) -> GpmSample:
        self.samples_alive += 1
        return GpmSample(id=self.samples_alive)

    def nvmlGpmSampleFree(self, sample: GpmSample) -> None:
        self.samples_alive -= 1

    def nvmlGpmSampleGet(self, d: FakeDevice, sample: GpmSample) -> GpmSample:
        self._call("nvmlGpmSampleGet", d)
        self.seq += 1
        sample.device, sample.seq = d, self.seq
        return sample

    def nvmlGpmMigSampleGet(self, d: FakeDevice, gpu_instance_id: int, sample: GpmSample) -> GpmSample:
        self._call("nvmlGpmMigSampleGet", d, gpu_instance_id)
        mig = next(m for m in d.migs.values() if m.gpu_instance_id == gpu_instance_id)
        self.seq += 1
        sample.device, sample.seq = mig, self.seq
        return sample

    def nvmlGpmMetricsGet(self, request: MetricsGet) -> MetricsGet:
        first, second = request.sample1, request.sample2
        # What GPM requires: two samples of one device, the older one first.
        assert first is not second
        assert first.device is second.device
        assert first.seq < second.seq
        device = second.device
        for metric in request.metrics[: request.numMetrics]:
            metric.nvmlReturn = device.gpm_returns.get(metric.metricId, SUCCESS)
            metric.value = device.gpm_values.get(metric.metricId, 0.0)
        return request


def gpu(n: int, **kwargs: Any) -> FakeDevice:
    return FakeDevice(uuid=f"GPU-{n:08d}-0000-0000-0000-000000000000", **kwargs)


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cmdline").write_bytes(b"python\0train.py\0--epochs\x003\0")
    return tmp_path


def opened(devices: list[FakeDevice], proc_root: Path | None = None) -> tuple[NvmlBackend, FakeNvml]:
    fake = FakeNvml(devices)
    backend = NvmlBackend(nvml=fake, proc_root=proc_root or Path("/nonexistent"), first_process_window=10.0)
    backend.open()
    return backend, fake


def readings(sample: GpuSample) -> dict[str, Any]:
    return sample.model_dump(exclude={"uuid", "index", "model", "mig_id", "state", "pods", "processes"})


def test_a_healthy_gpu_is_read_in_base_units(proc_root: Path) -> None:
    backend, _ = opened([gpu(0, procs=[Proc(4242, 3 * GIB), Proc(7, None)])], proc_root)
    (sample,) = backend.sample_devices(NOW)
    assert sample.state is DeviceState.OK
    assert sample.model == "NVIDIA H200"
    assert sample.utilization_gpu == 42
    assert sample.memory_used_bytes == 10 * GIB  # v2: without the driver's reserved memory
    assert sample.memory_total_bytes == 141 * GIB
    assert sample.temperature_c == 51
    assert sample.power_watts == pytest.approx(123.456)  # NVML answers milliwatts
    assert sample.sm_clock_mhz == 1980
    assert sample.ecc_uncorrected == 0
    first, second = sample.processes
    assert (first.pid, first.used_memory_bytes) == (4242, 3 * GIB)
    assert first.command == "python train.py --epochs 3"
    assert first.sm_util is None  # read at its own rate, merged by the loop
    assert (second.pid, second.used_memory_bytes, second.command) == (7, None, "")


def test_not_supported_leaves_the_field_empty_and_is_not_asked_again() -> None:
    backend, fake = opened([gpu(0, errors={"nvmlDeviceGetTemperature": NOT_SUPPORTED})])
    first = backend.sample_devices(NOW)[0]
    second = backend.sample_devices(NOW + 1)[0]
    for sample in (first, second):
        assert sample.state is DeviceState.OK
        assert sample.temperature_c is None
        assert sample.power_watts == pytest.approx(123.456)
    assert fake.count("nvmlDeviceGetTemperature") == 1


@pytest.mark.parametrize(
    "failing",
    [
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlGpmSampleGet",
    ],
)
def test_a_lost_gpu_is_lost_with_no_readings(failing: str) -> None:
    device = gpu(3)
    backend, _ = opened([device])
    backend.sample_devices(NOW)
    device.errors[failing] = GPU_IS_LOST
    (sample,) = backend.sample_devices(NOW + 1)
    assert sample.state is DeviceState.LOST
    assert (sample.uuid, sample.index, sample.model) == (device.uuid, 0, "NVIDIA H200")
    assert all(value is None for value in readings(sample).values()), readings(sample)
    assert sample.processes == []


@pytest.mark.parametrize("code", [UNKNOWN, NO_PERMISSION])
def test_an_unclassified_error_makes_the_state_unknown_and_the_field_empty(code: int) -> None:
    backend, _ = opened([gpu(0, errors={"nvmlDeviceGetPowerUsage": code})])
    (sample,) = backend.sample_devices(NOW)
    assert sample.state is DeviceState.UNKNOWN
    assert sample.power_watts is None  # never 0.0
    assert sample.utilization_gpu == 42  # what could be read still is


def test_a_gpu_that_cannot_be_enumerated_is_reported_lost_not_dropped() -> None:
    backend, _ = opened([gpu(0), gpu(1, errors={"nvmlDeviceGetUUID": GPU_IS_LOST})])
    first, second = backend.sample_devices(NOW)
    assert first.state is DeviceState.OK
    assert second.state is DeviceState.LOST
    assert second.index == 1


def test_memory_falls_back_to_v1_on_an_old_driver() -> None:
    backend, fake = opened([gpu(0, errors={"nvmlDeviceGetMemoryInfo_v2": FUNCTION_NOT_FOUND})])
    for t in range(2):
        (sample,) = backend.sample_devices(NOW + t)
        assert sample.state is DeviceState.OK
        assert sample.memory_used_bytes == 10 * GIB + GIB // 2
    assert fake.count("nvmlDeviceGetMemoryInfo_v2") == 1


def test_open_fails_with_a_backend_error_when_nvml_cannot_start() -> None:
    backend = NvmlBackend(nvml=FakeNvml([], init_error=LIBRARY_NOT_FOUND))
    with pytest.raises(BackendError, match="NVML failed to initialise"):
        backend.open()


def test_open_fails_when_there_is_no_gpu() -> None:
    fake = FakeNvml([])
    with pytest.raises(BackendError, match="no GPUs"):
        NvmlBackend(nvml=fake).open()
    assert fake.shut_down


def test_gpm_needs_two_samples_then_reports_between_consecutive_ones() -> None:
    backend, fake = opened([gpu(0)])
    assert backend.devices()[0].gpm
    first = backend.sample_devices(NOW)[0]
    assert (first.sm_active, first.sm_occupancy, first.tensor_active, first.dram_active) == (None,) * 4
    for t in range(1, 4):  # the fake asserts each pair is (previous, current) of one device
        sample = backend.sample_devices(NOW + t)[0]
        assert (sample.sm_active, sample.sm_occupancy, sample.tensor_active, sample.dram_active) == (
            61.5,
            30.25,
            12.0,
            48.0,
        )
    backend.close()
    assert fake.samples_alive == 0


def test_gpm_metric_not_supported_is_empty_and_out_of_range_values_are_clamped() -> None:
    device = gpu(0, gpm_returns={5: NOT_SUPPORTED}, gpm_values={2: 100.4, 3: -0.1, 10: float("nan")})
    backend, _ = opened([device])
    backend.sample_devices(NOW)
    sample = backend.sample_devices(NOW + 1)[0]
    assert sample.state is DeviceState.OK
    assert sample.tensor_active is None
    assert sample.sm_active == 100.0
    assert sample.sm_occupancy == 0.0
    assert sample.dram_active is None


def test_no_gpm_on_older_gpus_reads_as_absent() -> None:
    backend, fake = opened([gpu(0, gpm=False, name="NVIDIA A100-SXM4-80GB")])
    info = backend.devices()[0]
    assert not info.gpm
    assert "not supported" in info.gpm_note
    for t in range(3):
        sample = backend.sample_devices(NOW + t)[0]
        assert sample.state is DeviceState.OK
        assert sample.sm_active is None
    assert fake.count("nvmlGpmSampleGet") == 0


def test_gpm_that_refuses_samples_at_start_is_disabled_not_unknown_forever() -> None:
    backend, _ = opened([gpu(0, errors={"nvmlGpmSampleGet": NO_PERMISSION})])
    assert not backend.devices()[0].gpm
    assert "unreadable" in backend.devices()[0].gpm_note
    assert backend.sample_devices(NOW)[0].state is DeviceState.OK


def test_mig_mode_reports_the_gpu_and_each_mig_device() -> None:
    mig_a = FakeDevice(
        uuid="MIG-aaaa", used=5 * GIB, total=17 * GIB, gpu_instance_id=1, procs=[Proc(11, GIB)]
    )
    mig_b = FakeDevice(uuid="MIG-bbbb", used=1 * GIB, total=35 * GIB, gpu_instance_id=2)
    parent = gpu(0, mig_mode=1, migs={0: mig_a, 3: mig_b})
    backend, _ = opened([parent, gpu(1)])
    for t in range(2):
        samples = backend.sample_devices(NOW + t)
        assert [(s.uuid, s.mig_id) for s in samples] == [
            (parent.uuid, None),
            (parent.uuid, "MIG-aaaa"),
            (parent.uuid, "MIG-bbbb"),
            (gpu(1).uuid, None),
        ]
    whole, a, b, other = samples
    # the GPU's own entry: device-wide health; utilization is not defined in MIG mode
    assert whole.utilization_gpu is None
    assert whole.temperature_c == 51
    assert whole.processes == []
    # each MIG device: its memory, its processes, its GPM (per GPU instance)
    assert (a.memory_used_bytes, a.memory_total_bytes) == (5 * GIB, 17 * GIB)
    assert [p.pid for p in a.processes] == [11]
    assert a.temperature_c is None
    assert a.sm_active == 61.5
    assert b.memory_total_bytes == 35 * GIB
    assert all(s.state is DeviceState.OK for s in samples)
    assert other.utilization_gpu == 42


def test_a_disappearing_mig_device_is_dropped_with_its_gpm_buffers() -> None:
    mig_a = FakeDevice(uuid="MIG-aaaa", gpu_instance_id=1)
    parent = gpu(0, mig_mode=1, migs={0: mig_a})
    backend, fake = opened([parent])
    assert len(backend.sample_devices(NOW)) == 2
    alive = fake.samples_alive
    parent.migs.clear()
    # the layout is re-read once a minute, with the mode
    assert [s.mig_id for s in backend.sample_devices(NOW + 61)] == [None]
    assert fake.samples_alive == alive - 2


def test_mig_mode_is_read_once_a_minute_not_every_sample() -> None:
    parent = gpu(0, mig_mode=0)
    backend, fake = opened([parent])
    fake.calls.clear()
    for t in range(0, 121):
        mig_ids = [s.mig_id for s in backend.sample_devices(NOW + t)]
        assert mig_ids == ([None] if t < 120 else [None, "MIG-aaaa"])
        if t == 90:
            parent.mig_mode = 1  # MIG turned on (it takes a GPU reset); seen at the next check
            parent.migs[0] = FakeDevice(uuid="MIG-aaaa", gpu_instance_id=1)
    assert fake.count("nvmlDeviceGetMigMode") == 3  # at 0 s, 60 s and 120 s


def test_process_utilization_continues_from_the_newest_timestamp() -> None:
    us = int(NOW * 1e6)
    device = gpu(0, util_samples=[UtilSample(4242, us - 5_000_000, 40), UtilSample(4242, us - 1_000_000, 60)])
    backend, fake = opened([device])
    assert backend.sample_process_utilization(NOW) == {device.uuid: {4242: 50.0}}
    # NVML returns only samples newer than the timestamp passed; nothing new → no PIDs
    assert backend.sample_process_utilization(NOW + 10) == {device.uuid: {}}
    device.util_samples.append(UtilSample(4242, us + 9_000_000, 99))
    assert backend.sample_process_utilization(NOW + 20) == {device.uuid: {4242: 99.0}}
    passed = [args[1] for name, args in fake.calls if name == "nvmlDeviceGetProcessUtilization"]
    assert passed == [us - 10_000_000, us - 1_000_000, us - 1_000_000]


def test_process_utilization_not_supported_is_skipped_afterwards() -> None:
    device = gpu(0, errors={"nvmlDeviceGetProcessUtilization": NOT_SUPPORTED})
    backend, fake = opened([device])
    assert backend.sample_process_utilization(NOW) == {}
    assert backend.sample_process_utilization(NOW + 10) == {}
    assert fake.count("nvmlDeviceGetProcessUtilization") == 1


def test_a_process_left_out_of_a_good_reading_ran_no_kernel_and_reads_0() -> None:
    # Two processes on one GPU; NVML's per-process reading lists only the one that ran a kernel.
    us = int(NOW * 1e6)
    shared = gpu(0, procs=[Proc(4242, GIB), Proc(7, 8 * GIB)], util_samples=[UtilSample(4242, us - 1, 97)])
    nothing_ran = gpu(1, procs=[Proc(8, GIB)])  # no sample at all: NVML_ERROR_NOT_FOUND
    broken = gpu(2, procs=[Proc(9, GIB)], errors={"nvmlDeviceGetProcessUtilization": UNKNOWN})
    backend, _ = opened([shared, nothing_ran, broken])
    devices = backend.sample_devices(NOW)
    utilization = backend.sample_process_utilization(NOW)
    assert utilization == {shared.uuid: {4242: 97.0}, nothing_ran.uuid: {}}
    merged = merge_process_utilization(devices, utilization)
    assert [[(p.pid, p.sm_util) for p in g.processes] for g in merged] == [
        [(4242, 97.0), (7, 0.0)],  # the idle one beside the busy one: 0%, not unknown
        [(8, 0.0)],
        [(9, None)],  # the reading failed: no data
    ]


def test_process_utilization_is_not_asked_in_mig_mode_and_is_again_once_mig_is_off() -> None:
    mig = FakeDevice(uuid="MIG-aaaa", gpu_instance_id=1, procs=[Proc(11, GIB)])
    parent = gpu(0, mig_mode=1, migs={0: mig})
    backend, fake = opened([parent])
    devices = backend.sample_devices(NOW)
    assert backend.sample_process_utilization(NOW) == {}
    assert fake.count("nvmlDeviceGetProcessUtilization") == 0
    on_mig = merge_process_utilization(devices, {})[1]
    assert [p.sm_util for p in on_mig.processes] == [None]  # no per-process reading on a MIG device
    parent.mig_mode = 0
    backend.sample_devices(NOW + 61)  # the mode is re-read once a minute
    assert backend.sample_process_utilization(NOW + 61) == {parent.uuid: {}}


def test_a_gpu_with_mps_clients_has_no_per_process_reading() -> None:
    # Under MPS the clients' kernels run in the server's context: an absent client is not an idle one.
    us = int(NOW * 1e6)
    mps = gpu(0, procs=[Proc(10, GIB), Proc(11, GIB)], mps_procs=[Proc(10, GIB), Proc(11, GIB)])
    mps.util_samples = [UtilSample(10, us - 1, 90)]
    unsure = gpu(1, procs=[Proc(12, GIB)], errors={"nvmlDeviceGetMPSComputeRunningProcesses": UNKNOWN})
    no_mps = gpu(2, procs=[Proc(13, GIB)], errors={"nvmlDeviceGetMPSComputeRunningProcesses": NOT_SUPPORTED})
    backend, fake = opened([mps, unsure, no_mps])
    devices = backend.sample_devices(NOW)
    utilization = backend.sample_process_utilization(NOW)
    assert utilization == {no_mps.uuid: {}}
    merged = merge_process_utilization(devices, utilization)
    assert [[p.sm_util for p in g.processes] for g in merged] == [[None, None], [None], [0.0]]
    backend.sample_process_utilization(NOW + 10)
    assert fake.count("nvmlDeviceGetMPSComputeRunningProcesses") == 5  # not asked again where unsupported


def test_close_is_idempotent() -> None:
    backend, fake = opened([gpu(0)])
    backend.close()
    backend.close()
    assert fake.shut_down


# -- DRA device names: minor numbers and dynamic MIG placements, as NVIDIA's DRA driver reads them ------


def mig(uuid: str, *, instance: int, profile: int, start: int) -> FakeDevice:
    return FakeDevice(uuid=uuid, gpu_instance_id=instance, gi_profile_id=profile, placement_start=start)


def test_dynamic_mig_placements_are_read_as_the_driver_finds_them() -> None:
    # GPU minor 1 holds two 1g MIG devices (GI profile 19) at placements 0 and 1, and a 2g (14) at 2
    parent = gpu(
        1,
        minor=1,
        mig_mode=1,
        migs={
            0: mig("MIG-a", instance=7, profile=19, start=0),
            1: mig("MIG-b", instance=8, profile=19, start=1),
            3: mig("MIG-c", instance=3, profile=14, start=2),
        },
    )
    other = gpu(0, minor=0, mig_mode=0)
    nvml = FakeNvml([other, parent])

    assert nvml_minor_numbers(nvml) == {0: other.uuid, 1: parent.uuid}
    found = nvml_mig_devices({(1, 19, 1), (1, 14, 2), (1, 19, 4), (0, 19, 0)}, nvml)

    assert found == {
        (1, 19, 1): "MIG-b",
        (1, 14, 2): "MIG-c",
    }  # no device at 19/4; minor 0 is not in MIG mode
    assert nvml.count("nvmlDeviceGetMigDeviceHandleByIndex") == 7  # one walk of the one parent asked about


def test_a_gpu_instance_nvml_will_not_read_leaves_that_device_out_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parent = gpu(1, minor=1, mig_mode=1, migs={0: mig("MIG-a", instance=7, profile=19, start=0)})
    parent.errors["nvmlDeviceGetGpuInstanceById"] = 4  # NVML_ERROR_NO_PERMISSION: no MIG monitor capability

    with caplog.at_level(logging.WARNING):
        assert nvml_mig_devices({(1, 19, 0)}, FakeNvml([parent])) == {}

    assert "cannot read a MIG device" in caplog.text

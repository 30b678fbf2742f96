"""The NVML backend: the only module in gpuwarden that imports ``pynvml``.

Every reading NVML refuses becomes an explicit state, never a zero:

- ``NVML_ERROR_GPU_IS_LOST`` anywhere → the device's ``state`` is ``lost`` and all its
  readings are ``None`` (it fell off the bus; nothing it reports can be trusted);
- ``NVML_ERROR_NOT_SUPPORTED`` → that one field is ``None``; NVML support does not change
  while the driver is loaded, so the call is not made again for that device;
- any other error → the field is ``None`` and the device's ``state`` is ``unknown``.

MIG: a GPU in MIG mode is reported as one entry for the GPU itself (the device-wide
readings: memory, temperature, power, clock, ECC) and one entry per MIG device (its
memory, processes and GPM metrics), ``mig_id`` set to the MIG device's UUID. Pods are
allocated MIG devices, not the parent, so their series land on the MIG entries. MIG
mode and the MIG layout are re-read once a minute, not every sample: the mode query
alone costs ~360 µs on an H200 and changes only with a GPU reset.

GPM (Hopper and later) metrics are rates between two GPM samples: each device keeps
its previous sample, so the first device sample after start has no GPM values and
each later one covers the time since the one before.

Health (XIDs, memory errors, clock events) is :mod:`gpuwarden.agent.health`'s: an
:class:`~gpuwarden.agent.health.XidWatcher` thread from :meth:`NvmlBackend.open` to
:meth:`NvmlBackend.close`, and :func:`~gpuwarden.agent.health.read_health` on each GPU's
own entry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.agent.backend import BackendError
from gpuwarden.agent.health import XidWatcher, read_health, with_xids
from gpuwarden.wire.node import DeviceState, GpuSample, ProcessSample, ProcessUtilization

log = logging.getLogger(__name__)

_GPM_FIELDS: tuple[tuple[str, str], ...] = (
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
)
_MAX_COMMAND = 4096  # ProcessSample.command's limit on the wire


class _GpuLost(Exception):
    """Raised inside one device's sample to abandon it: nothing more can be read."""


@dataclass(slots=True)
class _Gpm:
    """Two GPM sample buffers used alternately, and the metrics request reused each time."""

    samples: tuple[Any, Any]
    request: Any
    next: int = 0
    primed: bool = False  # whether samples[next ^ 1] holds the previous reading


@dataclass(slots=True)
class _Device:
    """One GPU or MIG device as enumerated, with what NVML told us it cannot do."""

    handle: Any
    uuid: str
    index: int
    model: str
    mig_id: str | None = None
    parent_handle: Any = None  # MIG only: the GPU, for nvmlGpmMigSampleGet
    gpu_instance_id: int | None = None
    max_mig_devices: int = 0
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_checked_at: float | None = None
    unsupported: set[str] = field(default_factory=set)
    memory_v2: bool = True
    gpm: _Gpm | None = None
    gpm_note: str = "not probed"
    last_process_timestamp_us: int = 0
    migs: dict[str, _Device] = field(default_factory=dict)
    lost_at_open: bool = False


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What :meth:`NvmlBackend.devices` says about one GPU, for logs, the bench and the GPU test."""

    uuid: str
    index: int
    model: str
    mig_capable: bool
    gpm: bool
    gpm_note: str


class _Reader:
    """Reads the fields of one device for one sample and keeps the device's resulting state."""

    def __init__(self, backend: NvmlBackend, device: _Device) -> None:
        self._backend = backend
        self._device = device
        self.state = DeviceState.OK

    def __call__(self, name: str, fn: Any, *args: Any) -> Any:
        if name in self._device.unsupported:
            return None
        try:
            return fn(*args)
        except self._backend.nvml.NVMLError as exc:
            self.failed(name, exc.value)
            return None

    def failed(self, name: str, code: int) -> None:
        """Map one NVML error code for field ``name`` to a state (or raise :class:`_GpuLost`)."""
        nvml = self._backend.nvml
        if code == nvml.NVML_ERROR_NOT_SUPPORTED:
            self._device.unsupported.add(name)
        elif code == nvml.NVML_ERROR_GPU_IS_LOST:
            raise _GpuLost
        else:
            self.state = DeviceState.UNKNOWN
            self._backend.log_once(self._device, name, code)


def _text(value: Any) -> str:
    # pynvml returned bytes before 11.x and str since; accept both
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _percent(value: Any) -> float | None:
    """A GPM percentage, or None if NVML handed back something that is not one."""
    number = float(value)
    if not math.isfinite(number):
        return None
    # GPM rounding can overshoot the 0..100 range by a hair; the wire schema forbids it
    return min(100.0, max(0.0, number))


class NvmlBackend:
    """Reads every GPU of this host through NVML. See the module docstring for the error mapping.

    ``nvml`` is the pynvml module; tests pass a fake with the same names to check the
    mapping. ``first_process_window`` is how far back the first per-process utilization
    read looks, before there is a previous timestamp to continue from. MIG mode and the
    MIG layout are re-read every ``mig_recheck_seconds`` (reading the mode costs more
    than all the other readings of a GPU together).
    """

    name = "nvml"

    def __init__(
        self,
        *,
        nvml: Any = None,
        proc_root: Path = Path("/proc"),
        first_process_window: float = 10.0,
        mig_recheck_seconds: float = 60.0,
    ) -> None:
        self.nvml: Any = nvml
        self._mig_recheck = mig_recheck_seconds
        self._proc_root = proc_root
        self._first_window = first_process_window
        self._gpus: list[_Device] = []
        self._commands: dict[int, str] = {}
        self._logged: set[tuple[str, str, int]] = set()
        self._open = False
        self.xids: XidWatcher | None = None
        """The XID event thread, while open."""

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Initialise NVML and enumerate the GPUs; :class:`BackendError` if NVML cannot start."""
        if self.nvml is None:
            try:
                self.nvml = _pynvml()
            except ImportError as exc:  # pragma: no cover - a dependency of the package
                raise BackendError(f"cannot import pynvml (nvidia-ml-py): {exc}") from exc
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise BackendError(f"NVML failed to initialise: {exc}") from exc
        self._open = True
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            self.close()
            raise BackendError(f"NVML cannot count the GPUs: {exc}") from exc
        if count == 0:
            self.close()
            raise BackendError("NVML found no GPUs on this host")
        self._gpus = [self._enumerate(index) for index in range(count)]
        self.xids = XidWatcher(nvml)
        self.xids.start((g.uuid, g.handle) for g in self._gpus if not g.lost_at_open)
        for gpu in self._gpus:
            log.info(
                "GPU %d %s (%s): MIG %s, GPM %s",
                gpu.index,
                gpu.uuid,
                gpu.model,
                "capable" if gpu.mig_capable else "no",
                gpu.gpm_note,
            )

    def _enumerate(self, index: int) -> _Device:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            model = _text(nvml.nvmlDeviceGetName(handle))
        except nvml.NVMLError as exc:
            # Keep it, as lost, so that a dead GPU shows up as dead instead of vanishing.
            log.error("GPU %d cannot be enumerated (%s); reporting it as lost", index, exc)
            return _Device(
                handle=None, uuid=f"GPU-unreadable-{index}", index=index, model="", lost_at_open=True
            )
        device = _Device(handle=handle, uuid=uuid, index=index, model=model)
        try:
            nvml.nvmlDeviceGetMigMode(handle)
            device.mig_capable = True
            device.max_mig_devices = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except nvml.NVMLError:
            device.mig_capable = False
        device.gpm, device.gpm_note = self._probe_gpm(handle, None)
        return device

    def _probe_gpm(self, handle: Any, gpu_instance_id: int | None) -> tuple[_Gpm | None, str]:
        """GPM buffers for a device if GPM works there, and a note saying why not otherwise."""
        nvml = self.nvml
        if not hasattr(nvml, "nvmlGpmQueryDeviceSupport"):
            return None, "unavailable (nvidia-ml-py too old)"
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return None, "not supported by this device (GPM needs Hopper or later)"
        except nvml.NVMLError as exc:
            return None, f"not supported ({exc})"
        samples: list[Any] = []
        try:
            samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            gpm = _Gpm(samples=(samples[0], samples[1]), request=self._gpm_request())
            # One trial read: a GPU that advertises GPM but refuses samples (a VM, a
            # profiler holding the counters) would otherwise read as "unknown" forever.
            self._gpm_sample_get(handle, gpu_instance_id, gpm.samples[0])
        except nvml.NVMLError as exc:
            for sample in samples:
                self._free_gpm_sample(sample)
            return None, f"supported but unreadable ({exc})"
        return gpm, "yes"

    def _gpm_request(self) -> Any:
        """A metrics request with what never changes filled in once: only the two samples vary."""
        nvml = self.nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_FIELDS)
        for i, (_, metric) in enumerate(_GPM_FIELDS):
            request.metrics[i].metricId = getattr(nvml, metric)
        return request

    def close(self) -> None:
        """Free GPM buffers and shut NVML down; safe to call twice."""
        if not self._open:
            return
        if self.xids is not None:
            self.xids.stop()  # before nvmlShutdown: its thread waits in NVML
            self.xids = None
        for gpu in self._gpus:
            for device in (gpu, *gpu.migs.values()):
                if device.gpm is not None:
                    for sample in device.gpm.samples:
                        self._free_gpm_sample(sample)
                    device.gpm = None
        self._gpus = []
        self._open = False
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)

    def _free_gpm_sample(self, sample: Any) -> None:
        try:
            self.nvml.nvmlGpmSampleFree(sample)
        except self.nvml.NVMLError as exc:
            log.warning("nvmlGpmSampleFree failed: %s", exc)

    def devices(self) -> list[DeviceInfo]:
        """What was enumerated at :meth:`open`."""
        return [
            DeviceInfo(
                uuid=d.uuid,
                index=d.index,
                model=d.model,
                mig_capable=d.mig_capable,
                gpm=d.gpm is not None,
                gpm_note=d.gpm_note,
            )
            for d in self._gpus
        ]

    def log_once(self, device: _Device, name: str, code: int) -> None:
        """Log an unclassified NVML error once per device, field and code: it repeats every second."""
        key = (device.mig_id or device.uuid, name, code)
        if key in self._logged:
            return
        self._logged.add(key)
        try:
            text = _text(self.nvml.nvmlErrorString(code))
        except Exception:
            text = f"NVML error {code}"
        log.warning("%s: reading %s failed: %s; state unknown", key[0], name, text)

    # -- device samples --------------------------------------------------------------------------

    def sample_devices(self, now: float) -> list[GpuSample]:
        """Read every GPU (and MIG device) once. Never raises for a device's own failure."""
        samples: list[GpuSample] = []
        for gpu in self._gpus:
            samples.extend(self._sample_gpu(gpu, now))
        xids = self.xids.drain() if self.xids is not None else {}
        if xids:
            # On the GPU's own entry (a lost one too: XID 79 is why it is lost), never a MIG device's.
            samples = [
                s
                if s.mig_id is not None or s.uuid not in xids
                else s.model_copy(update={"health": with_xids(s.health, xids[s.uuid])})
                for s in samples
            ]
        live = {p.pid for s in samples for p in s.processes}
        for pid in self._commands.keys() - live:
            del self._commands[pid]
        return samples

    def _lost(self, device: _Device) -> GpuSample:
        if device.gpm is not None:
            device.gpm.primed = False
        return GpuSample(
            uuid=device.uuid,
            index=device.index,
            model=device.model,
            mig_id=device.mig_id,
            state=DeviceState.LOST,
        )

    def _sample_gpu(self, gpu: _Device, now: float) -> list[GpuSample]:
        if gpu.lost_at_open:
            return [self._lost(gpu)]
        read = _Reader(self, gpu)
        try:
            if gpu.mig_capable and (
                gpu.mig_checked_at is None or now - gpu.mig_checked_at >= self._mig_recheck
            ):
                # ~360 µs a call on an H200, seven times all the other readings together, for
                # a mode that changes only with a GPU reset: read once a minute, not every second.
                mode = read("mig_mode", self.nvml.nvmlDeviceGetMigMode, gpu.handle)
                if mode is not None:
                    gpu.mig_enabled = mode[0] == self.nvml.NVML_DEVICE_MIG_ENABLE
                    gpu.mig_checked_at = now
                    self._enumerate_migs(gpu)
            if gpu.mig_enabled:
                parent = self._read_device(gpu, read, per_instance=False)
                return [parent, *self._sample_migs(gpu)]
            return [self._read_device(gpu, read, per_instance=True)]
        except _GpuLost:
            gpu.mig_checked_at = None  # whatever comes back is looked at afresh
            return [self._lost(gpu)]

    def _enumerate_migs(self, gpu: _Device) -> None:
        """Refresh the GPU's MIG devices (none when MIG is off), keeping the state of those that stay."""
        nvml = self.nvml
        seen: set[str] = set()
        for slot in range(gpu.max_mig_devices if gpu.mig_enabled else 0):
            try:
                handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
                mig_uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_NOT_FOUND:
                    continue  # an empty slot: no MIG device was created there
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    raise _GpuLost from None
                self.log_once(gpu, f"mig[{slot}]", exc.value)
                continue
            seen.add(mig_uuid)
            mig = gpu.migs.get(mig_uuid)
            if mig is None:
                mig = _Device(
                    handle=handle,
                    uuid=gpu.uuid,
                    index=gpu.index,
                    model=gpu.model,
                    mig_id=mig_uuid,
                    parent_handle=gpu.handle,
                )
                try:
                    mig.gpu_instance_id = int(nvml.nvmlDeviceGetGpuInstanceId(handle))
                except nvml.NVMLError:
                    mig.gpu_instance_id = None
                if gpu.gpm is not None and mig.gpu_instance_id is not None:
                    mig.gpm, mig.gpm_note = self._probe_gpm(gpu.handle, mig.gpu_instance_id)
                gpu.migs[mig_uuid] = mig
            mig.handle = handle
        for gone in gpu.migs.keys() - seen:
            # The MIG layout changed; drop its GPM buffers with it.
            old = gpu.migs.pop(gone)
            if old.gpm is not None:
                for sample in old.gpm.samples:
                    self._free_gpm_sample(sample)

    def _sample_migs(self, gpu: _Device) -> list[GpuSample]:
        out: list[GpuSample] = []
        for mig in gpu.migs.values():
            read = _Reader(self, mig)
            try:
                out.append(self._read_device(mig, read, per_instance=True))
            except _GpuLost:
                out.append(self._lost(mig))
        return out

    def _read_device(self, device: _Device, read: _Reader, *, per_instance: bool) -> GpuSample:
        """Read one device. ``per_instance`` is False for a MIG-mode GPU's own entry."""
        nvml = self.nvml
        handle = device.handle
        is_mig = device.mig_id is not None
        fields: dict[str, Any] = {}

        if not is_mig and per_instance:
            # nvmlDeviceGetUtilizationRates is not supported on MIG devices nor in MIG mode
            rates = read("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
            fields["utilization_gpu"] = None if rates is None else float(rates.gpu)

        memory = self._read_memory(device, read)
        if memory is not None:
            fields["memory_used_bytes"] = int(memory.used)
            fields["memory_total_bytes"] = int(memory.total)

        if not is_mig:
            temperature = read(
                "temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
            )
            fields["temperature_c"] = None if temperature is None else float(temperature)
            milliwatts = read("power", nvml.nvmlDeviceGetPowerUsage, handle)
            fields["power_watts"] = None if milliwatts is None else milliwatts / 1000.0
            fields["sm_clock_mhz"] = read("sm_clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            fields["ecc_uncorrected"] = read(
                "ecc_uncorrected",
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            fields["health"] = read_health(nvml, handle, read)

        processes: list[ProcessSample] = []
        if per_instance:
            running = read("processes", nvml.nvmlDeviceGetComputeRunningProcesses, handle)
            for proc in running or ():
                used = getattr(proc, "usedGpuMemory", None)
                processes.append(
                    ProcessSample(
                        pid=int(proc.pid),
                        used_memory_bytes=None if used is None else int(used),
                        command=self._command(int(proc.pid)),
                    )
                )
            fields.update(self._read_gpm(device, read))

        return GpuSample(
            uuid=device.uuid,
            index=device.index,
            model=device.model,
            mig_id=device.mig_id,
            state=read.state,
            processes=processes,
            **fields,
        )

    def _read_memory(self, device: _Device, read: _Reader) -> Any:
        nvml = self.nvml
        if "memory" in device.unsupported:
            return None
        if device.memory_v2 and hasattr(nvml, "nvmlMemory_v2"):
            try:
                # v2 separates the driver's reserved memory from "used", as nvidia-smi shows it
                return nvml.nvmlDeviceGetMemoryInfo(device.handle, version=nvml.nvmlMemory_v2)
            except nvml.NVMLError as exc:
                if exc.value not in (nvml.NVML_ERROR_FUNCTION_NOT_FOUND, nvml.NVML_ERROR_NOT_SUPPORTED):
                    read.failed("memory", exc.value)
                    return None
            device.memory_v2 = False  # an older driver: fall back to v1 for good
        return read("memory", nvml.nvmlDeviceGetMemoryInfo, device.handle)

    def _gpm_sample_get(self, handle: Any, gpu_instance_id: int | None, sample: Any) -> None:
        if gpu_instance_id is None:
            self.nvml.nvmlGpmSampleGet(handle, sample)
        else:
            self.nvml.nvmlGpmMigSampleGet(handle, gpu_instance_id, sample)

    def _read_gpm(self, device: _Device, read: _Reader) -> dict[str, float | None]:
        gpm = device.gpm
        if gpm is None or "gpm" in device.unsupported:
            return {}
        nvml = self.nvml
        current = gpm.samples[gpm.next]
        handle = device.handle if device.mig_id is None else device.parent_handle
        try:
            self._gpm_sample_get(handle, device.gpu_instance_id, current)
        except nvml.NVMLError as exc:
            gpm.primed = False
            read.failed("gpm", exc.value)
            return {}
        if not gpm.primed:
            # The first of two samples: nothing to compare with yet, so no values (not zeros).
            gpm.primed = True
            gpm.next ^= 1
            return {}
        previous = gpm.samples[gpm.next ^ 1]
        gpm.next ^= 1
        request = gpm.request
        request.sample1 = previous
        request.sample2 = current
        try:
            nvml.nvmlGpmMetricsGet(request)
        except nvml.NVMLError as exc:
            read.failed("gpm", exc.value)
            return {}
        out: dict[str, float | None] = {}
        for i, (name, _) in enumerate(_GPM_FIELDS):
            metric = request.metrics[i]
            if metric.nvmlReturn != nvml.NVML_SUCCESS:
                read.failed(f"gpm.{name}", metric.nvmlReturn)
                out[name] = None
            else:
                out[name] = _percent(metric.value)
        return out

    def _command(self, pid: int) -> str:
        command = self._commands.get(pid)
        if command is None:
            try:
                raw = (self._proc_root / str(pid) / "cmdline").read_bytes()
                command = raw.replace(b"\0", b" ").strip().decode(errors="replace")[:_MAX_COMMAND]
            except OSError:
                command = ""  # gone already, or a PID from another PID namespace (no hostPID)
            self._commands[pid] = command
        return command

    # -- per-process utilization -----------------------------------------------------------------

    def _has_mps_clients(self, gpu: _Device) -> bool:
        """Whether processes run on ``gpu`` through MPS (asked at the per-process rate, not per sample)."""
        nvml = self.nvml
        if "mps" in gpu.unsupported or not hasattr(nvml, "nvmlDeviceGetMPSComputeRunningProcesses"):
            return False
        try:
            return bool(nvml.nvmlDeviceGetMPSComputeRunningProcesses(gpu.handle))
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                gpu.unsupported.add("mps")
                return False
            if exc.value != nvml.NVML_ERROR_GPU_IS_LOST:
                self.log_once(gpu, "mps_processes", exc.value)
            # Unknown: not trusting the per-process reading cannot call a busy client idle.
            return True

    def sample_process_utilization(self, now: float) -> ProcessUtilization:
        """SM utilization per PID since the previous call, from nvmlDeviceGetProcessUtilization.

        About 2 ms a GPU on an H200, hence its own, lower rate. NVML returns only samples
        newer than the timestamp passed, so each GPU keeps the newest it has seen, and
        only processes that ran a kernel since then: a GPU whose reading succeeded is a
        key even when no PID is listed (``NVML_ERROR_NOT_FOUND`` is that answer: nothing
        ran), and its processes that are not listed ran nothing. A GPU that could not be
        read is left out: no data. MIG devices have no per-process reading (the call is
        not made for a GPU in MIG mode, nor marked unsupported for it, so that it is read
        again once MIG is off); their processes keep ``sm_util`` at ``None``. Neither
        does a GPU with MPS clients: their kernels run in the MPS server's context, and
        whose SM time NVML then lists is not something to read an idle client from.
        """
        nvml = self.nvml
        out: ProcessUtilization = {}
        for gpu in self._gpus:
            if gpu.lost_at_open or gpu.mig_enabled or "process_utilization" in gpu.unsupported:
                continue
            if self._has_mps_clients(gpu):
                continue
            since = gpu.last_process_timestamp_us or int((now - self._first_window) * 1e6)
            try:
                samples = nvml.nvmlDeviceGetProcessUtilization(gpu.handle, since)
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_NOT_FOUND:
                    out[gpu.uuid] = {}  # a good reading: no process ran a kernel since `since`
                elif exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    gpu.unsupported.add("process_utilization")
                elif exc.value != nvml.NVML_ERROR_GPU_IS_LOST:  # the device sample reports that
                    self.log_once(gpu, "process_utilization", exc.value)
                continue
            sums: dict[int, list[float]] = {}
            newest = since
            for sample in samples:
                stamp = int(sample.timeStamp)
                if stamp <= since:
                    continue
                newest = max(newest, stamp)
                sums.setdefault(int(sample.pid), []).append(float(sample.smUtil))
            gpu.last_process_timestamp_us = newest
            # Several samples of one PID in the window: their mean is the window's utilization.
            out[gpu.uuid] = {pid: min(100.0, sum(v) / len(v)) for pid, v in sums.items()}
        return out


# -- DRA device names ----------------------------------------------------------------------------
# NVIDIA's DRA driver names a GPU by its minor number and a dynamic MIG device by its parent's minor,
# its GPU instance profile and placement; these read both the way the driver does. They run on the
# event loop between the backend's open and close (NVML is initialised) and only for names that the
# ResourceSlices do not resolve. NVML's failures leave entries out rather than raise: the devices are
# then counted unresolved, and the other GPUs' claims still resolve.


def nvml_minor_numbers(nvml: Any = None) -> dict[int, str]:
    """Every GPU's minor number (``/dev/nvidia<minor>``) → UUID."""
    nvml = nvml or _pynvml()
    found: dict[int, str] = {}
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as e:
        log.warning("NVML cannot count GPUs for DRA device names (%s)", e)
        return found
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        except nvml.NVMLError as e:
            log.warning("NVML cannot read GPU %d's minor number for DRA device names (%s)", index, e)
            continue
        found[minor] = uuid
    return found


def nvml_mig_devices(
    wanted: Collection[tuple[int, int, int]], nvml: Any = None
) -> dict[tuple[int, int, int], str]:
    """The MIG UUIDs of the (parent minor, GPU instance profile ID, placement start) asked for that exist.

    Each parent's MIG devices are walked once: a MIG device's GPU instance ID, that instance's
    profile ID and placement (``nvmlGpuInstanceGetInfo``), then its UUID. Reading a GPU instance needs
    the MIG monitor capability (``/proc/driver/nvidia/capabilities/mig/monitor``) inside a container.
    """
    nvml = nvml or _pynvml()
    found: dict[tuple[int, int, int], str] = {}
    parents = {minor for minor, _, _ in wanted}
    for minor, uuid in nvml_minor_numbers(nvml).items():
        if minor not in parents:
            continue
        try:
            parent = nvml.nvmlDeviceGetHandleByUUID(uuid)
            current, _pending = nvml.nvmlDeviceGetMigMode(parent)
            enabled = current == nvml.NVML_DEVICE_MIG_ENABLE
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent)) if enabled else 0
        except nvml.NVMLError as e:
            log.warning("NVML cannot read GPU %s's MIG mode for DRA device names (%s)", uuid, e)
            continue
        for slot in range(slots):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
            except nvml.NVMLError:
                continue  # an empty slot
            try:
                instance = nvml.nvmlDeviceGetGpuInstanceById(parent, nvml.nvmlDeviceGetGpuInstanceId(mig))
                info = nvml.nvmlGpuInstanceGetInfo(instance)
                placement = (minor, int(info.profileId), int(info.placement.start))
                if placement in wanted:
                    found[placement] = _text(nvml.nvmlDeviceGetUUID(mig))
            except nvml.NVMLError as e:
                log.warning("NVML cannot read a MIG device of GPU %s for DRA device names (%s)", uuid, e)
    return found


def _pynvml() -> Any:
    # The one import of pynvml in gpuwarden; a contract in pyproject.toml keeps it so.
    import pynvml

    return pynvml

"""What the sampling loop needs from a source of GPU readings.

Two backends implement :class:`DeviceBackend`: :class:`gpuwarden.agent.nvml.NvmlBackend`
(the real devices) and :class:`gpuwarden.agent.scenario.ScriptedBackend` (a scenario
file, for demos and end-to-end tests). The loop never knows which one it drives, and
the agent picks one only from an explicit flag.

Both are synchronous and may block for milliseconds (per-process utilization costs
about 2 ms a GPU on an H200), so the loop calls them off the event loop.
"""

from __future__ import annotations

from typing import Protocol

from gpuwarden.wire.node import GpuSample

ProcessUtilization = dict[str, dict[int, float]]
"""Per-process SM utilization (percent) by device key (see :func:`device_key`), then by PID.

A device is a key only when its reading succeeded; its PIDs are those that ran a kernel in
the window (NVML lists no other), so an empty dict is a good reading: nothing ran. A device
that is not a key was not read (unsupported, as on MIG devices; failed; lost).
"""


class BackendError(RuntimeError):
    """The backend could not start (no driver, no devices, an unreadable scenario)."""


def device_key(sample: GpuSample) -> str:
    """The identity of one sampled device: the MIG device's UUID, or the GPU's when not MIG."""
    return sample.mig_id or sample.uuid


def merge_process_utilization(gpus: list[GpuSample], utilization: ProcessUtilization) -> list[GpuSample]:
    """Set ``sm_util`` on each process of the devices a per-process reading covers.

    On a device the reading covers, a process it does not list ran no kernel in the window:
    its ``sm_util`` is 0, not unknown (a process that holds memory and computes nothing,
    beside a busy one, is the waste to find). Processes of a device the reading does not
    cover keep ``None``: no data.
    """
    out = []
    for gpu in gpus:
        by_pid = utilization.get(device_key(gpu))
        if by_pid is None or not gpu.processes:
            out.append(gpu)
            continue
        processes = [p.model_copy(update={"sm_util": by_pid.get(p.pid, 0.0)}) for p in gpu.processes]
        out.append(gpu.model_copy(update={"processes": processes}))
    return out


class DeviceBackend(Protocol):
    """A source of device readings; one instance per agent process, driven from one thread."""

    name: str
    """Short name for logs and the ``backend`` label: ``nvml`` or ``scripted``."""

    def open(self) -> None:
        """Initialise and enumerate devices; raise :class:`BackendError` if nothing can be read."""

    def sample_devices(self, now: float) -> list[GpuSample]:
        """Read every device once, at ``now`` (seconds since the epoch).

        Device-level failures are reported as states and ``None`` fields in the
        samples, never raised; ``pods`` and ``ProcessSample.pod`` are left empty
        for the attributor. ``sm_util`` of processes is left ``None``: it comes
        from :meth:`sample_process_utilization`, at its own, lower rate.
        """

    def sample_process_utilization(self, now: float) -> ProcessUtilization:
        """Per-process SM utilization since the previous call (or a short window on the first).

        One key per device whose reading succeeded, listing the PIDs that ran a kernel in
        the window (see :data:`ProcessUtilization`); a device that could not be read is left out.
        """

    def close(self) -> None:
        """Release what :meth:`open` took; safe to call twice."""

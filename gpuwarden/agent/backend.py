"""What the sampling loop needs from a source of GPU readings.

Two backends implement :class:`DeviceBackend`: :class:`gpuwarden.agent.nvml.NvmlBackend`
(the real devices) and :class:`gpuwarden.agent.scripted.ScriptedBackend` (a scenario
file, for demos and end-to-end tests). The loop never knows which one it drives, and
the agent picks one only from an explicit flag.

Both are synchronous and may block for milliseconds (per-process utilization costs
about 2 ms a GPU on an H200), so the loop calls them off the event loop.
"""

from __future__ import annotations

from typing import Protocol

from gpuwarden.wire.node import GpuSample, ProcessUtilization


class BackendError(RuntimeError):
    """The backend could not start (no driver, no devices, an unreadable scenario)."""


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

        One key per device whose reading succeeded, listing the PIDs that ran a kernel in the
        window (see :data:`~gpuwarden.wire.node.ProcessUtilization`); a device that could not be
        read is left out.
        """

    def close(self) -> None:
        """Release what :meth:`open` took; safe to call twice."""

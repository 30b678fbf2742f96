"""Put what the training hooks said on the snapshot: ``ProcessSample.hook`` on each hooked process.

:func:`attach_hook` is the pure core: the snapshot, the readings by PID (from
:class:`~gpuwarden.agent.hooksocket.HookReadings`) and a time in, the snapshot with hooks out.
:class:`HookStage` is the sampler's stage around it: it also refuses the readings of PIDs that NVML
lists on no GPU (``unknownProcess``), so a process without a GPU cannot keep an entry.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwarden.agent.hooksocket import MAX_AGE, HookEvents, HookReading, HookReadings
from gpuwarden.wire.node import GpuSample, HookSample, Snapshot, device_key


def hook_sample(reading: HookReading, gpu: GpuSample) -> HookSample:
    """What a reading says about its process on ``gpu``: that device's allocator numbers (when the
    message names it, by its UUID or MIG UUID), and the process's host memory and sites."""
    device = next((d for d in reading.message.devices if d.uuid == device_key(gpu)), None)
    return HookSample(
        timestamp=reading.read_at,
        step=reading.message.step,
        allocated_bytes=device.allocated_bytes if device else None,
        reserved_bytes=device.reserved_bytes if device else None,
        max_allocated_bytes=device.max_allocated_bytes if device else None,
        host_rss_bytes=reading.message.host_rss_bytes,
        host_limit_bytes=reading.message.host_limit_bytes,
        sites=reading.message.sites,
    )


def attach_hook(
    snapshot: Snapshot, readings: Mapping[int, HookReading], now: float, *, max_age: float = MAX_AGE
) -> Snapshot:
    """``snapshot`` with ``hook`` set on every process entry whose PID has a reading no older than
    ``max_age`` at ``now``; the input is not changed. A process NVML does not list gets nothing."""
    fresh = {pid: r for pid, r in readings.items() if now - r.read_at <= max_age}
    if not fresh:
        return snapshot
    gpus = []
    for gpu in snapshot.gpus:
        if not any(p.pid in fresh for p in gpu.processes):
            gpus.append(gpu)
            continue
        processes = [
            p.model_copy(update={"hook": hook_sample(fresh[p.pid], gpu)}) if p.pid in fresh else p
            for p in gpu.processes
        ]
        gpus.append(gpu.model_copy(update={"processes": processes}))
    return snapshot.model_copy(update={"gpus": gpus})


class HookStage:
    """The sampler's hook stage: attaches the fresh readings, after the attributor.

    A reading that arrived before the snapshot was taken, from a PID that the snapshot lists on no
    GPU, is refused (``unknownProcess``) and forgotten: that process's next message is judged afresh.
    """

    def __init__(self, readings: HookReadings, events: HookEvents) -> None:
        self._readings = readings
        self._events = events

    def annotate(self, snapshot: Snapshot) -> Snapshot:
        """The snapshot with hooks attached (its timestamp is the ``now`` readings are aged at)."""
        now = snapshot.timestamp
        fresh = self._readings.fresh(now)
        listed = {p.pid for gpu in snapshot.gpus for p in gpu.processes}
        for pid, reading in list(fresh.items()):
            if pid not in listed and reading.received_at <= now:
                self._readings.drop(pid)
                del fresh[pid]
                self._events.refused("unknownProcess")
        return attach_hook(snapshot, fresh, now, max_age=self._readings.max_age)

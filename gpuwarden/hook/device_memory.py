"""Readers of the CUDA caching allocator's figures, behind one protocol.

:class:`TorchMemory` reads torch's allocator; :class:`ScriptedMemory` plays given readings, for tests
and CI where there is no GPU. Each is chosen explicitly: a job without torch gets neither (the hook
then sends host memory and allocation sites only, and logs so once).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from gpuwarden.hook.message import DeviceMemory


class MemoryReader(Protocol):
    """Reads the allocator's figures for every CUDA device the process uses."""

    def read(self) -> Sequence[DeviceMemory]:
        """One entry per device in use; empty before CUDA is initialised."""
        ...


def nvml_uuid(raw: str, device_name: str) -> str:
    """A device's UUID as NVML spells it, from torch's ``get_device_properties(i).uuid``.

    torch prints the 16 bytes CUDA gives without NVML's prefix (seen on an H200, torch 2.11:
    ``0870f3d2-3202-f058-8615-020988542741``, which nvidia-smi calls ``GPU-0870f3d2-…``). For a
    MIG instance CUDA gives the instance's own UUID, and its name says ``MIG`` (``NVIDIA H100 80GB
    HBM3 MIG 1g.10gb``), so it becomes ``MIG-…``; any other device ``GPU-…``. A prefixed UUID is kept.
    """
    raw = raw.strip()
    if raw.startswith(("GPU-", "MIG-")):
        return raw
    prefix = "MIG-" if " MIG " in f" {device_name} " else "GPU-"
    return prefix + raw


class TorchMemory:
    """``torch.cuda.memory_stats``' allocated, reserved and peak allocated bytes of each device in use.

    A device counts as used once the allocator reserved memory on it, or it is the current device;
    nothing is read (and no CUDA context is created) before the job initialised CUDA itself. One
    ``memory_stats`` per device, not ``memory_allocated``, ``memory_reserved`` and
    ``max_memory_allocated`` (each of which builds the whole flattened statistics dict again).
    """

    def __init__(self) -> None:
        import torch  # the job's own torch: the hook needs it only here

        self._cuda: Any = torch.cuda
        self._uuids: dict[int, str] = {}

    def _uuid(self, index: int) -> str:
        if index not in self._uuids:
            props = self._cuda.get_device_properties(index)
            self._uuids[index] = nvml_uuid(str(props.uuid), str(props.name))
        return self._uuids[index]

    def read(self) -> list[DeviceMemory]:
        """The figures of each device in use (see the class doc)."""
        cuda = self._cuda
        if not cuda.is_initialized():
            return []
        current = cuda.current_device()
        readings = []
        for index in range(cuda.device_count()):
            stats = cuda.memory_stats(index)
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            if reserved == 0 and index != current:
                continue
            readings.append(
                DeviceMemory(
                    uuid=self._uuid(index),
                    allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
                    reserved_bytes=reserved,
                    max_allocated_bytes=int(stats.get("allocated_bytes.all.peak", 0)),
                )
            )
        return readings


class ScriptedMemory:
    """Plays readings in order, one per :meth:`read`, then repeats the last (none: no devices).

    ``readings`` may be a generator, e.g. a leak computed from a step counter.
    """

    def __init__(self, readings: Iterable[Sequence[DeviceMemory]]) -> None:
        self._readings: Iterator[Sequence[DeviceMemory]] = iter(readings)
        self._last: Sequence[DeviceMemory] = ()

    def read(self) -> Sequence[DeviceMemory]:
        """The next scripted reading."""
        for reading in itertools.islice(self._readings, 1):
            self._last = reading
        return self._last

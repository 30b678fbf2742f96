"""The hook's line on the wire (docs/hook.md, hook protocol version 1): one JSON object per reading.

Plain dataclasses and :mod:`json`, not the pydantic models of :mod:`gpuwarden.wire.node`: the hook runs
inside the training job and imports nothing beyond the standard library. The agent validates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 64 * 1024
"""The agent refuses longer lines."""
MAX_DEVICES = 64
MAX_SITES = 16
MAX_FILE_CHARS = 1024
"""``AllocationSite.file`` is at most this long; a longer path keeps its end (the file's own name)."""


@dataclass(frozen=True)
class DeviceMemory:
    """The caching allocator's figures for one CUDA device; ``None`` where not read."""

    uuid: str
    """As NVML spells it: ``GPU-…`` or ``MIG-…``."""
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None


@dataclass(frozen=True)
class Site:
    """A line of the training code whose live allocations grew since the first snapshot."""

    file: str
    line: int
    size_bytes: int
    growth_bytes: int
    count: int


@dataclass(frozen=True)
class Reading:
    """What the hook read at one instant. ``sites`` is ``None`` when tracemalloc is off."""

    timestamp: float
    step: int | None = None
    devices: tuple[DeviceMemory, ...] = ()
    host_rss_bytes: int | None = None
    host_limit_bytes: int | None = None
    """The memory limit the process runs under (its cgroup's, else the node's memory)."""
    sites: tuple[Site, ...] | None = field(default=None)


def _device(d: DeviceMemory) -> dict[str, Any]:
    out: dict[str, Any] = {"uuid": d.uuid}
    for key, value in (
        ("allocatedBytes", d.allocated_bytes),
        ("reservedBytes", d.reserved_bytes),
        ("maxAllocatedBytes", d.max_allocated_bytes),
    ):
        if value is not None:
            out[key] = value
    return out


def _site(s: Site) -> dict[str, Any]:
    return {
        "file": s.file[-MAX_FILE_CHARS:],
        "line": s.line,
        "sizeBytes": s.size_bytes,
        "growthBytes": s.growth_bytes,
        "count": s.count,
    }


def encode_line(reading: Reading) -> bytes:
    """One protocol line, newline included: camelCase, optional fields left out, within the limits.

    Sites are dropped, smallest growth first, should the line exceed :data:`MAX_LINE_BYTES` (it
    cannot with 16 sites of 1024-character paths, but the agent's limit must hold whatever the paths).
    """
    message: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "timestamp": float(reading.timestamp),
        "devices": [_device(d) for d in reading.devices[:MAX_DEVICES]],
    }
    if reading.step is not None:
        message["step"] = reading.step
    if reading.host_rss_bytes is not None:
        message["hostRssBytes"] = reading.host_rss_bytes
    if reading.host_limit_bytes is not None:
        message["hostLimitBytes"] = reading.host_limit_bytes
    sites = None if reading.sites is None else [_site(s) for s in reading.sites[:MAX_SITES]]
    while True:
        if sites is not None:
            message["sites"] = sites
        line = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        if len(line) <= MAX_LINE_BYTES or not sites:
            return line
        sites = sites[:-1]

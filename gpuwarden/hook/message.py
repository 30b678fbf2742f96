"""The hook's line on the wire (docs/hook.md, hook protocol version 1): one JSON object per reading.

Plain dataclasses and :mod:`json`, not the pydantic models of :mod:`gpuwarden.wire.node`: the hook runs
inside the training job and imports nothing beyond the standard library. The agent validates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
REQUESTS_VERSION = 1
"""The version of the agent's requests (``record``, ``snapshot``) this hook answers, announced in each
message as ``requests`` when the job opted in (docs/hook.md, "Requests")."""
MAX_LINE_BYTES = 64 * 1024
"""The agent refuses longer lines."""
MAX_DEVICES = 64
MAX_SITES = 16
MAX_ANSWERS = 8
MAX_REASON_CHARS = 256
MAX_ANSWER_SITES = 3
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
    """A line of the training code whose live allocations grew since the first snapshot.

    ``gpu``: the live GPU bytes of the blocks allocated at this line (the allocator's history),
    not host objects (tracemalloc); ``growth_per_minute`` is then their growth since recording began.
    """

    file: str
    line: int
    size_bytes: int
    growth_bytes: int
    count: int
    gpu: bool = False
    growth_per_minute: int | None = None


@dataclass(frozen=True)
class Answer:
    """The hook's answer to one of the agent's requests (``status`` ``ok`` or ``refused``)."""

    id: int
    status: str
    reason: str | None = None
    """Why refused (``noTorch``, ``noCuda``, ``alreadyRecording``, ``capReached``, …), or what failed."""
    file: str | None = None
    """``snapshot``: the file written, as the job sees it."""
    size_bytes: int | None = None
    sites: tuple[Site, ...] = ()
    """``snapshot``: its top GPU lines."""


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
    requests: int | None = None
    """The request version this hook answers; None: it takes no requests (not opted in)."""
    answers: tuple[Answer, ...] = ()


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
    out: dict[str, Any] = {
        "file": s.file[-MAX_FILE_CHARS:],
        "line": s.line,
        "sizeBytes": s.size_bytes,
        "growthBytes": s.growth_bytes,
        "count": s.count,
    }
    if s.gpu:
        out["memory"] = "gpu"
    if s.growth_per_minute is not None:
        out["growthBytesPerMinute"] = s.growth_per_minute
    return out


def _answer(a: Answer) -> dict[str, Any]:
    out: dict[str, Any] = {"id": a.id, "status": a.status}
    if a.reason is not None:
        out["reason"] = a.reason[:MAX_REASON_CHARS]
    if a.file is not None:
        out["file"] = a.file[-MAX_FILE_CHARS:]
    if a.size_bytes is not None:
        out["sizeBytes"] = a.size_bytes
    if a.sites:
        out["sites"] = [_site(s) for s in a.sites[:MAX_ANSWER_SITES]]
    return out


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
    if reading.requests is not None:
        message["requests"] = reading.requests
    if reading.answers:
        message["answers"] = [_answer(a) for a in reading.answers[:MAX_ANSWERS]]
    sites = None if reading.sites is None else [_site(s) for s in reading.sites[:MAX_SITES]]
    while True:
        if sites is not None:
            message["sites"] = sites
        line = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        if len(line) <= MAX_LINE_BYTES or not sites:
            return line
        sites = sites[:-1]

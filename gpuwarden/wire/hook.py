"""The hook protocol (version 1): one line a training hook writes to the agent's socket.

The wire format is fixed in docs/hook.md; :func:`parse_message` parses one line as strictly as
:mod:`gpuwarden.wire.node` parses a report: JSON types as declared, camelCase names only, nothing
unknown, every number bounded, ``v`` exactly 1. A message carries no PID and no pod: the agent
knows the writer from the socket (``SO_PEERCRED``), never from what it writes.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator, model_validator

from gpuwarden.wire.base import MAX_COUNT, MAX_TIMESTAMP, Bytes, WireModel, parse_strict
from gpuwarden.wire.node import AllocationSite, HookAnswerBody

PROTOCOL_VERSION = 1
REQUESTS_VERSION = 1
"""The version of the requests this agent writes to a hook (docs/hook.md, "Requests")."""
MAX_LINE_BYTES = 64 * 1024
"""A line longer than this (its newline not counted) ends the connection."""
MAX_DEVICES = 64
MAX_SITES = 16
MAX_ANSWERS = 8


class _Message(WireModel):
    # camelCase only: a snake_case spelling is an unknown field, refused like any other.
    model_config = ConfigDict(validate_by_name=False)


class HookDevice(_Message):
    """The caching allocator's numbers for one CUDA device of the process."""

    uuid: str = Field(min_length=1, max_length=128)
    """As NVML spells it: ``GPU-…``, or ``MIG-…`` for a MIG instance."""
    allocated_bytes: Bytes | None = None
    reserved_bytes: Bytes | None = None
    max_allocated_bytes: Bytes | None = None


class HookAnswer(_Message, HookAnswerBody):
    """The hook's answer to one request of the agent's, carried by its next message."""

    id: int = Field(ge=0, le=MAX_COUNT)


class HookMessage(_Message):
    """One reading of the hook (docs/hook.md, "Messages")."""

    v: int
    """The protocol version; only :data:`PROTOCOL_VERSION` is accepted."""
    timestamp: float = Field(gt=0, le=MAX_TIMESTAMP)
    step: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    devices: list[HookDevice] = Field(default_factory=list, max_length=MAX_DEVICES)
    host_rss_bytes: Bytes | None = None
    host_limit_bytes: Bytes | None = None
    sites: list[AllocationSite] = Field(default_factory=list, max_length=MAX_SITES)
    requests: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """The request version the hook answers; None: it takes none (an older hook, or not opted in)."""
    answers: list[HookAnswer] = Field(default_factory=list, max_length=MAX_ANSWERS)

    @field_validator("v")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(f"version {v} is not supported; this agent speaks {PROTOCOL_VERSION}")
        return v

    @model_validator(mode="after")
    def _one_entry_per_device(self) -> HookMessage:
        uuids = [d.uuid for d in self.devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError("devices: a uuid appears twice")
        return self


class MessageError(ValueError):
    """A line that is not a valid hook message; the message names the field."""


def parse_message(line: bytes | str) -> HookMessage:
    """Parse one line strictly; raise :class:`MessageError` naming the first offending field."""
    # by_name=False reaches the nested sites too (wire.node's models take both spellings).
    return parse_strict(HookMessage, line, MessageError, top="line", by_name=False)

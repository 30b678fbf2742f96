"""Kubernetes' times as text: RFC 3339, read and written in one place.

Kubernetes writes two forms: ``metav1.Time`` (whole seconds, ``2026-12-03T08:00:00Z``: status
times, Node conditions, an Event's first and last timestamps) and ``metav1.MicroTime`` (microseconds:
a Lease's ``renewTime``, an Event's ``eventTime``). Both are UTC with ``Z``. Readers accept any
RFC 3339 time (``Z`` or an offset); one without an offset is read as UTC, and text that does not
parse is None rather than an error, since these come from objects others may have edited.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["format_micro_time", "format_time", "parse_epoch", "parse_time"]


def format_time(epoch: float) -> str:
    """A ``metav1.Time``: UTC, whole seconds, ``Z``."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(epoch: float) -> str:
    """A ``metav1.MicroTime``: UTC, microseconds, ``Z``."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: object) -> datetime | None:
    """An RFC 3339 time as an aware datetime (UTC when it has no offset), or None when it does not parse."""
    if not isinstance(text, str):
        return None
    try:
        when = datetime.fromisoformat(text)  # accepts "Z" since Python 3.11
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def parse_epoch(text: object) -> float | None:
    """Epoch seconds of an RFC 3339 time, or None when it does not parse."""
    when = parse_time(text)
    return None if when is None else when.timestamp()

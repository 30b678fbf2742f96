"""gpuwarden.accounting: GPU-seconds allocated, used and idle, per pod and GPU. Pure: no I/O, no clock.

:class:`Ledger` integrates the readings the operator stores (or local mode reads) into per-subject
totals; :func:`devices_of` says what the ledger needs of each GPU entry of a snapshot (its model,
its share of the GPU when it is a MIG slice, who holds it). The rules are in :mod:`.ledger`'s doc
and in docs/accounting.md. The operator's adapter (``gpuwarden.operator.accounting``) labels the
totals by workload and exports them as counters; ``gpuwarden report`` and ``gpuwarden watch`` read
them.
"""

from gpuwarden.accounting.ledger import (
    CARRY_SECONDS,
    DEFAULT_IDLE_FLOOR,
    MIG_FALLBACK_FRACTION,
    Bound,
    Device,
    Ledger,
    Pod,
    Subject,
    Usage,
    devices_of,
    observe_snapshot,
    usage_lines,
)

__all__ = [
    "CARRY_SECONDS",
    "DEFAULT_IDLE_FLOOR",
    "MIG_FALLBACK_FRACTION",
    "Bound",
    "Device",
    "Ledger",
    "Pod",
    "Subject",
    "Usage",
    "devices_of",
    "observe_snapshot",
    "usage_lines",
]

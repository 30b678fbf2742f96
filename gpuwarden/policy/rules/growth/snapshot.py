"""When a growth finding's process is to be asked for an allocator snapshot: the one rule that
``gpuwarden watch`` (:mod:`gpuwarden.local.suspicion`) and the operator (:mod:`gpuwarden.operator.suspicion`)
both follow (docs/hook.md, "Requests").

Once a ``memoryGrowth`` finding starts, the process's hook is asked to record the allocator's history;
a snapshot is worth taking once the card is full within the rule's ``snapshotBefore`` (16m by default:
when the finding's reason becomes :data:`~.model.IMMINENT_REASON`) and the history has run
:data:`MIN_RECORDING_S`, so that the file holds the leak's own blocks; or at once when the card is full
within :data:`LAST_CHANCE_S`, whatever the history: after the crash there is none. Host memory's
findings call for none: the GPU allocator's snapshot does not hold host memory.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwarden.policy.rules.growth.model import (
    HOST_IMMINENT_REASON,
    HOST_LEAK_REASON,
    IMMINENT_SECONDS,
    MemoryGrowth,
)

__all__ = ["LAST_CHANCE_S", "MIN_RECORDING_S", "snapshot_before", "snapshot_due"]

MIN_RECORDING_S = 30.0
"""How long the history runs before an imminent leak's snapshot is taken: the blocks allocated before
recording began carry no line, so a snapshot at once would say little."""
LAST_CHANCE_S = 60.0
"""Full within this long, the snapshot is taken whatever the history."""


def snapshot_due(
    reason: str, seconds_to_full: float | None, recorded_for: float | None, before: float | None = None
) -> bool:
    """Whether a growth finding (its ``reason`` and ``seconds_to_full``) calls for its snapshot now;
    ``recorded_for``: how long the process's history has run (None: it does not record); ``before``:
    its rule's ``snapshotBefore`` in seconds (None: the default, :data:`~.model.IMMINENT_SECONDS`)."""
    if reason in (HOST_LEAK_REASON, HOST_IMMINENT_REASON) or seconds_to_full is None:
        return False
    if seconds_to_full <= LAST_CHANCE_S:
        return True
    horizon = IMMINENT_SECONDS if before is None else before
    return seconds_to_full <= horizon and recorded_for is not None and recorded_for >= MIN_RECORDING_S


def snapshot_before(rules: Iterable[object]) -> dict[str, float]:
    """Each memoryGrowth rule's ``snapshotBefore`` (seconds), by the rule's name."""
    return {r.name: r.snapshot_before_seconds for r in rules if isinstance(r, MemoryGrowth)}

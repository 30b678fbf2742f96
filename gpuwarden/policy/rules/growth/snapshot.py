"""When a growth finding's process is to be asked for an allocator snapshot: the one rule that
``gpuwarden watch`` (:mod:`gpuwarden.local.suspicion`) and the operator (:mod:`gpuwarden.operator.suspicion`)
both follow (docs/hook.md, "Requests").

Once a ``memoryGrowth`` finding starts, the process's hook is asked to record the allocator's history;
a snapshot is worth taking once the leak is imminent (reason :data:`~.model.IMMINENT_REASON`: the
card full within :data:`~.model.IMMINENT_SECONDS`) and the history has run :data:`MIN_RECORDING_S`,
so that the file holds the leak's own blocks; or at once when the card is full within
:data:`LAST_CHANCE_S`, whatever the history: after the crash there is none.
"""

from __future__ import annotations

from gpuwarden.policy.rules.growth.model import IMMINENT_REASON

__all__ = ["LAST_CHANCE_S", "MIN_RECORDING_S", "snapshot_due"]

MIN_RECORDING_S = 30.0
"""How long the history runs before an imminent leak's snapshot is taken: the blocks allocated before
recording began carry no line, so a snapshot at once would say little."""
LAST_CHANCE_S = 60.0
"""Full within this long, the snapshot is taken whatever the history."""


def snapshot_due(reason: str, seconds_to_full: float | None, recorded_for: float | None) -> bool:
    """Whether a growth finding (its ``reason`` and ``seconds_to_full``) calls for its snapshot now;
    ``recorded_for``: how long the process's history has run (None: it does not record)."""
    if seconds_to_full is not None and seconds_to_full <= LAST_CHANCE_S:
        return True
    return reason == IMMINENT_REASON and recorded_for is not None and recorded_for >= MIN_RECORDING_S

"""Which replica acts: peering (one acts), or sharded mode (each acts on its share of the ring).

What the rest of the operator imports (only from here): :class:`Leadership` (peering; not sharded,
the one shard of one) and :class:`Sharding` (sharded mode: membership, the ring, the report route),
the verdict exchange between shards (:class:`VerdictIngest`, :class:`VerdictSender`) and the
owner's board of the verdicts received (:class:`VerdictBoard`, :func:`pod_verdicts`).
"""

from gpuwarden.operator.sharding.board import VerdictBoard, pod_verdicts
from gpuwarden.operator.sharding.exchange import VerdictIngest, VerdictSender
from gpuwarden.operator.sharding.leadership import Leadership
from gpuwarden.operator.sharding.shard import Sharding

__all__ = [
    "Leadership",
    "Sharding",
    "VerdictBoard",
    "VerdictIngest",
    "VerdictSender",
    "pod_verdicts",
]

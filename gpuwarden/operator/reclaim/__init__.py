"""``actions.reclaim``: giving an idle workload's GPUs back, with a warning, a grace period and an undo.

What the rest of the operator imports (only from here): the :class:`Reclaimer` the composition root
plugs in over a :class:`KubeReclaimApi`, its :class:`ReclaimResult` and the :data:`RECLAIM_ACTIVE`
condition type; and the workload marks ``gpuwarden restore`` reads (:func:`restore_patch`).
"""

from gpuwarden.operator.reclaim.api import KubeReclaimApi, Owner, path_of
from gpuwarden.operator.reclaim.marks import KINDS, restore_patch
from gpuwarden.operator.reclaim.reclaimer import RECLAIM_ACTIVE, Reclaimer, ReclaimResult

__all__ = [
    "KINDS",
    "RECLAIM_ACTIVE",
    "KubeReclaimApi",
    "Owner",
    "ReclaimResult",
    "Reclaimer",
    "path_of",
    "restore_patch",
]

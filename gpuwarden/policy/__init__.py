"""gpuwarden.policy: the policy engine. Pure: no I/O, no clock (``now`` is passed in), deterministic.

Feed samples into a :class:`SeriesStore` (:func:`points_from_report` attributes a
node report's readings to pods), keep one :class:`PolicyEvaluator` per policy,
and call :meth:`PolicyEvaluator.evaluate` with the pods and ``now``: it returns
an :class:`Evaluation` with the findings' transitions.
"""

from gpuwarden.policy.engine import (
    SNOOZE_PREFIX,
    Evaluation,
    PodView,
    PolicyEvaluator,
    evaluate_rule,
    horizon_seconds,
    rule_kind,
    snoozed_until,
)
from gpuwarden.policy.findings import (
    Finding,
    FindingKey,
    FindingState,
    FindingTracker,
    FindingTransition,
    Resolution,
    Transition,
)
from gpuwarden.policy.rules.common import Outcome, RuleKind, WindowParams
from gpuwarden.policy.store.intake import (
    PROCESS_NAMESPACE,
    points_from_processes,
    points_from_report,
    points_from_snapshot,
    process_subject,
)
from gpuwarden.policy.store.series import (
    BYTES_PER_POINT,
    Column,
    PodId,
    Point,
    SeriesKey,
    SeriesStore,
    StoreStats,
    UtilizationSource,
    Window,
)

__all__ = [
    "BYTES_PER_POINT",
    "PROCESS_NAMESPACE",
    "SNOOZE_PREFIX",
    "Column",
    "Evaluation",
    "Finding",
    "FindingKey",
    "FindingState",
    "FindingTracker",
    "FindingTransition",
    "Outcome",
    "PodId",
    "PodView",
    "Point",
    "PolicyEvaluator",
    "Resolution",
    "RuleKind",
    "SeriesKey",
    "SeriesStore",
    "StoreStats",
    "Transition",
    "UtilizationSource",
    "Window",
    "WindowParams",
    "evaluate_rule",
    "horizon_seconds",
    "points_from_processes",
    "points_from_report",
    "points_from_snapshot",
    "process_subject",
    "rule_kind",
    "snoozed_until",
]

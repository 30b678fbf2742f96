"""The pods' own metrics on the operator's side (issue 30): the plan each node's agent gets in the
answer to its reports, and each policy's ``ServiceMetricsAvailable`` condition.

What the rest of the operator imports (only from here): the plan (:func:`plan_node`, its inputs
:class:`ServicePolicy` and :class:`ServicePod`, and the indexes' records of a policy and a pod,
:func:`service_policy` and :func:`service_pod`), and the condition (:func:`availability`,
:data:`AVAILABLE`).
"""

from gpuwarden.operator.scrape.condition import AVAILABLE, availability
from gpuwarden.operator.scrape.plan import (
    NodePlan,
    ServicePod,
    ServicePolicy,
    plan_node,
    service_pod,
    service_policy,
)

__all__ = [
    "AVAILABLE",
    "NodePlan",
    "ServicePod",
    "ServicePolicy",
    "availability",
    "plan_node",
    "service_pod",
    "service_policy",
]

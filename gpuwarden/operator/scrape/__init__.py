"""The pods' own metrics on the operator's side (issue 30): the plan each node's agent gets in the
answer to its reports, and the outcomes behind each policy's ``ServiceMetricsAvailable`` condition.

What the rest of the operator imports (only from here): the plan (:func:`plan_node`, its inputs
:class:`ServicePolicy` and :class:`ServicePod` and the pod index's record of a pod, :func:`service_pod`),
the :class:`ScrapeBook` of outcomes and the condition built from it (:func:`availability`,
:data:`AVAILABLE`).
"""

from gpuwarden.operator.scrape.book import AVAILABLE, Outcome, ScrapeBook, availability
from gpuwarden.operator.scrape.plan import NodePlan, ServicePod, ServicePolicy, plan_node, service_pod

__all__ = [
    "AVAILABLE",
    "NodePlan",
    "Outcome",
    "ScrapeBook",
    "ServicePod",
    "ServicePolicy",
    "availability",
    "plan_node",
    "service_pod",
]

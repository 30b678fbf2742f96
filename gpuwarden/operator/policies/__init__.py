"""One policy's evaluation loop and what it writes: Events, status; and which pods are indexed.

What the rest of the operator imports (only from here): :class:`PolicyRunner` (the loop a policy's
daemon runs), :class:`RunnerParts` (what every runner is given), and the pod index's filter and
record (:func:`requests_gpu`, :func:`pod_record`).
"""

from gpuwarden.operator.policies.pods import pod_record, requests_gpu
from gpuwarden.operator.policies.runner import PolicyRunner, RunnerParts

__all__ = ["PolicyRunner", "RunnerParts", "pod_record", "requests_gpu"]

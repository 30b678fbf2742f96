"""The operator's accounting (issue 31): GPU-seconds allocated, used and idle per workload, as counters.

What the rest of the operator imports (only from here): :class:`AccountingBook` (fed by the ingest,
collected by ``/metrics``, run as a background task), the :class:`OwnerResolver` it resolves pods
with, :class:`AccountingSettings` (the ``--accounting-*`` flags), and :func:`pod_grant`, what the API
says a pod may be billed for (the pod index keeps it). The arithmetic is the pure
:mod:`gpuwarden.accounting`; docs/accounting.md says what is counted and how.
"""

from gpuwarden.operator.accounting.book import LABELS, AccountingBook
from gpuwarden.operator.accounting.grants import pod_grant
from gpuwarden.operator.accounting.owners import OwnerResolver, Workload
from gpuwarden.operator.accounting.settings import AccountingSettings

__all__ = ["LABELS", "AccountingBook", "AccountingSettings", "OwnerResolver", "Workload", "pod_grant"]

"""The operator's HTTP routes for the agents: ``POST /v1/reports`` and what it shares.

What the rest of the operator imports (only from here): the app (:func:`make_ingest_app`) and its
core (:class:`ReportIngest`, the :class:`ReportBook` of duplicates, :class:`Elsewhere` for a node
another shard owns), the per-node rate limiter (:class:`NodeRateLimiter`), the paths
(:data:`REPORTS_PATH`, :data:`VERDICTS_PATH`), and what the POST routes share (:mod:`.http`: :class:`Refusal`,
:func:`authenticate`, :func:`read_body`, :func:`standby`), which the verdict route reuses.
"""

from gpuwarden.operator.endpoints.http import Refusal, authenticate, read_body, standby
from gpuwarden.operator.endpoints.ratelimit import NodeRateLimiter
from gpuwarden.operator.endpoints.reports import (
    REPORTS_PATH,
    VERDICTS_PATH,
    Elsewhere,
    ReportBook,
    ReportIngest,
    make_ingest_app,
)

__all__ = [
    "REPORTS_PATH",
    "VERDICTS_PATH",
    "Elsewhere",
    "NodeRateLimiter",
    "Refusal",
    "ReportBook",
    "ReportIngest",
    "authenticate",
    "make_ingest_app",
    "read_body",
    "standby",
]

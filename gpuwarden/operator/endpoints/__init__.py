"""The operator's HTTP routes for the agents: ``POST /v1/reports`` and what it shares.

What the rest of the operator imports (only from here): the app (:func:`make_ingest_app`) and its
core (:class:`ReportIngest`, the :class:`ReportBook` of duplicates, the :class:`Intake` a stored
report answers with, :class:`Elsewhere` for a node another shard owns), the per-node rate limiter
(:class:`NodeRateLimiter`), the paths (:data:`REPORTS_PATH`, :data:`VERDICTS_PATH`), the clock bound
(:data:`MAX_FUTURE_SKEW`), and what the POST routes share (:mod:`.http`: :class:`Refusal`,
:func:`authenticate`, :func:`read_body`, :func:`standby`), which the verdict route reuses.
"""

from gpuwarden.operator.endpoints.http import Refusal, authenticate, read_body, standby
from gpuwarden.operator.endpoints.ratelimit import NodeRateLimiter
from gpuwarden.operator.endpoints.reports import (
    MAX_FUTURE_SKEW,
    REPORTS_PATH,
    VERDICTS_PATH,
    Elsewhere,
    Intake,
    ReportBook,
    ReportIngest,
    make_ingest_app,
)

__all__ = [
    "MAX_FUTURE_SKEW",
    "REPORTS_PATH",
    "VERDICTS_PATH",
    "Elsewhere",
    "Intake",
    "NodeRateLimiter",
    "Refusal",
    "ReportBook",
    "ReportIngest",
    "authenticate",
    "make_ingest_app",
    "read_body",
    "standby",
]

"""The pods' own metrics on the wire: the scrape plan the operator sends an agent, and the scrapes the
agent sends back in its snapshots (NodeReport schema version 6).

The plan rides in the 2xx answer to a report (``{"accepted": ..., "scrape": {"targets": [...]}}``):
the pods of that node which a policy with ``serviceMetrics`` selects, where their endpoint is, which
metric names to keep and how often. An agent that predates it ignores the key; an operator that
predates it sends none, nor does one with nothing for that node to scrape: the agent then scrapes
nothing. An agent scrapes only the pods its own
pod list places on its node, at the address that list gives (:mod:`gpuwarden.agent.scrape`).

A scrape is compacted before it leaves the agent, so a report stays small whatever a server
exports: a histogram is summed over its label sets into one set of cumulative buckets (at most
:data:`MAX_BUCKETS`, the ``+Inf`` one as ``count``), a counter summed, a gauge one value per label
set (at most :data:`MAX_GAUGE_VALUES`). A failed scrape carries its reason (:class:`ScrapeFailure`)
and nothing else.
"""

from __future__ import annotations

import enum
import ipaddress
from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationError, field_validator, model_validator

from gpuwarden.wire.base import MAX_COUNT, MAX_TIMESTAMP, WireModel, first_error

__all__ = [
    "MAX_BUCKETS",
    "MAX_GAUGE_VALUES",
    "MAX_INTERVAL",
    "MAX_METRICS",
    "MAX_TARGETS",
    "MIN_INTERVAL",
    "MetricName",
    "PlanError",
    "ScrapeFailure",
    "ScrapePlan",
    "ScrapeTarget",
    "ServiceCounter",
    "ServiceGauge",
    "ServiceHistogram",
    "ServiceSample",
    "dump_plan",
    "parse_plan",
]

MAX_BUCKETS = 64
"""Finite bucket bounds kept per histogram (vLLM's latency histograms have 15 to 30)."""
MAX_GAUGE_VALUES = 16
"""Label sets kept per gauge: one value each, the first in the exposition's order."""
MAX_METRICS = 32
"""Metric names per target, and histograms, counters and gauges per scrape."""
MAX_TARGETS = 256
"""Targets per plan, and scrapes per snapshot: more pods than a node runs (the kubelet's default is 110)."""
MIN_INTERVAL = 1.0
MAX_INTERVAL = 3600.0
"""A target's interval in seconds: at most one scrape a second, at least one an hour."""

MetricName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]
"""A Prometheus metric name, as exposed (a counter's with its ``_total``; a histogram's base name)."""
Value = Annotated[float, Field(ge=-MAX_COUNT, le=MAX_COUNT)]
Count = Annotated[float, Field(ge=0, le=MAX_COUNT)]
ObjectName = Annotated[str, Field(min_length=1, max_length=253)]


class ScrapeFailure(enum.StrEnum):
    """Why a pod's metrics could not be read; the ``ServiceMetricsAvailable`` condition counts them."""

    TIMEOUT = "Timeout"
    """No complete answer within the scrape's timeout (a hung endpoint)."""
    TOO_LARGE = "TooLarge"
    """The body passed the agent's cap (1 MiB); it stopped reading there."""
    NOT_PROMETHEUS = "NotPrometheus"
    """The body is not the Prometheus text format (nor OpenMetrics, when its content type says so)."""
    HTTP_STATUS = "HTTPStatus"
    """An answer other than 200 (redirects are not followed)."""
    UNREACHABLE = "Unreachable"
    """No connection (refused, reset, no route)."""
    NO_PORT = "NoPort"
    """The operator's own: no port to scrape (none in the policy, the pod's annotations or its ports)."""


class ServiceHistogram(WireModel):
    """A histogram summed over its label sets: cumulative counts per finite bound, the total as ``count``."""

    name: MetricName
    bounds: list[Value] = Field(max_length=MAX_BUCKETS)
    """Finite upper bounds (``le``), ascending."""
    counts: list[Count] = Field(max_length=MAX_BUCKETS)
    """Cumulative counts, one per bound."""
    count: Count
    """Observations in all (the ``+Inf`` bucket)."""
    sum: Value

    @model_validator(mode="after")
    def _cumulative(self) -> Self:
        if len(self.counts) != len(self.bounds):
            raise ValueError("counts: one per bound")
        if any(b >= a for a, b in zip(self.bounds[1:], self.bounds, strict=False)):
            raise ValueError("bounds: must ascend")
        if any(b > a for a, b in zip([*self.counts[1:], self.count], self.counts, strict=True)):
            raise ValueError("counts: cumulative counts never decrease, and none exceeds count")
        return self


class ServiceCounter(WireModel):
    """A counter summed over its label sets."""

    name: MetricName
    value: Count


class ServiceGauge(WireModel):
    """A gauge: one value per label set, at most :data:`MAX_GAUGE_VALUES`."""

    name: MetricName
    values: list[Value] = Field(min_length=1, max_length=MAX_GAUGE_VALUES)


class ServiceSample(WireModel):
    """One scrape of one pod's metrics endpoint (schema version 6), on the snapshot it was taken before."""

    namespace: ObjectName
    name: ObjectName
    uid: str = Field(min_length=1, max_length=128)
    at: float = Field(gt=0, le=MAX_TIMESTAMP)
    """When the agent scraped (seconds since the epoch); held to the operator's clock as snapshots are."""
    error: ScrapeFailure | None = None
    """Why it failed; then nothing else is sent."""
    histograms: list[ServiceHistogram] = Field(default_factory=list, max_length=MAX_METRICS)
    counters: list[ServiceCounter] = Field(default_factory=list, max_length=MAX_METRICS)
    gauges: list[ServiceGauge] = Field(default_factory=list, max_length=MAX_METRICS)

    @model_validator(mode="after")
    def _failed_is_empty(self) -> Self:
        if self.error is not None and (self.histograms or self.counters or self.gauges):
            raise ValueError("error: a failed scrape carries no metrics")
        return self


class ScrapeTarget(WireModel):
    """One pod the agent is to scrape: where, what to keep, how often."""

    namespace: ObjectName
    name: ObjectName
    uid: str = Field(min_length=1, max_length=128)
    ip: str = Field(min_length=2, max_length=45)
    """The pod's IP (``status.podIP``); the agent scrapes it only if its own pod list agrees."""
    port: int = Field(ge=1, le=65535)
    path: str = Field(min_length=1, max_length=1024, pattern=r"^/[\x21-\x7e]*$")
    """The URL path, query included (printable ASCII, no spaces)."""
    scheme: Literal["http", "https"] = "http"
    metrics: list[MetricName] = Field(min_length=1, max_length=MAX_METRICS)
    """The names to keep, as exposed (a histogram's by its base name)."""
    interval_seconds: float = Field(ge=MIN_INTERVAL, le=MAX_INTERVAL)

    @field_validator("ip")
    @classmethod
    def _address(cls, value: str) -> str:
        ipaddress.ip_address(value)  # a ValueError names the field
        return value

    def url(self) -> str:
        """The endpoint's URL (an IPv6 address in brackets)."""
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{self.scheme}://{host}:{self.port}{self.path}"


class ScrapePlan(WireModel):
    """What one node's agent is to scrape: the ``scrape`` key of the operator's answer to its report."""

    targets: list[ScrapeTarget] = Field(default_factory=list, max_length=MAX_TARGETS)


class PlanError(ValueError):
    """A plan that is not a valid :class:`ScrapePlan`; the message names the field."""


def parse_plan(value: Any) -> ScrapePlan:
    """The plan from the answer's decoded ``scrape`` value, strictly; :class:`PlanError` names the field."""
    try:
        return ScrapePlan.model_validate(value, strict=True, by_name=False)
    except ValidationError as exc:
        raise PlanError(first_error(exc, top="scrape")) from None


def dump_plan(plan: ScrapePlan) -> str:
    """The plan as the answer's ``scrape`` value (JSON, camelCase)."""
    return plan.model_dump_json(by_alias=True)

"""A metrics page, parsed with prometheus_client's parser, compacted to the names a plan asks for (pure).

- **Histograms** (by base name): summed over their label sets into one set of cumulative buckets,
  at the bounds every label set has (a sum at a bound some lack would be no cumulative count);
  ``+Inf`` becomes ``count``. Past :data:`~gpuwarden.wire.scrape.MAX_BUCKETS` finite bounds, evenly
  spaced ones are kept (still a true histogram, only coarser).
- **Counters** (by the name as exposed, ``_total`` included; a name asked for without its ``_total``
  matches too): summed over label sets. An untyped sample whose name ends in ``_total`` counts as one.
- **Gauges** (and untyped samples): one value per label set, the first
  :data:`~gpuwarden.wire.scrape.MAX_GAUGE_VALUES` in the page's order.

A value that is not finite (NaN, infinities), or a histogram that is not cumulative, is left out:
it is no reading. A page the parser refuses, or whose content type is neither the Prometheus text
format nor OpenMetrics, raises :class:`ScrapeFailed` (``NotPrometheus``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from pydantic import ValidationError

from gpuwarden.wire.base import MAX_COUNT
from gpuwarden.wire.scrape import (
    MAX_BUCKETS,
    MAX_GAUGE_VALUES,
    ScrapeFailure,
    ServiceCounter,
    ServiceGauge,
    ServiceHistogram,
)

__all__ = ["Compacted", "ScrapeFailed", "compact", "media_type"]

OPENMETRICS = "application/openmetrics-text"
TEXT = "text/plain"


class ScrapeFailed(Exception):
    """A scrape that read nothing usable: the reason sent to the operator, and a detail for the log."""

    def __init__(self, reason: ScrapeFailure, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Compacted:
    """What a page holds of the names asked for."""

    histograms: list[ServiceHistogram] = field(default_factory=list)
    counters: list[ServiceCounter] = field(default_factory=list)
    gauges: list[ServiceGauge] = field(default_factory=list)


def media_type(content_type: str) -> str:
    """The media type of a Content-Type header, lower-case, without its parameters."""
    return content_type.partition(";")[0].strip().lower()


def compact(text: str, content_type: str, names: Collection[str]) -> Compacted:
    """Parse ``text`` (as its ``content_type`` says) and keep ``names`` (see the module doc)."""
    kind = media_type(content_type)
    parse: Callable[[str], Iterable[Metric]]
    if kind == OPENMETRICS:
        parse = openmetrics_families
    elif kind in (TEXT, ""):
        parse = text_families
    else:
        raise ScrapeFailed(ScrapeFailure.NOT_PROMETHEUS, f"content type {content_type[:80]!r}")
    wanted = frozenset(names)
    out = Compacted()
    # Across families: the parser makes a family of each untyped line.
    counters: dict[str, float] = {}
    gauges: dict[str, list[float]] = {}
    try:
        # The parser is lazy: it raises on a bad line while being iterated.
        for family in parse(text):
            if family.type == "histogram":
                histogram = _histogram(family) if family.name in wanted else None
                if histogram is not None:
                    out.histograms.append(histogram)
            elif family.type in ("counter", "gauge", "unknown"):
                _values(family, wanted, counters, gauges)
            # summaries, gauge histograms, info and state sets: no rule reads them
    except ValueError as exc:
        raise ScrapeFailed(ScrapeFailure.NOT_PROMETHEUS, str(exc)[:200]) from None
    out.counters.extend(ServiceCounter(name=n, value=v) for n, v in counters.items() if 0 <= v <= MAX_COUNT)
    out.gauges.extend(ServiceGauge(name=name, values=values) for name, values in gauges.items())
    return out


def _values(
    family: Metric, wanted: frozenset[str], counters: dict[str, float], gauges: dict[str, list[float]]
) -> None:
    for sample in family.samples:
        name, value = sample.name, sample.value
        if not _finite(value):
            continue
        if family.type == "counter" or (family.type == "unknown" and name.endswith("_total")):
            key = name if name in wanted else name.removesuffix("_total")
            if key in wanted and not name.endswith("_created"):
                counters[key] = counters.get(key, 0.0) + value
        elif name in wanted:
            values = gauges.setdefault(name, [])
            if len(values) < MAX_GAUGE_VALUES:
                values.append(value)


def _histogram(family: Metric) -> ServiceHistogram | None:
    """The family summed over its label sets; None when it holds no true cumulative histogram."""
    buckets: dict[frozenset[tuple[str, str]], dict[float, float]] = {}
    total_sum = 0.0
    for sample in family.samples:
        labels = frozenset((k, v) for k, v in sample.labels.items() if k != "le")
        if sample.name.endswith("_bucket"):
            try:
                bound = float(sample.labels.get("le", ""))
            except ValueError:
                return None
            buckets.setdefault(labels, {})[bound] = sample.value
        elif sample.name.endswith("_sum"):
            total_sum += sample.value
    if not buckets or not _finite(total_sum):
        return None
    shared = set.intersection(*(set(b) for b in buckets.values()))
    if math.inf not in shared:
        return None
    summed = {bound: sum(b[bound] for b in buckets.values()) for bound in shared}
    if not all(_finite(v) for v in summed.values()):
        return None
    finite = sorted(b for b in shared if b != math.inf)
    bounds = _spread(finite, MAX_BUCKETS)
    try:
        return ServiceHistogram(
            name=family.name,
            bounds=bounds,
            counts=[summed[b] for b in bounds],
            count=summed[math.inf],
            sum=total_sum,
        )
    except ValidationError:
        return None  # decreasing counts, or past the wire's bounds: not a histogram to judge by


def _spread(bounds: list[float], limit: int) -> list[float]:
    """At most ``limit`` of ``bounds``, evenly spaced, the last one kept."""
    if len(bounds) <= limit:
        return bounds
    step = len(bounds) / limit
    picked = [bounds[min(len(bounds) - 1, int((i + 1) * step) - 1)] for i in range(limit)]
    return sorted(set(picked))


def _finite(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= MAX_COUNT

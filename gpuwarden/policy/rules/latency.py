"""requestLatency: a percentile of a pod's request latency over a window, above a threshold.

- **Value.** ``histogram_quantile(percentile / 100, increase(<histogram>_bucket[window]))`` over the
  pod's own scrapes, as Prometheus computes it (:func:`~gpuwarden.policy.store.service.histogram_quantile`:
  linear interpolation inside a bucket; a percentile in the ``+Inf`` bucket reads as the highest finite
  bound, so a threshold at or above that bound can never be passed), counter resets handled as
  ``rate()`` does. The histogram is the rule's ``metric``, or its server's for the ``latency`` asked
  for (:mod:`gpuwarden.policy.spec.servers`), scaled to seconds (Triton's is in milliseconds).
- **No requests** in the window: no value (a quiet replica is not slow); nothing starts or clears.
- **Holds** when the value is above ``threshold`` and the pod was scraped since before the window
  began (the percentile then speaks for the whole window), for ``for`` (re-judged at every
  evaluation) before the finding starts. **Clears** at or below ``threshold`` less ``hysteresis``
  percent of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.humanize import format_count, format_latency
from gpuwarden.policy.rules.common import (
    Outcome,
    RuleKind,
    RuleType,
    Services,
    WindowParams,
    on_services,
    unknown,
)
from gpuwarden.policy.rules.service import SERVER, SHORT_OF_REPLICAS, metric_field, metric_of, parse_source
from gpuwarden.policy.spec.model import Server
from gpuwarden.policy.spec.schema import Body, Check, Choice, Duration, Integer, Number
from gpuwarden.policy.spec.servers import Latency, Metric, source_metric
from gpuwarden.policy.store.series import PodId
from gpuwarden.policy.store.service import histogram_quantile
from gpuwarden.units import format_duration

KIND = RuleKind("requestLatency")
"""Its kind: its key under ``spec.rules[]``."""


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """Fires when a percentile of a latency histogram over ``window`` stays above ``threshold_seconds``
    for ``for_seconds`` (see the module doc).

    After :func:`~gpuwarden.policy.parse.parse_spec`, ``metric`` or ``server`` is set (the policy's
    ``serviceMetrics.server`` fills in a rule that names neither)."""

    name: str
    percentile: int
    """50, 90, 95 or 99."""
    threshold_seconds: float
    window_seconds: float = 300.0
    for_seconds: float = 120.0
    latency: Latency = Latency.END_TO_END
    server: Server | None = None
    metric: str | None = None
    """A histogram by its base name (without ``_bucket``), in seconds; wins over ``server``."""
    hysteresis: float = 10.0
    """Percent of the threshold the percentile must fall below it before a finding clears."""


UNIT = "seconds"

_LATENCY_WORDS = {
    Latency.END_TO_END: "latency",
    Latency.TIME_TO_FIRST_TOKEN: "time to first token",
    Latency.INTER_TOKEN: "inter-token latency",
}


def latency_metric(rule: RequestLatency) -> Metric | str:
    """The histogram a requestLatency rule reads (seconds), or why its server has none."""
    return source_metric(rule, lambda preset: preset.latency[rule.latency])


PERCENTILE = Integer(
    "percentile",
    "Which percentile of the window's requests to judge (P50, P90, P95 or P99).",
    choices=(50, 90, 95, 99),
    required=True,
)
THRESHOLD = Duration(
    "threshold",
    "The latency the percentile must stay at or below (a duration such as 2s or 500ms, at least 1ms).",
    minimum="1ms",
    required=True,
)
WINDOW = Duration(
    "window",
    "The trailing window whose requests the percentile is taken over (a duration, at least 1s and at"
    " least evaluationInterval).",
    default="5m",
    minimum="1s",
    window=True,
)
FOR = Duration(
    "for",
    "How long the percentile must stay above threshold, judged at every evaluation, before the"
    " violation starts (a duration such as 2m).",
    default="2m",
)
LATENCY = Choice(
    "latency",
    "Which latency of the server's to read. endToEnd: from a request's arrival to its last token."
    " timeToFirstToken: to its first token. interToken: between consecutive output tokens (TGI: each"
    " request's mean time per token).",
    choices=Latency,
    default=Latency.END_TO_END,
)
METRIC = metric_field("A latency histogram in seconds, by its base name (without _bucket).")
HYSTERESIS = Number(
    "hysteresis",
    "Percent of threshold the percentile must fall below it before an active violation clears (0 to 90).",
    minimum=0,
    maximum=90,
    default=10,
)
BODY = Body(
    "Fires when a percentile of the pod's request latency over the trailing window is above threshold,"
    " for the duration `for`: the pod's own histogram (its server's, or metric), scraped by the node"
    " agent (spec.serviceMetrics), read as Prometheus's histogram_quantile(percentile/100,"
    " increase(<histogram>_bucket[window])) computes it. A window without requests has no value:"
    " nothing starts or clears. A percentile in the histogram's +Inf bucket reads as its highest"
    " finite bound.",
    (PERCENTILE, THRESHOLD, WINDOW, FOR, LATENCY, SERVER, METRIC, HYSTERESIS),
    # The parser refuses the same through the presets (latency_metric: no such histogram).
    (
        Check(
            "has(self.metric) || !has(self.server)"
            " || !(self.server == 'triton' && self.latency != 'timeToFirstToken')",
            "Triton exports no end-to-end or inter-token latency histogram (nv_inference_request_duration_us"
            " is a counter: a mean, not a percentile); use latency: timeToFirstToken or name a histogram"
            " with metric",
            ".latency",
        ),
        Check(
            "has(self.metric) || !has(self.server)"
            " || !(self.server == 'tgi' && self.latency == 'timeToFirstToken')",
            "TGI exports no time-to-first-token histogram; use latency: endToEnd or interToken, or name a"
            " histogram with metric",
            ".latency",
        ),
    ),
)


def parse_latency(name: str, obj: Mapping[str, Any], path: str) -> RequestLatency:
    """A requestLatency rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    server, metric = parse_source(obj, path, METRIC)
    return RequestLatency(
        name=name,
        percentile=PERCENTILE.read(obj, path),
        threshold_seconds=THRESHOLD.read(obj, path),
        window_seconds=WINDOW.read(obj, path),
        for_seconds=FOR.read(obj, path),
        latency=LATENCY.read(obj, path),
        server=server,
        metric=metric,
        hysteresis=HYSTERESIS.read(obj, path),
    )


def latency_message(o: Outcome) -> str:
    """``P99 latency 3.4s over 5m above 2s`` (``at or below`` when it is not), with the requests counted."""
    percentile, words, requests = o.extra if isinstance(o.extra, tuple) else (0, "latency", 0.0)
    value = o.value or 0.0
    side = "above" if value > o.threshold else "at or below"
    return (
        f"P{percentile} {words} {format_latency(value)} over {format_duration(o.window_seconds)}"
        f" {side} {format_latency(o.threshold)} ({format_count(requests)} requests)"
    )


def evaluate_latency(
    rule: RequestLatency, pod: PodId, now: float, params: WindowParams, services: Services | None
) -> Outcome:
    """Judge a requestLatency rule for one pod (see the module doc)."""
    kind = KIND
    nothing = unknown(rule.name, kind, pod, rule.threshold_seconds, UNIT)
    if services is None:
        return nothing
    metric = metric_of(latency_metric(rule))
    window = services.store.increase(pod, metric.names, rule.window_seconds, now, params.stale_after_seconds)
    if window is None or window.histogram is None:
        return nothing
    q = histogram_quantile(rule.percentile / 100, window.histogram)
    if q is None:
        return nothing
    value = q * metric.scale
    holds = window.covered and value > rule.threshold_seconds
    clears = not holds and value <= rule.threshold_seconds * (1 - rule.hysteresis / 100)
    words = "latency" if rule.metric is not None else _LATENCY_WORDS[rule.latency]
    return Outcome(
        rule.name,
        kind,
        pod,
        value,
        rule.threshold_seconds,
        UNIT,
        holds=holds,
        clears=clears,
        window_seconds=rule.window_seconds,
        signal=window.name,
        extra=(rule.percentile, words, window.histogram.counts[-1]),
        describe=latency_message,
    )


RULE_TYPE = RuleType(
    kind=KIND,
    model=RequestLatency,
    parse=parse_latency,
    body=BODY,
    evaluate=on_services(evaluate_latency),
    # The window, and the scrape before it (which tells the window is covered): scrapes come at most
    # a minute apart in any sensible serviceMetrics.interval.
    reach=lambda rule: rule.window_seconds + 60.0,
    window=lambda rule: rule.window_seconds,
    reason="RequestLatencyHigh",
    meaning="its requests are served too slowly: it may need more replicas",
    per_gpu=False,
    colour="goldenrod",
    utilization=True,  # local mode's plot draws it on the utilization panel: it speaks of load
    hold=lambda rule: rule.for_seconds,
    metric=latency_metric,
    refused_at="latency",  # a server lacks one latency's histogram, not all of them
    counts_requests=True,
    up_only=SHORT_OF_REPLICAS,
)

"""The metric names of the inference servers the service rule kinds know, and what each can give.

A rule that names a ``server`` (or whose policy's ``serviceMetrics.server`` does) reads that server's
metric from :data:`PRESETS`; one that names a ``metric`` reads it by name. Where a server exports
nothing a rule could judge truthfully (Triton has no end-to-end latency histogram, only a counter of
microseconds: a mean, not a percentile), the preset holds the reason, and the parser refuses the rule
with it rather than judge something else.

Names are as the servers expose them (histograms by base name, without ``_bucket``); where a server
renamed a metric, the current name comes first and the older ones follow: a pod is read by the first
it exports.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpuwarden.policy.spec.model import Server, ServiceRule

__all__ = [
    "PRESETS",
    "Latency",
    "Metric",
    "Preset",
    "request_counters",
    "source_metric",
]


class Latency(enum.StrEnum):
    """Which latency histogram of a server's preset (a requestLatency rule's ``latency``)."""

    END_TO_END = "endToEnd"  # from the request's arrival to its last token
    TIME_TO_FIRST_TOKEN = "timeToFirstToken"
    INTER_TOKEN = "interToken"  # between consecutive output tokens of a request


@dataclass(frozen=True, slots=True)
class Metric:
    """What a service rule reads: a metric's names (the first a pod exports wins) and the factor that
    turns its values into the rule's unit (seconds for latency, percent for KV-cache usage)."""

    names: tuple[str, ...]
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Preset:
    """One server's metrics; a ``str`` in place of a :class:`Metric` says why it has none."""

    title: str
    """The server's name in messages (``vLLM``)."""
    latency: Mapping[Latency, Metric | str]
    waiting: Metric | str
    """Requests waiting to be scheduled (a gauge)."""
    kv_cache: Metric | str
    """KV-cache usage (a gauge), scaled to percent."""
    requests: tuple[str, ...]
    """Counters of requests served: the forecast's load where the pods export one."""


PRESETS: Mapping[Server, Preset] = {
    Server.VLLM: Preset(
        title="vLLM",
        latency={
            Latency.END_TO_END: Metric(("vllm:e2e_request_latency_seconds",)),
            Latency.TIME_TO_FIRST_TOKEN: Metric(("vllm:time_to_first_token_seconds",)),
            # vLLM before 0.10 named its inter-token histogram after the time per output token.
            Latency.INTER_TOKEN: Metric(
                ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
            ),
        },
        waiting=Metric(("vllm:num_requests_waiting",)),
        # A ratio, 0..1; vLLM before 0.10 named it after the GPU cache.
        kv_cache=Metric(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), 100.0),
        requests=("vllm:request_success_total",),
    ),
    Server.SGLANG: Preset(
        title="SGLang",
        latency={
            Latency.END_TO_END: Metric(("sglang:e2e_request_latency_seconds",)),
            Latency.TIME_TO_FIRST_TOKEN: Metric(("sglang:time_to_first_token_seconds",)),
            Latency.INTER_TOKEN: Metric(("sglang:inter_token_latency_seconds",)),
        },
        waiting=Metric(("sglang:num_queue_reqs",)),
        kv_cache=Metric(("sglang:token_usage",), 100.0),  # the KV pool's tokens in use, 0..1
        requests=("sglang:num_requests_total",),
    ),
    Server.TRITON: Preset(
        title="Triton",
        latency={
            Latency.END_TO_END: (
                "Triton exports no end-to-end latency histogram (nv_inference_request_duration_us is a"
                " counter of microseconds: a mean, not a percentile); use latency: timeToFirstToken"
                " (nv_inference_first_response_histogram_ms, with Triton's --metrics-config"
                " histogram_latencies=true) or name a histogram with metric"
            ),
            Latency.TIME_TO_FIRST_TOKEN: Metric(("nv_inference_first_response_histogram_ms",), 0.001),
            Latency.INTER_TOKEN: (
                "Triton exports no inter-token latency histogram; name a histogram with metric"
            ),
        },
        waiting=Metric(("nv_inference_pending_request_count",)),
        kv_cache=(
            "Triton exports no KV-cache usage of its own (its backends may: name their gauge with metric)"
        ),
        requests=("nv_inference_request_success",),
    ),
    # text-generation-inference is archived upstream (read-only): these names will not change.
    Server.TGI: Preset(
        title="TGI",
        latency={
            Latency.END_TO_END: Metric(("tgi_request_duration",)),
            Latency.TIME_TO_FIRST_TOKEN: (
                "TGI exports no time-to-first-token histogram; use latency: endToEnd or interToken,"
                " or name a histogram with metric"
            ),
            # Each request's mean time per output token: percentiles over requests, not over tokens.
            Latency.INTER_TOKEN: Metric(("tgi_request_mean_time_per_token_duration",)),
        },
        waiting=Metric(("tgi_queue_size",)),
        kv_cache="TGI exports no KV-cache usage; name a gauge with metric",
        requests=("tgi_request_success",),
    ),
}
"""Every server's metrics, by :class:`Server`."""


def source_metric(
    rule: ServiceRule, found: Callable[[Preset], Metric | str], scale: float = 1.0
) -> Metric | str:
    """What a service rule reads: its ``metric`` by name (its values times ``scale``), else what
    ``found`` picks from its server's preset; or why there is none."""
    if rule.metric is not None:
        return Metric((rule.metric,), scale)
    return "names neither server nor metric" if rule.server is None else found(PRESETS[rule.server])


def request_counters(servers: Iterable[Server]) -> tuple[str, ...]:
    """The counters of requests served that these servers export, without repeats."""
    return tuple(dict.fromkeys(name for s in servers for name in PRESETS[s].requests))

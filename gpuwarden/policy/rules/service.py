"""What the service rule kinds (those that read the pods' own metrics) share: naming the metric they
read (a ``server``'s preset or a ``metric`` by name, :mod:`gpuwarden.policy.spec.servers`), and how
stale a pod's scrapes may be.

They read the pods' own metrics as the node agents scraped them (the
:class:`~gpuwarden.policy.store.service.ServiceStore`), not the GPUs' series: a pod is judged as of its
newest scrape at or before ``now``, and only when that scrape succeeded and is fresh (no older than
``stale_after_seconds``, nor than three of the pod's scrape intervals); else there is nothing to judge
(no value: nothing starts, nothing clears), as with the GPU kinds' stale pods. Each holds for its
``for`` before its finding starts (the finding tracker's hold, re-judged at every evaluation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwarden.policy.spec.fields import SpecError, show, type_name
from gpuwarden.policy.spec.model import Server
from gpuwarden.policy.spec.schema import Choice, Text
from gpuwarden.policy.spec.servers import Metric

__all__ = ["SERVER", "SHORT_OF_REPLICAS", "metric_field", "metric_of", "parse_source"]

SERVER = Choice(
    "server",
    "The inference server whose metric to read, by its preset: vllm, sglang, triton or tgi"
    " (text-generation-inference, archived upstream). Default: spec.serviceMetrics.server. Set this,"
    " metric, or spec.serviceMetrics.server.",
    choices=Server,
)
"""A service rule's ``server`` (no CRD default: the parser fills in ``serviceMetrics.server``)."""


def metric_field(description: str) -> Text:
    """A service rule's ``metric``: a Prometheus metric name (the classic grammar every server here
    writes), which wins over ``server``."""
    return Text(
        "metric",
        f"{description} Wins over server.",
        max_length=200,
        pattern="[a-zA-Z_:][a-zA-Z0-9_:]*",
        message="must be a Prometheus metric name such as vllm:num_requests_waiting",
    )


SHORT_OF_REPLICAS = (
    "it fires when the service is short of replicas, so it can only scale up"
    " (scale down on a utilizationFloor rule)"
)
"""Why a service rule may not be a ``scaleDownOn`` rule (its kinds' records' ``up_only``)."""


def parse_source(obj: Mapping[str, Any], path: str, metric: Text) -> tuple[Server | None, str | None]:
    """A service rule's ``server`` and ``metric`` (either may be absent here: the policy's
    ``serviceMetrics.server`` may name the server; :func:`gpuwarden.policy.parse.parse_spec` checks)."""
    server = SERVER.get(obj, path)
    raw = obj.get("metric")
    if raw is None:
        return server, None
    field = f"{path}.metric"
    if not isinstance(raw, str):
        raise SpecError(field, f"must be a metric name, not {type_name(raw)}")
    if not metric.matches(raw):
        raise SpecError(
            field,
            f"{show(raw)} is not a Prometheus metric name such as vllm:num_requests_waiting"
            " (a histogram by its base name, without _bucket)",
        )
    if raw.endswith("_bucket"):
        raise SpecError(
            field, f"{show(raw)}: name a histogram by its base name ({raw.removesuffix('_bucket')})"
        )
    return server, raw


def metric_of(found: Metric | str) -> Metric:
    """The metric a parsed rule reads (the parser refused one whose server has none)."""
    if isinstance(found, str):
        raise ValueError(f"a service rule that reads nothing: {found}")
    return found

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

import re
from collections.abc import Mapping
from typing import Any

from gpuwarden.policy.spec.fields import SpecError, member, show, type_name
from gpuwarden.policy.spec.model import Server
from gpuwarden.policy.spec.servers import Metric

__all__ = ["MAX_METRIC_NAME", "METRIC_NAME", "SHORT_OF_REPLICAS", "metric_of", "parse_source"]

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
"""A Prometheus metric name (the classic grammar every server here writes)."""
MAX_METRIC_NAME = 200

SHORT_OF_REPLICAS = (
    "it fires when the service is short of replicas, so it can only scale up"
    " (scale down on a utilizationFloor rule)"
)
"""Why a service rule may not be a ``scaleDownOn`` rule (its kinds' records' ``up_only``)."""


def parse_source(obj: Mapping[str, Any], path: str) -> tuple[Server | None, str | None]:
    """A service rule's ``server`` and ``metric`` (either may be absent here: the policy's
    ``serviceMetrics.server`` may name the server; :func:`gpuwarden.policy.parse.parse_spec` checks)."""
    server = None if obj.get("server") is None else member(Server, obj["server"], f"{path}.server")
    raw = obj.get("metric")
    if raw is None:
        return server, None
    field = f"{path}.metric"
    if not isinstance(raw, str):
        raise SpecError(field, f"must be a metric name, not {type_name(raw)}")
    if len(raw) > MAX_METRIC_NAME or not METRIC_NAME.fullmatch(raw):
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

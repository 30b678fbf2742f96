"""requestQueue: requests waiting to be served, per replica or per pod, above a limit.

- **Value.** A pod's queue is its gauge of waiting requests (the rule's ``metric``, or its server's:
  ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``, ...), summed over its label sets (one per
  model served), from its newest fresh scrape. ``per: replica`` (the default) judges the workload's
  queue per replica: the sum over the policy's pods that report / their number, the same for every
  pod (a load balancer may queue unevenly; scaling answers the workload's queue); ``per: pod`` judges
  each pod's own.
- **Holds** above ``limit``, for ``for`` before the finding starts; **clears** at or below ``limit``
  less ``hysteresis`` percent of it. A pod with no fresh scrape of its own is not judged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.humanize import format_count
from gpuwarden.policy.rules.common import (
    JudgeContext,
    Outcome,
    RuleKind,
    RuleType,
    Services,
    WindowParams,
    unknown,
)
from gpuwarden.policy.rules.service import SERVER, SHORT_OF_REPLICAS, metric_field, metric_of, parse_source
from gpuwarden.policy.spec.model import Server
from gpuwarden.policy.spec.schema import Body, Choice, Duration, Number
from gpuwarden.policy.spec.servers import Metric, source_metric
from gpuwarden.policy.store.series import PodId

KIND = RuleKind("requestQueue")
"""Its kind: its key under ``spec.rules[]``."""


class QueueScope(enum.StrEnum):
    """How a requestQueue rule counts waiting requests."""

    REPLICA = "replica"  # the workload's: waiting requests summed over the policy's pods / pods reporting
    POD = "pod"  # each pod's own queue


@dataclass(frozen=True, slots=True)
class RequestQueue:
    """Fires when waiting requests per replica (or per pod) stay above ``limit`` for ``for_seconds``
    (see the module doc)."""

    name: str
    limit: float
    for_seconds: float = 60.0
    per: QueueScope = QueueScope.REPLICA
    server: Server | None = None
    metric: str | None = None
    """A gauge of waiting requests (summed over its label sets); wins over ``server``."""
    hysteresis: float = 10.0
    """Percent of the limit the queue must fall below it before a finding clears."""


UNIT = "requests"


LIMIT = Number(
    "limit",
    "The most waiting requests (per replica, or per pod) that is fine.",
    minimum=0,
    maximum=1_000_000,
    required=True,
)
FOR = Duration(
    "for",
    "How long the queue must stay above limit, judged at every evaluation, before the violation starts"
    " (a duration such as 1m).",
    default="1m",
)
PER = Choice(
    "per",
    "replica: the workload's waiting requests per replica (a load balancer may queue unevenly; scaling"
    " answers the workload's queue). pod: each pod's own.",
    choices=QueueScope,
    default=QueueScope.REPLICA,
)
METRIC = metric_field("A gauge of waiting requests (summed over its label sets).")
HYSTERESIS = Number(
    "hysteresis",
    "Percent of limit the queue must fall below it before an active violation clears (0 to 90).",
    minimum=0,
    maximum=90,
    default=10,
)
BODY = Body(
    "Fires when requests waiting to be served stay above limit for the duration `for`: the pods' own"
    " gauge of waiting requests (their server's, or metric), scraped by the node agent"
    " (spec.serviceMetrics), summed over its label sets. Per replica (the default): the sum over the"
    " policy's pods that report, divided by their number, judged on every pod alike; per pod: each"
    " pod's own.",
    (LIMIT, FOR, PER, SERVER, METRIC, HYSTERESIS),
)


def parse_queue(name: str, obj: Mapping[str, Any], path: str) -> RequestQueue:
    """A requestQueue rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    server, metric = parse_source(obj, path, METRIC)
    return RequestQueue(
        name=name,
        limit=LIMIT.read(obj, path),
        for_seconds=FOR.read(obj, path),
        per=PER.read(obj, path),
        server=server,
        metric=metric,
        hysteresis=HYSTERESIS.read(obj, path),
    )


def queue_metric(rule: RequestQueue) -> Metric | str:
    """The gauge of waiting requests a requestQueue rule reads, or why its server has none."""
    return source_metric(rule, lambda preset: preset.waiting)


class QueueMemo:
    """The workload's queue per replica, worked out once per evaluation, not once per pod."""

    def __init__(self) -> None:
        self._replica: dict[tuple[tuple[str, ...], float, int], tuple[float, int]] = {}

    def per_replica(
        self, names: tuple[str, ...], services: Services, now: float, stale_after: float
    ) -> tuple[float, int]:
        """The sum of the reporting pods' queues / their number, and that number."""
        key = (names, now, id(services.pods))
        found = self._replica.get(key)
        if found is None:
            queues = [
                q
                for pod in services.pods
                if (q := pod_queue(services, pod, names, now, stale_after)) is not None
            ]
            found = self._replica[key] = (sum(queues) / len(queues) if queues else 0.0, len(queues))
        return found

    def sweep(self) -> None:
        """An evaluation ended: the next one reads the queues afresh."""
        self._replica.clear()


def pod_queue(
    services: Services, pod: PodId, names: Sequence[str], now: float, stale_after: float
) -> float | None:
    """A pod's waiting requests (its gauge summed over label sets); None when it has no fresh one."""
    found = services.store.gauge(pod, names, now, stale_after)
    return None if found is None else sum(found[1])


def queue_message(o: Outcome) -> str:
    """``7.5 waiting requests per replica across 4 pods (this pod 9), limit 5`` or
    ``12 waiting requests, limit 5``."""
    own, pods = o.extra if isinstance(o.extra, tuple) else (None, 0)
    value = format_count(o.value or 0.0)
    if own is None:
        return f"{value} waiting requests, limit {format_count(o.threshold)}"
    return (
        f"{value} waiting requests per replica across {pods} pods (this pod {format_count(own)}),"
        f" limit {format_count(o.threshold)}"
    )


def evaluate_queue(
    rule: RequestQueue,
    pod: PodId,
    now: float,
    params: WindowParams,
    services: Services | None,
    memo: QueueMemo | None,
) -> Outcome:
    """Judge a requestQueue rule for one pod (see the module doc)."""
    kind = KIND
    nothing = unknown(rule.name, kind, pod, rule.limit, UNIT)
    if services is None:
        return nothing
    names = metric_of(queue_metric(rule)).names
    stale_after = params.stale_after_seconds
    own = pod_queue(services, pod, names, now, stale_after)
    if own is None:
        return nothing
    extra: tuple[float | None, int] = (None, 1)
    value = own
    if rule.per is QueueScope.REPLICA:
        value, pods = (memo or QueueMemo()).per_replica(names, services, now, stale_after)
        extra = (own, pods)
    holds = value > rule.limit
    clears = not holds and value <= rule.limit * (1 - rule.hysteresis / 100)
    return Outcome(
        rule.name,
        kind,
        pod,
        value,
        rule.limit,
        UNIT,
        holds=holds,
        clears=clears,
        window_seconds=rule.for_seconds,
        extra=extra,
        describe=queue_message,
    )


def _judge(rule: RequestQueue, c: JudgeContext, memo: QueueMemo | None) -> Outcome:
    return evaluate_queue(rule, c.pod, c.now, c.params, c.services, memo)


RULE_TYPE = RuleType(
    kind=KIND,
    model=RequestQueue,
    parse=parse_queue,
    body=BODY,
    evaluate=_judge,
    # It reads the newest scrape; the last few tell the pod's scrape interval (its staleness).
    reach=lambda rule: max(rule.for_seconds, 60.0),
    window=None,
    reason="RequestQueueLong",
    meaning="requests wait to be served: it needs more replicas",
    per_gpu=False,
    colour="teal",
    utilization=True,  # local mode's plot draws it on the utilization panel: it speaks of load
    hold=lambda rule: rule.for_seconds,
    memo=QueueMemo,
    metric=queue_metric,
    up_only=SHORT_OF_REPLICAS,
)

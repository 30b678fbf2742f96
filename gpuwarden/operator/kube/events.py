"""Kubernetes Events: what one looks like, and a poster that sends them in the background, never twice.

:func:`event_body` is the one shape of every Event the operator posts (the policies' announcements,
the scaler's, the node view's): a core/v1 Event named ``<object>.<random>`` as kubectl users know
them, about an :class:`ObjectRef` (by uid, so ``kubectl describe`` finds it).

:class:`EventPoster` sends the announcements: :meth:`~EventPoster.post` builds the Event at once (its
time and its name) and queues it; one worker posts the queue in order. What the API server may not
have stored (no answer, a timeout, 429, a 5xx) is sent again under the **same name**, with capped
backoff. An API server whose etcd stalls stores a write it has already answered 500 or 504 for, or
after the client gave up on it; the retry then meets 409 AlreadyExists, which counts as posted,
where a generated name (``generateName``, as Kopf posts them) would have made a second Event: the
violation announced twice. Any other refusal (RBAC, a namespace being deleted) is logged and the
Event dropped.

Bounded: at most ``limit`` Events wait (the oldest are dropped first); one that could not be posted
within ``max_age`` seconds is dropped. Drops are counted in
``gpuwarden_operator_events_dropped_total{reason}`` (``queue_full``, ``expired``, ``refused``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Counter

from gpuwarden.kubetime import format_micro_time, format_time
from gpuwarden.operator.kube.client import ApiError, JsonObject, KubeApi
from gpuwarden.operator.resources import ObjectRef

__all__ = ["COMPONENT", "EventPoster", "EventSink", "event_body", "object_ref"]

logger = logging.getLogger(__name__)

COMPONENT = "gpuwarden-operator"
"""``source.component`` and ``reportingComponent`` of every Event the operator posts."""

ACTION = "Evaluate"
"""``action`` of every Event: each one is what an evaluation (or the scaling after it) concluded."""

MAX_MESSAGE = 1024

CLUSTER_EVENTS_NAMESPACE = "default"
"""Where Events about cluster-scoped objects are posted, as the kubelet posts a Node's."""


class EventSink(Protocol):
    """Posts Kubernetes Events (the :class:`EventPoster`; tests record them)."""

    async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        """Post one Event about ``regarding``; never raises (an Event is not worth failing for)."""
        ...


def event_body(
    regarding: ObjectRef, type_: str, reason: str, message: str, *, instance: str, now: float
) -> JsonObject:
    """A core/v1 Event about ``regarding``, stamped ``now``, named ``<object>.<random>``.

    Events about a cluster-scoped object (a Node) go to :data:`CLUSTER_EVENTS_NAMESPACE`, where
    ``kubectl describe node`` looks for them.
    """
    involved = {"apiVersion": regarding.api_version, "kind": regarding.kind, "name": regarding.name}
    if regarding.namespace:
        involved["namespace"] = regarding.namespace
    if regarding.uid:
        involved["uid"] = regarding.uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            # 253 characters at most; the suffix takes 17.
            "name": f"{regarding.name[:236]}.{secrets.token_hex(8)}",
            "namespace": regarding.namespace or CLUSTER_EVENTS_NAMESPACE,
        },
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "action": ACTION,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance or COMPONENT,
        "firstTimestamp": format_time(now),
        "lastTimestamp": format_time(now),
        # Microseconds, for whoever times the operator (bench/detection_latency.py).
        "eventTime": format_micro_time(now),
        "count": 1,
    }


@dataclass(slots=True)
class _Queued:
    body: JsonObject
    queued_at: float

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.body['metadata']['namespace']}/events"


class EventPoster:
    """Posts Events in the background, in the order they were queued, each exactly once.

    ``instance``: this replica's identity (``reportingInstance``); ``dropped``: the drop counter, by
    reason (``OperatorMetrics.events_dropped``); ``clock``: wall time, for the Events' timestamps and
    their age.
    """

    def __init__(
        self,
        api: KubeApi,
        *,
        instance: str,
        dropped: Counter,
        limit: int = 1000,
        max_age: float = 3600.0,
        backoff_base: float = 1.0,
        backoff_cap: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._instance = instance
        self._limit = limit
        self._max_age = max_age
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._clock = clock
        self._queue: deque[_Queued] = deque()
        self._failures = 0
        # Bound to the running loop only when awaited: post() works before the worker starts.
        self._queued = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._dropped = dropped

    @property
    def pending(self) -> int:
        """Events queued and not posted yet (the one being posted included)."""
        return len(self._queue)

    async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
        """Queue one Event about ``regarding``; returns at once (the worker posts it), never raises."""
        now = self._clock()
        body = event_body(regarding, type_, reason, message, instance=self._instance, now=now)
        self._queue.append(_Queued(body, now))
        if len(self._queue) > self._limit:
            # The oldest goes (if it is the one being posted, the worker's answer finds it gone).
            self._queue.popleft()
            self._dropped.labels("queue_full").inc()
        self._empty.clear()
        self._queued.set()

    async def run(self) -> None:
        """Post the queue forever (cancel to stop)."""
        while True:
            if not self._queue:
                self._empty.set()
                self._queued.clear()
                await self._queued.wait()
                continue
            event = self._queue[0]
            if not await self._send(event):
                await asyncio.sleep(self._backoff())
                continue
            if self._queue and self._queue[0] is event:
                self._queue.popleft()

    async def drain(self) -> None:
        """Return once the queue is empty (:meth:`run` must be running to empty it)."""
        await self._empty.wait()

    async def _send(self, event: _Queued) -> bool:
        """Post one Event: True when it is done with (posted, or dropped), False to retry it."""
        reason = event.body["reason"]
        if self._clock() - event.queued_at > self._max_age:
            logger.warning("Dropping Event %s: not posted within %gs.", reason, self._max_age)
            self._dropped.labels("expired").inc()
            return True
        try:
            await self._api.request("POST", event.path, body=event.body)
        except ApiError as exc:
            if exc.status == 409:
                pass  # stored by an earlier attempt whose answer was lost: posted, once
            elif exc.status in (0, 429) or exc.status >= 500:
                self._failures += 1
                if self._failures == 1:  # the first of a streak is news; the rest is the same news
                    logger.warning("Cannot post Event %s (retrying): %s", reason, exc)
                return False
            else:
                logger.warning("The API server refused Event %s; dropping it: %s", reason, exc)
                self._dropped.labels("refused").inc()
        if self._failures:
            logger.info("Posting Events again after %d failed attempts.", self._failures)
            self._failures = 0
        return True

    def _backoff(self) -> float:
        return float(min(self._backoff_cap, self._backoff_base * 2 ** min(self._failures - 1, 10)))


def object_ref(body: Any) -> ObjectRef:
    """The :class:`ObjectRef` of an object's body (apiVersion, kind, metadata)."""
    meta = body.get("metadata") or {}
    return ObjectRef(
        str(body.get("apiVersion", "")),
        str(body.get("kind", "")),
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        str(meta.get("uid", "")),
    )

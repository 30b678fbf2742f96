"""The node view of GPU health (``--node-health``): a ``GPUHealthy`` condition on each reporting Node,
Warning Events on the Node and on the pods of the affected GPU, and an optional cordon.

From the health store the agents' reports fill (:mod:`gpuwarden.policy.store.health`), once a second
on the acting replica. A node's view comes only from its own agent's reports (the store keys each
GPU by the reporting node, and puts on it only the pods the index places on that node), so one
node's token can change no other node's condition, Events or cordon.

- **Condition** ``GPUHealthy`` on the Node's status (:func:`node_verdict`): ``False`` while one of its
  GPUs is lost, raised one of ``--node-health-xids`` in the last ``--node-health-hold``, had a new
  uncorrected ECC error in that time, or reports a failed or pending memory repair; reason the most
  serious of ``GPULost``, ``GPUXidError``, ``GPUMemoryError``, the message every problem in words.
  ``True`` (``GPUsHealthy``) otherwise. Written only when status, reason or message change, with a
  ``lastTransitionTime`` that moves only with the status; a node whose GPUs went unreported for a
  minute is left as it was (the kubelet's ``Ready`` covers a node that is down).
- **Events** (:func:`incident_event`), Warning, on the Node (namespace ``default``, where Events about
  cluster-scoped objects live, so ``kubectl describe node`` shows them) and on the pods that were on
  the GPU: ``GPULost``, ``GPUXidError`` (a counted XID, with its meaning and the recommended action
  from :mod:`gpuwarden.policy.xids`), ``GPUMemoryError``, ``GPUThrottled`` (the hardware slows the
  clocks: overheating, a power brake). At most one per GPU and kind (and XID code) a minute; an
  incident older than the hold when it arrives (a replay after an outage) gets none. Normal
  ``GPUHealthRecovered`` on the Node when the condition turns ``True`` again.
- **Cordon** (``--cordon``), when the condition turns ``False``: ``dry-run`` posts
  ``GPUNodeCordonDryRun`` and changes nothing; ``on`` marks the Node unschedulable (annotated
  ``gpuwarden.dev/cordoned``) and posts ``GPUNodeCordoned``. Never uncordoned automatically: a person
  decides the GPU is fixed (``kubectl uncordon``).

Events, on the Node and on the pods, go through the operator's one Event poster
(:class:`~gpuwarden.operator.kube.events.EventPoster`): in the background, and under a fixed name, so a
retry after a lost answer never posts one twice. A Node's go to ``default`` with no namespace in
``involvedObject``, where ``kubectl describe node`` finds them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwarden.kubetime import format_time
from gpuwarden.operator.config import CordonMode, OperatorConfig
from gpuwarden.operator.kube import ApiError, EventSink, KubeApi
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.resources import FIELD_MANAGER, ObjectRef, PodRecord
from gpuwarden.policy import (
    GpuRecord,
    HealthStore,
    Incident,
    IncidentKind,
    Problem,
    approx_duration,
    describe_xid,
    gpu_name,
    gpu_problems,
)

__all__ = ["CONDITION", "NodeHealthMonitor", "NodeSettings", "Verdict", "incident_event", "node_verdict"]

logger = logging.getLogger(__name__)

CONDITION = "GPUHealthy"
"""Where Events about Nodes go (the kubelet's too): a cluster-scoped object has no namespace of its own."""
CORDON_ANNOTATION = "gpuwarden.dev/cordoned"
REPEAT_SECONDS = 60.0
"""The least time between two Events for the same GPU and kind of incident (and XID code)."""
RETRY_MISSING_SECONDS = 60.0
"""A node the API server does not know (404) is looked up again after this long."""
MAX_MESSAGE = 1024

_SEVERITY = ("GPULost", "GPUXidError", "GPUMemoryError")


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """What makes a node unhealthy: the counted XIDs, how long an XID or ECC error counts, staleness."""

    xids: tuple[int, ...]
    hold: float
    stale_after: float = 60.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """The ``GPUHealthy`` condition a node should carry."""

    status: str
    reason: str
    message: str


def node_verdict(records: Sequence[GpuRecord], now: float, settings: NodeSettings) -> Verdict | None:
    """The condition for a node's GPUs (see the module doc); None when none was reported lately."""
    fresh = [r for r in records if r.fresh(now, settings.stale_after)]
    if not fresh:
        return None
    problems: list[Problem] = []
    for record in fresh:
        problems.extend(gpu_problems(record, now, xids=settings.xids, hold=settings.hold))
    if not problems:
        count = f"{len(fresh)} GPU{'s' if len(fresh) != 1 else ''}"
        return Verdict("True", "GPUsHealthy", f"The {count} the gpuwarden agent reports on are healthy.")
    reason = min((p.reason for p in problems), key=_SEVERITY.index)
    message = "; ".join(f"{gpu_name(p.gpu)}: {p.text}" for p in problems)
    return Verdict("False", reason, _clip(message))


def incident_event(incident: Incident, settings: NodeSettings) -> tuple[str, str] | None:
    """The Warning Event's ``(reason, message)`` for an incident, or None when it gets none."""
    name = f"GPU {incident.index} ({incident.uuid})"
    match incident.kind:
        case IncidentKind.LOST:
            return (
                "GPULost",
                f"{name} has fallen off the bus (NVML cannot reach it): the work on it has stopped; "
                "drain and reboot the node, check power, cooling and the PCIe slot",
            )
        case IncidentKind.XID if incident.xid is not None and incident.xid in settings.xids:
            return "GPUXidError", f"{name}: {describe_xid(incident.xid)}"
        case IncidentKind.ECC:
            count = int(incident.detail or "1")
            return (
                "GPUMemoryError",
                f"{name}: {count} new uncorrected ECC error{'s' if count != 1 else ''}: data in GPU memory "
                "was lost and the work on it may be wrong; reset the GPU, replace it if it recurs",
            )
        case IncidentKind.MEMORY_REPAIR:
            then = "replace the GPU if it recurs" if "failed" in incident.detail else "it applies the repair"
            return "GPUMemoryError", f"{name}: {incident.detail}; reset the GPU ({then})"
        case IncidentKind.HW_SLOWDOWN:
            return (
                "GPUThrottled",
                f"{name}: the hardware holds its clocks down ({incident.detail}): it is overheating or its "
                "power is braked; check cooling and power",
            )
    return None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


@dataclass(slots=True)
class _Node:
    """What this replica knows of one Node object."""

    uid: str = ""
    status: str | None = None
    reason: str = ""
    message: str = ""
    since: str | None = None
    """The condition's lastTransitionTime."""
    unhealthy_at: float | None = None
    missing_at: float | None = None
    """When the API server said it has no such node (looked up again after a while)."""


class NodeHealthMonitor:
    """Keeps the node view up to date from the health store (see the module doc).

    ``pods`` reads the operator's GPU pod index (namespace → records), for the pods' uids; ``acting``
    says whether this replica acts (peering), as only the acting one receives reports.
    """

    def __init__(
        self,
        config: OperatorConfig,
        api: KubeApi,
        health: HealthStore,
        metrics: OperatorMetrics,
        events: EventSink,
        *,
        pods: Callable[[], Mapping[str, Iterable[PodRecord]]],
        acting: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
        interval: float = 1.0,
    ) -> None:
        self.settings = NodeSettings(xids=config.node_health_xids, hold=config.node_health_hold)
        self.cordon = config.cordon
        self.observe_only = config.observe_only
        self.api = api
        self.events = events
        self.health = health
        self.metrics = metrics
        self.pods = pods
        self._acting = acting
        self._clock = clock
        self.interval = interval
        self._nodes: dict[str, _Node] = {}
        self._seen = 0
        self._posted: dict[tuple[str, str, str, int | None], float] = {}

    async def run(self) -> None:
        """Judge every reporting node once per interval, until cancelled."""
        while True:
            if self._acting():
                try:
                    await self.step()
                except Exception:
                    logger.exception("Judging node health failed; it is retried in a second.")
            await asyncio.sleep(self.interval)

    async def step(self) -> None:
        """Announce the incidents that came in since the last step, then judge every node; an error on
        one incident or node is logged and never stops the others'."""
        now = self._clock()
        for key in [k for k, at in self._posted.items() if now - at >= REPEAT_SECONDS]:
            del self._posted[key]
        for incident in list(self.health.incidents(after=self._seen)):
            self._seen = incident.seq
            try:
                await self._announce(incident, now)
            except Exception:
                logger.exception("Announcing %s on node %s failed.", incident.kind, incident.node)
        for node in sorted(self.health.nodes()):
            if node:
                # One node's failure (a bug, an API error we did not foresee) never stops the others'.
                try:
                    await self._assess(node, now)
                except Exception:
                    logger.exception("Judging node %s failed; it is judged again in a second.", node)

    # -- Events ---------------------------------------------------------------------------------

    async def _announce(self, incident: Incident, now: float) -> None:
        event = incident_event(incident, self.settings)
        if event is None or not incident.node or now - incident.at > self.settings.hold:
            return
        key = (incident.node, incident.uuid, incident.kind.value, incident.xid)
        if key in self._posted:
            return
        self._posted[key] = now
        reason, message = event
        state = await self._node(incident.node, now)
        if state is not None:
            await self._post(self._node_ref(incident.node, state), "Warning", reason, message)
        for pod in incident.pods:
            record = self._pod(pod.namespace, pod.name)
            if record is not None:
                await self._post(
                    record.object_ref(), "Warning", reason, f"on node {incident.node}: {message}"
                )

    def _pod(self, namespace: str, name: str) -> PodRecord | None:
        for record in self.pods().get(namespace, ()):
            if record.view.name == name:
                return record
        return None

    @staticmethod
    def _node_ref(node: str, state: _Node) -> ObjectRef:
        return ObjectRef("v1", "Node", "", node, state.uid)

    async def _post(self, regarding: ObjectRef, type: str, reason: str, message: str) -> None:
        await self.events.post(regarding, type, reason, message)
        self.metrics.events.labels(type, reason).inc()

    # -- the condition and the cordon -----------------------------------------------------------

    async def _node(self, node: str, now: float) -> _Node | None:
        """This replica's record of a Node, read from the API server at first sight; None if it has none."""
        state = self._nodes.get(node)
        if state is not None and (state.missing_at is None or now - state.missing_at < RETRY_MISSING_SECONDS):
            return None if state.missing_at is not None else state
        try:
            body = await self.api.get(f"/api/v1/nodes/{node}")
        except ApiError as exc:
            if exc.status == 404:
                if state is None:
                    logger.warning("Node %s reports GPUs but has no Node object; its condition waits.", node)
                self._nodes[node] = _Node(missing_at=now)
            else:
                logger.warning("Cannot read node %s: %s", node, exc)
            return None
        state = _Node(uid=str((body.get("metadata") or {}).get("uid", "")))
        for condition in (body.get("status") or {}).get("conditions") or ():
            if isinstance(condition, Mapping) and condition.get("type") == CONDITION:
                state.status = str(condition.get("status"))
                state.reason = str(condition.get("reason", ""))
                state.message = str(condition.get("message", ""))
                state.since = condition.get("lastTransitionTime")
        self._nodes[node] = state
        return state

    async def _assess(self, node: str, now: float) -> None:
        verdict = node_verdict(self.health.gpus_on(node), now, self.settings)
        if verdict is None:
            return
        state = await self._node(node, now)
        if state is None:
            return
        if (state.status, state.reason, state.message) == (verdict.status, verdict.reason, verdict.message):
            return
        turned = state.status != verdict.status
        since = state.since if not turned and state.since else format_time(now)
        condition = {
            "type": CONDITION,
            "status": verdict.status,
            "reason": verdict.reason,
            "message": verdict.message,
            "lastHeartbeatTime": format_time(now),
            "lastTransitionTime": since,
        }
        try:
            if not self.observe_only:  # observe only: the Events tell, the node is left as it is
                await self.api.patch_node_condition(node, condition, manager=FIELD_MANAGER)
        except ApiError as exc:
            logger.warning("Cannot set %s on node %s: %s", CONDITION, node, exc)
            if exc.status == 404:
                self._nodes[node] = _Node(missing_at=now)
            return
        was_unhealthy_at = state.unhealthy_at
        was = state.status
        state.status, state.reason, state.message, state.since = (
            verdict.status,
            verdict.reason,
            verdict.message,
            since,
        )
        logger.info(
            "Node %s: %s=%s (%s) %s", node, CONDITION, verdict.status, verdict.reason, verdict.message
        )
        if not turned:
            return
        if verdict.status == "False":
            state.unhealthy_at = now
            await self._cordon(node, state, verdict, now)
        elif was == "False":  # not at first sight of a healthy node: nothing recovered
            state.unhealthy_at = None
            lasted = (
                f" after {approx_duration(now - was_unhealthy_at)}" if was_unhealthy_at is not None else ""
            )
            await self._post(
                self._node_ref(node, state),
                "Normal",
                "GPUHealthRecovered",
                f"GPUs healthy again{lasted}",
            )

    async def _cordon(self, node: str, state: _Node, verdict: Verdict, now: float) -> None:
        why = f"{verdict.reason}: {verdict.message}"
        ref = self._node_ref(node, state)
        if self.cordon is CordonMode.DRY_RUN:
            text = f"would cordon the node (--cordon=dry-run; nothing changed): {why}"
            await self._post(ref, "Normal", "GPUNodeCordonDryRun", text)
            return
        if self.cordon is not CordonMode.ON:
            return
        try:
            body = await self.api.get(f"/api/v1/nodes/{node}")
            if (body.get("spec") or {}).get("unschedulable"):
                return  # cordoned already, by someone or by us: leave it as it is
            await self.api.cordon_node(
                node, {CORDON_ANNOTATION: f"{format_time(now)} {verdict.reason}"}, manager=FIELD_MANAGER
            )
        except ApiError as exc:
            logger.warning("Cannot cordon node %s: %s", node, exc)
            return
        logger.warning("Cordoned node %s: %s", node, why)
        text = f"cordoned: {why}; uncordon it (kubectl uncordon {node}) once its GPUs are fixed"
        await self._post(ref, "Warning", "GPUNodeCordoned", text)

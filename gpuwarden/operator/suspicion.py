"""What the operator asks the hooks of a pod under a ``memoryGrowth`` finding, through its node's agent.

The operator judges, but only the node's agent reaches a training process's hook (docs/hook.md,
"In a cluster"). So :meth:`HookAsks.observe`, after each evaluation of a policy this replica acts on,
files for each pod with an active growth finding an ask to ``record`` the allocator's history (once
a pod), and, when :func:`~gpuwarden.policy.snapshot_due` says so, one ``snapshot`` per finding. An ask
waits for its node: :meth:`HookAsks.for_node` puts it in the answer to that node's next report
(``hookAsks``), again in every answer until its reply comes back on a snapshot (:meth:`HookAsks.replied`)
or :data:`ASK_TTL_S` passes. Each reply worth saying becomes an Event on the pod: recording began
(``GPUMemoryRecording``), a snapshot was written (``GPUMemorySnapshot``: the file and its top lines),
or could not be (``GPUMemorySnapshotFailed``: why). A pod without a hook that takes requests says so
once (the agent's ``noHookedProcess``, the hook's ``notSupported``) and is not asked again for
recording; snapshots are asked all the same, one per finding, as the hook may have come since.

Bounded: at most :data:`~gpuwarden.wire.node.MAX_HOOK_ASKS` asks wait per node; a reply whose id the
operator does not have waiting (a node answering for another's ask, a duplicate) is dropped.

Sharded mode: a policy's findings are on the replica that owns the policy, and a node's reports go to
the replica that owns the node; an ask reaches its node only where the two are the same replica (else it
expires unanswered). Not sharded, every ask reaches its node.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.operator.kube import EventSink
from gpuwarden.operator.resources import ObjectRef
from gpuwarden.policy import Finding, answer_text, snapshot_due
from gpuwarden.wire.node import MAX_HOOK_ASKS, HookAsk, HookOp, HookReply, dump_asks

__all__ = ["ASK_TTL_S", "GROWTH_KIND", "HookAsks", "PodPlace"]

logger = logging.getLogger(__name__)

GROWTH_KIND = "memoryGrowth"
ASK_TTL_S = 120.0
"""An ask not answered within this long is dropped (its node is gone, or reports to another replica);
a recording ask is filed again at the next evaluation that still finds the leak."""
QUIET = ("notSupported", "unknownProcess", "noHookedProcess")
"""Refusals that say the pod has no hook taking requests: said once a pod, never as a failure."""


@dataclass(frozen=True, slots=True)
class PodPlace:
    """Where a pod under suspicion runs, and how an Event names it."""

    node: str
    ref: ObjectRef


@dataclass(slots=True)
class _Ask:
    ask: HookAsk
    node: str
    ref: ObjectRef
    filed_at: float


class HookAsks:
    """The asks waiting for each node, and what their replies say (see the module doc). ``events``
    posts the Events; ``clock`` is the operator's (epoch seconds)."""

    def __init__(self, events: EventSink, clock: Callable[[], float]) -> None:
        self._events = events
        self._clock = clock
        # Ids unique across restarts in practice (a restarted operator's first id is its start in ms),
        # so that an agent remembering the ids it acted on does not take a new ask for an old one.
        self._ids = itertools.count(int(clock() * 1000))
        self._waiting: dict[int, _Ask] = {}
        self._recording: dict[tuple[str, str], float | None] = {}
        """(namespace, pod) → when its recording began; None: asked, or it has no hook taking requests."""
        self._snapshots: set[tuple[str, str, str, str]] = set()
        """(policy, rule, namespace, pod) of the findings a snapshot was asked for: one each."""
        self._tasks: set[asyncio.Task[None]] = set()

    def observe(
        self,
        policy: str,
        active: Iterable[Finding],
        place_of: Callable[[str], PodPlace | None],
        before: Mapping[str, float],
    ) -> None:
        """File the asks ``policy``'s ``active`` findings call for; ``place_of``: where a pod of the
        policy's namespace runs, by name (None: not known, not asked); ``before``: its memoryGrowth
        rules' ``snapshotBefore``, by name (:func:`~gpuwarden.policy.snapshot_before`). Forgets the
        snapshots asked for its findings no longer active."""
        now = self._clock()
        self._expire(now)
        growing = [
            (f, place) for f in active if f.kind == GROWTH_KIND and (place := place_of(f.pod)) is not None
        ]
        live = {(f.policy, f.rule, f.namespace, f.pod) for f, _ in growing}
        self._snapshots = {k for k in self._snapshots if k[0] != policy or k in live}
        for finding, place in growing:
            pod = (finding.namespace, finding.pod)
            if pod not in self._recording:
                self._recording[pod] = None
                self._file("record", finding, place, now)
            key = (finding.policy, finding.rule, finding.namespace, finding.pod)
            since = self._recording.get(pod)
            recorded_for = None if since is None else now - since
            due = snapshot_due(
                finding.reason, finding.seconds_to_full, recorded_for, before.get(finding.rule)
            )
            if key not in self._snapshots and due:
                self._snapshots.add(key)
                self._file("snapshot", finding, place, now)

    def for_node(self, node: str) -> str | None:
        """The answer's ``hookAsks`` for ``node`` (JSON), None when nothing waits for it."""
        if not self._waiting:  # nearly always: this answers every report
            return None
        asks = [w.ask for w in self._waiting.values() if w.node == node]
        return dump_asks(asks) if asks else None

    def replied(self, node: str, replies: Sequence[HookReply]) -> None:
        """Take ``node``'s agent's replies: each one ends its ask, and says what happened in an Event."""
        # A pod's hooked processes each reply to the same ask, together: the ask ends after all of them.
        answered: set[int] = set()
        for reply in replies:
            waiting = self._waiting.get(reply.id)
            if waiting is None or waiting.node != node or waiting.ask.op != reply.op:
                continue  # not ours to hear from this node (or heard already in an earlier snapshot)
            answered.add(reply.id)
            self._heard(waiting, reply)
        for id_ in answered:
            del self._waiting[id_]

    def forget_pod(self, namespace: str, name: str) -> None:
        """A pod was deleted: drop its asks and what it was asked."""
        self._recording.pop((namespace, name), None)
        self._snapshots = {k for k in self._snapshots if (k[2], k[3]) != (namespace, name)}
        for id_, w in list(self._waiting.items()):
            if (w.ask.namespace, w.ask.pod) == (namespace, name):
                del self._waiting[id_]

    async def drain(self) -> None:
        """Until the Events of the replies taken so far are posted (tests; the operator's shutdown)."""
        await asyncio.gather(*self._tasks)

    def _file(self, op: HookOp, finding: Finding, place: PodPlace, now: float) -> None:
        if sum(1 for w in self._waiting.values() if w.node == place.node) >= MAX_HOOK_ASKS:
            logger.warning(
                "%s asks already wait for node %s; %s of %s/%s not asked",
                MAX_HOOK_ASKS,
                place.node,
                op,
                finding.namespace,
                finding.pod,
            )
            if op == "record":
                del self._recording[(finding.namespace, finding.pod)]  # asked again next evaluation
            return
        ask = HookAsk(
            id=next(self._ids), namespace=finding.namespace, pod=finding.pod, gpus=list(finding.gpus), op=op
        )
        self._waiting[ask.id] = _Ask(ask, place.node, place.ref, now)

    def _expire(self, now: float) -> None:
        for id_, w in list(self._waiting.items()):
            if now - w.filed_at > ASK_TTL_S:
                del self._waiting[id_]
                pod = (w.ask.namespace, w.ask.pod)
                if w.ask.op == "record" and self._recording.get(pod) is None:
                    self._recording.pop(pod, None)

    def _heard(self, waiting: _Ask, reply: HookReply) -> None:
        pod = (reply.namespace, reply.pod)
        reason = reply.reason or ""
        who = f"pid {reply.pid}" if reply.pid else "the pod"
        if reply.op == "record":
            if reply.status == "ok" or reason.startswith("alreadyRecording"):
                if self._recording.get(pod) is None:
                    self._recording[pod] = self._clock()
                self._post(
                    waiting,
                    "Normal",
                    "GPUMemoryRecording",
                    f"{who}: recording the allocator's history (GPU bytes by line), asked on a "
                    f"memoryGrowth finding; its cost is in docs/hook.md",
                )
            elif not reason.startswith(QUIET):
                self._post(
                    waiting,
                    "Warning",
                    "GPUMemorySnapshotFailed",
                    f"{who}: cannot record the allocator's history: {answer_text(reply)}",
                )
            return
        if reply.status == "ok":
            self._post(waiting, "Normal", "GPUMemorySnapshot", f"{who} wrote {answer_text(reply)}")
        elif not reason.startswith(QUIET):
            self._post(
                waiting, "Warning", "GPUMemorySnapshotFailed", f"{who}: no snapshot: {answer_text(reply)}"
            )

    def _post(self, waiting: _Ask, type_: str, reason: str, message: str) -> None:
        self._spawn(self._events.post(waiting.ref, type_, reason, message))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

"""The operator's asks to the hooks of this node's pods, relayed (docs/hook.md, "In a cluster").

The operator judges; only the node's agent can reach a training process's hook. So once a
``memoryGrowth`` finding starts for a pod, the operator's answer to this node's next report carries a
``hookAsks`` entry (:class:`~gpuwarden.wire.node.HookAsk`: record the allocator's history, or write a
snapshot); :meth:`HookRelay.accept` takes it, asks each hooked process of that pod on those GPUs
(:class:`PodProcesses`, from the newest snapshot's attribution) over its hook connection, and files each
answer as a :class:`~gpuwarden.wire.node.HookReply`, which rides on the next snapshot out
(:meth:`HookRelay.drain`). A pod with no hooked process there, or none that takes requests, is answered
``refused`` with ``pid`` 0, so that the operator stops asking.

The operator repeats an ask in every answer until its reply arrives (an answer can be lost); the relay
acts on each ``id`` once, remembered for :data:`REMEMBER_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from gpuwarden.agent.hooksocket import HookServer, refusal
from gpuwarden.wire.hook import HookAnswer
from gpuwarden.wire.node import (
    MAX_HOOK_ASKS,
    MAX_HOOK_REPLIES,
    AsksError,
    HookAsk,
    HookReply,
    Snapshot,
    device_key,
    parse_asks,
)

__all__ = ["REMEMBER_S", "HookRelay", "PodProcesses"]

log = logging.getLogger(__name__)

REMEMBER_S = 600.0
"""How long an ask's id is remembered as acted on: longer than the operator keeps asking it."""
MAX_PENDING_REPLIES = 4 * MAX_HOOK_REPLIES
"""Replies kept while no snapshot goes out (the oldest dropped first): the operator asks again."""


class PodProcesses:
    """Which hooked processes each pod runs on each GPU, as the newest snapshot attributes them."""

    def __init__(self) -> None:
        self._newest: Snapshot | None = None

    def observe(self, snapshot: Snapshot) -> Snapshot:
        """Keep ``snapshot`` (annotated: pods and hooks attached) as the newest; return it."""
        self._newest = snapshot
        return snapshot

    def pids(self, namespace: str, pod: str, gpus: Sequence[str] = ()) -> list[int]:
        """The PIDs of ``namespace/pod``'s processes with a hook reading, on ``gpus`` (a GPU's UUID or a
        MIG device's; empty: on any GPU), in the snapshot's order, each once."""
        found: dict[int, None] = {}
        for gpu in self._newest.gpus if self._newest is not None else ():
            if gpus and device_key(gpu) not in gpus and gpu.uuid not in gpus:
                continue
            for process in gpu.processes:
                ref = process.pod
                if (
                    ref is not None
                    and process.hook is not None
                    and (ref.namespace, ref.name) == (namespace, pod)
                ):
                    found[process.pid] = None
        return list(found)


class HookRelay:
    """Relays the operator's asks to the hooks (see the module doc)."""

    def __init__(
        self,
        hooks: HookServer,
        processes: PodProcesses,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hooks = hooks
        self._processes = processes
        self._monotonic = monotonic
        self._acted: dict[int, float] = {}
        """Ask id → when it was taken."""
        self._replies: deque[HookReply] = deque(maxlen=MAX_PENDING_REPLIES)
        self._tasks: set[asyncio.Task[None]] = set()

    def accept(self, value: Any) -> None:
        """Act on the ``hookAsks`` of an answer (its decoded JSON; None when it has none)."""
        try:
            asks = parse_asks(value)
        except AsksError as exc:
            log.warning("the operator's hookAsks are malformed (%s); ignored", exc)
            return
        now = self._monotonic()
        for id_, taken in list(self._acted.items()):
            if now - taken > REMEMBER_S:
                del self._acted[id_]
        for ask in asks[:MAX_HOOK_ASKS]:
            if ask.id in self._acted:
                continue
            self._acted[ask.id] = now
            self._spawn(self._relay(ask))

    @property
    def pending(self) -> int:
        """Replies filed and not yet drained."""
        return len(self._replies)

    def drain(self) -> list[HookReply]:
        """The replies filed since the last call, at most :data:`MAX_HOOK_REPLIES` (the rest wait)."""
        out: list[HookReply] = []
        while self._replies and len(out) < MAX_HOOK_REPLIES:
            out.append(self._replies.popleft())
        return out

    async def settled(self) -> None:
        """Until the asks taken so far are answered (each hook's wait is bounded)."""
        await asyncio.gather(*self._tasks)

    async def close(self) -> None:
        """Give up the asks still on their way (the agent is stopping)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, ask: HookAsk) -> None:
        pids = self._processes.pids(ask.namespace, ask.pod, ask.gpus)
        if not pids:
            self._file(ask, 0, refusal(0, "noHookedProcess: no process of this pod there has a hook"))
            return
        answers = await asyncio.gather(*(self._hooks.ask(pid, ask.op) for pid in pids))
        for pid, answer in zip(pids, answers, strict=True):
            self._file(ask, pid, answer)

    def _file(self, ask: HookAsk, pid: int, answer: HookAnswer) -> None:
        fields = answer.model_dump(exclude={"id"})
        self._replies.append(
            HookReply(id=ask.id, namespace=ask.namespace, pod=ask.pod, pid=pid, op=ask.op, **fields)
        )

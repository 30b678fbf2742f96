"""What watch asks a hooked process once a leak is suspected: GPU bytes by line, then a snapshot.

On a memoryGrowth finding of a process whose hook takes requests (docs/hook.md, "Requests"), watch asks
the hook to ``record`` the allocator's history: from then on its readings carry the GPU bytes of each
of the job's lines, which the finding's message names (``train.py:35 holds 41.2Gi (+36.9Gi/m)``).
When :func:`~gpuwarden.policy.snapshot_due` says so (the leak imminent and recorded for a while, or
the card about to be full), it asks for one ``snapshot``: one per finding. The operator follows the
same rule through the nodes' agents (:mod:`gpuwarden.operator.suspicion`). Each answer is said on a
line of its own (``RECORDING``, ``SNAPSHOT``, ``NO SNAPSHOT``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

from gpuwarden.agent.hooksocket import HookServer
from gpuwarden.policy import PROCESS_NAMESPACE, Finding, answer_text, snapshot_due

GROWTH_KIND = "memoryGrowth"
QUIET = ("notSupported", "unknownProcess")
"""Refusals not worth a line: a process without a hook, or whose job did not opt in."""


def pid_of(finding: Finding) -> int | None:
    """The PID a finding speaks of in watch (``pid/<pid>``), None for anything else."""
    name = finding.pod
    if finding.namespace != PROCESS_NAMESPACE or not name.startswith("pid/") or not name[4:].isdigit():
        return None
    return int(name[4:])


class SuspicionResponder:
    """Asks the hooks of processes under a growth finding (see the module doc); :meth:`observe` after
    each evaluation, on the event loop. ``note`` says each answer; ``clock`` is the findings' clock."""

    def __init__(
        self,
        hooks: HookServer,
        note: Callable[[str], None],
        before: Mapping[tuple[str, str], float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._hooks = hooks
        self._before = before or {}
        """(policy, rule) → the rule's ``snapshotBefore``; a rule not in it: the default, 16m."""
        self._note = note
        self._clock = clock
        self._recording: dict[int, float | None] = {}
        """PID → when recording began (None while the request is on its way, or when refused)."""
        self._snapshots: set[tuple[str, str, int]] = set()
        """(policy, rule, pid) of the findings a snapshot was asked for: one each."""
        self._tasks: set[asyncio.Task[None]] = set()

    def observe(self, findings: Iterable[Finding], now: float) -> None:
        """Ask what the active ``findings`` call for (each thing once)."""
        for finding in findings:
            pid = pid_of(finding)
            if finding.kind != GROWTH_KIND or pid is None:
                continue
            if pid not in self._recording:
                self._recording[pid] = None
                self._spawn(self._record(pid, finding.rule))
            key = (finding.policy, finding.rule, pid)
            if key in self._snapshots or not self._due(finding, pid, now):
                continue
            self._snapshots.add(key)
            self._spawn(self._snapshot(pid, finding.rule))

    def _due(self, finding: Finding, pid: int, now: float) -> bool:
        since = self._recording.get(pid)
        recorded_for = None if since is None else now - since
        before = self._before.get((finding.policy, finding.rule))
        return snapshot_due(finding.reason, finding.seconds_to_full, recorded_for, before)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, pid: int, rule: str) -> None:
        answer = await self._hooks.ask(pid, "record")
        reason = answer.reason or ""
        if answer.status == "ok" or reason.startswith("alreadyRecording"):
            self._recording[pid] = self._clock()
            self._note(f"RECORDING {rule} pid {pid}: GPU bytes by line, from the allocator's history")
        elif not reason.startswith(QUIET):
            self._note(f"NOT RECORDING {rule} pid {pid}: {answer_text(answer)}")

    async def _snapshot(self, pid: int, rule: str) -> None:
        answer = await self._hooks.ask(pid, "snapshot")
        if (answer.reason or "").startswith(QUIET):
            return
        word = "SNAPSHOT" if answer.status == "ok" else "NO SNAPSHOT"
        self._note(f"{word} {rule} pid {pid}: {answer_text(answer)}")

    async def close(self) -> None:
        """Give up the questions still on their way (watch is stopping)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""When each policy's evaluation daemon evaluates next: its :class:`Pacing`, and the schedule of all.

A daemon evaluates every ``evaluationInterval``, as soon as fresh readings for its namespace
arrived after the interval began (so a condition is judged as soon as its data lands), and at
once when its spec changes. The ingest wakes the daemons of the namespaces that got readings
(:meth:`PolicySchedule.nudge_data`), the policy handler the daemon whose spec changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Pacing", "PolicySchedule"]


@dataclass(slots=True)
class Pacing:
    """When a policy's daemon evaluates next: every interval, as soon as fresh data came after it."""

    interval: float = 10.0
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    spec_changed: bool = False
    data_pending: bool = False
    due_at: float | None = None
    """Loop time at which a spec change made the next evaluation due (for the delay histogram)."""
    data_at: float = 0.0
    """Loop time the latest readings arrived."""
    uid: str = ""
    """The policy object's uid: a deletion ends only its own daemon, never a namesake's created since."""
    ended: bool = False
    """The policy is gone: the daemon returns at its next wake-up (:meth:`end`)."""

    def end(self) -> None:
        """The policy was deleted: wake the daemon so that it returns."""
        self.ended = True
        self.wakeup.set()

    def nudge_spec(self) -> None:
        """The spec changed: evaluate now."""
        self.spec_changed = True
        if self.due_at is None:
            self.due_at = asyncio.get_running_loop().time()
        self.wakeup.set()

    def nudge_data(self, now: float) -> None:
        """Readings for the policy's namespace arrived at loop time ``now``."""
        if not self.data_pending:
            self.data_pending = True
            self.wakeup.set()
        self.data_at = now

    async def wait_next(self, started: float) -> float:
        """Sleep until the next evaluation is due (the previous one started at loop time ``started``).

        Due ``interval`` after the previous start, once readings arrived since it
        (so a condition is judged as soon as its data lands, not up to an interval
        later); without readings, one interval later still (to notice silence).
        Returns the loop time it became due.
        """
        loop = asyncio.get_running_loop()
        due = started + self.interval
        while not (self.spec_changed or self.ended) and loop.time() < due:
            await _sleep_on(self.wakeup, due - loop.time())
        if self.ended:
            return loop.time()
        if not self.spec_changed:
            fallback = due + self.interval
            while not (self.data_pending or self.spec_changed or self.ended) and loop.time() < fallback:
                await _sleep_on(self.wakeup, fallback - loop.time())
            if self.data_pending:
                due = max(due, self.data_at)
            elif not self.spec_changed:
                due = fallback
        at = self.due_at if self.spec_changed and self.due_at is not None else due
        self.spec_changed = self.data_pending = False
        self.due_at = None
        self.wakeup.clear()
        return at


async def _sleep_on(event: asyncio.Event, seconds: float) -> None:
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await event.wait()
    except TimeoutError:
        pass
    event.clear()


class PolicySchedule:
    """The pacing of every evaluation daemon running here, by namespace and policy name."""

    def __init__(self) -> None:
        self._pacing: dict[str, dict[str, Pacing]] = {}
        self._by_uid: dict[str, Pacing] = {}
        """Every running daemon's by its policy object's uid: a namesake created before the deleted
        one's daemon ended has taken its place above."""

    def __len__(self) -> int:
        return sum(len(p) for p in self._pacing.values())

    def __contains__(self, policy: tuple[str, str]) -> bool:
        return policy[1] in self._pacing.get(policy[0], {})

    def open(self, namespace: str, name: str, uid: str = "") -> Pacing:
        """A policy's daemon starts: its pacing, fresh."""
        pacing = self._pacing.setdefault(namespace, {})[name] = Pacing(uid=uid)
        if uid:
            self._by_uid[uid] = pacing
        return pacing

    def close(self, namespace: str, name: str, pacing: Pacing | None = None) -> None:
        """A policy's daemon ends (``pacing``: only if it is still this one, not a namesake's since)."""
        policies = self._pacing.get(namespace, {})
        if pacing is None or policies.get(name) is pacing:
            policies.pop(name, None)
        if pacing is not None and self._by_uid.get(pacing.uid) is pacing:
            del self._by_uid[pacing.uid]
        if not policies:
            self._pacing.pop(namespace, None)

    def nudge_spec(self, namespace: str, name: str) -> None:
        """A policy's spec changed: its daemon (if it runs here) evaluates now."""
        pacing = self._pacing.get(namespace, {}).get(name)
        if pacing is not None:
            pacing.nudge_spec()

    def end(self, uid: str) -> None:
        """The policy object ``uid`` was deleted: its daemon (if it runs here) returns."""
        pacing = self._by_uid.get(uid)
        if pacing is not None:
            pacing.end()

    def nudge_data(self, namespaces: Iterable[str]) -> None:
        """Readings for ``namespaces`` arrived: their policies' daemons may evaluate."""
        if not self._pacing:
            return
        now = asyncio.get_running_loop().time()
        for namespace in namespaces:
            for pacing in self._pacing.get(namespace, {}).values():
                pacing.nudge_data(now)

    def nudge_policy_data(self, namespace: str, name: str) -> None:
        """Data for one policy arrived (another shard's verdicts): its daemon, if running here, may run."""
        pacing = self._pacing.get(namespace, {}).get(name)
        if pacing is not None:
            pacing.nudge_data(asyncio.get_running_loop().time())

    def running(self) -> list[tuple[str, str]]:
        """(namespace, name) of every policy whose daemon runs here."""
        return [(ns, name) for ns, names in self._pacing.items() for name in names]

"""What became of each pod's latest scrape, for its policies' ``ServiceMetricsAvailable`` condition.

The intake writes each scrape's outcome here as it stores the scrape (the reason of a failed one, as
the agent sent it); the plan writes ``NoPort`` for a selected pod with no port to scrape. A policy's
condition (:func:`availability`) counts its selected pods' latest outcomes by reason and names a few
pods of each. Bounded like the series: an outcome older than the retention is forgotten, and a
deleted pod's at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuwarden.policy import PodId
from gpuwarden.wire.scrape import ScrapeFailure

__all__ = ["AVAILABLE", "NAMED_PODS", "Outcome", "ScrapeBook", "availability"]

AVAILABLE = "ServiceMetricsAvailable"
"""The condition's type."""
NAMED_PODS = 3
"""Pods named per reason in the condition's message."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """A pod's latest scrape (or plan) outcome: None when its metrics were read, else the reason."""

    error: ScrapeFailure | None
    at: float


class ScrapeBook:
    """The latest outcome per pod (see the module doc); ``retention_seconds`` as the series store's."""

    def __init__(self, retention_seconds: float) -> None:
        self.retention_seconds = retention_seconds
        self._latest: dict[PodId, Outcome] = {}

    def __len__(self) -> int:
        return len(self._latest)

    def saw(self, pod: PodId, error: ScrapeFailure | None, at: float) -> None:
        """Record an outcome, unless an outcome newer than ``at`` is recorded (a replay comes late)."""
        known = self._latest.get(pod)
        if known is None or known.at <= at:
            self._latest[pod] = Outcome(error, at)

    def latest(self, pod: PodId) -> Outcome | None:
        """The pod's latest outcome, if any."""
        return self._latest.get(pod)

    def forget_pod(self, namespace: str, name: str) -> None:
        """A pod was deleted."""
        self._latest.pop(PodId(namespace, name), None)

    def prune(self, now: float) -> None:
        """Forget outcomes older than the retention."""
        horizon = now - self.retention_seconds
        for pod in [p for p, o in self._latest.items() if o.at < horizon]:
            del self._latest[pod]


def availability(book: ScrapeBook, pods: Iterable[PodId]) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the ``ServiceMetricsAvailable`` condition over ``pods``."""
    read = 0
    failing: dict[str, list[str]] = {}
    for pod in sorted(pods):
        outcome = book.latest(pod)
        if outcome is None:
            continue
        if outcome.error is None:
            read += 1
        else:
            failing.setdefault(outcome.error.value, []).append(pod.name)
    if failing:
        total = read + sum(len(names) for names in failing.values())
        parts = []
        for reason, names in sorted(failing.items()):
            shown = ", ".join(names[:NAMED_PODS]) + (", …" if len(names) > NAMED_PODS else "")
            parts.append(f"{reason} {len(names)} ({shown})")
        bad = total - read
        message = f"{bad} of {total} pods' metrics cannot be read: {'; '.join(parts)}."
        return "False", "EndpointsFailing", message
    if read:
        return "True", "MetricsRead", f"The metrics of all {read} scraped pods are read."
    return "Unknown", "NoScrapes", "No selected pod's metrics have been read yet."

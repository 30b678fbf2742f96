"""A policy's ``ServiceMetricsAvailable`` condition: whether its selected pods' own metrics are read.

Built from each selected pod's latest scrape in the service store (the agent's outcome, or ``NoPort``
when the plan found no port to scrape, :meth:`~gpuwarden.operator.admission.ReportAdmission.plan`):
failing pods counted by reason with a few named, as a user can act on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuwarden.policy import PodId, ServiceScrape

__all__ = ["AVAILABLE", "NAMED_PODS", "availability"]

AVAILABLE = "ServiceMetricsAvailable"
"""The condition's type."""
NAMED_PODS = 3
"""Pods named per reason in the condition's message."""


def availability(
    latest: Callable[[PodId], ServiceScrape | None], pods: Iterable[PodId]
) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the condition over ``pods``, by each one's ``latest`` scrape:
    ``True`` (``MetricsRead``) when every pod scraped lately was read; ``False`` (``EndpointsFailing``)
    when one failed; ``Unknown`` (``NoScrapes``) before the first scrape."""
    read = 0
    failing: dict[str, list[str]] = {}
    for pod in sorted(pods):
        scrape = latest(pod)
        if scrape is None:
            continue
        if scrape.error is None:
            read += 1
        else:
            failing.setdefault(scrape.error, []).append(pod.name)
    if failing:
        bad = sum(len(names) for names in failing.values())
        parts = []
        for reason, names in sorted(failing.items()):
            shown = ", ".join(names[:NAMED_PODS]) + (", …" if len(names) > NAMED_PODS else "")
            parts.append(f"{reason} {len(names)} ({shown})")
        message = f"{bad} of {bad + read} pods' metrics cannot be read: {'; '.join(parts)}."
        return "False", "EndpointsFailing", message
    if read:
        return "True", "MetricsRead", f"The metrics of all {read} scraped pods are read."
    return "Unknown", "NoScrapes", "No selected pod's metrics have been read yet."

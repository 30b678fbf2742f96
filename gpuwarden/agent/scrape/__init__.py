"""Reading the pods' own metrics: the operator's scrape plan in, compacted scrapes out (issue 30).

What the rest of the agent imports (only from here): :class:`Scraper` (the loop, and the plan it
takes from the answers to the reports), :class:`ListedPod` (how the agent's pod list answers it),
:class:`ScrapeEvents` (what it counts), and the vocabularies of its counters (:data:`RESULTS`,
:data:`REFUSALS`) and its defaults. Inside: ``fetch`` (one bounded GET), ``compact`` (the page
parsed and kept to the names asked for), ``scraper`` (the schedule). Local mode's ``watch
--service-metrics`` fetches and compacts a page as the scraper does: :func:`fetch`, :func:`compact`,
:class:`ScrapeFailed`.
"""

from gpuwarden.agent.scrape.compact import ScrapeFailed, compact
from gpuwarden.agent.scrape.fetch import DEFAULT_MAX_BYTES, fetch
from gpuwarden.agent.scrape.scraper import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIMEOUT,
    REFUSALS,
    RESULTS,
    ListedPod,
    ScrapeEvents,
    Scraper,
)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_TIMEOUT",
    "REFUSALS",
    "RESULTS",
    "ListedPod",
    "ScrapeEvents",
    "ScrapeFailed",
    "Scraper",
    "compact",
    "fetch",
]

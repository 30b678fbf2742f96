"""memoryGrowth: GPU memory growing in a straight line (a leak), and the time until the card is full.

What it decides, and why, is told once, for users and readers of this code alike, in docs/policy.md,
"memoryGrowth" (evidence spans, urgency, imminent, the bucket-aligned spans, the shape tests, holds and
clears, cost, which memory). In short: each GPU's memory is judged over a ladder of trailing spans
(4m doubling up to the ``window``; shorter "urgent" spans only when the card would be full soon), each
cut into 20 buckets aligned to the epoch so that a verdict depends on the samples only, never on when
evaluations run. A span holds when the Theil-Sen slope's lower bound reaches ``rate``, the line fits,
every quarter grows, the rise is not made of jumps and memory was not higher before.

Its parts, by job: ``model`` (the spec, the constants, the spans and the reasons), ``shape`` (one GPU's
trend over one span), ``cache`` (the trends kept between evaluations), ``judge`` (the verdicts),
``text`` (the messages), ``parse`` (the rule's body) and ``snapshot`` (when a suspect's hook is
asked for an allocator snapshot). Others import what this package exports
(``__all__``); tests may reach a part's own names.
"""

from gpuwarden.policy.rules.common import JudgeContext, Outcome, RuleType
from gpuwarden.policy.rules.growth.cache import GrowthCache
from gpuwarden.policy.rules.growth.judge import evaluate_growth
from gpuwarden.policy.rules.growth.model import (
    BUCKETS,
    HOST_IMMINENT_REASON,
    IMMINENT_REASON,
    IMMINENT_SECONDS,
    KIND,
    MESSAGE_SITES,
    MemoryGrowth,
    MemorySource,
)
from gpuwarden.policy.rules.growth.parse import BODY, parse_memory_growth
from gpuwarden.policy.rules.growth.snapshot import snapshot_before, snapshot_due
from gpuwarden.policy.rules.growth.text import answer_text, site_text

__all__ = [
    "HOST_IMMINENT_REASON",
    "IMMINENT_REASON",
    "IMMINENT_SECONDS",
    "KIND",
    "MESSAGE_SITES",
    "RULE_TYPE",
    "GrowthCache",
    "MemoryGrowth",
    "MemorySource",
    "answer_text",
    "evaluate_growth",
    "parse_memory_growth",
    "site_text",
    "snapshot_before",
    "snapshot_due",
]


def _judge(rule: MemoryGrowth, c: JudgeContext, memo: GrowthCache | None) -> Outcome:
    return evaluate_growth(rule, c.pod, c.series, c.now, c.params, memo)


RULE_TYPE = RuleType(
    kind=KIND,
    model=MemoryGrowth,
    parse=parse_memory_growth,
    body=BODY,
    evaluate=_judge,
    # growth_window: the window plus one bucket.
    reach=lambda rule: rule.window_seconds * (1 + 1 / BUCKETS),
    window=lambda rule: rule.window_seconds,
    reason="GPUMemoryLeakSuspected",
    meaning="steady growth like this usually means a leak, heading for out-of-memory",
    per_gpu=True,
    colour="darkmagenta",
    utilization=False,
    hold=lambda rule: rule.for_seconds,
    memo=GrowthCache,
)

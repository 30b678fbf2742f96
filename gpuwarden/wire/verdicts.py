"""The VerdictReport wire schema: one shard's per-pod verdicts on one policy, for the policy's owner.

Sharded mode (docs/scaling-out.md, "Policies across shards"): a replica that does not own a
policy judges the policy's rules on the pods whose readings it holds and sends the owner, once
per evaluation interval, ``POST /v1/verdicts``, what each rule concluded about each pod: whether
it holds or clears, the figure and the message. Not readings: a few hundred bytes a judged pod
instead of the window's thousands of points. The owner runs the findings' lifecycle (start,
re-notification, resolution) on them as on its own pods' outcomes.

Parsed strictly and bounded like :mod:`gpuwarden.wire.node`: JSON types as declared, floats
finite, every list and string capped, unknown fields refused.
"""

from __future__ import annotations

from pydantic import Field

from gpuwarden.wire.base import MAX_COUNT, MAX_TIMESTAMP, WireModel, parse_strict

__all__ = [
    "MAX_PODS",
    "SCHEMA_VERSION",
    "VERDICT_REFUSALS",
    "PodVerdict",
    "RuleVerdict",
    "VerdictError",
    "VerdictReport",
    "dump_verdicts",
    "parse_verdicts",
]

SCHEMA_VERSION = 1
"""The ``schemaVersion`` this build sends and accepts."""

MAX_PODS = 50_000
"""Pods one report may judge: a shard of 2,000 nodes holds at most 16,000 GPU pods."""
VERDICT_REFUSALS = ("unknownPolicy", "future", "tooManyPods")
"""Why an owner keeps none of a verdict report (a policy whose daemon does not run here; ``at``
ahead of its clock by more than the readings' skew), or not some of its pods' verdicts (past
:data:`MAX_PODS` pods held for one policy)."""
MAX_RULES = 64
"""Rules a policy may have that one pod's verdict speaks for."""
MAX_VALUE = 2.0**60
"""Figures (percent, bytes, bytes/s, seconds) are far below this; beyond, no reading made them."""


class RuleVerdict(WireModel):
    """What one rule concluded about one pod: only rules that had something to judge are sent."""

    rule: str = Field(min_length=1, max_length=253)
    kind: str = Field(min_length=1, max_length=64)
    """The rule's kind as the shard's spec has it (``utilizationFloor``...)."""
    holds: bool
    """The rule is violated (a finding starts, or goes on)."""
    clears: bool
    """Back within the rule by its hysteresis margin (an active finding resolves)."""
    value: float = Field(ge=-MAX_VALUE, le=MAX_VALUE)
    threshold: float = Field(ge=-MAX_VALUE, le=MAX_VALUE)
    unit: str = Field(max_length=32)
    gpus: list[str] = Field(default_factory=list, max_length=64)
    reason: str | None = Field(default=None, max_length=128)
    """The finding's reason when it is not the kind's (an anomaly's pattern)."""
    message: str = Field(default="", max_length=4096)
    fit: float | None = Field(default=None, ge=-MAX_VALUE, le=MAX_VALUE)
    seconds_to_full: float | None = Field(default=None, ge=0, le=MAX_VALUE)


class PodVerdict(WireModel):
    """One pod of the policy's namespace, judged by the sending shard (its node is the shard's)."""

    pod: str = Field(min_length=1, max_length=253)
    rules: list[RuleVerdict] = Field(default_factory=list, max_length=MAX_RULES)
    """Empty: the pod is the shard's, but no rule had anything to judge (no readings yet)."""


class VerdictReport(WireModel):
    """One shard's verdicts on one policy at one evaluation."""

    schema_version: int = Field(ge=0, le=2**31)
    shard: str = Field(min_length=1, max_length=253)
    """The sending replica's identity."""
    at: float = Field(gt=0, le=MAX_TIMESTAMP)
    """When the shard judged (seconds since the epoch, its clock): the newest verdict on a pod wins."""
    namespace: str = Field(min_length=1, max_length=253)
    policy: str = Field(min_length=1, max_length=253)
    generation: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """The policy's ``metadata.generation`` the shard judged by; the owner drops verdicts of another."""
    pods: list[PodVerdict] = Field(default_factory=list, max_length=MAX_PODS)


class VerdictError(ValueError):
    """A body that is not a valid VerdictReport; the message names the field."""


def parse_verdicts(body: bytes | str) -> VerdictReport:
    """Parse a JSON body strictly; raise :class:`VerdictError` naming the field."""
    report = parse_strict(VerdictReport, body, VerdictError)
    if report.schema_version != SCHEMA_VERSION:
        raise VerdictError(
            f"schemaVersion: {report.schema_version} is not supported; this operator speaks {SCHEMA_VERSION}"
        )
    return report


def dump_verdicts(report: VerdictReport) -> bytes:
    """Serialise a report for the wire (camelCase, no ``None`` fields)."""
    return report.model_dump_json(by_alias=True, exclude_none=True).encode()

"""What local mode remembers for the plot and the summary: per-GPU readings, findings' spans, the
service rules' values at each evaluation, and the scale decisions.

The engine's store keeps only what the rules need (minutes); this keeps the whole run,
bounded: each GPU's series, and each pod's or process's own readings on it, hold at most
``max_points`` readings, and when one fills up every other reading is dropped and only
every second one kept from then on (so a day of ``watch`` costs the same memory as a
minute, at a coarser resolution).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

from gpuwarden.policy import Finding, Resolution, RuleKind

DEFAULT_MAX_POINTS = 4096
"""Readings per GPU before the series is thinned out (4096 x 3 floats: ~100 KiB a GPU)."""


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


@dataclass(slots=True)
class _Thinning:
    """Which readings of a series to keep: every ``stride``-th, the stride doubling when it fills up."""

    max_points: int
    stride: int = 1
    seen: int = 0

    def keep(self) -> bool:
        """Whether the next reading falls on the stride (call once per reading)."""
        self.seen += 1
        return (self.seen - 1) % self.stride == 0

    def trim(self, columns: tuple[list[float], ...]) -> None:
        """Over ``max_points``: drop every other kept reading, and keep every second one from now on."""
        if len(columns[0]) > self.max_points:
            for column in columns:
                del column[1::2]
            self.stride *= 2


@dataclass(slots=True)
class ShareHistory:
    """One pod's or process's own readings on a device (its share, on a shared GPU) over the run.

    Utilization is kept only where it was read: per-process utilization comes at its own,
    lower rate, so most samples have none.
    """

    max_points: int = DEFAULT_MAX_POINTS
    times: list[float] = field(default_factory=list)
    memory_used: list[float] = field(default_factory=list)
    """Bytes (NaN where not read)."""
    utilization_times: list[float] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)
    """Percent: its per-process SM utilization on a shared GPU, the device's alone on one."""
    _memory: _Thinning = field(init=False)
    _utilization: _Thinning = field(init=False)

    def __post_init__(self) -> None:
        self._memory = _Thinning(self.max_points)
        self._utilization = _Thinning(self.max_points)

    def append(self, t: float, utilization: float | None, memory_used: float | None) -> None:
        """Record one sample (each column kept when it falls on its stride)."""
        if self._memory.keep():
            self.times.append(t)
            self.memory_used.append(_nan(memory_used))
            self._memory.trim((self.times, self.memory_used))
        if utilization is not None and self._utilization.keep():
            self.utilization_times.append(t)
            self.utilization.append(utilization)
            self._utilization.trim((self.utilization_times, self.utilization))

    def utilization_at(self, t: float) -> float | None:
        """The last utilization read at or before ``t`` (the first one after it, if none was)."""
        if not self.utilization:
            return None
        i = bisect_right(self.utilization_times, t)
        return self.utilization[max(0, i - 1)]

    def memory_at(self, t: float) -> float | None:
        """Memory used at the sample kept nearest before ``t`` (None if it was not read)."""
        if not self.times:
            return None
        value = self.memory_used[max(0, bisect_right(self.times, t) - 1)]
        return None if math.isnan(value) else value


@dataclass(slots=True)
class DeviceHistory:
    """One GPU's (or MIG device's) readings over the run; missing readings are NaN."""

    name: str
    """How the display names it: ``GPU 0``."""
    model: str
    max_points: int = DEFAULT_MAX_POINTS
    subjects: list[str] = field(default_factory=list)
    """Every pod or process seen on it, in order of appearance."""
    times: list[float] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)
    """NVML utilization.gpu, percent."""
    sm_active: list[float] = field(default_factory=list)
    """GPM SM activity, percent (NaN without GPM)."""
    memory_used: list[float] = field(default_factory=list)
    """Bytes."""
    memory_total: float | None = None
    """Bytes, as last reported."""
    shares: dict[str, ShareHistory] = field(default_factory=dict)
    """Each subject's own readings, by display name (what the plot draws a line for on a shared GPU)."""
    shared: bool = False
    """Whether it ever ran more than one subject at a time."""
    _thinning: _Thinning = field(init=False)

    def __post_init__(self) -> None:
        self._thinning = _Thinning(self.max_points)

    def append(
        self, t: float, utilization: float | None, sm_active: float | None, memory_used: float | None
    ) -> None:
        """Record one reading (kept when it falls on the current stride)."""
        if not self._thinning.keep():
            return
        self.times.append(t)
        self.utilization.append(_nan(utilization))
        self.sm_active.append(_nan(sm_active))
        self.memory_used.append(_nan(memory_used))
        self._thinning.trim((self.times, self.utilization, self.sm_active, self.memory_used))

    def add_subject(self, subject: str) -> None:
        """Remember that ``subject`` ran on this GPU."""
        if subject not in self.subjects:
            self.subjects.append(subject)

    def share(self, subject: str) -> ShareHistory:
        """``subject``'s own readings on this device, created on first sight."""
        found = self.shares.get(subject)
        if found is None:
            found = self.shares[subject] = ShareHistory(max_points=self.max_points)
        return found


@dataclass(slots=True)
class FindingSpan:
    """One finding from its start to its resolution (``end`` None while active)."""

    policy: str
    rule: str
    kind: RuleKind
    reason: str
    subject: str
    devices: tuple[str, ...]
    start: float
    message: str
    """The engine's message when it started."""
    end: float | None = None
    resolution: Resolution | None = None
    last_message: str = ""
    """The engine's latest message; once resolved, the one it cleared with."""
    value: float | None = None
    """The value it fired with (its first evaluation's), in ``unit``: what the plot labels it with."""
    threshold: float | None = None
    """The rule's threshold, in ``unit``: the plot's line for it."""
    unit: str = ""


@dataclass(slots=True)
class JudgedSeries:
    """A service rule's value (P99 latency, a queue) on one subject at each evaluation: the figure it
    compares with its threshold, which no GPU reading shows. NaN where it had nothing to judge."""

    rule: str
    kind: RuleKind
    unit: str
    threshold: float
    max_points: int = DEFAULT_MAX_POINTS
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    _thinning: _Thinning = field(init=False)

    def __post_init__(self) -> None:
        self._thinning = _Thinning(self.max_points)

    def append(self, t: float, value: float | None) -> None:
        """Record one evaluation's value (kept when it falls on the current stride)."""
        if self._thinning.keep():
            self.times.append(t)
            self.values.append(_nan(value))
            self._thinning.trim((self.times, self.values))


@dataclass(frozen=True, slots=True)
class ScaleMark:
    """A simulated scale decision, where the plot marks it: on the GPUs of the pods its policy matched."""

    at: float
    current: int
    desired: int
    applied: bool
    """False: the policy is ``dryRun``, the replicas stayed."""
    devices: tuple[str, ...]
    """Device keys."""


class History:
    """Every GPU's readings, every finding's span and every scale decision, for one local run."""

    def __init__(self, max_points: int = DEFAULT_MAX_POINTS) -> None:
        self.max_points = max_points
        self.devices: dict[str, DeviceHistory] = {}
        """By device key (GPU or MIG UUID), in order of appearance."""
        self.spans: list[FindingSpan] = []
        self.full_names: dict[str, str] = {}
        """A subject's whole name where its display name is shortened: a process's entire command line."""
        self.judged: dict[str, dict[str, JudgedSeries]] = {}
        """Each subject's service rules' values, by display name, then rule."""
        self.scaling: list[ScaleMark] = []
        self._open: dict[tuple[str, str, str, str], FindingSpan] = {}
        self.first: float | None = None
        self.last: float | None = None

    def device(self, key: str, name: str, model: str) -> DeviceHistory:
        """The history of one device, created on first sight."""
        found = self.devices.get(key)
        if found is None:
            found = self.devices[key] = DeviceHistory(name=name, model=model, max_points=self.max_points)
        return found

    def mark_time(self, t: float) -> None:
        """Extend the run's time range to ``t``."""
        if self.first is None:
            self.first = t
        self.last = t

    def record_judged(
        self,
        subject: str,
        rule: str,
        kind: RuleKind,
        unit: str,
        threshold: float,
        at: float,
        value: float | None,
    ) -> None:
        """A service rule's value on ``subject`` at an evaluation (None: nothing to judge)."""
        rules = self.judged.setdefault(subject, {})
        series = rules.get(rule)
        if series is None:
            series = rules[rule] = JudgedSeries(rule, kind, unit, threshold, max_points=self.max_points)
        series.append(at, value)

    def started(self, finding: Finding, subject: str, devices: tuple[str, ...], at: float) -> None:
        """A finding started (``devices``: the GPUs it speaks for)."""
        span = FindingSpan(
            policy=finding.policy,
            rule=finding.rule,
            kind=finding.kind,
            reason=finding.reason,
            subject=subject,
            devices=devices,
            start=at,
            message=finding.message,
            last_message=finding.message,
            value=finding.value,
            threshold=finding.threshold,
            unit=finding.unit,
        )
        self.spans.append(span)
        self._open[self._key(finding)] = span

    def updated(self, finding: Finding) -> None:
        """An active finding has a new message (and reason, when re-described); its value stays the one
        it fired with."""
        span = self._open.get(self._key(finding))
        if span is not None:
            span.last_message = finding.message
            span.reason = finding.reason

    def resolved(self, finding: Finding, resolution: Resolution | None, at: float) -> None:
        """A finding ended; its message now says why (the summary prints it after "cleared")."""
        span = self._open.pop(self._key(finding), None)
        if span is not None:
            span.end = at
            span.resolution = resolution
            span.last_message = finding.message

    def active(self) -> list[FindingSpan]:
        """Spans still open, in order of start."""
        return [s for s in self.spans if s.end is None]

    @staticmethod
    def _key(finding: Finding) -> tuple[str, str, str, str]:
        return (finding.policy, finding.rule, finding.namespace, finding.pod)

"""What every rule shares: its kinds and their record (RuleType), its outcome, and how a window is cut and
judged complete.

Windows are data-defined, so that the same samples always give the same verdict
whatever the evaluation cadence (a replay re-derives the same findings):

- **As-of time.** A pod is judged as of its newest sample at or before ``now``
  (``end``), not ``now`` itself: reports arrive batched and late, and a window
  ending at ``now`` would see a gap at its tail at every evaluation. A pod whose
  newest sample is older than ``stale_after_seconds`` is not judged at all
  (value unknown: nothing starts, nothing clears).
- **The window** of a rule of length ``L`` is ``[end - L, end]``, both ends
  included (memoryGrowth aligns its window to buckets; see
  :mod:`gpuwarden.policy.rules.growth`). The pod's GPUs are its series with at least
  one point in it; a GPU silent for a whole window has left the pod's view.
- **Coverage.** A series covers the window when the readings the rule uses
  (non-missing values of its column) account for all of it:

  - *inside*, no gap longer than ``max_gap`` between consecutive readings, nor
    from the last reading to ``end``;
  - *at the leading edge*, the first reading is at most **one sampling
    interval** after the window's start (the median interval between the
    window's readings, below; a reading exactly at the start is unlikely), or
    else the series' point just before the window has a reading at most
    ``max_gap`` before that first reading (the start then falls inside an
    interval between two readings, judged like any other). The leading edge
    is never allowed ``max_gap`` on its own: a series whose readings begin at
    ``t0`` covers a window of length ``L`` no earlier than ``t0 + L`` minus
    one interval.

  ``max_gap`` is the evaluator's ``max_gap_seconds`` when set; by default it
  adapts to the series: a gap is too long when it exceeds both 5 s and 3 x
  the median interval between the window's readings (estimated, for both
  uses, from at most 64 of them, evenly strided; with fewer than 3 readings
  the limit is 5 s, and a lone reading has no interval, so the leading edge
  then needs the reading before the window or the lone one exactly at the
  start). Missing samples never satisfy a duration: a utilization rule starts
  only when every GPU of the pod covers its window; a memory rule judges each
  GPU on its own readings, and only a covered GPU can make it start.
- **Hysteresis.** Each rule states two conditions: *holds* (start a finding)
  and *clears* (resolve it), separated by a margin, so a value hovering at the
  threshold does not flap. A clear is judged on whatever readings the window
  has, even when it is not covered, so a recovered pod is recognised promptly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import sub
from typing import Any, Generic, NewType, Protocol, TypeAlias, TypeVar

from gpuwarden.policy.spec.model import Signal
from gpuwarden.policy.spec.schema import Body
from gpuwarden.policy.spec.servers import Metric
from gpuwarden.policy.store.health import HealthStore
from gpuwarden.policy.store.series import GAP_RECORD_SECONDS, Column, PodId, SeriesKey, Window
from gpuwarden.policy.store.service import ServiceStore

MIN_GAP_SECONDS = GAP_RECORD_SECONDS
"""The adaptive ``max_gap`` is never below this (5 s): agents sample at 1 s, and reports jitter."""

GAP_INTERVALS = 3.0
"""The adaptive ``max_gap`` is this many median sampling intervals."""


RuleKind = NewType("RuleKind", str)
"""A rule's kind, named as its key in the CRD (``utilizationFloor``); each kind's module declares its
own (``KIND``), and its :class:`RuleType` says what it is (:data:`gpuwarden.policy.rules.RULE_TYPES`)."""


@dataclass(frozen=True, slots=True)
class WindowParams:
    """Evaluator-wide settings for cutting and judging windows."""

    max_gap_seconds: float | None = None
    """The longest gap a covered window may have; None adapts it per series (see the module doc)."""
    stale_after_seconds: float = 60.0
    """A pod whose newest sample is older than this is not judged (its node went quiet)."""


def _no_message(outcome: Outcome) -> str:
    return "no data to judge" if outcome.value is None else ""


@dataclass(slots=True)
class Outcome:
    """What one rule concluded about one pod at one evaluation.

    ``value`` is None when there was nothing to judge (no readings, stale pod);
    then both ``holds`` and ``clears`` are False. ``holds`` implies not ``clears``.

    A mutable result: its kind's evaluator builds it, and the adapter that made
    the evaluator a :data:`Judge` may amend it before returning it (a note: the
    throttling beside a utilization verdict, why a service kind had nothing to
    judge; a verdict throttling belies). Once the :data:`Judge` returns it, no
    one changes it. Not frozen, and its message built only when asked for, by a
    module-level function from the fields below (no closure): one is built per
    pod, rule and evaluation, and all of them live until the evaluation ends,
    so each object less per outcome is less work for the cyclic GC; a frozen
    dataclass also takes five times as long to build.
    """

    rule: str
    kind: RuleKind
    pod: PodId
    value: float | None
    threshold: float
    unit: str
    holds: bool
    clears: bool
    gpus: tuple[str, ...] = ()
    """The GPUs the value speaks for: all the pod's GPUs for utilization, the offending ones for memory."""
    gpu_count: int = 0
    """How many of the pod's GPUs were judged."""
    window_seconds: float = 0.0
    """The rule's window: ``for``; for memoryGrowth the evidence span it spoke on (at most ``window``)."""
    signal: str = ""
    """Utilization rules: the signal that decided, in words (``SM activity (GPM)``,
    ``GPU utilization (device counter)``, ``per-process SM utilization``); memoryGrowth: the
    memory judged (a :class:`~gpuwarden.policy.rules.growth.MemorySource` value, ``auto`` resolved)."""
    busy_watts: float | None = None
    """utilizationFloor: the mean power of the GPU that counts as busy, if one does."""
    level_bytes: float | None = None
    """memoryCeiling: the memory the worst GPU stayed above."""
    total_bytes: float | None = None
    """Memory rules: the worst GPU's card size."""
    fit: float | None = None
    """memoryGrowth: R² of the worst GPU's trend."""
    seconds_to_full: float | None = None
    """memoryGrowth: projected seconds until the worst GPU's card is full."""
    reason: str | None = None
    """The finding's reason when it is not the kind's (anomaly: its pattern, ``GPUPeriodicSpikes``;
    memoryGrowth: ``GPUMemoryExhaustionImminent`` when the card is full soon)."""
    kept_reason: str | None = None
    """A reason an active finding keeps when it has it, rather than take ``reason`` (hysteresis:
    memoryGrowth keeps ``GPUMemoryExhaustionImminent`` while the card is full within twice its horizon)."""
    extra: object = None
    """Kind-specific figures its ``describe`` reads (anomaly: the worst GPU's episode; memoryGrowth:
    the speaking series' newest allocation sites, a tuple, or None)."""
    detail: str = ""
    """gpuHealth: the problems in words (built as they are found: there is no figure to build them from)."""
    describe: Callable[[Outcome], str] = field(default=_no_message, compare=False, repr=False)
    """Builds :attr:`message` from the fields above."""
    note: str = ""
    """What else bears on the verdict, appended to the message (utilization rules: throttling)."""

    @property
    def message(self) -> str:
        """The verdict in words, e.g. ``mean SM activity (GPM) 3% over 5m, floor 20%``."""
        text = self.describe(self)
        return f"{text}; {self.note}" if self.note else text


def unknown(rule: str, kind: RuleKind, pod: PodId, threshold: float, unit: str) -> Outcome:
    """An outcome with nothing to judge."""
    return Outcome(rule, kind, pod, None, threshold, unit, holds=False, clears=False)


def pod_end(series: Sequence[tuple[SeriesKey, Window]], now: float, params: WindowParams) -> float | None:
    """The pod's as-of time: its newest sample at or before ``now``; None when it has none, or
    when that sample is older than ``params.stale_after_seconds`` (a silent pod is not judged)."""
    end: float | None = None
    for _, window in series:
        t = window.latest_at(now)
        if t is not None and (end is None or t > end):
            end = t
    if end is None or now - end > params.stale_after_seconds:
        return None
    return end


@dataclass(slots=True)
class Readings:
    """The non-missing readings of one column over a window, oldest first."""

    times: Sequence[float]
    values: Sequence[float]
    window: Window | None = None
    """The window they came from when none was missing (its gap index then describes ``times``)."""
    before: float | None = None
    """When the series' point just before ``start`` was taken, if it has a reading of the column."""


def readings(window: Window, column: Column, start: float, end: float) -> Readings:
    """The non-missing readings of ``column`` in ``[start, end]``, and the reading just before."""
    i0, i1 = window.span(start, end)
    times = window.times(i0, i1)
    values = window.values(column, i0, i1)
    before = window.reading_before(column, i0)
    if not window.has_missing(column, i0):
        return Readings(times, values, window, before)
    keep = [i for i, v in enumerate(values) if v == v]
    if len(keep) == len(values):
        return Readings(times, values, window, before)
    return Readings([times[i] for i in keep], [values[i] for i in keep], None, before)


def _median_interval(times: Sequence[float]) -> float:
    """The median interval between consecutive ``times`` (0.0 for fewer than two); of an even
    count, the lower middle one.

    Estimated from at most 64 evenly strided intervals: as telling, and bounded in cost. The lower
    middle, because the gap being judged is one of the intervals: with three readings around a hole
    (1 s and 9 s apart), the mean of the two would make the hole its own yardstick (a 5 s
    "interval", a 15 s limit) and a window mostly unread would count as covered.
    """
    n = len(times)
    if n < 2:
        return 0.0
    step = -(-(n - 1) // 64)
    return statistics.median_low([times[i + 1] - times[i] for i in range(0, n - 1, step)])


def covered(r: Readings, start: float, end: float, max_gap: float | None) -> bool:
    """Whether the readings cover ``[start, end]`` (see the module doc).

    Inside the window, and from the last reading to ``end``, no gap may exceed
    the limit: ``max_gap``, or with ``max_gap=None`` the larger of
    :data:`MIN_GAP_SECONDS` and :data:`GAP_INTERVALS` median intervals. The
    leading edge is covered when the first reading is at most one median
    interval after ``start``, or when ``r.before`` (the reading just before the
    window) is within the limit of it.
    """
    times = r.times
    n = len(times)
    if not n:
        return False
    first = times[0]
    last = times[-1]
    if r.window is not None and (max_gap is None or max_gap >= GAP_RECORD_SECONDS):
        # Intervals the window did not index are at most GAP_RECORD_SECONDS long: within any limit here.
        inner = r.window.longest_gap(first, last)
    else:
        inner = max(map(sub, times[1:], times[:-1]), default=0.0)
    worst = max(inner, end - last)
    # The interval that spans the window's start, when the series has a reading before it.
    across = math.inf if r.before is None else first - r.before
    at_start = first <= start
    if max_gap is None:
        if worst <= MIN_GAP_SECONDS and (at_start or across <= MIN_GAP_SECONDS):
            return True  # within the adaptive limit's floor: no median needed (the steady state)
        median = _median_interval(times)
        # Too few intervals to tell a slow sampler from a silence: keep to the floor.
        limit = MIN_GAP_SECONDS if n < 3 else max(MIN_GAP_SECONDS, GAP_INTERVALS * median)
    else:
        if worst > max_gap:
            return False
        if at_start or across <= max_gap:
            return True
        median = _median_interval(times)
        limit = max_gap
    if worst > limit:
        return False
    # No reading before the window within the limit (typically: the series began inside it). Its
    # start may then be uncovered by one sampling interval at most, never by a whole `limit`:
    # missing samples must not count towards the duration.
    return across <= limit or first - start <= median


def percent(value: float) -> str:
    """A percentage for a message: ``3%``, ``97.5%``, ``0.4%``."""
    if value >= 10 or value == int(value):
        return f"{value:.0f}%"
    return f"{value:.1f}%"


class Memo(Protocol):
    """What a rule kind keeps between evaluations (memoryGrowth: its fitted trends), per evaluator."""

    def sweep(self) -> None:
        """Drop what the evaluation that just ended did not use."""


@dataclass(frozen=True, slots=True)
class Services:
    """What the service rule kinds read: the pods' scrapes, and the pods the policy selects (a
    per-replica figure is over those of them that report; in sharded mode, this shard's)."""

    store: ServiceStore
    pods: Sequence[PodId]


@dataclass(slots=True)
class JudgeContext:
    """Everything a rule kind's evaluator may read of one pod at one evaluation, in one object (as
    Kopf passes one cause per handler call): what a kind reads is its own business, and a new field
    changes no evaluator's signature. The engine builds one per pod and evaluation, for all its rules.

    No evaluator assigns to it. Not frozen: a frozen dataclass takes four times as long to build
    (1.1 µs against 0.3), which :func:`~gpuwarden.policy.engine.evaluate_rule` pays per call.
    """

    pod: PodId
    series: Sequence[tuple[SeriesKey, Window]]
    """The pod's series, one per GPU it was seen on."""
    now: float
    params: WindowParams
    health: HealthStore | None = None
    """The GPUs' health records (gpuHealth, and throttling beside utilization); None: nothing to judge."""
    services: Services | None = None
    """The pods' own metrics; None: the service kinds have nothing to judge."""


_R = TypeVar("_R")
_M = TypeVar("_M", bound=Memo | None)

Judge: TypeAlias = Callable[[_R, JudgeContext, _M | None], Outcome]
"""A rule kind's evaluator: ``(rule, context, memo)``; ``memo`` is what the kind keeps between
evaluations (its :class:`RuleType`'s ``memo`` makes it), None when it keeps none or the caller
keeps none."""


def on_series(
    evaluate: Callable[[_R, PodId, Sequence[tuple[SeriesKey, Window]], float, WindowParams], Outcome],
) -> Judge[_R, None]:
    """An evaluator that reads only the pod's series, as a :data:`Judge` (no memo, no health)."""

    def judge(rule: _R, c: JudgeContext, memo: None) -> Outcome:
        return evaluate(rule, c.pod, c.series, c.now, c.params)

    return judge


def on_services(
    evaluate: Callable[[_R, PodId, float, WindowParams, Services | None], Outcome],
) -> Judge[_R, None]:
    """An evaluator that reads only the pods' own metrics, as a :data:`Judge` (no series, memo or health).

    An outcome with nothing to judge carries why in its ``note`` (a failed or stale scrape), which a
    reminder of an active finding then says beside its last figure.
    """

    def judge(rule: _R, c: JudgeContext, memo: None) -> Outcome:
        outcome = evaluate(rule, c.pod, c.now, c.params, c.services)
        if outcome.value is None and c.services is not None:
            outcome.note = c.services.store.unjudged(c.pod, c.now, c.params.stale_after_seconds)
        return outcome

    return judge


@dataclass(frozen=True, slots=True)
class RuleType(Generic[_R, _M]):
    """Everything gpuwarden knows of one rule kind, in one record; each kind's module defines its own
    next to its evaluator, and :data:`gpuwarden.policy.rules.RULE_TYPES` lists them. The parser, the
    engine, the operator's status and Events, and local mode's plot read these, never the kinds."""

    kind: RuleKind
    """Its name, which is its key under ``spec.rules[]`` in the CRD."""
    model: type[_R]
    """Its spec's class: a frozen dataclass with a ``name`` (a :class:`~gpuwarden.policy.spec.model.Rule`)."""
    parse: Callable[[str, Mapping[str, Any], str], _R]
    """``(name, body, path)``: the checked spec of a rule of this kind; raises
    :class:`~gpuwarden.policy.spec.fields.SpecError` naming the field."""
    body: Body
    """Its fields, declared once: the parser reads them, and the CRD's schema is rendered from them
    (:mod:`gpuwarden.policy.crd`)."""
    evaluate: Judge[_R, _M]
    """Judges one pod."""
    reach: Callable[[_R], float]
    """How far back before a pod's newest sample it reads (sizes the store's retention)."""
    window: Callable[[_R], float] | None
    """Its window's length, which must span an evaluation interval; None: it reads none. Its field
    is the body's :attr:`~gpuwarden.policy.spec.schema.Body.window`."""
    reason: str
    """The Event reason of its findings (an outcome may name a more precise one)."""
    meaning: str
    """What a finding means for the pod, in an Event's words."""
    per_gpu: bool
    """Whether a finding speaks of one GPU (the status names it) rather than all the pod's."""
    colour: str
    """Its findings' colour in local mode's plot (a matplotlib colour)."""
    utilization: bool | None
    """Whether it judges utilization (local mode's plot draws it there), else memory; None: either,
    its message says which."""
    hold: Callable[[_R], float] | None = None
    """How long a holding outcome must last before its finding starts (the tracker's ``for``);
    None: at once (a kind whose window is its ``for``)."""
    memo: Callable[[], _M] | None = None
    """Makes what it keeps between evaluations (its evaluator's ``memo``); None: nothing."""
    metric: Callable[[_R], Metric | str] | None = None
    """A kind that reads the pods' own metrics (its spec is a
    :class:`~gpuwarden.policy.spec.model.ServiceRule`): the metric a rule reads, or why its server has
    none (the parser refuses it with that); what the agents keep of the pods' scrapes. None: it reads
    the GPUs'."""
    refused_at: str = "server"
    """The field a rule's error names when its server has no such metric."""
    counts_requests: bool = False
    """Whether its metric is a histogram whose count is the requests served (a forecast of requests
    reads it where the servers' own counters are not known)."""
    up_only: str | None = None
    """Why a finding of it may only scale up (a ``scaleDownOn`` naming it is refused with this);
    None: it may scale either way."""
    forecast_ceiling: Callable[[_R], tuple[float, Signal]] | None = None
    """As the first such rule in ``scaleUpOn``: the per-replica utilization ceiling (percent, and the
    reading) a utilization forecast compares against; None: it gives none."""
    forecast_floor: Callable[[_R], float] | None = None
    """As the first such rule in ``scaleDownOn``: the utilization floor (percent) under which a
    utilization forecast lets a scale-down go ahead; None: it gives none."""
    idle: str | None = None
    """What its findings say is idle, for ``actions.reclaim``: ``"pod"`` (the pod's GPUs: any action
    fits), ``"some"`` (some GPUs while another works: only Annotate fits, stopping the workload would
    stop the work); None: nothing idle, it cannot trigger a reclaim."""

    def __post_init__(self) -> None:
        if (self.window is None) != (self.body.window is None):
            raise ValueError(f"{self.kind}: a window needs a Duration field with window=True, and back")

    @property
    def defaults(self) -> Mapping[str, Any]:
        """The CRD's scalar defaults for its fields, by name."""
        return self.body.defaults

    @property
    def key(self) -> str:
        """Its key under ``spec.rules[]`` in the CRD."""
        return self.kind

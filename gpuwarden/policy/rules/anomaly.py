"""anomaly: sudden deviations from a GPU's usual readings, and the pattern they make.

Semantics (the window, coverage and as-of time are in :mod:`gpuwarden.policy.rules.common`):

- **Baseline.** Per GPU, the median and the MAD (median absolute deviation) of the
  metric's readings over ``[end - window, end]``: robust, so a spike does not widen
  its own band, as a mean and standard deviation would. The scale is ``1.4826 MAD``
  (the standard deviation, for normal noise), and never below
  ``minDeviation / threshold``: a flat series (MAD 0) would otherwise call any wobble
  a deviation.
- **Deviation.** A reading deviates when its robust z-score ``(x - median) / scale``
  passes ``threshold`` either way. An **episode** starts there and goes on while
  the readings stay past :data:`EPISODE_HOLD` of the threshold, the same way;
  deviating readings of one sign less than :data:`MERGE_SECONDS` apart are one too. While the newest reading
  deviates (an episode still going on), the baseline is taken again from the
  readings before that episode, when there are enough: a lasting change must not
  become its own baseline. An episode still going on that is younger than
  :data:`SUSTAINED_FRACTION` of the window is not judged yet (a spike and the start
  of a climb look alike); once over, or lasting, it is.
- **Pattern**, named in the finding's reason and message (the pattern now: a finding
  whose pattern changed is announced again under the new one, see
  :mod:`gpuwarden.policy.findings`):

  - ``GPUSteadyClimb``: the episode is still going on, has lasted at least
    :data:`SUSTAINED_FRACTION` of the window, and its readings keep rising (the
    last third's mean exceeds the first third's by :data:`RISE_SIGMAS` standard
    errors): an unbounded cache, a queue that never drains;
  - ``GPULevelShift``: still going on and lasting, but flat: the readings moved to a
    new level (a second model loaded, a new tenant);
  - ``GPUPeriodicSpikes``: at least :data:`MIN_PERIODIC` episodes of one sign (the
    latest's) starting inside the window at a regular interval (each gap within a
    quarter of their median): a scheduled job. A rise then dips (a load that
    climbed, then spread over a new replica) is no schedule, and neither is an
    episode the window's start cuts short (its start is the window's);
  - ``GPUSpike``: anything else, one or a few irregular deviations.

  ``memoryGrowth`` and this rule answer different questions: growth fits a trend to
  the whole window (a leak heading for out-of-memory), this one looks for readings
  that leave their usual band. A steady leak that began before the window has no
  episode (the window's median climbs with it); one that starts inside it is a
  ``GPUSteadyClimb`` here and a ``GPUMemoryLeakSuspected`` there.
- **Holds** when some GPU that covers the window has an episode in it; the pod's
  value is the largest robust z-score of its worst GPU. **Clears** when no GPU has
  one (a spike clears once it has left the window).
"""

from __future__ import annotations

import enum
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.policy.humanize import approx_duration, format_bytes
from gpuwarden.policy.rules.common import (
    Outcome,
    RuleKind,
    RuleType,
    WindowParams,
    covered,
    on_series,
    percent,
    pod_end,
    readings,
    unknown,
)
from gpuwarden.policy.spec.schema import Body, Choice, Duration, Number
from gpuwarden.policy.store.series import Column, PodId, SeriesKey, Window
from gpuwarden.units import format_duration

KIND = RuleKind("anomaly")
"""Its kind: its key under ``spec.rules[]``."""


class AnomalyMetric(enum.StrEnum):
    """Which reading an anomaly rule watches."""

    UTILIZATION = "utilization"  # smActive where the GPU reports it, else gpuUtil (as signal: auto)
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Fires on sudden deviations from a GPU's usual readings: robust z-score over a rolling window."""

    name: str
    metric: AnomalyMetric
    window_seconds: float
    threshold: float
    """The robust z-score (|x - median| / (1.4826 MAD)) a reading must pass to deviate."""
    min_deviation: float
    """The least deviation that counts: percentage points (utilization) or percent of the card (memory)."""


UNIT = "z"

MAD_SCALE = 1.4826
"""MAD times this estimates the standard deviation of normal noise."""

MERGE_SECONDS = 5.0
"""Deviating readings of one sign closer than this are one episode (a noisy burst may dip for a reading)."""

EPISODE_HOLD = 0.5
"""An episode goes on while its readings stay past this share of the threshold: a value wobbling at the
threshold (a noisy ramp crossing it) is one episode, not a string of spikes."""

SUSTAINED_FRACTION = 0.1
"""An episode still going on after this share of the window is a lasting change, not a spike."""

RISE_SIGMAS = 3.0
"""A lasting episode climbs when its last third's mean exceeds its first third's by this many standard
errors of their difference; else it is a new level."""

MIN_PERIODIC = 3
"""Episodes needed to call a pattern periodic."""

PERIOD_TOLERANCE = 0.25
"""How far each gap between episode starts may stray from their median, as a share of it."""

MIN_READINGS = 8
"""Readings needed for a baseline."""

BASELINE_SAMPLE = 512
"""The baseline is taken from at most this many readings, evenly strided (it is robust; this bounds cost)."""


class Pattern(enum.StrEnum):
    """What the deviations look like; ``reason`` is the finding's and the Event's reason."""

    SPIKE = "GPUSpike"
    PERIODIC = "GPUPeriodicSpikes"
    CLIMB = "GPUSteadyClimb"
    SHIFT = "GPULevelShift"


@dataclass(slots=True)
class Episode:
    """A run of deviating readings of one sign."""

    start: float
    end: float
    peak: float
    """The reading furthest from the median."""
    z: float
    """Its robust z-score (signed)."""
    ongoing: bool = False


@dataclass(slots=True)
class GpuAnomaly:
    """One GPU's deviations over a window."""

    gpu: str
    covered: bool
    median: float
    episodes: list[Episode]
    pattern: Pattern | None
    period: float | None = None
    """PERIODIC: the median gap between episode starts."""

    @property
    def z(self) -> float:
        """The largest robust z-score of the episodes that make the pattern (0 without one)."""
        if not self.episodes:
            return 0.0
        if self.pattern in (Pattern.CLIMB, Pattern.SHIFT):
            return abs(self.episodes[-1].z)
        return max(abs(e.z) for e in self.episodes)


@dataclass(frozen=True, slots=True)
class Figures:
    """What the message needs of the worst GPU (:attr:`Outcome.extra`)."""

    metric: AnomalyMetric
    signal: str
    median: float
    episode: Episode
    """The latest episode (for SPIKE the largest)."""
    count: int
    """The episodes of the reported one's sign (spikes, or dips)."""
    period: float | None
    end: float
    window_seconds: float


def _median_mad(values: Sequence[float]) -> tuple[float, float]:
    step = -(-len(values) // BASELINE_SAMPLE)
    sample = values[::step] if step > 1 else values
    median = statistics.median(sample)
    return median, statistics.median([abs(v - median) for v in sample])


def _episodes(
    times: Sequence[float], values: Sequence[float], median: float, scale: float, threshold: float
) -> list[Episode]:
    out: list[Episode] = []
    # Only readings past the lower bar can start or continue an episode: find them at C speed first.
    hold = threshold * EPISODE_HOLD * scale
    low, high = median - hold, median + hold
    candidates = [i for i, v in enumerate(values) if v > high or v < low]
    inside = False
    """Whether the previous reading belonged to the latest episode (it then holds at the lower bar)."""
    before = -2
    for i in candidates:
        if i != before + 1:
            inside = False  # the reading before this one was inside the lower bar
        before = i
        t, v = times[i], values[i]
        z = (v - median) / scale
        prev = out[-1] if out else None
        same_way = prev is not None and (z > 0) == (prev.z > 0)
        if not (inside and same_way) and abs(z) <= threshold:
            inside = False
            continue
        inside = True
        if prev is not None and same_way and t - prev.end <= MERGE_SECONDS:
            prev.end = t
            if abs(z) > abs(prev.z):
                prev.peak, prev.z = v, z
        else:
            out.append(Episode(t, t, v, z))
    if out and times[-1] - out[-1].end <= MERGE_SECONDS:
        out[-1].ongoing = True  # a reading or two back inside the band may yet be merged into it
    return out


def _pattern(
    episodes: list[Episode],
    times: Sequence[float],
    values: Sequence[float],
    window_seconds: float,
    scale: float,
) -> tuple[Pattern | None, float | None]:
    if not episodes:
        return None, None
    last = episodes[-1]
    lasting = last.end - last.start >= SUSTAINED_FRACTION * window_seconds
    if last.ongoing and not lasting:
        # Too young to tell a spike from the start of a climb: judge the settled ones meanwhile.
        settled = episodes[:-1]
        return _pattern(settled, times, values, window_seconds, scale) if settled else (None, None)
    if last.ongoing:
        inside = [v for t, v in zip(times, values, strict=True) if t >= last.start]
        third = max(1, len(inside) // 3)
        first, final = sum(inside[:third]) / third, sum(inside[-third:]) / third
        rise = (final - first) if last.z > 0 else (first - final)
        # A flat new level leaves the two thirds' means equal within their noise (scale / sqrt(third)).
        return (Pattern.CLIMB if rise > RISE_SIGMAS * scale * math.sqrt(2 / third) else Pattern.SHIFT), None
    # A schedule repeats one thing: spikes, or dips, each with a start inside the window (an episode
    # the window's start cuts short has none: its first reading is just where the window begins). A
    # rise followed by dips (a load that climbed, then was spread over a new replica) is not one.
    repeats = [e for e in episodes if (e.z > 0) == (last.z > 0) and e.start > times[0]]
    if len(repeats) >= MIN_PERIODIC:
        gaps = [b.start - a.start for a, b in itertools.pairwise(repeats)]
        period = statistics.median(gaps)
        if period > 0 and all(abs(g - period) <= PERIOD_TOLERANCE * period for g in gaps):
            return Pattern.PERIODIC, period
    return Pattern.SPIKE, None


def gpu_anomaly(
    gpu: str, window: Window, rule: Anomaly, start: float, end: float, max_gap: float | None
) -> tuple[GpuAnomaly, str] | None:
    """One GPU's deviations over ``[start, end]`` and the reading's name; None when it cannot be judged."""
    if rule.metric is AnomalyMetric.MEMORY:
        column, signal = Column.MEM_USED, "GPU memory"
        if not window.mem_total:
            return None
        least = rule.min_deviation / 100 * window.mem_total
    else:
        column, signal = Column.SM_ACTIVE, "SM activity"
        least = rule.min_deviation
    r = readings(window, column, start, end)
    if not r.values and rule.metric is AnomalyMetric.UTILIZATION:
        column, signal = Column.GPU_UTIL, "GPU utilization"
        r = readings(window, column, start, end)
    times, values = r.times, r.values
    if len(values) < MIN_READINGS:
        return None
    floor = least / rule.threshold

    median, mad = _median_mad(values)
    scale = max(MAD_SCALE * mad, floor)
    episodes = _episodes(times, values, median, scale, rule.threshold)
    if episodes and episodes[-1].ongoing:
        before = [v for t, v in zip(times, values, strict=True) if t < episodes[-1].start]
        if len(before) >= MIN_READINGS:
            median, mad = _median_mad(before)
            scale = max(MAD_SCALE * mad, floor)
            episodes = _episodes(times, values, median, scale, rule.threshold)
    pattern, period = _pattern(episodes, times, values, rule.window_seconds, scale)
    return (
        GpuAnomaly(gpu, covered(r, start, end, max_gap), median, episodes, pattern, period),
        signal,
    )


_CLIMB_LIKE = {
    AnomalyMetric.MEMORY: "like an unbounded cache",
    AnomalyMetric.UTILIZATION: "like load that keeps growing",
}


def _level(metric: AnomalyMetric, value: float) -> str:
    return format_bytes(value) if metric is AnomalyMetric.MEMORY else percent(max(0.0, value))


def anomaly_message(o: Outcome) -> str:
    """The worst GPU's deviations: ``GPU utilization spikes to 25% (median 3%, robust z 22) every 7m...``."""
    f = o.extra
    if not isinstance(f, Figures):
        return f"no deviation left in the {format_duration(o.window_seconds)} window"
    e, m = f.episode, f.metric
    median = _level(m, f.median)
    z = f"robust z {abs(e.z):.0f}"
    way = "above" if e.z > 0 else "below"
    apart = _level(m, abs(e.peak - f.median))
    window = format_duration(f.window_seconds)
    if o.reason == Pattern.PERIODIC:
        period = approx_duration(f.period or 0.0)
        moves = "spikes" if e.z > 0 else "dips"
        text = (
            f"{f.signal} {moves} to {_level(m, e.peak)} (median {median}, {z}) every {period}: "
            f"{f.count} times in {window}, like a scheduled job"
        )
    elif o.reason == Pattern.CLIMB:
        text = (
            f"{f.signal} climbs steadily: {_level(m, e.peak)}, {apart} {way} its median {median}, for the "
            f"last {approx_duration(f.end - e.start)} ({z}), {_CLIMB_LIKE[m]}"
        )
    elif o.reason == Pattern.SHIFT:
        text = (
            f"{f.signal} moved to a new level: {_level(m, e.peak)}, {apart} {way} its median {median}, for "
            f"the last {approx_duration(f.end - e.start)} ({z})"
        )
    else:
        times = "once" if f.count == 1 else f"{f.count} times"
        moved = "spiked" if e.z > 0 else "dipped"
        text = (
            f"{f.signal} {moved} to {_level(m, e.peak)}, {apart} {way} its median {median} ({z}), "
            f"{times} in {window}"
        )
    if o.gpu_count > 1 and o.gpus:
        text += f" (on {len(o.gpus)} of {o.gpu_count} GPUs)"
    return text


def evaluate_anomaly(
    rule: Anomaly,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
) -> Outcome:
    """Judge an anomaly rule for one pod (see the module doc)."""
    kind = KIND
    end = pod_end(series, now, params)
    if end is None:
        return unknown(rule.name, kind, pod, rule.threshold, UNIT)
    start = end - rule.window_seconds
    judged: list[tuple[GpuAnomaly, str]] = []
    for key, window in series:
        got = gpu_anomaly(key.gpu, window, rule, start, end, params.max_gap_seconds)
        if got is not None:
            judged.append(got)
    if not judged:
        return unknown(rule.name, kind, pod, rule.threshold, UNIT)
    holding = [(g, s) for g, s in judged if g.covered and g.pattern is not None]
    worst, signal = max(holding or judged, key=lambda gs: gs[0].z)
    figures = None
    if worst.episodes:
        episode = worst.episodes[-1]
        if worst.pattern is Pattern.SPIKE:
            episode = max(worst.episodes, key=lambda e: abs(e.z))
        figures = Figures(
            rule.metric,
            signal,
            worst.median,
            episode,
            sum(1 for e in worst.episodes if (e.z > 0) == (episode.z > 0)),
            worst.period,
            end,
            rule.window_seconds,
        )
    return Outcome(
        rule.name,
        kind,
        pod,
        worst.z,
        rule.threshold,
        UNIT,
        holds=bool(holding),
        clears=all(not g.episodes for g, _ in judged),
        gpus=tuple(g.gpu for g, _ in holding),
        gpu_count=len(judged),
        window_seconds=rule.window_seconds,
        signal=signal,
        reason=None if worst.pattern is None else worst.pattern.value,
        extra=figures,
        describe=anomaly_message,
    )


# --- the kind ----------------------------------------------------------------------------------------

METRIC = Choice(
    "metric",
    "The reading to watch. utilization: SM activity where the GPU reports it (GPM), else GPU"
    " utilization. memory: GPU memory used.",
    choices=AnomalyMetric,
    required=True,
)
WINDOW = Duration(
    "window",
    "The trailing window the median and MAD are taken over, and deviations looked for in (a duration,"
    " at least 1m and at least evaluationInterval). The GPU's samples must cover it without gaps"
    " before the rule can fire.",
    default="30m",
    # A baseline needs readings enough to say what is usual: a minute of them, at the agent's 1 s.
    minimum="1m",
    window=True,
)
THRESHOLD = Number(
    "threshold",
    "The robust z-score a reading must pass, either way, to deviate (1 to 100; 5 is far outside"
    " normal noise).",
    minimum=1,
    maximum=100,
    default=5,
)
MIN_DEVIATION = Number(
    "minDeviation",
    "The least distance from the median that counts, whatever the z-score: percentage points of"
    " utilization, or percent of the GPU's memory (0 to 100), so that a series flat to the byte does"
    " not call any wobble a deviation.",
    minimum=0,
    maximum=100,
    default=5,
)
BODY = Body(
    "Fires when one of the pod's GPUs leaves its usual band: a reading whose robust z-score (distance"
    " from the window's median in units of 1.4826 x its median absolute deviation, so that a spike"
    " does not widen its own band) passes threshold, and by at least minDeviation. Names the pattern"
    " in the reason: GPUSpike (one or a few irregular deviations), GPUPeriodicSpikes (at least three"
    " at a regular interval: a scheduled job), GPUSteadyClimb (a deviation still going on that keeps"
    " rising: an unbounded cache) or GPULevelShift (one still going on, flat: a new level). Clears"
    " once no deviation is left in the window.",
    (METRIC, WINDOW, THRESHOLD, MIN_DEVIATION),
)


def parse_anomaly(name: str, obj: Mapping[str, Any], path: str) -> Anomaly:
    """An anomaly rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    return Anomaly(
        name=name,
        metric=METRIC.read(obj, path),
        window_seconds=WINDOW.read(obj, path),
        threshold=THRESHOLD.read(obj, path),
        min_deviation=MIN_DEVIATION.read(obj, path),
    )


RULE_TYPE = RuleType(
    kind=KIND,
    model=Anomaly,
    parse=parse_anomaly,
    body=BODY,
    evaluate=on_series(evaluate_anomaly),
    reach=lambda rule: rule.window_seconds,
    window=lambda rule: rule.window_seconds,
    reason="GPUAnomaly",
    meaning="its GPU readings left their usual band",
    per_gpu=True,
    colour="tab:brown",
    utilization=None,
)

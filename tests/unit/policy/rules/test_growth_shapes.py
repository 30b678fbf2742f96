"""memoryGrowth through the engine: leaks are found in minutes; caches, periodic patterns and noise never.

Each trace is one GPU's memory at 1 s readings, judged by a PolicyEvaluator every 10 s
(``evaluationInterval: 10s``) from its first reading on, as the operator would.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from functools import partial

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuwarden.policy import (
    FindingTransition,
    PodView,
    Point,
    PolicyEvaluator,
    SeriesKey,
    SeriesStore,
    Transition,
)
from gpuwarden.policy.rules.growth import MemoryGrowth
from gpuwarden.policy.rules.growth.model import MIN_SPAN_SECONDS, URGENCY, evidence_spans, urgent_spans
from gpuwarden.policy.spec.model import LabelSelector, PolicySpec

T0 = 1_749_999_960.0
MI = 2**20
GI = 2**30
CARD = 141 * GI
KEY = SeriesKey("ns", "job", "GPU-1")
EVERY = 10

Used = Callable[[int], float]
"""Bytes used at ``t`` seconds into the trace."""


def rule(rate_mi_per_min: float, window: float = 1800.0, min_fit: float = 0.8) -> MemoryGrowth:
    return MemoryGrowth("leak", rate_mi_per_min * MI / 60, window, min_fit)


def play(used: Used, growth: MemoryGrowth, seconds: int, judge_from: int = 0) -> list[FindingTransition]:
    """Readings every second of ``[0, seconds)``; an evaluation every 10 s from ``judge_from`` on."""
    evaluator = PolicyEvaluator("ns/p", PolicySpec(selector=LabelSelector(), rules=(growth,)))
    store = SeriesStore(retention_seconds=4000, max_points=8000)
    pods = [PodView(KEY.namespace, KEY.pod)]
    steps: list[FindingTransition] = []
    for t in range(seconds):
        store.add(KEY, Point(T0 + t, mem_used=used(t), mem_total=CARD))
        if t >= judge_from and t % EVERY == 0:
            steps += evaluator.evaluate(pods, store, T0 + t).transitions
    return steps


def started(steps: list[FindingTransition]) -> list[float]:
    """Seconds into the trace at which a finding started."""
    return [s.at - T0 for s in steps if s.transition is Transition.STARTED]


def deciding_span(per_second: float, top: float, window: float = 1800.0) -> float:
    """The shortest span that may decide on a straight rise at ``per_second`` up to ``top`` bytes."""
    spans = urgent_spans(window)
    nexts = (*spans[1:], evidence_spans(window)[0])
    urgent = [s for s, n in zip(spans, nexts, strict=True) if (CARD - top) / per_second <= URGENCY * n]
    return min(urgent, default=evidence_spans(window)[0])


def leaking(per_second: float, t: int) -> float:
    """20Gi and growing by ``per_second`` from 0."""
    return 20 * GI + per_second * t


def noisy(shape: Used, sigma: float, seed: int) -> Used:
    rng = random.Random(seed)
    return lambda t: shape(t) + rng.gauss(0, sigma)


# -- leaks: found in minutes ------------------------------------------------------------------------


def test_the_example_leak_is_found_within_five_minutes_and_says_over_what() -> None:
    """200Mi/m against ``{rate: 100Mi/m, window: 30m, minFit: 0.8}``: found on the 4-minute span."""
    steps = play(noisy(lambda t: 20 * GI + 200 * MI / 60 * t, 4 * MI, seed=1), rule(100), 600)
    (at,) = started(steps)
    assert MIN_SPAN_SECONDS <= at <= 300
    (first,) = [s for s in steps if s.transition is Transition.STARTED]
    assert first.finding.message.startswith("GPU memory grows 200Mi/m over 4m, fit 1.00; the card (141Gi)")


@settings(max_examples=20, deadline=None)
@given(
    times_rate=st.sampled_from([1.5, 2.0, 5.0, 20.0]),
    start=st.floats(1, 60),  # GiB
    load=st.sampled_from([0.0, 60.0]),  # GiB loaded in the first 30 s, before the leak
    onset=st.sampled_from([0, 60, 2400]),  # the leak's start: at once, after the load, after 40 flat minutes
    noise=st.floats(0, 16),  # MiB
    seed=st.integers(0, 2**32 - 1),
)
@example(times_rate=2.0, start=124.0, load=0.0, onset=60, noise=4.0, seed=0)  # the demo's leak
# 40 flat minutes, then 500Mi/m: found 2 minutes in, on a span half flat, when the quarters' noise
# was taken from the spread of the rises (which the onset inflates) instead of their curvature.
@example(times_rate=5.0, start=1.0, load=0.0, onset=2400, noise=7.0, seed=1)
def test_a_steady_leak_is_found_within_five_minutes_of_its_onset(
    times_rate: float, start: float, load: float, onset: int, noise: float, seed: int
) -> None:
    """At 1.5x the rule's rate or more, with little noise: whatever came before (a model load, a
    long flat stretch), a leak is found once the shortest span that may decide lies inside it (an
    urgent one when the card is full soon)."""
    per_second = times_rate * 100 * MI / 60

    def shape(t: int) -> float:
        loaded = start * GI + load * GI * min(1.0, t / 30)
        return min(CARD, loaded + per_second * max(0, t - onset))

    steps = play(noisy(shape, noise * MI, seed), rule(100), onset + 330)
    assert started(steps), "not found"
    # The fullest the card gets before the 4-minute span decides: the most urgent the leak becomes.
    top = min(CARD, (start + load) * GI + per_second * MIN_SPAN_SECONDS)
    assert onset + deciding_span(per_second, top) - 30 <= started(steps)[0] <= onset + 300


def test_faster_leaks_are_found_no_later() -> None:
    """With noise, the evidence needed shrinks as the rate grows: no rate is found later than a slower one."""
    found = []
    for times_rate in (1.5, 2, 5, 20):
        per_second = times_rate * 100 * MI / 60
        steps = play(noisy(partial(leaking, per_second), GI, seed=3), rule(100), 1900)
        found.append(started(steps)[0])
    assert found == sorted(found, reverse=True)
    assert found[0] > found[-1]  # and the noise makes the slow one wait for a longer span


def test_a_leak_about_to_fill_the_card_is_announced_without_waiting_for_the_bound() -> None:
    """Urgency: the same noisy trend (104Mi/m, 43Mi of noise), far from full and 0.9Gi from full.

    Its slope is just over ``rate``, so the slope's lower bound often is not. Near full, the card
    fills within twice the 4-minute span: announced there on the slope alone.
    """
    per_second = 104 * MI / 60
    found_far = found_near = 0
    for seed in range(12):
        far = play(noisy(lambda t: 20 * GI + per_second * t, 43 * MI, seed), rule(100), 300)
        near = play(noisy(lambda t: CARD - 0.9 * GI + per_second * t, 43 * MI, seed), rule(100), 300)
        found_far += bool(started(far))
        found_near += bool(started(near))
    assert found_near >= 10
    assert found_far <= found_near / 2


def test_a_slow_noisy_leak_near_full_is_flagged_with_three_quarters_of_its_time_ahead() -> None:
    """The bench's "0.9Gi from full" row: 104Mi/m under 43Mi of noise, its card full in 8m52s.

    Its rate is 4% over ``rate``, which no span under 2m40s can show; but the card full within the
    1m20s span's horizon can be, at the slope's lower bound, with the noise taken out of the fit:
    found with at least 3/4 of the time to full ahead (by 2m13s), not on the 2m40s span (2m50s)."""
    per_second = 104 * MI / 60
    to_full = 0.9 * GI / per_second
    delays = []
    for seed in range(12):
        shape = noisy(lambda t: min(CARD, CARD - 0.9 * GI + per_second * t), 43 * MI, seed)
        found = started(play(shape, rule(100), math.ceil(to_full)))
        delays.append(found[0] if found else math.inf)
    assert sum(delay <= to_full / 4 for delay in delays) >= 9, delays


FAST_RATES = (5, 15, 30, 60)
"""Gi per minute: the issue's fast leaks, which fill a 141Gi card in 2 to 28 minutes."""


@pytest.mark.parametrize("per_minute", FAST_RATES)
@pytest.mark.parametrize("start", [2, 40, 80])
@pytest.mark.parametrize(("noise", "onset"), [(4, 0), (4, 307), (256, 1203)])
def test_a_fast_leak_is_flagged_with_three_quarters_of_its_time_to_full_ahead(
    per_minute: int, start: int, noise: int, onset: int
) -> None:
    """Urgency: a leak filling the card 3 minutes to 24 hours after its onset is flagged with at least
    3/4 of that time ahead; one filling it within 5 minutes, within a minute of its onset. Its
    message says the time left."""
    per_second = per_minute * GI / 60
    to_full = (CARD - start * GI) / per_second
    shape = noisy(lambda t: min(CARD, start * GI + per_second * max(0, t - onset)), noise * MI, seed=onset)
    steps = play(shape, rule(100), onset + math.ceil(to_full))
    assert started(steps), "not found before the card was full"
    delay = started(steps)[0] - onset
    if to_full >= 180:
        assert delay <= to_full / 4
    if to_full <= 300:
        assert delay <= 60
    (first,) = [s for s in steps if s.transition is Transition.STARTED]
    assert "; the card (141Gi) is full in " in first.finding.message


@settings(max_examples=25, deadline=None)
@given(
    per_minute=st.floats(5, 60),  # GiB
    start=st.floats(1, 100),  # GiB
    onset=st.integers(0, 900),
    noise=st.sampled_from([0.0, 4.0, 64.0, 256.0]),  # MiB
    seed=st.integers(0, 2**32 - 1),
)
def test_any_fast_leak_leaves_three_quarters_of_its_time_ahead(
    per_minute: float, start: float, onset: int, noise: float, seed: int
) -> None:
    """Any rate from 5 to 60Gi/m from any level that leaves the card a minute or more: flagged within
    a minute when it fills within 5, else with 3/4 of its time to full ahead."""
    per_second = per_minute * GI / 60
    to_full = (CARD - start * GI) / per_second
    if to_full < 60:
        return  # full before the shortest urgent span has seen it: see docs/policy.md
    shape = noisy(lambda t: min(CARD, start * GI + per_second * max(0, t - onset)), noise * MI, seed)
    found = started(play(shape, rule(100), onset + math.ceil(to_full)))
    assert found, "not found before the card was full"
    assert found[0] - onset <= (60 if to_full <= 300 else to_full / 4)


# -- what is not a leak: never flagged -----------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    steps=st.integers(1, 6),
    height=st.floats(0.25, 16),  # GiB per step
    every=st.integers(5, 600),  # seconds between steps
    at=st.sampled_from([0, 600, 2400]),  # when the climb starts: with the job, or later in its life
    noise=st.sampled_from([0.0, 2.0, 16.0, 64.0]),  # MiB
    seed=st.integers(0, 2**32 - 1),
)
@example(steps=4, height=16.0, every=90, at=0, noise=2.0, seed=0)  # the demo's caching allocator
# Steps every 3 buckets of the 16m span, flat before: its first quarter (a step at its edge) must
# refuse the span, which a quarter's noise taken from the medians' own scatter would excuse.
@example(steps=5, height=1.0, every=144, at=2400, noise=0.0, seed=0)
# Six 256Mi steps 28 s apart under 64Mi of noise, a 4m span around them: at the buckets' resolution a
# ramp inside flat ends, each end quarter short of half the slope only within its noise; both at once
# are significantly short (the S-shape), which a quarter judged alone let pass.
@example(steps=6, height=0.25, every=28, at=600, noise=64.0, seed=1)
# Four 256Mi steps 73 s apart from the job's start under 64Mi of noise: a 4m span holding three of
# them fired a minute after the last, when a rise was judged by the rises' own spread, which the steps
# widen (one of three counted as a jump); judged by the medians' noise, all three are jumps.
@example(steps=4, height=0.25, every=73, at=0, noise=64.0, seed=0)
# Six 288Mi steps 70 s apart under 64Mi of noise: one step fell mid-bucket and rose in two, 157 and
# 173Mi, each under the threshold; counted apart, neither was a jump, and the 4m span fired.
@example(steps=6, height=0.288, every=70, at=2400, noise=64.0, seed=3069431946)
def test_a_caching_allocator_that_steps_up_and_plateaus_never_fires(
    steps: int, height: float, every: int, at: int, noise: float, seed: int
) -> None:
    """Up to six steps, 5 s to 10 minutes apart, then flat. The rule's rate is half the climb's own, so a
    slope over the climb alone would fire."""
    climb = max(60, (steps - 1) * every)

    def shape(t: int) -> float:
        taken = min(steps, (t - at) // every + 1) if t >= at else 0
        return 8 * GI + taken * height * GI

    rate = steps * height * GI / climb * 60 / MI / 2
    steps_taken = play(noisy(shape, noise * MI, seed), rule(rate), at + climb + 1900)
    assert not started(steps_taken)


SPAN_16M_BUCKET = 48
"""Seconds a bucket of the 16-minute span covers (16 min / 20 buckets)."""


@pytest.mark.parametrize(("steps", "every", "at"), [(5, 192, 2400), (6, 192, 0), (6, 144, 2400)])
def test_steps_in_phase_with_the_16m_spans_buckets_never_fire(steps: int, every: int, at: int) -> None:
    """Steps every 3 or 4 buckets of the 16-minute span, each in the middle of a bucket of an even
    count of readings: a bucket's value averaging its two middle readings split each step into two
    half rises, so half the rises were nonzero, the typical rise was half a step, and none counted as
    a jump. A bucket's value is its lower median, always a reading: a step lands whole in one rise."""
    assert every % SPAN_16M_BUCKET == 0
    climb = (steps - 1) * every

    def shape(t: int) -> float:
        return 8 * GI + (min(steps, (t - at) // every + 1) if t >= at else 0) * GI

    rate = steps * GI / climb * 60 / MI / 2
    assert not started(play(shape, rule(rate), at + climb + 1900))


@settings(max_examples=20, deadline=None)
@given(
    at=st.integers(0, 2400),
    size=st.floats(0.5, 120),  # GiB
    over=st.sampled_from([1, 10, 30]),  # seconds the load takes
    noise=st.sampled_from([0.0, 4.0, 64.0]),  # MiB
    rate=st.sampled_from([10.0, 100.0, 1000.0]),  # MiB per minute
    seed=st.integers(0, 2**32 - 1),
)
def test_a_model_loaded_once_never_fires(
    at: int, size: float, over: int, noise: float, rate: float, seed: int
) -> None:
    """One load (at once or over up to 30 s) at any point of the job's life, then a flat line."""

    def shape(t: int) -> float:
        return 2 * GI + size * GI * min(1.0, max(0.0, (t - at) / over))

    assert not started(play(noisy(shape, noise * MI, seed), rule(rate), at + 1900))


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["ramp", "square", "sine"]),
    period=st.integers(20, 1200),
    amplitude=st.floats(0.5, 20),  # GiB
    phase=st.floats(0, 1),
    noise=st.sampled_from([0.0, 4.0, 64.0]),  # MiB
    seed=st.integers(0, 2**32 - 1),
)
@example(kind="ramp", period=600, amplitude=20.0, phase=0.0, noise=4.0, seed=0)  # the 20-40Gi/10m
def test_periodic_allocate_and_free_never_fires_once_it_has_freed(
    kind: str, period: int, amplitude: float, phase: float, noise: float, seed: int
) -> None:
    """Sawtooth, square wave and sine, with a rate a quarter of the fastest allocation.

    Judged from the first reading when every rise is shorter than 3/4 of the shortest span that
    may decide on it (an urgent span when the fastest rise would fill the card soon enough);
    otherwise once a whole period has been seen: the first steady rise of a young series (a
    sine's flank is nearly straight over a short span), longer than that span, is by the data a
    leak until it frees (docs/policy.md says so).
    """

    def level(t: int) -> float:
        x = (t / period + phase) % 1.0
        if kind == "ramp":
            return x
        if kind == "square":
            return float(x >= 0.5)
        return 0.5 - 0.5 * math.cos(2 * math.pi * x)

    # Once a whole period has been seen and freed (the ramp's second wrap; for the sine, the trough
    # after its first whole crest), plus two evaluations: the history then holds the level the
    # pattern returns to, for long enough to show in a bucket median.
    if kind == "ramp":
        rise, freed = float(period), period * ((1.0 - phase) % 1.0 or 1.0) + period
    elif kind == "sine":
        rise, freed = period / 2, period * ((0.5 - phase) % 1.0 + 0.5) + period
    else:
        rise, freed = 0, 0.0
    fastest = amplitude * GI / (period if kind == "ramp" else period / math.pi) * 60 / MI
    top = 20 * GI + amplitude * GI
    shortest = deciding_span(fastest * MI / 60, top)
    judge_from = 0 if rise <= 0.75 * shortest else math.ceil(freed) + 2 * EVERY
    shape = noisy(lambda t: 20 * GI + amplitude * GI * level(t), noise * MI, seed)
    assert not started(play(shape, rule(max(1.0, fastest / 4)), judge_from + 2400, judge_from))


@settings(max_examples=20, deadline=None)
@given(
    level=st.floats(1, 120),  # GiB
    noise=st.sampled_from([1.0, 16.0, 256.0, 1024.0]),  # MiB
    spikes=st.floats(0, 0.05),  # share of readings with a transient +4 GiB
    rate=st.sampled_from([1.0, 10.0, 100.0]),  # MiB per minute
    seed=st.integers(0, 2**32 - 1),
)
def test_noise_alone_never_fires(level: float, noise: float, spikes: float, rate: float, seed: int) -> None:
    """A flat line under noise and transient allocations: the slope's bound never clears ``rate``."""
    rng = random.Random(seed)

    def shape(t: int) -> float:
        return level * GI + rng.gauss(0, noise * MI) + (4 * GI if rng.random() < spikes else 0.0)

    assert not started(play(shape, rule(rate), 2400))


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["flat", "load", "staircase"]),
    below=st.floats(0.1, 3),  # GiB from full where it settles
    noise=st.sampled_from([4.0, 43.0, 256.0]),  # MiB
    rate=st.sampled_from([10.0, 100.0, 1000.0]),  # MiB per minute
    seed=st.integers(0, 2**32 - 1),
)
@example(kind="flat", below=0.9, noise=43.0, rate=100.0, seed=0)  # the near-full leak's level, not growing
@example(kind="flat", below=1.0, noise=256.0, rate=10.0, seed=38354)  # paged before URGENT_SIGNIFICANCE_Z
def test_memory_settled_near_full_never_fires(
    kind: str, below: float, noise: float, rate: float, seed: int
) -> None:
    """Near full, where the urgent spans may decide on the slope's bound projecting the card full:
    a flat line under noise and transients, a load over 30 s, or 4 steps 90 s apart that end there."""
    rng = random.Random(seed)
    top = CARD - below * GI

    def shape(t: int) -> float:
        if kind == "load":
            level = top - 60 * GI * (1 - min(1.0, max(0.0, (t - 600) / 30)))
        elif kind == "staircase":
            level = top - 16 * GI * (4 - min(4, max(0, (t - 600) // 90 + 1)))
        else:
            level = top
        spike = 4 * GI if rng.random() < 0.01 else 0.0
        return min(CARD, level + rng.gauss(0, noise * MI) + spike)

    assert not started(play(shape, rule(rate), 2400))


@pytest.mark.parametrize("window", [60.0, 300.0])
def test_a_window_shorter_than_the_shortest_span_is_judged_on_itself(window: float) -> None:
    """``window: 1m`` still finds a fast leak within about a minute: the spans never exceed the window."""
    steps = play(lambda t: 20 * GI + 3 * GI / 60 * t, rule(1024, window=window), int(window) + 120)
    assert window <= started(steps)[0] <= window + window / 20 + EVERY


# -- what the findings say ---------------------------------------------------------------------


def test_a_leak_filling_the_card_soon_pages_and_a_slower_one_escalates_once() -> None:
    """Within 16m of full: GPUMemoryExhaustionImminent, with the time left. A leak found earlier is
    re-announced under that reason once its card comes within 16m of full, and keeps it."""
    fast = play(lambda t: 2 * GI + 30 * GI / 60 * t, rule(100), 120)
    (first,) = [s for s in fast if s.transition is Transition.STARTED]
    assert first.finding.reason == "GPUMemoryExhaustionImminent"
    assert re.fullmatch(
        r"GPU memory grows 30Gi/m over 40s, fit 1\.00; the card \(141Gi\) is full in 3m5\ds",
        first.finding.message,
    )

    slow = play(noisy(lambda t: 90 * GI + 2 * GI / 60 * t, 64 * MI, seed=2), rule(100), 1500)
    changes = [(s.transition, s.finding.reason) for s in slow if s.transition is not Transition.ONGOING]
    assert changes == [
        (Transition.STARTED, "GPUMemoryLeakSuspected"),
        (Transition.RENOTIFY, "GPUMemoryExhaustionImminent"),
    ]
    (escalated,) = [s for s in slow if s.transition is Transition.RENOTIFY]
    assert escalated.finding.seconds_to_full is not None
    assert 15 * 60 <= escalated.finding.seconds_to_full <= 16 * 60


def test_a_clearing_says_what_changed_not_the_trend_it_no_longer_has() -> None:
    """The first tooth of a 20-40Gi/10m sawtooth frees: "fell from ... to 20Gi", never "grows 2Gi/m";
    a ramp that stopped: flat over the span that speaks."""
    tooth = play(noisy(lambda t: 20 * GI + 20 * GI * ((t % 600) / 600), 4 * MI, 0), rule(100), 1200)
    (cleared,) = [s for s in tooth if s.transition is Transition.RESOLVED]
    assert re.fullmatch(
        r"GPU memory fell from 3\d\.\dGi to 20\.\dGi over the last 4m", cleared.finding.message
    )

    stopped = play(lambda t: 20 * GI + 30 * GI / 60 * min(60, max(0, t - 100)), rule(100), 900)
    (cleared,) = [s for s in stopped if s.transition is Transition.RESOLVED]
    assert cleared.finding.message == "GPU memory is flat over 4m (fit 0.00)"

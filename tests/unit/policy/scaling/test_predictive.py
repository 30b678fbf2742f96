"""Forecast-driven scaling's parts: the load sample, the start-up clock, and the forecast's verdict."""

from __future__ import annotations

import random

import pytest

from gpuwarden.policy.engine import PodView, PolicyEvaluator
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.rules.common import WindowParams
from gpuwarden.policy.scaling.predictive import (
    DEFAULT_HORIZON_SECONDS,
    MAX_STARTUP_SECONDS,
    Predictor,
    StartupClock,
    View,
    WorkloadLoad,
    workload_load,
)
from gpuwarden.policy.spec.model import BUCKET_SECONDS, ScaleForecast, Signal
from gpuwarden.policy.store.series import Point, SeriesKey, SeriesStore

T0 = 1_750_000_020.0 - (1_750_000_020.0 % BUCKET_SECONDS)
FORECAST = ScaleForecast("saturated", 95.0, Signal.AUTO, "idle-gpu", 20.0, horizon_seconds=None)


def test_the_load_is_the_sum_of_the_pods_means_over_the_interval() -> None:
    store = SeriesStore(retention_seconds=600, max_points=1000)
    for i in range(30):
        t = T0 + i
        store.add(SeriesKey("ns", "a", "GPU-1"), Point(t, gpu_util=80.0))
        # Two GPUs, one busy: the pod reads 45%, as the rules read it.
        store.add(SeriesKey("ns", "b", "GPU-2"), Point(t, gpu_util=90.0))
        store.add(SeriesKey("ns", "b", "GPU-3"), Point(t, gpu_util=0.0))
        store.add(SeriesKey("ns", "c", "GPU-4"), Point(t, gpu_util=1.0))  # loading its model
        if i < 5:
            store.add(SeriesKey("ns", "gone", "GPU-5"), Point(t, gpu_util=99.0))  # stale since
    pods = [store.series_of("ns", p) for p in ("a", "b", "c", "gone", "empty")]
    load = workload_load(pods, FORECAST, T0 + 29, 10.0, WindowParams(stale_after_seconds=20))
    assert load is not None
    assert load.total == pytest.approx(126.0)
    assert (load.serving, load.pods) == (2, 3)
    assert workload_load([], FORECAST, T0, 10.0, WindowParams()) is None


def test_the_start_up_clock_times_a_scale_up_until_every_replica_carries_load() -> None:
    clock = StartupClock()
    clock.observe(0, 5)  # nothing pending: nothing timed
    clock.scaled(100, 2, 3)
    clock.observe(150, 2)
    clock.observe(190, 3)
    clock.observe(300, 3)
    assert list(clock.samples) == [90]
    # A scale-down, and a newer change before the pods serve, are not timed.
    clock.scaled(400, 3, 2)
    clock.observe(410, 3)
    clock.scaled(500, 2, 4)
    clock.scaled(520, 4, 5)
    clock.observe(560, 5)
    assert list(clock.samples) == [90, 40]
    # A scale-up whose pods never all serve is forgotten.
    clock.scaled(1000, 5, 6)
    clock.observe(1000 + MAX_STARTUP_SECONDS + 1, 6)
    assert list(clock.samples) == [90, 40]
    assert clock.observed() == 65


def feed(p: Predictor, totals: list[float], start: float = T0, serving: int = 2) -> float:
    """One sample every 10 s, six per bucket; returns the time of the last."""
    t = start
    for i, total in enumerate(totals):
        for j in range(6):
            t = start + i * BUCKET_SECONDS + j * 10
            p.observe(WorkloadLoad(total, serving, serving), t)
    return t


def test_the_horizon_is_the_configured_one_else_the_observed_start_up_else_the_default() -> None:
    p = Predictor()
    assert p.horizon_seconds(FORECAST) == DEFAULT_HORIZON_SECONDS
    p.startup.samples.append(150)
    assert p.horizon_seconds(FORECAST) == 150
    configured = ScaleForecast("saturated", 95.0, Signal.AUTO, horizon_seconds=60)
    assert p.horizon_seconds(configured) == 60


def test_no_say_without_ten_minutes_of_history() -> None:
    p = Predictor()
    now = feed(p, [150.0] * 5)
    assert p.verdict(FORECAST, 2, now).view is View.NO_HISTORY
    assert not p.verdict(FORECAST, 2, now).has_say
    now = feed(p, [150.0] * 12, start=now + 10)
    assert p.verdict(FORECAST, 2, now).view is View.HOLD_DOWN  # 75% per replica: far above the floor


def test_a_ramp_is_forecast_above_the_ceiling_before_it_gets_there() -> None:
    p = Predictor()
    rng = random.Random(1)
    flat = [150 + rng.gauss(0, 2) for _ in range(20)]
    now = feed(p, flat)
    assert p.verdict(FORECAST, 2, now).view is View.HOLD_DOWN
    # +8 a minute: at 182 the two replicas run at 91%, three minutes on they would be past 95%.
    ramp = [150.0 + 8 * k for k in range(1, 5)]
    now = feed(p, ramp, start=now + 10)
    verdict = p.verdict(FORECAST, 2, now)
    assert verdict.view is View.UP, verdict
    assert verdict.per_replica is not None
    assert verdict.per_replica > 95
    assert ramp[-1] / 2 < 95  # not saturated now
    assert verdict.summary(FORECAST) == "forecast above saturated's ceiling (95%) in 3m"
    assert verdict.detail().endswith("%)")
    # Counted over more replicas, the same load needs no more.
    assert p.verdict(FORECAST, 3, now).view is View.HOLD_DOWN


def test_a_low_flat_load_lets_a_scale_down_through_and_a_coming_rise_holds_it_back() -> None:
    p = Predictor()
    rng = random.Random(2)
    now = feed(p, [20 + rng.gauss(0, 1) for _ in range(30)])
    clear = p.verdict(FORECAST, 4, now)  # 5% per replica, far under the 20% floor
    assert clear.view is View.CLEAR
    assert p.verdict(FORECAST, 1, now).view is View.HOLD_DOWN  # 20% on one: at the floor


def test_a_noisy_load_is_too_unsure_to_act_on() -> None:
    p = Predictor()
    rng = random.Random(3)
    now = feed(p, [rng.choice((50.0, 350.0)) for _ in range(30)])
    verdict = p.verdict(FORECAST, 2, now)
    assert verdict.view is View.UNSURE
    assert not verdict.has_say
    assert verdict.summary(FORECAST) == "forecast unsure: the rules decide"


def test_the_evaluation_carries_a_load_sample_only_for_a_forecasting_policy() -> None:
    base = {
        "selector": {},
        "rules": [{"name": "saturated", "utilizationCeiling": {"percent": 95, "signal": "gpuUtil"}}],
        "actions": {
            "scale": {
                "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                "maxReplicas": 4,
                "scaleUpOn": ["saturated"],
            }
        },
    }
    store = SeriesStore(retention_seconds=600, max_points=1000)
    for i in range(30):
        store.add(SeriesKey("ns", "a", "GPU-1"), Point(T0 + i, gpu_util=60.0, sm_active=10.0))
        store.add(SeriesKey("ns", "b", "GPU-2"), Point(T0 + i, gpu_util=70.0, sm_active=10.0))
    pods = [PodView("ns", "a"), PodView("ns", "b")]
    plain = PolicyEvaluator("ns/p", parse_spec(base)).evaluate(pods, store, T0 + 29)
    assert plain.load is None
    base["actions"]["scale"]["forecast"] = {}  # type: ignore[index]
    ahead = PolicyEvaluator("ns/p", parse_spec(base)).evaluate(pods, store, T0 + 29)
    assert ahead.load is not None
    assert ahead.load.total == pytest.approx(130.0)  # on gpuUtil, the rule's
    assert (ahead.load.serving, ahead.load.pods) == (2, 2)

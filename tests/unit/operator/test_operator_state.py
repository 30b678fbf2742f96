"""The operator's records over time (looptime): series that stop receiving readings go."""

from __future__ import annotations

import asyncio

import pytest

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.state import MIN_RETENTION, PRUNE_SECONDS
from gpuwarden.policy.store.series import Point, SeriesKey

T0 = 1_800_000_000.0


@pytest.mark.looptime
async def test_a_series_that_stops_receiving_readings_is_dropped_after_the_retention() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    operator = build_operator(OperatorConfig(), clock=lambda: T0 + loop.time() - start)
    state = operator.state
    # A pod whose last report landed after its deletion, and one still reporting.
    gone, alive = SeriesKey("ns", "gone", "GPU-1"), SeriesKey("ns", "alive", "GPU-2")
    state.store.add(gone, Point(t=T0, gpu_util=3.0))
    pruning = asyncio.create_task(operator.lifecycle.tasks["gpuwarden pruning"]())  # as the root wired it
    try:
        for second in range(int(MIN_RETENTION + 2 * PRUNE_SECONDS)):
            state.store.add(alive, Point(t=T0 + second, gpu_util=50.0))
            await asyncio.sleep(1)
            if second < MIN_RETENTION:
                assert state.store.window(gone) is not None  # kept while within the retention
    finally:
        pruning.cancel()
    assert state.store.window(gone) is None
    assert state.store.window(alive) is not None

"""A pod's GPU activity over a window, as the utilization kinds read it (utilizationFloor and
-Ceiling, idleGpus; a scale forecast and reclaim read it too): per GPU, the mean of its SM activity
(GPM) or its utilization counter, and whether its readings cover the window.

Its own module because several kinds read it, and kinds do not import kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuwarden.policy.rules.common import WindowParams, covered, pod_end, readings
from gpuwarden.policy.spec.model import Signal
from gpuwarden.policy.store.series import Column, SeriesKey, UtilizationSource, Window

UNIT = "percent"

SIGNAL_NAMES = {
    UtilizationSource.DEVICE: "GPU utilization (device counter)",
    UtilizationSource.PROCESSES: "per-process SM utilization",
    UtilizationSource.NO_PROCESS: "per-process SM utilization (no process of its own on the shared GPU)",
}
"""How a message names a gpuUtil reading, by what it is made of."""
GPM_SIGNAL = "SM activity (GPM)"


@dataclass(slots=True)
class GpuActivity:
    """One GPU's activity over a window."""

    gpu: str
    column: Column
    """The reading used (SM_ACTIVE or GPU_UTIL)."""
    signal: str
    """What that reading is made of, in words (see :data:`SIGNAL_NAMES`)."""
    mean: float | None
    """None when the window has no reading of ``column``."""
    covered: bool
    power_w: float | None = None
    """Mean power draw over the window, when asked for and reported."""


def gpu_activity(
    gpu: str,
    window: Window,
    signal: Signal,
    start: float,
    end: float,
    *,
    noise_floor: float = 0.0,
    max_gap: float | None = None,
    with_power: bool = False,
) -> GpuActivity:
    """One GPU's mean activity over ``[start, end]`` per ``signal``, readings <= ``noise_floor`` as 0."""
    column = Column.GPU_UTIL if signal is Signal.GPU_UTIL else Column.SM_ACTIVE
    r = readings(window, column, start, end)
    if not r.values and signal is Signal.AUTO:
        column = Column.GPU_UTIL
        r = readings(window, column, start, end)
    power: float | None = None
    if with_power:
        watts = readings(window, Column.POWER_W, start, end).values
        power = sum(watts) / len(watts) if watts else None
    named = GPM_SIGNAL if column is Column.SM_ACTIVE else SIGNAL_NAMES[window.util_source]
    if not r.values:
        return GpuActivity(gpu, column, named, None, covered=False, power_w=power)
    total = sum(filter(noise_floor.__lt__, r.values)) if noise_floor > 0 else sum(r.values)
    return GpuActivity(
        gpu,
        column,
        named,
        total / len(r.values),
        covered=covered(r, start, end, max_gap),
        power_w=power,
    )


def pod_activity(
    series: Sequence[tuple[SeriesKey, Window]],
    signal: Signal,
    start: float,
    end: float,
    *,
    noise_floor: float = 0.0,
    max_gap: float | None = None,
    with_power: bool = False,
) -> list[GpuActivity]:
    """Activity of each of the pod's GPUs that has any point in ``[start, end]``."""
    out = []
    for key, window in series:
        i0, i1 = window.span(start, end)
        if i0 == i1:
            continue  # silent for the whole window: no longer part of the pod's view
        out.append(
            gpu_activity(
                key.gpu,
                window,
                signal,
                start,
                end,
                noise_floor=noise_floor,
                max_gap=max_gap,
                with_power=with_power,
            )
        )
    return out


def trailing_activity(
    series: Sequence[tuple[SeriesKey, Window]],
    signal: Signal,
    for_seconds: float,
    now: float,
    params: WindowParams,
    *,
    noise_floor: float = 0.0,
    with_power: bool = False,
) -> list[GpuActivity]:
    """What a utilization kind judges: :func:`pod_activity` over ``[end - for_seconds, end]``, ``end``
    the pod's as-of time (:func:`~gpuwarden.policy.rules.common.pod_end`); empty for a stale pod."""
    end = pod_end(series, now, params)
    if end is None:
        return []
    return pod_activity(
        series,
        signal,
        end - for_seconds,
        end,
        noise_floor=noise_floor,
        max_gap=params.max_gap_seconds,
        with_power=with_power,
    )


def signal_name(gpus: Sequence[GpuActivity]) -> str:
    """The signal that decided, in words; several when the pod's GPUs were judged on different ones."""
    names = list(dict.fromkeys(g.signal for g in gpus if g.mean is not None))
    if len(names) == 1:
        return names[0]
    return f"GPU activity ({'; '.join(names)})"

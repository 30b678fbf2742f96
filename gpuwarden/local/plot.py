"""``--plot FILE.png``: each GPU's utilization and memory over the run, with its findings marked.

One row per GPU that ran something (the others are named in one line under the title), two
panels: utilization (NVML utilization.gpu and, where the GPU has GPM, SM activity) and memory
used, its axis scaled to the readings (a leak of a few GiB on a 141 GiB card climbs across the
panel; from where a growth finding started, so a job's load before it does not flatten it; the
card's size is in the title, and its line is drawn where the readings come near it). A GPU that
ran several pods or processes at once (a shared GPU) also gets one line per pod or process in
each panel: its own per-process SM utilization, drawn through its readings (they come every
``--process-interval``), and its own memory; the device's lines stay, thinner. A finding is drawn
on the panel of what it judged (utilization rules on the left, memory rules on the right): a
dashed line where it started and a shaded band until it cleared (or the run ended), its rule's
name and the value it fired with in a label above the readings, its rule's threshold as a
dash-dot line. The service rules' values (P99 latency, a queue) are drawn where they are judged:
on a right axis of the utilization panel of their pod's GPU, or in a row of their own for a
subject on no GPU (``service/<host:port>``). Scale decisions are marked on the GPUs of the pods
they sized. On a shared GPU each pod or process has a lane of its own under the readings, named
in its colour, and its findings' bands run in its lane only; a dot marks where each started on
its line, and the label names it. Labels never cover each other: each takes the first line of
the headroom where it overlaps none placed before, and the headroom grows to hold them.

matplotlib is an optional dependency (``pip install 'gpuwarden[plot]'``); the figure is
built on the Agg canvas directly, never through pyplot, so nothing global changes and
no display is needed.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.local.history import DeviceHistory, FindingSpan, History, JudgedSeries, ScaleMark, ShareHistory
from gpuwarden.policy import format_bytes, format_count, format_latency, rule_type

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.transforms import Bbox

GIB = float(2**30)
ROW_HEIGHT = 2.6
"""Inches per GPU row."""
TITLE_CHARS = 52
"""A panel title's pod or process is cut here (a process's command line can be long)."""

LABEL_POINTS = 12.0
"""Height of one line of finding labels, in points (their font is 8 points)."""
LANE_POINTS = 10.0
"""Height of a pod's or process's lane under the readings of a shared GPU, in points."""
MAX_LANES_SHARE = 0.4
"""The lanes take at most this share of a panel's height (they get thinner past it)."""
MEMORY_NEAR_FULL = 0.8
"""Readings above this share of the card bring the card's size into the memory panel's view."""


def judges_utilization(span: FindingSpan) -> bool:
    """Whether a finding speaks of utilization (its panel), else of memory.

    A kind that watches either (anomaly) names the reading first in its message (``GPU memory ...``).
    """
    judges = rule_type(span.kind).utilization
    if judges is None:
        return not span.message.startswith("GPU memory")
    return judges


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` with the install hint when matplotlib is missing (check early)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'gpuwarden[plot]'") from None


def build_figure(history: History, title: str) -> Figure:
    """The whole figure: a suptitle, per GPU that ran something a utilization panel and a memory panel,
    per judged service that runs on none a row of its own, and a line naming the GPUs left out."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    devices = [(key, d) for key, d in history.devices.items() if d.subjects or _spans_on(history, key)]
    empty = [d for key, d in history.devices.items() if not (d.subjects or _spans_on(history, key))]
    services = _service_rows(history, devices)
    rows = max(1, len(devices) + len(services))
    folded = 0.25 if empty else 0.0
    height = 1.4 + folded + ROW_HEIGHT * rows
    # Fixed margins rather than a layout engine: constrained layout doubles the time to save.
    figure = Figure(figsize=(14, height))
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=13, fontweight="bold", y=1 - 0.12 / height)
    if empty:
        names = ", ".join(d.name for d in empty)
        them = "it" if len(empty) == 1 else "them"
        figure.text(
            0.5, 1 - 0.5 / height, f"Not drawn: {names}: no pod or process ran on {them}",
            ha="center", va="center", fontsize=10, gid="empty-gpus",
        )  # fmt: skip
    if not devices and not services:
        figure.text(0.5, 0.5, "no GPU readings", ha="center", va="center")
        return figure
    axes = figure.subplots(
        rows,
        2,
        sharex=True,
        squeeze=False,
        gridspec_kw={
            "left": 0.055,
            "right": 0.955,
            "top": 1 - (0.55 + folded) / height,
            "bottom": 0.95 / height,
            "hspace": 0.32,
            "wspace": 0.21,
        },
    )
    origin = history.first if history.first is not None else 0.0
    span_seconds = (history.last or origin) - origin
    unit, scale = "seconds", 1.0
    if span_seconds > 3 * 3600:
        unit, scale = "hours", 3600.0
    elif span_seconds > 300:
        unit, scale = "minutes", 60.0

    def x(t: float) -> float:
        return (t - origin) / scale

    end_x = x(history.last if history.last is not None else origin)
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.set_xlim(0, max(end_x, 1e-9))  # first: the labels are placed by their width on it
    for row, (key, device) in enumerate(devices):
        _gpu_row(history, key, device, axes[row][0], axes[row][1], x, end_x, scale, renderer)
    for row, subject in enumerate(services, start=len(devices)):
        _service_row(history, subject, axes[row][0], axes[row][1], x, end_x, renderer)
    for ax in axes[-1]:
        ax.set_xlabel(f"{unit} since start")
    # One legend for all panels, below them: per-panel legends would hide the finding labels.
    figure.legend(handles=_legend_handles(), loc="lower center", ncols=5, fontsize=9, frameon=False)
    return figure


def _spans_on(history: History, key: str) -> list[FindingSpan]:
    return [s for s in history.spans if key in s.devices]


def _service_rows(history: History, devices: list[tuple[str, DeviceHistory]]) -> list[str]:
    """The subjects whose service rules were judged (or fired) that run on no GPU drawn: a
    ``service/...`` that ``watch`` scrapes, a served pod without a GPU."""
    drawn = {s for _, d in devices for s in d.subjects}
    keys = {k for k, _ in devices}
    rows = [s for s in history.judged if s not in drawn]
    for span in history.spans:
        if span.subject not in drawn and not keys.intersection(span.devices) and span.subject not in rows:
            rows.append(span.subject)
    return rows


def _gpu_row(
    history: History,
    key: str,
    device: DeviceHistory,
    util_ax: Axes,
    mem_ax: Axes,
    x: Callable[[float], float],
    end_x: float,
    scale: float,
    renderer: Any,
) -> None:
    """One GPU's two panels: readings, the latency its pods' service rules judge (on the utilization
    panel's right axis), findings with their thresholds, scale decisions."""
    subject = _cut(_subject_text(device))
    card = f"; card {format_bytes(device.memory_total)}" if device.memory_total else ""
    util_ax.set_title(f"{device.name}: {subject}  (utilization)", loc="left", fontsize=10)
    mem_ax.set_title(f"{device.name}: {subject}  (memory{card})", loc="left", fontsize=10)
    spans = sorted(_spans_on(history, key), key=lambda s: s.start)
    xs = [x(t) for t in device.times]
    _utilization_panel(util_ax, xs, device)
    memory_spans = [s for s in spans if not judges_utilization(s)]
    memory_range = _memory_panel(mem_ax, xs, device, memory_spans)
    judged = [series for s in device.subjects for series in history.judged.get(s, {}).values()]
    service_unit = _first_unit(judged)
    service_ax = util_ax.twinx() if service_unit is not None else None
    service_range = (
        _judged_lines(service_ax, [j for j in judged if j.unit == service_unit], x)
        if service_ax is not None and service_unit is not None
        else None
    )
    colors = _share_colors(device)
    if colors:
        _share_lines(util_ax, mem_ax, device, colors, x)
    labels: dict[int, list[Bbox]] = {id(util_ax): [], id(mem_ax): []}
    for span in spans:
        ax = util_ax if judges_utilization(span) else mem_ax
        start, end = x(span.start), x(span.end) if span.end is not None else end_x
        lane = list(colors).index(span.subject) if span.subject in colors else None
        _mark(ax, span, start, end, lane, len(colors))
        who = _who(span.subject) if lane is not None else ""
        _label(ax, span, start, who, labels[id(ax)], renderer)
        if lane is not None:
            _dot(ax, span, start, device.shares[span.subject])
        if rule_type(span.kind).metric is not None:
            if service_ax is not None and span.unit == service_unit and service_range is not None:
                service_range = _threshold(service_ax, span, span.threshold, service_range)
        elif ax is util_ax:
            if span.unit == "percent":
                _threshold(util_ax, span, span.threshold, (0.0, 100.0))
        else:
            memory_range = _memory_threshold(mem_ax, span, device, start, end, scale, memory_range)
    for mark in history.scaling:
        if key in mark.devices:
            _scale_mark(util_ax, mark, x(mark.at), labels[id(util_ax)], renderer)
    _fit(util_ax, (0.0, 100.0), len(colors), labels[id(util_ax)], ticks=False)
    _fit(mem_ax, memory_range, len(colors), labels[id(mem_ax)], ticks=True)
    if service_ax is not None and service_range is not None and service_unit is not None:
        service_ax.set_ylabel(_UNIT_LABELS.get(service_unit, service_unit))
        _fit(service_ax, service_range, len(colors), labels[id(util_ax)], ticks=True)
    if colors:
        _lane_names(util_ax, mem_ax, colors)


def _service_row(
    history: History,
    subject: str,
    left: Axes,
    right: Axes,
    x: Callable[[float], float],
    end_x: float,
    renderer: Any,
) -> None:
    """A served subject on no GPU: its service rules' values, one unit a panel (latency first; the
    right panel only for a second unit), its findings with their thresholds."""
    judged = list(history.judged.get(subject, {}).values())
    spans = sorted((s for s in history.spans if s.subject == subject), key=lambda s: s.start)
    units = list(dict.fromkeys([u for u in (_first_unit(judged),) if u] + [j.unit for j in judged]))
    units += [s.unit for s in spans if s.unit not in units]
    panels = list(zip(units[:2], (left, right), strict=False))
    if len(panels) < 2:
        right.set_visible(False)
    for unit, ax in panels:
        ax.set_title(f"{_cut(subject)}  ({_UNIT_LABELS.get(unit, unit)})", loc="left", fontsize=10)
        ax.set_ylabel(_UNIT_LABELS.get(unit, unit))
        data = _judged_lines(ax, [j for j in judged if j.unit == unit], x)
        placed: list[Bbox] = []
        for span in (s for s in spans if s.unit == unit or (unit == units[0] and s.unit not in units[:2])):
            start, end = x(span.start), x(span.end) if span.end is not None else end_x
            _mark(ax, span, start, end, None, 0)
            _label(ax, span, start, "", placed, renderer)
            if span.unit == unit:
                data = _threshold(ax, span, span.threshold, data)
        _fit(ax, data, 0, placed, ticks=True)


_UNIT_LABELS = {"seconds": "latency (s)", "requests": "requests", "percent": "percent (%)"}
"""A service rule's unit as its axis says it."""


def _first_unit(judged: list[JudgedSeries]) -> str | None:
    """The unit a panel of service values shows: latency's where it is judged, else the first's."""
    units = [j.unit for j in judged]
    return "seconds" if "seconds" in units else (units[0] if units else None)


def _judged_lines(ax: Axes, judged: list[JudgedSeries], x: Callable[[float], float]) -> tuple[float, float]:
    """Each service rule's value at each evaluation, in its rule's colour; returns the range to show
    (from 0)."""
    top = 0.0
    for series in judged:
        ax.plot(
            [x(t) for t in series.times], series.values, color=rule_type(series.kind).colour, linewidth=1.3,
            gid=f"judged:{series.rule}",
        )  # fmt: skip
        top = max([top, *(v for v in series.values if not math.isnan(v))])
    return 0.0, top or 1.0


def _threshold(
    ax: Axes, span: FindingSpan, level: float | None, data: tuple[float, float]
) -> tuple[float, float]:
    """The rule's threshold across the panel (once per rule); returns ``data`` stretched to hold it."""
    if level is None:
        return data
    gid = f"threshold:{span.rule}"
    if not any(line.get_gid() == gid for line in ax.lines):
        ax.axhline(level, color=rule_type(span.kind).colour, linestyle="-.", linewidth=1.0, gid=gid)
    return min(data[0], level), max(data[1], level)


def _memory_threshold(
    ax: Axes,
    span: FindingSpan,
    device: DeviceHistory,
    start: float,
    end: float,
    scale: float,
    data: tuple[float, float],
) -> tuple[float, float]:
    """A memory rule's threshold on the memory panel: a ceiling's level (a percent of the card, or
    bytes), or a growth rule's rate as a line from the reading where it fired (steeper readings
    grow faster than the rule lets them)."""
    if span.threshold is None:
        return data
    if span.unit == "percent" and device.memory_total:
        return _threshold(ax, span, span.threshold / 100 * device.memory_total / GIB, data)
    if span.unit == "bytes":
        return _threshold(ax, span, span.threshold / GIB, data)
    if span.unit == "bytes/s":
        i = bisect_right(device.times, span.start) - 1
        at = device.memory_used[max(0, i)] / GIB if device.memory_used else math.nan
        if math.isnan(at):
            return data
        rise = span.threshold * scale / GIB * (end - start)
        ax.plot(
            [start, end], [at, at + rise], color=rule_type(span.kind).colour, linestyle="-.", linewidth=1.0,
            gid=f"threshold:{span.rule}",
        )  # fmt: skip
    return data


def _scale_mark(ax: Axes, mark: ScaleMark, at: float, placed: list[Bbox], renderer: Any) -> None:
    """A scale decision on the utilization panel of a GPU its policy's pods ran on: a line and its
    replicas, labelled like a finding."""
    ax.axvline(at, color="black", linestyle="-", linewidth=1.0, alpha=0.7, gid=f"scale:{mark.at:g}")
    verb = "scale" if mark.applied else "would scale"
    _place(
        ax,
        f"{verb} {mark.current}->{mark.desired}",
        at,
        "black",
        f"scale-label:{mark.at:g}",
        placed,
        renderer,
    )


def save_plot(history: History, path: str | Path, title: str) -> None:
    """Build the figure and write it as a PNG to ``path``."""
    build_figure(history, title).savefig(str(path), format="png", dpi=100)


def _legend_handles() -> list[Artist]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Line2D([], [], color="tab:green", label="utilization.gpu"),
        Line2D([], [], color="tab:olive", label="SM activity (GPM)"),
        Line2D([], [], color="tab:blue", label="memory used"),
        Line2D([], [], color="black", linestyle=":", label="card's memory"),
        Line2D([], [], color="gray", linestyle="--", label="finding started"),
        Patch(color="gray", alpha=0.25, label="finding active"),
        Line2D([], [], color="gray", linestyle="-.", label="rule's threshold (a rate: from where it fired)"),
        Line2D([], [], color="gray", linewidth=1.3, label="service rule's value (GPU row: right axis)"),
        Line2D([], [], color="black", alpha=0.7, label="scale decision"),
    ]


SHARE_COLORS = ("tab:cyan", "tab:pink", "tab:brown", "tab:purple", "tab:gray", "tab:orange", "tab:red")
"""One per pod or process on a shared GPU, in order of appearance (cycled past seven)."""


def _share_colors(device: DeviceHistory) -> dict[str, str]:
    """A color per subject of a shared GPU; none for a GPU that never ran two at once."""
    if not device.shared:
        return {}
    return {s: SHARE_COLORS[i % len(SHARE_COLORS)] for i, s in enumerate(device.shares)}


def _share_lines(
    util_ax: Axes, mem_ax: Axes, device: DeviceHistory, colors: dict[str, str], x: Callable[[float], float]
) -> None:
    """Each subject's own utilization and memory on a shared GPU."""
    for subject, color in colors.items():
        share = device.shares[subject]
        style: dict[str, Any] = {"color": color, "linewidth": 1.4, "label": _cut(subject)}
        style["gid"] = f"share:{subject}"
        util_ax.plot([x(t) for t in share.utilization_times], share.utilization, **style)
        mem_ax.plot([x(t) for t in share.times], [v / GIB for v in share.memory_used], **style)
    if not any(device.shares[s].utilization for s in colors):
        util_ax.text(
            0.5, _lane(util_ax, 0, len(colors))[1] + 0.04, "no per-process utilization read",
            transform=util_ax.transAxes, ha="center", fontsize=9,
        )  # fmt: skip


def _lane_names(util_ax: Axes, mem_ax: Axes, colors: dict[str, str]) -> None:
    """Each subject's name in its colour, in its lane at the panel's left (the lanes' legend)."""
    for ax in (util_ax, mem_ax):
        for i, (subject, color) in enumerate(colors.items()):
            bottom, top = _lane(ax, i, len(colors))
            ax.text(
                0.004, (bottom + top) / 2, _cut(subject), transform=ax.transAxes, va="center",
                fontsize=6.5, color=color, fontweight="bold", gid=f"lane:{subject}",
            )  # fmt: skip


def _dot(ax: Axes, span: FindingSpan, start: float, share: ShareHistory) -> None:
    """The finding's mark on the line of the pod or process it concerns, where it started."""
    if judges_utilization(span):
        value = share.utilization_at(span.start)
    else:
        memory = share.memory_at(span.start)
        value = None if memory is None else memory / GIB
    if value is None:
        return
    (dot,) = ax.plot(
        [start], [value], marker="o", markersize=7, color=rule_type(span.kind).colour, linestyle="none"
    )
    dot.set_gid(f"finding-dot:{span.rule}:{span.subject}")


def _utilization_panel(ax: Axes, xs: list[float], device: DeviceHistory) -> None:
    # On a shared GPU the device's lines are the background to each subject's own.
    width, alpha = (0.7, 0.5) if device.shared else (1.0, 1.0)
    ax.plot(xs, device.utilization, color="tab:green", linewidth=width, alpha=alpha, label="utilization.gpu")
    if any(not math.isnan(v) for v in device.sm_active):
        ax.plot(
            xs, device.sm_active, color="tab:olive", linewidth=width, alpha=0.8 * alpha, label="SM activity"
        )
    ax.set_yticks([0, 25, 50, 75, 100])
    ax.set_ylabel("utilization (%)")


def _memory_panel(
    ax: Axes, xs: list[float], device: DeviceHistory, spans: list[FindingSpan]
) -> tuple[float, float]:
    """The device's memory line; returns the range of GiB to show: the readings' (its subjects'
    too) from where the first growth finding started (a job's load before a leak would flatten
    the leak; the line comes in from below), with the card's size where they come near it."""
    width, alpha = (0.7, 0.5) if device.shared else (1.2, 1.0)
    memory = [v / GIB for v in device.memory_used]
    ax.plot(xs, memory, color="tab:blue", linewidth=width, alpha=alpha, label="memory used")
    since = min((s.start for s in spans if s.unit == "bytes/s"), default=-math.inf)
    readings = [v for t, v in zip(device.times, memory, strict=True) if t >= since and not math.isnan(v)]
    for share in device.shares.values() if device.shared else ():
        readings += [
            v / GIB
            for t, v in zip(share.times, share.memory_used, strict=True)
            if t >= since and not math.isnan(v)
        ]
    card = device.memory_total / GIB if device.memory_total else None
    if not readings:
        return 0.0, card or 1.0
    lo, hi = min(readings), max(readings)
    # Noise on a flat line is not magnified into hills: the range is at least 1% of the card (or 0.25 GiB).
    pad = max(0.08 * (hi - lo), 0.005 * card if card else 0.125)
    lo, hi = max(0.0, lo - pad), hi + pad
    if card is not None and hi >= MEMORY_NEAR_FULL * card:
        ax.axhline(card, color="black", linestyle=":", linewidth=1.0, label="card's memory")
        hi = max(hi, card * 1.01)
    ax.set_ylabel("memory (GiB)")
    return lo, hi


def _fit(ax: Axes, data: tuple[float, float], lanes: int, labels: list[Bbox], *, ticks: bool) -> None:
    """The y limits that put ``data`` between the subjects' ``lanes`` (below) and the finding
    ``labels`` (above: the headroom reaches down to the lowest one); with ``ticks``, ticks on the
    data only."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = data
    tall = _points_tall(ax)
    axes_top = ax.transAxes.transform((0, 1))[1]
    headroom = max((axes_top - b.y0 for b in labels), default=0.0) / _dpp(ax)
    top = (headroom + 3) / tall if labels else 0.04
    bottom = _lane(ax, 0, lanes)[1] + 0.02 if lanes else 0.0
    span = (hi - lo) / max(1 - top - bottom, 0.2)
    if ticks:
        ax.set_yticks([t for t in MaxNLocator(5).tick_values(lo, hi) if lo - 1e-9 <= t <= hi + 1e-9])
    ax.set_ylim(lo - bottom * span, hi + top * span)


def _points_tall(ax: Axes) -> float:
    """The panel's height in points."""
    return float(ax.bbox.height / _dpp(ax))


def _dpp(ax: Axes) -> float:
    """Display pixels per point."""
    return float(ax.figure.dpi / 72)


def _lane(ax: Axes, i: int, lanes: int) -> tuple[float, float]:
    """Subject ``i``'s lane in axes fraction (bottom, top): the lanes run down from under the
    readings to the panel's bottom, in the subjects' order."""
    height = min(LANE_POINTS / _points_tall(ax), MAX_LANES_SHARE / max(lanes, 1))
    return (lanes - i - 1) * height, (lanes - i) * height


def _mark(ax: Axes, span: FindingSpan, start: float, end: float, lane: int | None, lanes: int) -> None:
    """A dashed line where the finding started and a band until it cleared: the panel's whole
    height, or on a shared GPU its subject's lane (``lane`` of ``lanes``) only."""
    from matplotlib.patches import Rectangle

    color = rule_type(span.kind).colour
    line = ax.axvline(start, color=color, linestyle="--", linewidth=1.4, label=f"{span.rule} started")
    line.set_gid(f"finding-start:{span.rule}")
    if lane is None:
        shade = ax.axvspan(start, end, color=color, alpha=0.12, linewidth=0)
        shade.set_gid(f"finding-span:{span.rule}")
        return
    bottom, top = _lane(ax, lane, lanes)
    gap = 0.12 * (top - bottom)  # neighbouring lanes' bands read as two
    band = Rectangle(
        (start, bottom + gap), end - start, top - bottom - 2 * gap, transform=ax.get_xaxis_transform(),
        color=color, alpha=0.35, linewidth=0, gid=f"finding-span:{span.rule}:{span.subject}",
    )  # fmt: skip
    ax.add_patch(band)


def _label(ax: Axes, span: FindingSpan, start: float, who: str, placed: list[Bbox], renderer: Any) -> None:
    """The finding's rule, subject and the value it fired with, above the readings at its start line."""
    text = " ".join(part for part in (span.rule, who, _value_text(span)) if part)
    gid = f"finding-label:{span.rule}:{span.subject}"
    _place(ax, text, start, rule_type(span.kind).colour, gid, placed, renderer)


def _place(ax: Axes, text: str, at: float, color: str, gid: str, placed: list[Bbox], renderer: Any) -> None:
    """A label above the readings at ``at``: on the first line of the headroom where it overlaps no
    label ``placed`` before (it is added to them); to the line's left where it would run past the
    panel's right edge."""
    note = ax.annotate(
        text, xy=(at, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
        textcoords="offset points", va="top", fontsize=8, color=color, fontweight="bold",
    )  # fmt: skip
    note.set_gid(gid)
    right = ax.get_window_extent(renderer).x1
    if note.get_window_extent(renderer).x1 > right:
        note.set_horizontalalignment("right")
        note.set_position((-3, -3))
    line = 0
    while True:
        note.set_position((note.get_position()[0], -3 - LABEL_POINTS * line))
        box = note.get_window_extent(renderer)
        if not any(box.overlaps(other) for other in placed):
            placed.append(box)
            return
        line += 1


def _who(subject: str) -> str:
    """A subject as a finding's label names it: ``pid 51002`` (without its command), or the pod."""
    words = subject.split(" ", 2)
    return " ".join(words[:2]) if words[0] == "pid" and len(words) > 1 else _cut(subject)


def _value_text(span: FindingSpan) -> str:
    """The value the finding fired with, short: ``3%``, ``+200Mi/m``, ``z 20``."""
    if span.value is None:
        return ""
    if span.unit == "bytes/s":
        return f"+{format_bytes(span.value * 60)}/m"
    if span.unit == "bytes":
        return format_bytes(span.value)
    if span.unit == "problems":
        return ""  # gpuHealth: the problem is in the rule's name and the log, not a figure
    if span.unit == "seconds":
        return format_latency(span.value)  # requestLatency
    if span.unit == "requests":
        return format_count(span.value)  # requestQueue
    if span.unit == "z":
        return f"z {span.value:.0f}"  # anomaly: how far from its median, in robust deviations
    return f"{span.value:.0f}%"


def _subject_text(device: DeviceHistory) -> str:
    if not device.subjects:
        return "(nothing ran on it)"
    more = f" (+{len(device.subjects) - 1} more)" if len(device.subjects) > 1 else ""
    return device.subjects[0] + more


def _cut(text: str) -> str:
    return text if len(text) <= TITLE_CHARS else text[: TITLE_CHARS - 3] + "..."

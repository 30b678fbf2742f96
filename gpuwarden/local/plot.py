"""``--plot FILE.png``: each GPU's utilization and memory over the run, with its findings marked.

One row per GPU, two panels: utilization (NVML utilization.gpu and, where the GPU has
GPM, SM activity) and memory used against the card's size. A GPU that ran several pods
or processes at once (a shared GPU) also gets one line per pod or process in each panel:
its own per-process SM utilization, drawn through its readings (they come every
``--process-interval``), and its own memory; the device's lines stay, thinner. A finding
is drawn on the panel of what it judged (utilization rules on the left, memory rules on
the right): a dashed line where it started and a shaded span until it cleared (or the
run ended); on a shared GPU a dot on the line of the pod or process it concerns, and
its name in the label.

matplotlib is an optional dependency (``pip install 'gpuwarden[plot]'``); the figure is
built on the Agg canvas directly, never through pyplot, so nothing global changes and
no display is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.local.history import DeviceHistory, FindingSpan, History, ShareHistory
from gpuwarden.policy import format_bytes, format_count, format_latency, rule_type

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

GIB = float(2**30)
ROW_HEIGHT = 2.6
"""Inches per GPU row."""
TITLE_CHARS = 52
"""A panel title's pod or process is cut here (a process's command line can be long)."""

LABEL_STEP = 11
"""Points between the labels of successive findings on one panel."""
LABEL_LINES = 3
"""Labels stack this deep (in the headroom above the data), then start again at the top."""


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
    """The whole figure: a suptitle, and per GPU a utilization panel and a memory panel."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    devices = list(history.devices.items())
    rows = max(1, len(devices))
    height = 1.2 + ROW_HEIGHT * rows
    # Fixed margins rather than a layout engine: constrained layout doubles the time to save.
    figure = Figure(figsize=(14, height))
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=13, fontweight="bold", y=1 - 0.12 / height)
    if not devices:
        figure.text(0.5, 0.5, "no GPU readings", ha="center", va="center")
        return figure
    axes = figure.subplots(
        rows,
        2,
        sharex=True,
        squeeze=False,
        gridspec_kw={
            "left": 0.055,
            "right": 0.985,
            "top": 1 - 0.55 / height,
            "bottom": 0.75 / height,
            "hspace": 0.32,
            "wspace": 0.13,
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
    for row, (key, device) in enumerate(devices):
        util_ax, mem_ax = axes[row][0], axes[row][1]
        subject = _cut(_subject_text(device))
        util_ax.set_title(f"{device.name}: {subject}  (utilization)", loc="left", fontsize=10)
        mem_ax.set_title(f"{device.name}: {subject}  (memory)", loc="left", fontsize=10)
        xs = [x(t) for t in device.times]
        _utilization_panel(util_ax, xs, device)
        _memory_panel(mem_ax, xs, device)
        colors = _share_colors(device)
        if colors:
            _share_lines(util_ax, mem_ax, device, colors, x)
        marked = {id(util_ax): 0, id(mem_ax): 0}
        for span in (s for s in history.spans if key in s.devices):
            ax = util_ax if judges_utilization(span) else mem_ax
            shared = span.subject in colors
            end = x(span.end) if span.end is not None else end_x
            _mark(ax, span, x(span.start), end, marked[id(ax)], _who(span.subject) if shared else "")
            marked[id(ax)] += 1
            if shared:
                _dot(ax, span, x(span.start), device.shares[span.subject])
        for ax in (util_ax, mem_ax):
            ax.grid(True, alpha=0.3)
            ax.set_xlim(0, max(end_x, 1e-9))
    for ax in axes[-1]:
        ax.set_xlabel(f"{unit} since start")
    # One legend for all panels, below them: per-panel legends would hide the finding labels.
    figure.legend(handles=_legend_handles(), loc="lower center", ncols=6, fontsize=9, frameon=False)
    return figure


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
    """Each subject's own utilization and memory on a shared GPU, with a legend of their names."""
    handles: list[Artist] = []
    for subject, color in colors.items():
        share = device.shares[subject]
        style: dict[str, Any] = {"color": color, "linewidth": 1.4, "label": _cut(subject)}
        style["gid"] = f"share:{subject}"
        (line,) = util_ax.plot([x(t) for t in share.utilization_times], share.utilization, **style)
        mem_ax.plot([x(t) for t in share.times], [v / GIB for v in share.memory_used], **style)
        handles.append(line)
    if not any(device.shares[s].utilization for s in colors):
        util_ax.text(
            0.5, 0.12, "no per-process utilization read", transform=util_ax.transAxes, ha="center", fontsize=9
        )
    # A subject at 0 would hide under the axis; a little room below shows it.
    util_ax.set_ylim(-4, util_ax.get_ylim()[1])
    top = mem_ax.get_ylim()[1]
    mem_ax.set_ylim(-0.03 * top, top)
    for ax in (util_ax, mem_ax):
        ax.legend(handles=handles, loc="center right", fontsize=7, framealpha=0.7)


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
    # Headroom above 100% for the finding labels.
    ax.set_ylim(0, 118)
    ax.set_yticks([0, 25, 50, 75, 100])
    ax.set_ylabel("utilization (%)")


def _memory_panel(ax: Axes, xs: list[float], device: DeviceHistory) -> None:
    width, alpha = (0.7, 0.5) if device.shared else (1.2, 1.0)
    memory = [v / GIB for v in device.memory_used]
    ax.plot(xs, memory, color="tab:blue", linewidth=width, alpha=alpha, label="memory used")
    top = device.memory_total
    if top is not None:
        ax.axhline(top / GIB, color="black", linestyle=":", linewidth=1.0, label="card's memory")
        ax.set_ylim(0, top / GIB * 1.18)
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("memory (GiB)")


def _mark(ax: Axes, span: FindingSpan, start: float, end: float, nth: int, who: str = "") -> None:
    """A dashed line where the finding started, shading until it cleared, its rule's name on top.

    ``nth``: how many findings this panel already shows; each label goes one line lower.
    ``who``: the subject, named in the label where the panel shows several.
    """
    color = rule_type(span.kind).colour
    line = ax.axvline(start, color=color, linestyle="--", linewidth=1.4, label=f"{span.rule} started")
    line.set_gid(f"finding-start:{span.rule}")
    shade = ax.axvspan(start, end, color=color, alpha=0.12, linewidth=0)
    shade.set_gid(f"finding-span:{span.rule}")
    ax.annotate(
        " ".join(part for part in (span.rule, who, _value_text(span)) if part),
        xy=(start, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -3 - LABEL_STEP * (nth % LABEL_LINES)),
        textcoords="offset points",
        va="top",
        fontsize=8,
        color=color,
        fontweight="bold",
    )


def _who(subject: str) -> str:
    """A subject as a finding's label names it: ``pid 51002`` (without its command), or the pod."""
    words = subject.split(" ", 2)
    return " ".join(words[:2]) if words[0] == "pid" and len(words) > 1 else _cut(subject)


def _value_text(span: FindingSpan) -> str:
    """The finding's latest value, short: ``3%``, ``+200Mi/m``."""
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
    return f"{span.value:.0f}%"


def _subject_text(device: DeviceHistory) -> str:
    if not device.subjects:
        return "(nothing ran on it)"
    more = f" (+{len(device.subjects) - 1} more)" if len(device.subjects) > 1 else ""
    return device.subjects[0] + more


def _cut(text: str) -> str:
    return text if len(text) <= TITLE_CHARS else text[: TITLE_CHARS - 3] + "..."

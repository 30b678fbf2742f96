"""The report ``gpuwarden report`` prints: GPU-hours by namespace and workload, the worst offenders.

Pure: it takes the window's totals per workload (what Prometheus' ``increase()`` of the
operator's counters gave) and the findings per workload, and builds the :class:`Report`, then
renders it as a table, JSON or CSV. Hours are GPU-hours; efficiency is used over allocated.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Line", "Report", "WorkloadRef", "build_report", "render"]

FORMATS = ("table", "json", "csv")


@dataclass(frozen=True, slots=True, order=True)
class WorkloadRef:
    """A workload as the counters label it."""

    namespace: str
    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class Finding:
    """A policy's active violation on one of the workload's pods (its status.violations entry)."""

    policy: str
    pod: str
    rule: str
    reason: str
    message: str = ""


@dataclass(slots=True)
class Line:
    """GPU-hours of one workload (or namespace) over the window; ``cost`` None without a price."""

    allocated: float = 0.0
    used: float = 0.0
    idle: float = 0.0
    cost: float | None = None

    def add(self, other: Line) -> None:
        """Add ``other``'s hours (and cost, where either has one)."""
        self.allocated += other.allocated
        self.used += other.used
        self.idle += other.idle
        if other.cost is not None:
            self.cost = (self.cost or 0.0) + other.cost

    @property
    def efficiency(self) -> float | None:
        """Used over allocated; None with nothing allocated."""
        return self.used / self.allocated if self.allocated > 0 else None


@dataclass
class Report:
    """The window's GPU-hours by namespace and by workload, and the worst offenders."""

    window: str
    namespaces: dict[str, Line]
    workloads: dict[WorkloadRef, Line]
    offenders: list[tuple[WorkloadRef, Line, list[Finding]]] = field(default_factory=list)
    total: Line = field(default_factory=Line)


def build_report(
    window: str,
    workloads: Mapping[WorkloadRef, Line],
    findings: Mapping[WorkloadRef, Sequence[Finding]],
    *,
    top: int = 5,
) -> Report:
    """The report of ``workloads``' lines; the ``top`` workloads with the most idle hours are the
    offenders (ties by name), each with its findings."""
    namespaces: dict[str, Line] = {}
    total = Line()
    for ref, line in sorted(workloads.items()):
        namespaces.setdefault(ref.namespace, Line()).add(line)
        total.add(line)
    worst = sorted(
        (r for r, line in workloads.items() if line.idle > 0), key=lambda r: (-workloads[r].idle, r)
    )
    offenders = [(ref, workloads[ref], list(findings.get(ref, ()))) for ref in worst[:top]]
    return Report(window, dict(sorted(namespaces.items())), dict(sorted(workloads.items())), offenders, total)


def render(report: Report, output: str) -> str:
    """``report`` as ``table`` (for people), ``json`` or ``csv`` (one row per workload)."""
    if output == "json":
        return json.dumps(_as_json(report), indent=2) + "\n"
    if output == "csv":
        return _as_csv(report)
    return _as_table(report)


def _hours(value: float) -> str:
    # Hundredths: a notebook idle for a quarter of an hour reads 0.25, not 0.2.
    return f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _line_json(line: Line) -> dict[str, Any]:
    return {
        "allocatedGpuHours": round(line.allocated, 6),
        "usedGpuHours": round(line.used, 6),
        "idleGpuHours": round(line.idle, 6),
        "efficiency": None if line.efficiency is None else round(line.efficiency, 6),
        "idleCost": None if line.cost is None else round(line.cost, 6),
    }


def _as_json(report: Report) -> dict[str, Any]:
    return {
        "window": report.window,
        "total": _line_json(report.total),
        "namespaces": [{"namespace": ns} | _line_json(line) for ns, line in report.namespaces.items()],
        "workloads": [
            {"namespace": r.namespace, "kind": r.kind, "workload": r.name} | _line_json(line)
            for r, line in report.workloads.items()
        ],
        "worstOffenders": [
            {"namespace": r.namespace, "kind": r.kind, "workload": r.name}
            | _line_json(line)
            | {
                "findings": [
                    {
                        "policy": f.policy,
                        "pod": f.pod,
                        "rule": f.rule,
                        "reason": f.reason,
                        "message": f.message,
                    }
                    for f in found
                ]
            }
            for r, line, found in report.offenders
        ],
    }


CSV_COLUMNS = (
    "namespace",
    "kind",
    "workload",
    "allocated_gpu_hours",
    "used_gpu_hours",
    "idle_gpu_hours",
    "efficiency",
    "idle_cost",
)


def _as_csv(report: Report) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for ref, line in report.workloads.items():
        efficiency = line.efficiency
        writer.writerow(
            (
                ref.namespace,
                ref.kind,
                ref.name,
                f"{line.allocated:.6f}",
                f"{line.used:.6f}",
                f"{line.idle:.6f}",
                "" if efficiency is None else f"{efficiency:.6f}",
                "" if line.cost is None else f"{line.cost:.6f}",
            )
        )
    return out.getvalue()


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    body = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in body) for i in range(len(header))]
    # Names left, figures right, as people read columns of numbers.
    return [
        "  ".join(
            c.ljust(w) if i < len(header) - 5 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in body
    ]


def _figures(line: Line) -> list[str]:
    return [
        _hours(line.allocated),
        _hours(line.used),
        _hours(line.idle),
        _percent(line.efficiency),
        _money(line.cost),
    ]


def _as_table(report: Report) -> str:
    figures = ["ALLOCATED", "USED", "IDLE", "EFFICIENCY", "IDLE COST"]
    lines = [f"GPU-hours over the last {report.window}", ""]
    lines += _table(
        ["NAMESPACE", *figures], [[ns, *_figures(line)] for ns, line in report.namespaces.items()]
    )
    lines.append("")
    lines += _table(
        ["NAMESPACE", "WORKLOAD", *figures],
        [[r.namespace, f"{r.kind}/{r.name}", *_figures(line)] for r, line in report.workloads.items()],
    )
    lines += ["", f"TOTAL  {'  '.join(_figures(report.total))}", ""]
    if report.offenders:
        lines.append("Worst offenders (most idle GPU-hours):")
        for ref, line, found in report.offenders:
            cost = "" if line.cost is None else f", idle cost {_money(line.cost)}"
            lines.append(
                f"  {ref.namespace}/{ref.kind}/{ref.name}: {_hours(line.idle)} of {_hours(line.allocated)} "
                f"GPU-hours idle ({_percent(line.efficiency)} efficient{cost})"
            )
            for f in found:
                lines.append(
                    f"    {f.policy}: pod {f.pod} {f.rule} {f.reason}"
                    + (f": {f.message}" if f.message else "")
                )
            if not found:
                lines.append("    no active finding (no policy selects its pods, or none flags them now)")
    else:
        lines.append("No idle GPU-hours in the window.")
    return "\n".join(lines) + "\n"

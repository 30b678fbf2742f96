"""The report ``gpuwarden report`` prints: GPU-hours by namespace and workload (or by label, GPU model,
node), the GPUs nobody held, the costs, the worst offenders.

Pure: it takes the window's totals per workload (what Prometheus' ``increase()`` of the
operator's counters gave), or per group for ``--by``, the unallocated GPU-hours per node and model,
and the findings per workload, and builds the :class:`Report`, then renders it as a table, JSON or
CSV. Hours are GPU-hours; efficiency is used over allocated; cost is allocated GPU-hours at the
model's price, idle cost the idle part of it; tokens are those the workload's inference servers
counted (prompt and generated), and a million of them cost the workload's cost over its tokens.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BY", "Finding", "Line", "Report", "WorkloadRef", "build_report", "render"]

FORMATS = ("table", "json", "csv")
BY = ("namespace", "workload", "model", "node")
"""What ``--by`` groups by, besides ``label:KEY``."""


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
    """The idle hours' cost."""
    total_cost: float | None = None
    """The allocated hours' cost."""
    tokens: float | None = None
    """Tokens its inference servers counted (prompt and generated); None: none export them."""

    def add(self, other: Line) -> None:
        """Add ``other``'s hours (and costs and tokens, where either has them)."""
        self.allocated += other.allocated
        self.used += other.used
        self.idle += other.idle
        if other.cost is not None:
            self.cost = (self.cost or 0.0) + other.cost
        if other.total_cost is not None:
            self.total_cost = (self.total_cost or 0.0) + other.total_cost
        if other.tokens is not None:
            self.tokens = (self.tokens or 0.0) + other.tokens

    @property
    def hours_per_million_tokens(self) -> float | None:
        """GPU-hours allocated per million tokens; None without tokens."""
        return self.allocated / self.tokens * 1e6 if self.tokens else None

    @property
    def cost_per_million_tokens(self) -> float | None:
        """Cost per million tokens; None without tokens or a price."""
        return self.total_cost / self.tokens * 1e6 if self.tokens and self.total_cost is not None else None

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
    """What the pods were allocated."""
    unallocated: dict[tuple[str, str], Line] = field(default_factory=dict)
    """GPU-hours no pod held, by (node, GPU model) (``allocated``: the hours; ``total_cost``: theirs)."""
    by: tuple[str, ...] = ()
    """``--by`` other than workload: the columns of :attr:`groups`."""
    groups: dict[tuple[str, ...], Line] = field(default_factory=dict)


def build_report(
    window: str,
    workloads: Mapping[WorkloadRef, Line],
    findings: Mapping[WorkloadRef, Sequence[Finding]],
    *,
    top: int = 5,
    unallocated: Mapping[tuple[str, str], Line] | None = None,
    by: Sequence[str] = (),
    groups: Mapping[tuple[str, ...], Line] | None = None,
) -> Report:
    """The report of ``workloads``' lines; the ``top`` workloads with the most idle hours are the
    offenders (ties by name), each with its findings. ``by`` and ``groups``: the lines grouped
    otherwise (``--by``), printed instead of the namespaces' and workloads'."""
    namespaces: dict[str, Line] = {}
    total = Line()
    for ref, line in sorted(workloads.items()):
        namespaces.setdefault(ref.namespace, Line()).add(line)
        total.add(line)
    worst = sorted(
        (r for r, line in workloads.items() if line.idle > 0), key=lambda r: (-workloads[r].idle, r)
    )
    offenders = [(ref, workloads[ref], list(findings.get(ref, ()))) for ref in worst[:top]]
    return Report(
        window,
        dict(sorted(namespaces.items())),
        dict(sorted(workloads.items())),
        offenders,
        total,
        dict(sorted((unallocated or {}).items())),
        tuple(by),
        dict(sorted((groups or {}).items())),
    )


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


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _line_json(line: Line) -> dict[str, Any]:
    return {
        "allocatedGpuHours": round(line.allocated, 6),
        "usedGpuHours": round(line.used, 6),
        "idleGpuHours": round(line.idle, 6),
        "efficiency": _round(line.efficiency),
        "idleCost": _round(line.cost),
        "cost": _round(line.total_cost),
        "tokens": _round(line.tokens),
        "gpuHoursPerMillionTokens": _round(line.hours_per_million_tokens),
        "costPerMillionTokens": _round(line.cost_per_million_tokens),
    }


def _as_json(report: Report) -> dict[str, Any]:
    by = {
        "by": list(report.by),
        "groups": [
            dict(zip(report.by, key, strict=True)) | _line_json(line) for key, line in report.groups.items()
        ],
    }
    return {
        "window": report.window,
        "total": _line_json(report.total),
        "unallocated": [
            {
                "node": node,
                "gpuModel": model,
                "gpuHours": round(line.allocated, 6),
                "cost": _round(line.total_cost),
            }
            for (node, model), line in report.unallocated.items()
        ],
        **(by if report.by else {}),
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
    "cost",
    "tokens",
    "gpu_hours_per_million_tokens",
    "cost_per_million_tokens",
)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def _csv_figures(line: Line) -> list[str]:
    return [
        f"{line.allocated:.6f}",
        f"{line.used:.6f}",
        f"{line.idle:.6f}",
        _number(line.efficiency),
        _number(line.cost),
        _number(line.total_cost),
        _number(line.tokens),
        _number(line.hours_per_million_tokens),
        _number(line.cost_per_million_tokens),
    ]


def _as_csv(report: Report) -> str:
    """One row per workload (or per group with ``--by``), then one per node and GPU model for the
    GPU-hours no pod held (kind ``Unallocated``, workload ``<node>/<model>``)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if report.by:
        writer.writerow((*report.by, *CSV_COLUMNS[3:]))
        for key, line in report.groups.items():
            writer.writerow((*key, *_csv_figures(line)))
        return out.getvalue()
    writer.writerow(CSV_COLUMNS)
    for ref, line in report.workloads.items():
        writer.writerow((ref.namespace, ref.kind, ref.name, *_csv_figures(line)))
    for (node, model), line in report.unallocated.items():
        writer.writerow(("", "Unallocated", f"{node}/{model}", *_csv_figures(line)))
    return out.getvalue()


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], names: int) -> list[str]:
    body = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in body) for i in range(len(header))]
    # Names left, figures right, as people read columns of numbers.
    return [
        "  ".join(
            c.ljust(w) if i < names else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in body
    ]


FIGURES = ["ALLOCATED", "USED", "IDLE", "EFFICIENCY", "IDLE COST", "COST"]
TOKEN_FIGURES = ["M TOKENS", "GPU-H/M TOKENS", "COST/M TOKENS"]


def _figures(line: Line, tokens: bool) -> list[str]:
    figures = [
        _hours(line.allocated),
        _hours(line.used),
        _hours(line.idle),
        _percent(line.efficiency),
        _money(line.cost),
        _money(line.total_cost),
    ]
    if tokens:
        per_hour = line.hours_per_million_tokens
        figures += [
            "-" if line.tokens is None else f"{line.tokens / 1e6:.3f}",
            "-" if per_hour is None else f"{per_hour:.3f}",
            _money(line.cost_per_million_tokens),
        ]
    return figures


def _as_table(report: Report) -> str:
    lines = [f"GPU-hours over the last {report.window}", ""]
    tokens = any(line.tokens is not None for line in report.workloads.values()) or any(
        line.tokens is not None for line in report.groups.values()
    )
    figures = FIGURES + (TOKEN_FIGURES if tokens else [])
    if report.by:
        header = [b.upper() for b in report.by]
        rows = [[*(k or "-" for k in key), *_figures(line, tokens)] for key, line in report.groups.items()]
        lines += _table([*header, *figures], rows, len(header))
    else:
        lines += _table(
            ["NAMESPACE", *figures],
            [[ns, *_figures(line, tokens)] for ns, line in report.namespaces.items()],
            1,
        )
        lines.append("")
        lines += _table(
            ["NAMESPACE", "WORKLOAD", *figures],
            [
                [r.namespace, f"{r.kind}/{r.name}", *_figures(line, tokens)]
                for r, line in report.workloads.items()
            ],
            2,
        )
    lines += ["", f"TOTAL  {'  '.join(_figures(report.total, tokens))}", ""]
    if report.unallocated:
        lines += _table(
            ["UNALLOCATED", "GPU MODEL", "GPU-HOURS", "COST"],
            [
                [node, model, _hours(line.allocated), _money(line.total_cost)]
                for (node, model), line in report.unallocated.items()
            ],
            2,
        )
        free = Line()
        for line in report.unallocated.values():
            free.add(line)
        capacity = report.total.allocated + free.allocated
        share = f" ({100 * free.allocated / capacity:.0f}% of the GPUs' hours)" if capacity > 0 else ""
        lines += [f"UNALLOCATED TOTAL  {_hours(free.allocated)}  {_money(free.total_cost)}{share}", ""]
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

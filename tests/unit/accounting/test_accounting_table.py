"""The report's arithmetic and its three renderings."""

from __future__ import annotations

import csv
import io
import json

import pytest

from gpuwarden.accounting.table import Finding, Line, WorkloadRef, build_report, render

WEB = WorkloadRef("search", "Deployment", "web")
NB = WorkloadRef("research", "Pod", "notebook")
TRAIN = WorkloadRef("research", "Job", "train")
LINES = {
    WEB: Line(allocated=48.0, used=30.0, idle=4.0, cost=14.0),
    NB: Line(allocated=24.0, used=0.5, idle=23.0, cost=80.5),
    TRAIN: Line(allocated=8.0, used=7.5, idle=0.0),
}
FINDINGS = {NB: [Finding("research/idle", "notebook", "idle-gpu", "UtilizationBelowFloor", "2% for 23h")]}


def test_namespaces_sum_their_workloads_and_the_offenders_are_the_most_idle() -> None:
    report = build_report("day", LINES, FINDINGS, top=5)
    research = report.namespaces["research"]
    assert (research.allocated, research.used, research.idle, research.cost) == (32.0, 8.0, 23.0, 80.5)
    assert report.total.allocated == 80.0
    assert report.total.efficiency == pytest.approx(38.0 / 80.0)
    assert [ref for ref, _, _ in report.offenders] == [NB, WEB]  # TRAIN was never idle
    assert report.offenders[0][2] == FINDINGS[NB]
    assert [ref for ref, _, _ in build_report("day", LINES, FINDINGS, top=1).offenders] == [NB]


def test_the_table_names_each_workload_its_hours_and_the_findings_of_the_worst() -> None:
    text = render(build_report("week", LINES, FINDINGS), "table")
    assert text.startswith("GPU-hours over the last week\n")
    row = next(line for line in text.splitlines() if "Pod/notebook" in line)
    assert row.split() == ["research", "Pod/notebook", "24.00", "0.50", "23.00", "2%", "80.50", "-"]
    assert "research/idle: pod notebook idle-gpu UtilizationBelowFloor: 2% for 23h" in text
    assert "search/Deployment/web: 4.00 of 48.00 GPU-hours idle (62% efficient, idle cost 14.00)" in text


def test_json_and_csv_carry_the_same_figures() -> None:
    report = build_report("day", LINES, FINDINGS)
    data = json.loads(render(report, "json"))
    assert data["total"]["allocatedGpuHours"] == 80.0
    assert data["worstOffenders"][0]["findings"][0]["rule"] == "idle-gpu"
    train = next(w for w in data["workloads"] if w["workload"] == "train")
    assert train["idleCost"] is None
    assert train["efficiency"] == pytest.approx(7.5 / 8)
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert [(r["namespace"], r["kind"], r["workload"]) for r in rows] == [
        ("research", "Job", "train"),
        ("research", "Pod", "notebook"),
        ("search", "Deployment", "web"),
    ]
    assert float(rows[1]["idle_gpu_hours"]) == 23.0
    assert rows[0]["idle_cost"] == ""


def test_nothing_idle_says_so() -> None:
    assert "No idle GPU-hours in the window." in render(
        build_report("day", {TRAIN: LINES[TRAIN]}, {}), "table"
    )


def test_by_a_label_the_groups_carry_the_costs_the_tokens_and_the_unallocated_gpus() -> None:
    groups: dict[tuple[str, ...], Line] = {
        ("search",): Line(allocated=48.0, used=30.0, idle=4.0, cost=14.0, total_cost=168.0, tokens=12e6),
        ("",): Line(allocated=8.0, used=7.5, idle=0.0, total_cost=28.0),
    }
    free = {("gpu-node-1", "NVIDIA H200"): Line(allocated=24.0, total_cost=84.0)}
    report = build_report("day", LINES, {}, unallocated=free, by=("team",), groups=groups)
    text = render(report, "table")
    row = next(line for line in text.splitlines() if line.startswith("search"))
    # 48 GPU-hours for 12 million tokens: 4 GPU-hours and 14.00 a million.
    assert row.split() == [
        "search",
        "48.00",
        "30.00",
        "4.00",
        "62%",
        "14.00",
        "168.00",
        "12.000",
        "4.000",
        "14.00",
    ]
    assert "gpu-node-1   NVIDIA H200" in text
    data = json.loads(render(report, "json"))
    assert data["groups"][1] == data["groups"][1] | {"team": "search", "costPerMillionTokens": 14.0}
    assert data["unallocated"] == [
        {"node": "gpu-node-1", "gpuModel": "NVIDIA H200", "gpuHours": 24.0, "cost": 84.0}
    ]
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert rows[1]["team"] == "search"
    assert float(rows[1]["cost_per_million_tokens"]) == 14.0


def test_unallocated_gpus_are_rows_of_their_own_in_csv_and_a_share_of_capacity_in_the_table() -> None:
    free = {("gpu-node-1", "NVIDIA H200"): Line(allocated=20.0)}
    report = build_report("day", LINES, FINDINGS, unallocated=free)
    assert "UNALLOCATED TOTAL  20.00  - (20% of the GPUs' hours)" in render(report, "table")
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert rows[-1]["kind"] == "Unallocated"
    assert rows[-1]["workload"] == "gpu-node-1/NVIDIA H200"

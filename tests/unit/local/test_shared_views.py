"""Local mode's views of a shared GPU: a line per pod or process in the table, the status and the plot,
each with its own readings, and a finding marked on the one it concerns (scenario shared-gpu)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import yaml
from matplotlib.figure import Figure

from gpuwarden.local.demo import ScenarioRun
from gpuwarden.local.display import elapsed_clock, render_table, status_lines, summary_lines
from gpuwarden.local.history import History, ShareHistory
from gpuwarden.local.plot import build_figure
from gpuwarden.local.policies import LocalPolicy
from gpuwarden.local.rows import Step
from gpuwarden.policy.parse import parse_spec
from gpuwarden.sim.scenario import DEFAULT_ORIGIN, load_scenario

POLICY = parse_spec(
    yaml.safe_load(
        """
        selector: {}
        evaluationInterval: 5s
        rules:
          - {name: idle, utilizationFloor: {percent: 10, for: 1m}}
          - {name: saturated, utilizationCeiling: {percent: 90, for: 1m}}
          - {name: big, memoryCeiling: {bytes: 20Gi, for: 1m}}
        """
    )
)
GPU0 = "GPU-5a1b2c3d-0e1f-4a2b-8c3d-4e5f6a7b8c01"
GPU1 = "GPU-6b2c3d4e-1f2a-4b3c-9d4e-5f6a7b8c9d02"


class Played:
    def __init__(self) -> None:
        self.run = ScenarioRun(load_scenario("shared-gpu"), [LocalPolicy("p", None, POLICY)])
        self.steps: dict[float, Step] = {}
        for t, _, step in self.run.steps():
            self.steps[t] = step

    @property
    def history(self) -> History:
        return self.run.history


@pytest.fixture(scope="module")
def played() -> Played:
    return Played()


def test_a_shared_gpus_row_lists_each_pod_with_its_own_readings_and_findings(played: Played) -> None:
    gpu0, gpu1 = played.steps[120].rows
    assert [(s.subject, s.findings) for s in gpu0.shares] == [
        ("inference/llm-server-0", ("big", "saturated")),
        ("research/notebook-0", ("idle",)),
        ("batch/embed-0", ("idle",)),
    ]
    server, notebook, embed = gpu0.shares
    assert server.utilization is not None
    assert server.utilization > 90
    assert (notebook.utilization, embed.utilization) == (0.0, 0.0)
    assert notebook.memory_used == pytest.approx(10 * 2**30, rel=1e-3)
    assert embed.memory_used == 0.0
    # No per-process reading on GPU 1: unknown, never 0, and nobody is idle there.
    assert [(s.utilization, s.findings) for s in gpu1.shares] == [(None, ()), (None, ())]


def test_the_table_lists_the_pods_under_their_gpu(played: Played) -> None:
    lines = render_table(played.steps[120].rows, "title", subject_header="pod")[2:]
    assert re.fullmatch(
        r"GPU 0   \(3 pods\) +9\d%  8\d%  40.5Gi/140Gi \(29%\) +big, idle, saturated", lines[0]
    )
    assert re.fullmatch(r" {10}inference/llm-server-0 +9\d%    -  30Gi +big, saturated", lines[1])
    assert re.fullmatch(r" {10}research/notebook-0 +0%    -  10Gi +idle", lines[2])
    assert re.fullmatch(r" {10}batch/embed-0 +0%    -  0 +idle", lines[3])
    assert re.fullmatch(r"GPU 1   \(2 pods\) +\d+%  \d+%  20.5Gi/140Gi \(15%\) +-", lines[4])
    assert re.fullmatch(r" {10}research/notebook-1 +-    -  10Gi +-", lines[5])
    assert len(lines) == 7
    processes = render_table(played.steps[120].rows, "title", subject_header="process")
    assert processes[2].startswith("GPU 0   (3 processes) ")


def test_status_lines_follow_a_shared_gpu_with_a_line_per_pod(played: Played) -> None:
    first, *shares = status_lines(played.steps[120].rows[0], "02:00")
    assert first.startswith("[02:00] GPU 0 inference/llm-server-0, research/notebook-0, batch/embed-0: util ")
    assert shares[1:] == [
        "[02:00]   research/notebook-0: util 0%, mem 10Gi; findings: idle",
        "[02:00]   batch/embed-0: util 0%, mem 0; findings: idle",
    ]


def test_a_share_keeps_utilization_only_where_it_was_read(played: Played) -> None:
    device = played.history.devices[GPU0]
    assert device.shared
    notebook = device.shares["research/notebook-0"]
    assert len(notebook.times) == 601  # every sample, 10 minutes at 1 s
    steps = {b - a for a, b in zip(notebook.utilization_times, notebook.utilization_times[1:], strict=False)}
    assert steps == {10.0}  # per-process utilization: every 10 s
    assert set(notebook.utilization) == {0.0}


def test_a_share_thins_out_like_a_device() -> None:
    share = ShareHistory(max_points=100)
    for t in range(1000):
        share.append(float(t), 5.0 if t % 10 == 0 else None, 1.0)
    assert 50 <= len(share.times) <= 100
    assert 50 <= len(share.utilization_times) <= 100
    assert share.utilization_at(995.5) == 5.0


@pytest.fixture(scope="module")
def figure(played: Played) -> Figure:
    return build_figure(played.history, "shared-gpu")


def _lines(ax: object, prefix: str) -> Iterator[object]:
    return (line for line in ax.lines if (line.get_gid() or "").startswith(prefix))  # type: ignore[attr-defined]


def test_the_plot_draws_a_line_per_pod_of_a_shared_gpu_in_both_panels(figure: Figure) -> None:
    util, mem = figure.axes[0], figure.axes[1]
    pods = ["share:inference/llm-server-0", "share:research/notebook-0", "share:batch/embed-0"]
    for ax in (util, mem):
        assert [line.get_gid() for line in _lines(ax, "share:")] == pods  # type: ignore[attr-defined]
    notebook = next(_lines(util, "share:research/notebook-0"))
    assert set(notebook.get_ydata()) == {0.0}  # type: ignore[attr-defined]
    # GPU 1 has no per-process readings: its pods' utilization lines are empty, and it says so.
    assert all(len(line.get_xdata()) == 0 for line in _lines(figure.axes[2], "share:"))  # type: ignore[attr-defined]
    assert any(t.get_text() == "no per-process utilization read" for t in figure.axes[2].texts)


def test_a_finding_is_dotted_on_the_line_of_the_pod_it_concerns(figure: Figure) -> None:
    util, mem = figure.axes[0], figure.axes[1]
    dots = {line.get_gid(): line.get_ydata()[0] for line in _lines(util, "finding-dot:")}  # type: ignore[attr-defined]
    assert dots["finding-dot:idle:research/notebook-0"] == 0.0
    assert dots["finding-dot:idle:batch/embed-0"] == 0.0
    assert dots["finding-dot:saturated:inference/llm-server-0"] > 90  # not drawn at the device's line
    (big,) = _lines(mem, "finding-dot:")
    assert big.get_gid() == "finding-dot:big:inference/llm-server-0"  # type: ignore[attr-defined]
    assert big.get_ydata()[0] == pytest.approx(30, rel=1e-3)  # type: ignore[attr-defined]
    labels = [t.get_text() for t in util.texts]
    assert "idle research/notebook-0 0%" in labels


def test_the_summary_says_whose_finding_it_is_on_a_shared_gpu(played: Played) -> None:
    lines = summary_lines(played.history, [], elapsed_clock(DEFAULT_ORIGIN))
    assert lines[2].startswith("           research/notebook-0: idle (GPUUnderutilized) since 00:50: ")
    assert any(line.strip().startswith("batch/embed-0: idle (GPUUnderutilized)") for line in lines)

"""`--plot`: two panels per GPU, titled with its pod, findings marked where they began."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from gpuwarden.local.demo import ScenarioRun
from gpuwarden.local.history import History
from gpuwarden.local.plot import build_figure, save_plot
from gpuwarden.local.policies import demo_policy_path, load_policies
from gpuwarden.sim.scenario import load_scenario

PODS = ("research/notebook-idle-0", "training/llm-finetune-0", "training/vision-train-0")
"""GPUs 0-2; 3-5 carry the serving Deployment's replicas (names generated), 6-7 never run anything."""
GPUS = 8


@pytest.fixture(scope="module")
def history() -> History:
    run = ScenarioRun(load_scenario("demo"), load_policies(demo_policy_path()))
    for _ in run.steps():
        pass
    return run.history


@pytest.fixture(scope="module")
def figure(history: History) -> Figure:
    return build_figure(history, "gpuwarden demo: scenario demo")


def marks(ax: object, kind: str) -> list[str]:
    """Rules whose finding-start lines (``kind="start"``) or spans (``"span"``) are on an axes."""
    artists = [*ax.lines, *ax.patches]  # type: ignore[attr-defined]
    prefix = f"finding-{kind}:"
    return sorted(a.get_gid()[len(prefix) :] for a in artists if (a.get_gid() or "").startswith(prefix))


def test_a_panel_pair_per_gpu_titled_with_its_pod(figure: Figure) -> None:
    axes = figure.axes
    assert len(axes) == 2 * GPUS
    for i, pod in enumerate(PODS):
        util, mem = axes[2 * i], axes[2 * i + 1]
        assert util.get_title(loc="left") == f"GPU {i}: {pod}  (utilization)"
        assert mem.get_title(loc="left") == f"GPU {i}: {pod}  (memory; card 140Gi)"
    for i in range(GPUS):
        assert axes[2 * i].get_ylabel() == "utilization (%)"
        assert axes[2 * i + 1].get_ylabel() == "memory (GiB)"
    assert axes[6].get_title(loc="left").startswith("GPU 3: inference/llm-server-")
    # GPU 6 gets the fourth replica (the demo scales on latency at 22m); GPU 7 nothing.
    assert axes[12].get_title(loc="left").startswith("GPU 6: inference/llm-server-")
    assert axes[14].get_title(loc="left") == "GPU 7: (nothing ran on it)  (utilization)"
    assert [ax.get_xlabel() for ax in axes[-2:]] == ["minutes since start"] * 2
    assert figure.get_suptitle() == "gpuwarden demo: scenario demo"


def test_findings_are_marked_on_the_panel_of_what_they_judged(figure: Figure) -> None:
    axes = figure.axes
    assert marks(axes[0], "start") == ["idle-gpu", "unusual-activity"]  # GPU 0 utilization
    assert marks(axes[1], "start") == []
    assert marks(axes[2], "start") == []
    assert marks(axes[3], "start") == ["leak", "near-oom"]  # GPU 1 memory
    assert marks(axes[4], "start") == marks(axes[5], "start") == []  # the plateau: nothing
    # The ramp the replicas on GPUs 3 and 4 see begin: an anomaly of utilization, on its panel.
    # The servers: the climb on the two that saw the ramp, and their P99 latency on all three serving
    # when the answers grow longer (a service rule speaks for the pod's GPU).
    assert marks(axes[6], "start") == marks(axes[8], "start") == ["slow-requests", "unusual-activity"]
    assert marks(axes[10], "start") == ["slow-requests"]
    assert marks(axes[7], "start") == marks(axes[9], "start") == []
    assert marks(axes[0], "span") == ["idle-gpu", "unusual-activity"]
    assert marks(axes[3], "span") == ["leak", "near-oom"]


def test_a_finding_is_marked_where_it_started_and_shaded_to_the_end(figure: Figure) -> None:
    idle = next(line for line in figure.axes[0].lines if line.get_gid() == "finding-start:idle-gpu")
    assert list(np.asarray(idle.get_xdata())) == pytest.approx([5.0, 5.0], abs=0.2)  # minutes
    shade = next(p for p in figure.axes[0].patches if p.get_gid() == "finding-span:idle-gpu")
    (x0, _), (x1, _) = shade.get_extents().get_points()
    assert x1 > x0
    assert figure.axes[0].get_xlim() == pytest.approx((0.0, 30.0))


def test_the_png_decodes_at_its_size(history: History, tmp_path: Path) -> None:
    path = tmp_path / "demo.png"
    save_plot(history, path, "demo")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000
    pixels = imread(path)
    assert pixels.shape[1] == 1400  # 14 in at 100 dpi
    assert pixels.shape[0] > 1000
    # Not a blank canvas: the panels drew something.
    assert pixels[..., :3].min() < 0.5


def test_no_gpu_readings_still_make_a_figure() -> None:
    figure = build_figure(History(), "empty")
    assert figure.axes == []
    assert any(t.get_text() == "no GPU readings" for t in figure.texts)


def test_a_long_watch_is_plotted_in_hours() -> None:
    history = History()
    device = history.device("GPU-x", "GPU 0", "H200")
    device.add_subject("pid 7 python leak.py")
    for t in range(0, 6 * 3600, 60):
        history.mark_time(float(t))
        device.append(float(t), 50.0, None, 1e9)
    figure = build_figure(history, "long")
    assert [ax.get_xlabel() for ax in figure.axes] == ["hours since start"] * 2  # one row: the bottom one
    assert figure.axes[0].get_title(loc="left") == "GPU 0: pid 7 python leak.py  (utilization)"
    # Without SM activity readings there is no SM line.
    assert [line.get_label() for line in figure.axes[0].lines] == ["utilization.gpu"]

"""`--plot`: two panels per GPU, titled with its pod, findings marked where they began."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.image import imread

from gpuwarden.local.demo import ScenarioRun
from gpuwarden.local.history import History
from gpuwarden.local.plot import build_figure, save_plot
from gpuwarden.local.policies import demo_policy_path, load_policies
from gpuwarden.policy.rules import RULE_TYPES
from gpuwarden.sim.scenario import load_scenario

PODS = ("research/notebook-idle-0", "training/llm-finetune-0", "training/vision-train-0")
"""GPUs 0-2; 3-6 carry the serving Deployment's replicas (names generated), 7 never runs anything."""
DRAWN = 7
"""GPU 7 is not drawn."""
SERVED = 4
"""GPUs 3-6: their pods' latency on a right axis of their utilization panel."""


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
    axes = figure.axes[: 2 * DRAWN]  # then the right axes of the served GPUs' latency
    assert len(figure.axes) == 2 * DRAWN + SERVED
    for i, pod in enumerate(PODS):
        util, mem = axes[2 * i], axes[2 * i + 1]
        assert util.get_title(loc="left") == f"GPU {i}: {pod}  (utilization)"
        assert mem.get_title(loc="left") == f"GPU {i}: {pod}  (memory; card 140Gi)"
    for i in range(DRAWN):
        assert axes[2 * i].get_ylabel() == "utilization (%)"
        assert axes[2 * i + 1].get_ylabel() == "memory (GiB)"
    assert axes[6].get_title(loc="left").startswith("GPU 3: inference/llm-server-")
    # GPU 6 gets the fourth replica (the demo scales on latency at 22m).
    assert axes[12].get_title(loc="left").startswith("GPU 6: inference/llm-server-")
    assert [ax.get_xlabel() for ax in axes[-2:]] == ["minutes since start"] * 2
    assert figure.get_suptitle() == "gpuwarden demo: scenario demo"


def test_a_gpu_nothing_ran_on_is_one_line_not_a_row(figure: Figure) -> None:
    assert not [ax for ax in figure.axes if ax.get_title(loc="left").startswith("GPU 7")]
    (line,) = [t for t in figure.texts if t.get_gid() == "empty-gpus"]
    assert line.get_text() == "Not drawn: GPU 7: no pod or process ran on it"


def labels(ax: Axes) -> dict[str, str]:
    """The finding labels on a panel: gid's rule and subject -> text."""
    prefix = "finding-label:"
    return {
        str(t.get_gid())[len(prefix) :]: t.get_text()
        for t in ax.texts
        if (t.get_gid() or "").startswith(prefix)
    }


def test_each_label_shows_the_value_its_finding_fired_with(figure: Figure) -> None:
    # The idle finding fired at 3.1% (its 5m mean); by its last update the mean was past 20%.
    assert labels(figure.axes[0]) == {
        "idle-gpu:research/notebook-idle-0": "idle-gpu 3%",
        "unusual-activity:research/notebook-idle-0": "unusual-activity z 21",  # a robust z, not a percent
    }
    assert labels(figure.axes[3]) == {
        "leak:training/llm-finetune-0": "leak +200Mi/m",
        "near-oom:training/llm-finetune-0": "near-oom 90%",
    }
    served = labels(figure.axes[6])
    assert [text for gid, text in served.items() if gid.startswith("slow-requests:")] == [
        "slow-requests 13.9s"
    ]


def thresholds(ax: Axes) -> dict[str, tuple[list[float], list[float]]]:
    """The threshold lines on a panel: rule -> (xs, ys)."""
    prefix = "threshold:"
    return {
        str(line.get_gid())[len(prefix) :]: (
            np.asarray(line.get_xdata(), dtype=float).tolist(),
            np.asarray(line.get_ydata(), dtype=float).tolist(),
        )
        for line in ax.lines
        if (line.get_gid() or "").startswith(prefix)
    }


def right_axis(figure: Figure, ax: Axes) -> Axes | None:
    """The axes drawn over ``ax`` with its own y axis on the right (the served pods' latency)."""
    twins = [a for a in figure.axes if a is not ax and a.get_position().bounds == ax.get_position().bounds]
    return twins[0] if twins else None


def test_each_rule_that_fired_has_its_threshold_on_the_panel_it_judges(figure: Figure) -> None:
    util, mem = figure.axes[0], figure.axes[3]
    assert thresholds(util) == {"idle-gpu": ([0.0, 1.0], [20.0, 20.0])}  # the floor, across the panel
    found = thresholds(mem)
    assert found["near-oom"][1] == pytest.approx([0.9 * 140.4] * 2, abs=0.1)  # 90% of the card, in GiB
    # The leak's rate (100Mi/m) from where it fired: 100Mi a minute over the span's 25 minutes.
    (x0, x1), (y0, y1) = found["leak"]
    assert x0 == pytest.approx(4.67, abs=0.1)
    assert (y1 - y0) / (x1 - x0) == pytest.approx(100 / 1024)
    latency = right_axis(figure, figure.axes[6])
    assert latency is not None
    assert thresholds(latency) == {"slow-requests": ([0.0, 1.0], [10.0, 10.0])}  # seconds
    assert thresholds(figure.axes[2]) == thresholds(figure.axes[5]) == {}  # nothing fired on GPU 2


def test_latency_is_drawn_where_it_is_judged(figure: Figure) -> None:
    for row in (3, 4, 5, 6):  # the served replicas, the fourth included (no finding on it)
        latency = right_axis(figure, figure.axes[2 * row])
        assert latency is not None
        assert latency.get_ylabel() == "latency (s)"
        (line,) = [line for line in latency.lines if line.get_gid() == "judged:slow-requests"]
        ys = np.asarray(line.get_ydata(), dtype=float)
        assert np.nanmin(ys) > 0
        if row < 6:
            assert np.nanmax(ys) > 10  # past the threshold it fired on
    for row in (0, 1, 2):
        assert right_axis(figure, figure.axes[2 * row]) is None  # nothing served there


def test_scale_decisions_are_marked_on_the_gpus_of_the_pods_they_sized(figure: Figure) -> None:
    def scales(ax: Axes) -> list[tuple[float, str]]:
        xs = [
            round(float(np.asarray(line.get_xdata(), dtype=float)[0]), 2)
            for line in ax.lines
            if (line.get_gid() or "").startswith("scale:")
        ]
        texts = [t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("scale-label:")]
        return list(zip(xs, texts, strict=True))

    # Out to 3 on the forecast at 15:10 (two replicas then, on GPUs 3 and 4), to 4 on latency at 22:00.
    both = [(15.17, "scale 2->3"), (22.0, "scale 3->4")]
    assert scales(figure.axes[6]) == scales(figure.axes[8]) == both
    assert scales(figure.axes[10]) == both[1:]  # the third replica, started at 15:10
    assert scales(figure.axes[0]) == scales(figure.axes[12]) == []


def test_a_leak_after_the_load_climbs_on_its_panel(figure: Figure) -> None:
    # GPU 1 loads 124Gi in its first minute, then leaks 200Mi/m: about 5Gi over the 25 minutes after
    # the leak finding started. Scaled from 25Gi (the load) to the card, that was a flat line.
    mem = figure.axes[3]
    (line,) = [line for line in mem.lines if line.get_label() == "memory used"]
    xs, ys = np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)
    rise = (
        mem.transData.transform((xs[-1], ys[-1]))[1]
        - mem.transData.transform((5.0, np.interp(5.0, xs, ys)))[1]
    )
    assert rise / mem.get_window_extent().height > 0.2  # it was 0.04
    assert mem.get_ylim()[0] > 100


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


def test_no_two_rule_kinds_share_a_colour() -> None:
    # Two kinds of one colour on one panel read as one kind (anomaly and requestQueue were both brown).
    colours = {t.kind: to_rgba(t.colour) for t in RULE_TYPES}
    assert len(set(colours.values())) == len(colours), colours

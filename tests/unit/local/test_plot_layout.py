"""`--plot` at a glance: the memory axis scaled to the readings, one finding band per process of a
shared GPU in its own lane, and finding labels that cover neither each other nor the readings."""

from __future__ import annotations

from itertools import combinations, pairwise
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from test_shared_views import POLICY as SHARED_POLICY  # idle, saturated and a 20Gi ceiling

from gpuwarden.local.demo import ScenarioRun
from gpuwarden.local.history import FindingSpan, History
from gpuwarden.local.plot import build_figure
from gpuwarden.local.policies import LocalPolicy
from gpuwarden.policy import RuleKind
from gpuwarden.policy.rules import anomaly, growth, latency, queue, utilization
from gpuwarden.sim.scenario import load_scenario

GIB = 2.0**30
CARD = 143771 * 2.0**20
"""An H200's memory, 140Gi."""
SHARED_GPU0 = ("inference/llm-server-0", "research/notebook-0", "batch/embed-0")
"""shared-gpu's GPU 0: the server saturates it, the other two are idle beside it."""


def one_gpu(memory: list[float], *, minutes: int = 10) -> History:
    """A GPU at 50% whose memory goes through ``memory`` (GiB) in even steps over ``minutes``."""
    history = History()
    device = history.device("GPU-x", "GPU 0", "NVIDIA H200")
    device.add_subject("training/job-0")
    device.memory_total = CARD
    n = minutes * 60
    for t in range(n + 1):
        history.mark_time(float(t))
        at = t / n * (len(memory) - 1)
        i = min(int(at), len(memory) - 2)
        gib = memory[i] + (memory[i + 1] - memory[i]) * (at - i)
        device.append(float(t), 50.0, None, gib * GIB)
    return history


def span(rule: str, start: float, *, kind: RuleKind = utilization.FLOOR_KIND, **more: Any) -> FindingSpan:
    fields: dict[str, Any] = {
        "subject": "training/job-0",
        "devices": ("GPU-x",),
        "value": 3.0,
        "unit": "percent",
        "message": "",
    }
    return FindingSpan(
        policy="p", rule=rule, kind=kind, reason="GPUUnderutilized", start=start, **(fields | more)
    )


def data_y(ax: Axes, value: float) -> float:
    """Where ``value`` of the panel's y axis is drawn, in display pixels."""
    return float(ax.transData.transform((0.0, value))[1])


def label_boxes(figure: Figure, ax: Axes) -> list[Bbox]:
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    return [
        t.get_window_extent(renderer) for t in ax.texts if (t.get_gid() or "").startswith("finding-label:")
    ]


def bands(ax: Axes) -> dict[str, Bbox]:
    """The finding bands on a panel, by gid, in display pixels."""
    return {
        str(p.get_gid()): p.get_window_extent()
        for p in ax.patches
        if (p.get_gid() or "").startswith("finding-span:")
    }


def assert_labels_clear(figure: Figure, ax: Axes, top_reading: float) -> None:
    """The panel's finding labels overlap no other, stay inside it, and sit above its readings."""
    boxes = label_boxes(figure, ax)
    for a, b in combinations(boxes, 2):
        assert not a.overlaps(b), f"{ax.get_title(loc='left')}: labels {a} and {b} collide"
    panel = ax.get_window_extent()
    above = data_y(ax, top_reading)
    for box in boxes:
        assert panel.x0 <= box.x0, f"a label runs out of the panel: {box} in {panel}"
        assert box.x1 <= panel.x1, f"a label runs out of the panel: {box} in {panel}"
        assert box.y0 >= above, f"a label covers the readings: {box} under {above}"
        assert box.y1 <= panel.y1


def test_a_leak_of_a_few_gib_climbs_across_the_memory_panel() -> None:
    figure = build_figure(one_gpu([20.0, 23.0]), "leak")
    mem = figure.axes[1]
    bottom, top = mem.get_ylim()
    assert 0 <= bottom <= 20  # the readings' range, not the card's 140Gi
    assert 23 <= top < 30
    assert (data_y(mem, 23) - data_y(mem, 20)) / mem.get_window_extent().height > 0.6
    assert all(line.get_label() != "card's memory" for line in mem.lines)  # far from full: not drawn
    assert mem.get_title(loc="left") == "GPU 0: training/job-0  (memory; card 140Gi)"
    assert all(bottom <= tick <= top for tick in mem.get_yticks())


def test_memory_near_the_card_brings_the_card_into_view() -> None:
    figure = build_figure(one_gpu([100.0, 130.0]), "near full")
    mem = figure.axes[1]
    (card,) = [line for line in mem.lines if line.get_label() == "card's memory"]
    assert card.get_ydata()[0] == pytest.approx(CARD / GIB)  # type: ignore[index]
    assert mem.get_ylim()[1] >= CARD / GIB
    assert mem.get_ylim()[0] >= 90  # still the readings' range below


def test_a_flat_line_is_not_magnified_into_hills() -> None:
    figure = build_figure(one_gpu([9.0, 9.001]), "flat")
    bottom, top = figure.axes[1].get_ylim()
    assert top - bottom >= 0.01 * CARD / GIB


def test_labels_of_findings_started_together_take_lines_of_their_own() -> None:
    history = one_gpu([20.0, 20.0])
    # Five findings within seconds of each other, and one so late that its label cannot run right.
    history.spans += [span(f"rule-{i}", 60.0 + i) for i in range(5)]
    history.spans.append(span("late-finding-with-a-long-name", 595.0, end=600.0))
    figure = build_figure(history, "crowded")
    util = figure.axes[0]
    assert len(label_boxes(figure, util)) == 6
    assert_labels_clear(figure, util, 100.0)
    assert util.get_ylim()[1] > 100 + 5 * 10  # the headroom grew to hold five lines


@pytest.fixture(scope="module")
def shared() -> Figure:
    run = ScenarioRun(load_scenario("shared-gpu"), [LocalPolicy("p", None, SHARED_POLICY)])
    for _ in run.steps():
        pass
    return build_figure(run.history, "shared-gpu")


def test_each_process_of_a_shared_gpu_has_its_own_finding_band(shared: Figure) -> None:
    util, mem = shared.axes[0], shared.axes[1]
    found = bands(util)
    assert set(found) == {
        "finding-span:saturated:inference/llm-server-0",
        "finding-span:idle:research/notebook-0",
        "finding-span:idle:batch/embed-0",
    }  # no band across the whole panel
    # Each in a lane of its own, in the subjects' order from the top, all under the readings.
    order = [
        found[f"finding-span:{rule}:{s}"]
        for rule, s in zip(("saturated", "idle", "idle"), SHARED_GPU0, strict=True)
    ]
    for upper, lower in pairwise(order):
        assert lower.y1 <= upper.y0
    assert max(b.y1 for b in order) < data_y(util, 0.0)
    # The lanes are named in their subjects' colours, each beside its band.
    lanes = {t.get_gid(): t for t in util.texts if (t.get_gid() or "").startswith("lane:")}
    assert list(lanes) == [f"lane:{s}" for s in SHARED_GPU0]
    renderer = shared.canvas.get_renderer()  # type: ignore[attr-defined]
    for name, band in zip(lanes.values(), order, strict=True):
        box = name.get_window_extent(renderer)
        assert band.y0 <= (box.y0 + box.y1) / 2 <= band.y1
    # The memory rule's band runs in the server's lane of the memory panel.
    (big,) = bands(mem).values()
    assert big.y1 < data_y(mem, 0.0)
    assert list(bands(mem)) == ["finding-span:big:inference/llm-server-0"]


def test_the_labels_on_a_shared_gpu_clear_each_other_and_the_readings(shared: Figure) -> None:
    util = shared.axes[0]
    assert len(label_boxes(shared, util)) == 3  # they started within seconds of each other
    assert_labels_clear(shared, util, 100.0)


def test_memory_is_scaled_from_where_the_first_growth_finding_started() -> None:
    # A job loads 100Gi in its first minute, then leaks 2Gi over nine: on a 0-102Gi axis the leak is flat.
    history = one_gpu([0.0, 100.0, *(100.0 + i / 4 for i in range(9))], minutes=10)
    history.spans.append(span("leak", 240.0, kind=growth.KIND, value=2 * GIB / 540, unit="bytes/s"))
    mem = build_figure(history, "leak after load").axes[1]
    bottom, top = mem.get_ylim()
    assert bottom >= 99
    assert top < 104
    assert (data_y(mem, 102.0) - data_y(mem, 100.5)) / mem.get_window_extent().height > 0.3
    # Another memory finding at the end (an anomaly, a ceiling) does not cut the readings before it off.
    history = one_gpu([20.0, 60.0])
    history.spans.append(span("dip", 590.0, kind=anomaly.KIND, unit="z", message="GPU memory dipped"))
    assert build_figure(history, "late anomaly").axes[1].get_ylim()[0] <= 20


SERVICE = "service/127.0.0.1:8000"


def test_a_service_on_no_gpu_has_a_row_of_its_own() -> None:
    # watch --service-metrics: the server is a subject of its own, on no GPU.
    history = one_gpu([20.0, 20.0])
    for t in range(0, 601, 10):
        history.record_judged(
            SERVICE, "slow", latency.KIND, "seconds", 2.0, float(t), 1.0 if t < 300 else 3.0
        )
        history.record_judged(SERVICE, "queued", queue.KIND, "requests", 50.0, float(t), 5.0)
    history.spans.append(
        span(
            "slow",
            330.0,
            kind=latency.KIND,
            subject=SERVICE,
            devices=(),
            value=3.0,
            unit="seconds",
            threshold=2.0,
        )
    )
    figure = build_figure(history, "served")
    latency_ax, queue_ax = figure.axes[2], figure.axes[3]
    assert latency_ax.get_title(loc="left") == f"{SERVICE}  (latency (s))"
    assert queue_ax.get_title(loc="left") == f"{SERVICE}  (requests)"
    assert [line.get_gid() for line in latency_ax.lines] == [
        "judged:slow",
        "finding-start:slow",
        "threshold:slow",
    ]
    assert [t.get_text() for t in latency_ax.texts] == ["slow 3s"]
    assert [line.get_gid() for line in queue_ax.lines] == ["judged:queued"]
    assert latency_ax.get_ylim()[1] >= 3.0
    assert_labels_clear(figure, latency_ax, 3.0)

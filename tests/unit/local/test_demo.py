"""`gpuwarden demo`: the four stories found (and the plateau not), through the real command.

What it costs in wall time (the README's "under a minute") is measured by bench/demo.py.
"""

from __future__ import annotations

import asyncio
import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gpuwarden import cli
from gpuwarden.local.demo import ScenarioRun
from gpuwarden.local.display import (
    LiveDisplay,
    PlainDisplay,
    ScaleRepeats,
    elapsed_clock,
    render_table,
    summary_lines,
)
from gpuwarden.local.history import History
from gpuwarden.local.policies import demo_policy_path, for_processes, load_policies
from gpuwarden.local.rows import GpuRow, ScaleNote, Step, TargetRow
from gpuwarden.policy import Resolution
from gpuwarden.policy.parse import SpecError
from gpuwarden.policy.rules import growth
from gpuwarden.policy.scaling.decider import Direction, ScaleDecision
from gpuwarden.sim.scenario import DEFAULT_ORIGIN, load_scenario
from gpuwarden.wire.node import DeviceState

MIN = 60.0


@pytest.fixture(scope="module")
def demo_run() -> ScenarioRun:
    run = ScenarioRun(load_scenario("demo"), load_policies(demo_policy_path()))
    for _ in run.steps():
        pass
    return run


def starts(run: ScenarioRun) -> dict[tuple[str, str], float]:
    """(rule, subject) -> scenario seconds at which the finding started."""
    return {(s.rule, s.subject): s.start - DEFAULT_ORIGIN for s in run.history.spans}


# -- the command ----------------------------------------------------------------------------------


def test_demo_finds_idle_leak_and_patterns_scales_ahead_but_not_the_plateau_and_the_idle_gpu_clears() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "demo", "--no-pace"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr

    assert re.search(r"STARTED idle-gpu research/notebook-idle-0 on GPU 0: GPUUnderutilized: mean SM", out)
    assert re.search(
        r"STARTED leak training/llm-finetune-0 on GPU 1: GPUMemoryLeakSuspected: "
        r"GPU memory grows 2\d\dMi/m over 4m, fit (0\.9\d|1\.00); the card \(140Gi\) is full in \d",
        out,
    )
    # The notebook's scheduled bursts and the serving replicas' ramp are told apart.
    assert re.search(
        r"STARTED unusual-activity research/notebook-idle-0 on GPU 0: GPUPeriodicSpikes: "
        r"SM activity spikes to \d+% \(median \d.*\) every 4m: 3 times in 15m, like a scheduled job",
        out,
    )
    assert re.search(r"STARTED unusual-activity inference/llm-server-\S+ on GPU 3: GPUSteadyClimb: ", out)
    # The forecast scales the Deployment out ahead of the ramp, once: before any pod is saturated.
    assert re.search(
        r"\[1[3-5]:\d\d\] SCALE   scaled Deployment inference/llm-server 2 -> 3 \(simulated\): "
        r"forecast above saturated's ceiling \(95%\) in 3m: \d+% per replica \(80% interval ",
        out,
    )
    # Longer answers from 18m fill the three replicas' batches and a queue, which their GPUs (~77%)
    # do not show: the servers' own P99 latency does, and the Deployment is scaled on it, once.
    assert re.search(
        r"STARTED slow-requests inference/llm-server-\S+ on GPU [3-5]: RequestLatencyHigh: "
        r"P99 latency 1\d(\.\d+)?s over 1m above 10s \(\d+ requests\)",
        out,
    )
    assert re.search(
        r"\[2[0-3]:\d\d\] SCALE   scaled Deployment inference/llm-server 3 -> 4 \(simulated\): "
        r"slow-requests on 3/3 pods",
        out,
    )
    assert re.search(
        r"CLEARED slow-requests inference/llm-server-\S+ on GPU [3-5]: Recovered: "
        r"P99 latency \S+ over 1m at or below 10s",
        out,
    )
    assert "inference/llm-server 4 -> 5" not in out
    assert "GPUSaturated" not in out
    assert "would scale" not in out
    # The caching allocator plateaus: no finding, live or in the summary.
    assert not [line for line in out.splitlines() if "STARTED" in line and "vision-train-0" in line]
    # The notebook gets to work at 22m: the idle finding clears, in the engine's words, before the end.
    assert re.search(
        r"\[2[2-9]:\d\d\] CLEARED idle-gpu research/notebook-idle-0 on GPU 0: Recovered: "
        r"mean SM activity \(GPM\) \d+% over 5m, floor 20%",
        out,
    )
    summary = out[out.index("Summary:") :]
    assert re.search(r"GPU 2  training/vision-train-0\n\s+no findings\n", summary)
    assert re.search(r"idle-gpu \(GPUUnderutilized\) 05:00-2\d:\d\d, cleared: Recovered: ", summary)
    counts = re.search(r"(\d+) findings started, (\d+) cleared, (\d+) active at the end\.", summary)
    assert counts is not None
    assert int(counts[2]) >= 1
    assert (counts[1], counts[2], counts[3]) == ("9", "7", "2")
    assert (
        "Deployment inference/llm-server: 2 -> 4 replicas (simulated; dry run in local mode), 2 scale-ups; "
        "policy inference/llm-serving" in summary
    )


def test_paced_run_holds_its_speed() -> None:
    """At 600x the 30-minute scenario takes at least 3 s: the loop waits for the schedule."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "demo", "--speed", "600", "--plain"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - began >= 1800 / 600


async def test_metrics_during_the_demo_and_ctrl_c_ends_it_with_a_summary() -> None:
    async with asyncio.timeout(60):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuwarden",
            "demo",
            "--metrics-port=0",
            "--speed=30",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert process.stdout is not None
        lines: list[str] = []
        try:
            while not (match := re.search(r"/metrics on .*0\.0\.0\.0:(\d+)", lines[-1] if lines else "")):
                line = await process.stdout.readline()
                assert line, "demo exited early:\n" + "".join(lines)
                lines.append(line.decode())
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{match.group(1)}/metrics") as r,
            ):
                body = await r.text()
            assert "# HELP gpuwarden_local_finding_active" in body
            assert "gpuwarden_gpu_utilization_ratio{" in body
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGINT)
            rest = (await process.stdout.read()).decode()
            code = await process.wait()
    assert code == 130, "".join(lines) + rest
    assert "Summary:" in rest


def test_bad_policy_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("apiVersion: gpuwarden.dev/v1alpha1\nkind: GPUMonitorPolicy\nmetadata: {name: p}\n")
    assert cli.main(["demo", "--policy", str(policy), "--no-pace"]) == 2
    assert f"{policy}: spec: required field is missing" in capsys.readouterr().err


def test_speed_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--speed", "0"])
    assert exit_info.value.code == 2
    assert "must be a finite number above zero" in capsys.readouterr().err


# -- the engine on the scenario ---------------------------------------------------------------------


def test_each_story_starts_when_its_window_allows(demo_run: ScenarioRun) -> None:
    found = starts(demo_run)
    assert found[("idle-gpu", "research/notebook-idle-0")] == pytest.approx(5 * MIN, abs=10)
    # Bursts at 3m45s, 7m45s and 11m45s: three, once the 15m window is covered.
    assert found[("unusual-activity", "research/notebook-idle-0")] == pytest.approx(15 * MIN, abs=10)
    servers = [s.subject for s in demo_run.history.spans if s.rule == "unusual-activity"][1:]
    assert len(servers) == 2  # the two replicas that see the ramp from its start
    # The leak: once the 4-minute span lies past the model load (done at 0:30); it leaks from 1m.
    assert 4.5 * MIN <= found[("leak", "training/llm-finetune-0")] <= 5 * MIN
    # ...and it runs into 90% of the card at about 13m; near-oom needs 1m of it.
    assert 13 * MIN <= found[("near-oom", "training/llm-finetune-0")] <= 16 * MIN
    assert not [s for s in demo_run.history.spans if "vision-train-0" in s.subject]
    slow = [s.start - DEFAULT_ORIGIN for s in demo_run.history.spans if s.rule == "slow-requests"]
    assert len(slow) == 3  # the three replicas that serve when the answers grow longer
    assert all(20 * MIN <= t <= 23 * MIN for t in slow), slow
    assert len(found) == 9


def test_the_servers_climb_then_spread_load_is_no_schedule_and_its_reason_follows_its_message(
    demo_run: ScenarioRun,
) -> None:
    """SM activity climbs with the rush (GPUSteadyClimb at 15m), drops to ~55% when the third replica
    takes its share (16.6m), then dips back in a few seconds: a climb, then dips of the other sign,
    counted as three "dips every 1m34s, like a scheduled job" under the reason GPUSteadyClimb. Now:
    re-described as what the window shows, the climb's peak, under a reason that agrees. The fourth
    replica (22m, on latency) spreads the load thinner still, and the spike leaves the window."""
    servers = [s for s in demo_run.history.spans if s.rule == "unusual-activity" and "server" in s.subject]
    assert [s.start - DEFAULT_ORIGIN for s in servers] == [15 * MIN, 15 * MIN]
    for span in servers:
        assert span.message.startswith("SM activity climbs steadily: ")
        assert span.reason == "GPUSpike"
        assert span.resolution is Resolution.RECOVERED
        assert span.end is not None
        assert 22 * MIN < span.end - DEFAULT_ORIGIN < 27 * MIN


def test_the_idle_finding_clears_once_the_notebook_works(demo_run: ScenarioRun) -> None:
    """Work starts at 22m; the 5m mean of SM activity (~61% busy, ~2% idle) reaches 25% about 2m later."""
    (idle,) = [s for s in demo_run.history.spans if s.rule == "idle-gpu"]
    assert idle.end is not None
    assert idle.end - DEFAULT_ORIGIN == pytest.approx(24 * MIN, abs=30)
    assert idle.resolution is Resolution.RECOVERED
    # The summary says why it cleared: the clearing message, not the last one while active.
    assert re.fullmatch(r"mean SM activity \(GPM\) (2[5-9]|3\d)% over 5m, floor 20%", idle.last_message)
    assert [s.rule for s in demo_run.history.active()] == ["leak", "near-oom"]


def test_leak_message_projects_the_time_to_full(demo_run: ScenarioRun) -> None:
    (leak,) = [s for s in demo_run.history.spans if s.kind == growth.KIND]
    assert re.fullmatch(
        r"GPU memory grows 2\d\dMi/m over (4|8|16)m, fit (0\.9\d|1\.00); the card \(140Gi\) is full in .+",
        leak.message,
    )


def test_the_forecast_scales_out_ahead_of_the_ramp_and_the_load_spreads(demo_run: ScenarioRun) -> None:
    """Two replicas at ~75% until the ramp (12m-20m); they would saturate at 16m, the rule hold at 18m."""
    note = demo_run.scaling[0]
    assert note.target == "Deployment inference/llm-server"
    assert (note.decision.current, note.decision.desired, note.applied) == (2, 3, True)
    assert 12 * MIN < note.at - DEFAULT_ORIGIN < 16 * MIN
    assert note.decision.reason.startswith("forecast above saturated's ceiling (95%) in 3m: ")
    # The third replica serves 90 s after it was asked for: the load (230%) splits three ways.
    after = note.at - DEFAULT_ORIGIN + 90 + 60
    scenario = demo_run.scenario
    busy = [g.utilization_gpu for g in scenario.snapshot(after + 3 * MIN).gpus[3:6]]
    assert all(b == pytest.approx(230 / 3, abs=6) for b in busy), busy
    assert [len(g.pods) for g in scenario.snapshot(after).gpus[3:]] == [1, 1, 1, 0, 0]
    # No pod was saturated, so no reactive step on the GPUs followed: the forecast's was the one needed.
    assert not [s for s in demo_run.history.spans if s.rule == "saturated"]


def test_latency_scales_out_once_what_the_gpus_do_not_show_and_it_falls_back(demo_run: ScenarioRun) -> None:
    """From 18m the answers grow from 64 to 88 tokens at the same request rate: the three replicas'
    batches fill and a queue builds while their GPUs stay ~77% busy. P99 passes 10 s; one replica
    more (serving 90 s later) drains the queue, and P99 falls back below the threshold."""
    _, latency = demo_run.scaling
    assert (latency.decision.current, latency.decision.desired, latency.applied) == (3, 4, True)
    assert latency.decision.reason == "slow-requests on 3/3 pods"
    slow = [s for s in demo_run.history.spans if s.rule == "slow-requests"]
    assert len(slow) == 3
    for span in slow:
        assert span.start == latency.at
        assert re.fullmatch(r"P99 latency 1\d(\.\d+)?s over 1m above 10s \(\d+ requests\)", span.message)
        assert span.end is not None
        assert span.resolution is Resolution.RECOVERED
        # Within 4 minutes: the 90 s start, the queue drained, then a minute's window of short waits.
        assert span.end - latency.at <= 4 * MIN
        assert re.fullmatch(r"P99 latency \S+ over 1m at or below 10s \(\d+ requests\)", span.last_message)
    # The GPUs never saw it: no saturated finding, and nothing followed the cooldown.
    assert not [s for s in demo_run.history.spans if s.rule == "saturated"]
    (target,) = demo_run.session.targets()
    assert (target.initial, target.replicas, target.scaled_up, target.scaled_down) == (2, 4, 2, 0)


# Saturated for 10s in e2e-fast (the server is saturated from its first second), 30s apart.
FAST_SCALING = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: serving, namespace: inference}
spec:
  selector: {matchLabels: {app: llm-server}}
  evaluationInterval: 1s
  rules:
    - name: saturated
      utilizationCeiling: {percent: 95, for: 10s}
  actions:
    scale:
      targetRef: {apiVersion: apps/v1, kind: Deployment, name: llm-server}
      minReplicas: 1
      maxReplicas: 3
      scaleUpOn: [saturated]
      behavior:
        scaleUp: {stabilizationWindow: 0s, step: 1, cooldown: 30s}
"""


def _fast_scaling_run(tmp_path: Path, extra: str = "") -> ScenarioRun:
    path = tmp_path / "serving.yaml"
    path.write_text(FAST_SCALING + extra)
    run = ScenarioRun(load_scenario("e2e-fast"), load_policies(path))
    for _ in run.steps():
        pass
    return run


def test_the_simulated_deployment_stops_at_max_replicas(tmp_path: Path) -> None:
    run = _fast_scaling_run(tmp_path)
    assert [(n.decision.current, n.decision.desired) for n in run.scaling] == [(1, 2), (2, 3)]
    assert run.scaling[1].at - run.scaling[0].at == pytest.approx(30, abs=1)
    (target,) = run.session.targets()
    assert (target.replicas, target.dry_run) == (3, False)
    lines = summary_lines(run.history, run.scaling, elapsed_clock(DEFAULT_ORIGIN), run.session.targets())
    assert (
        "  Deployment inference/llm-server: 1 -> 3 replicas (simulated; dry run in local mode), 2 scale-ups; "
        "policy inference/serving" in lines
    )


def test_a_dry_run_policy_leaves_the_simulated_deployment_as_it_was(tmp_path: Path) -> None:
    run = _fast_scaling_run(tmp_path, "      dryRun: true\n")
    # As the operator in dryRun: the same wish once per cooldown, the replicas untouched.
    assert len(run.scaling) >= 3
    assert {(n.decision.current, n.decision.desired, n.applied) for n in run.scaling} == {(1, 2, False)}
    (target,) = run.session.targets()
    assert (target.replicas, target.dry_run) == (1, True)
    lines = summary_lines(run.history, run.scaling, elapsed_clock(DEFAULT_ORIGIN), run.session.targets())
    times = len(run.scaling)
    assert (
        f"  Deployment inference/llm-server: would scale 1 -> 2, {times} times (once per cooldown) (dryRun); "
        "policy inference/serving" in lines
    )


# -- displays ------------------------------------------------------------------------------------------


def _row(findings: tuple[str, ...] = ()) -> GpuRow:
    return GpuRow(
        device="GPU-1",
        name="GPU 1",
        model="NVIDIA H200",
        state=DeviceState.OK,
        utilization=88.0,
        sm_active=75.0,
        memory_used=126 * 2.0**30,
        memory_total=140 * 2.0**30,
        subjects=("training/llm-finetune-0",),
        findings=findings,
    )


def _step(at: float, rows: tuple[GpuRow, ...] = (), scaling: tuple[ScaleNote, ...] = ()) -> Step:
    return Step(at=at, rows=rows or (_row(),), announcements=(), scaling=scaling, evaluated=True)


def test_table_shows_gpu_pod_utilization_memory_and_findings() -> None:
    lines = render_table([_row(("leak", "near-oom"))], "title", subject_header="pod")
    assert lines[0] == "title"
    assert lines[1].split() == ["GPU", "POD", "UTIL", "SM", "MEMORY", "FINDINGS"]
    assert re.fullmatch(
        r"GPU 1\s+training/llm-finetune-0\s+88%\s+75%\s+126Gi/140Gi \(90%\)\s+leak, near-oom", lines[2]
    )


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_live_display_redraws_the_table_in_place_at_most_every_refresh() -> None:
    out = io.StringIO()
    fake = FakeTime()
    display = LiveDisplay(out, elapsed_clock(0.0), subject_header="pod", refresh=0.1, monotonic=fake)
    display.show(_step(1.0), "t1")
    first = out.getvalue()
    assert first.startswith("\x1b[?25l")
    assert "t1\n" in first
    assert "\x1b[" not in first[6:]
    display.show(_step(2.0), "t2")  # within refresh: nothing
    assert out.getvalue() == first
    fake.now = 0.2
    display.show(_step(3.0), "t3")
    redraw = out.getvalue()[len(first) :]
    assert redraw.startswith("\x1b[3F\x1b[J")  # up over title, header and one row; clear below
    assert "t3\n" in redraw
    display.close()
    assert out.getvalue().endswith("\x1b[?25h")


def test_plain_display_prints_status_every_interval_and_a_scale_wish_once() -> None:
    out = io.StringIO()
    display = PlainDisplay(out, elapsed_clock(0.0), status_every=300.0)
    decision = ScaleDecision(1, 2, Direction.UP, "saturated on 1/1 pods")
    note = ScaleNote(
        "inference/llm-serving", "Deployment inference/llm-server", decision, 120.0, applied=False
    )
    for t in range(0, 601, 10):
        display.show(_step(float(t), scaling=(note,) if t % 300 == 120 else ()))
    text = out.getvalue()
    assert [line[:7] for line in text.splitlines() if "GPU 1" in line] == ["[00:00]", "[05:00]", "[10:00]"]
    assert text.count("would scale Deployment inference/llm-server 1 -> 2") == 1
    assert "(policy inference/llm-serving; dryRun)" in text


TARGET = TargetRow("inference/llm-serving", "Deployment inference/llm-server", 3, dry_run=False)


def test_a_simulated_scale_prints_a_line_and_the_replicas_show_in_table_and_status() -> None:
    decision = ScaleDecision(2, 3, Direction.UP, "saturated on 1/1 pods for 5m")
    note = ScaleNote(
        "inference/llm-serving", "Deployment inference/llm-server", decision, 420.0, applied=True
    )
    out = io.StringIO()
    display = PlainDisplay(out, elapsed_clock(0.0), status_every=300.0)
    display.show(
        Step(at=420.0, rows=(_row(),), announcements=(), scaling=(note,), evaluated=True, targets=(TARGET,))
    )
    assert out.getvalue().splitlines() == [
        "[07:00] SCALE   scaled Deployment inference/llm-server 2 -> 3 (simulated): "
        "saturated on 1/1 pods for 5m (policy inference/llm-serving)",
        "[07:00] GPU 1 training/llm-finetune-0: util 88%, SM 75%, mem 126Gi/140Gi (90%); findings: none",
        "[07:00] Deployment inference/llm-server: 3 replicas (simulated)",
    ]
    table = render_table([_row()], "title", subject_header="pod", targets=[TARGET])
    assert table[-1] == "Deployment inference/llm-server: 3 replicas (simulated)"
    one = TargetRow("p", "Deployment d", 1, dry_run=True)
    assert render_table([_row()], "t", subject_header="pod", targets=[one])[-1] == (
        "Deployment d: 1 replica (dryRun: stays)"
    )


def test_the_live_table_grows_by_the_target_line_and_redraws_over_it() -> None:
    out = io.StringIO()
    fake = FakeTime()
    display = LiveDisplay(out, elapsed_clock(0.0), subject_header="pod", refresh=0.1, monotonic=fake)
    step = Step(at=1.0, rows=(_row(),), announcements=(), scaling=(), evaluated=True, targets=(TARGET,))
    display.show(step, "t1")
    assert "Deployment inference/llm-server: 3 replicas (simulated)\n" in out.getvalue()
    fake.now = 0.2
    before = len(out.getvalue())
    display.show(step, "t2")
    # Up over title, header, one GPU row and the target's line.
    assert out.getvalue()[before:].startswith("\x1b[4F\x1b[J")


def test_scale_repeats_let_a_changed_wish_through() -> None:
    repeats = ScaleRepeats()

    def note(current: int, desired: int) -> ScaleNote:
        return ScaleNote(
            "p", "Deployment d", ScaleDecision(current, desired, Direction.UP, ""), 0.0, applied=False
        )

    assert [repeats.fresh(n) for n in (note(1, 2), note(1, 2), note(2, 3), note(1, 2))] == [
        True,
        False,
        True,
        True,
    ]


# -- policies ------------------------------------------------------------------------------------------


def test_demo_policy_file_holds_a_node_wide_and_a_serving_policy() -> None:
    hygiene, serving = load_policies(demo_policy_path())
    assert (hygiene.key, hygiene.namespace) == ("gpu-hygiene", None)
    assert [r.name for r in hygiene.spec.rules] == ["idle-gpu", "near-oom", "leak", "unusual-activity"]
    assert serving.key == "inference/llm-serving"
    assert serving.spec.actions.scale is not None
    assert serving.spec.actions.scale.forecast is not None


def test_a_policy_file_that_cannot_be_read_or_parsed_says_so_with_its_name(tmp_path: Path) -> None:
    absent = tmp_path / "absent.yaml"
    with pytest.raises(SpecError, match=f"^{absent}: cannot read policy file"):
        load_policies(absent)
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    with pytest.raises(SpecError, match=f"^{broken}: not valid YAML"):
        load_policies(broken)


def test_policy_errors_name_the_document(tmp_path: Path) -> None:
    good = "apiVersion: gpuwarden.dev/v1alpha1\nkind: GPUMonitorPolicy\nmetadata: {name: a}\n"
    good += "spec: {selector: {}, rules: [{name: r, utilizationFloor: {percent: 5, for: 1m}}]}\n"
    path = tmp_path / "p.yaml"
    path.write_text(good + "---\n" + good.replace("percent: 5", "percent: 500"))
    with pytest.raises(SpecError, match=r"\(document 2\): spec.rules\[0\].utilizationFloor.percent"):
        load_policies(path)
    path.write_text(good + "---\n" + good)
    with pytest.raises(SpecError, match="two policies are named a"):
        load_policies(path)
    path.write_text("")
    with pytest.raises(SpecError, match="holds no GPUMonitorPolicy"):
        load_policies(path)


def test_watch_judges_every_process_and_scales_nothing() -> None:
    _, serving = load_policies(demo_policy_path())
    local = for_processes(serving)
    assert local.namespace is None
    assert not local.spec.selector.match_labels
    assert not local.spec.selector.match_expressions
    assert local.spec.actions.scale is None
    assert local.spec.rules == serving.spec.rules


def test_history_thins_out_a_long_series_evenly() -> None:
    history = History(max_points=100)
    device = history.device("GPU-1", "GPU 1", "H200")
    for t in range(1000):
        device.append(float(t), 1.0, None, 2.0)
    assert 50 <= len(device.times) <= 100
    steps = {b - a for a, b in zip(device.times, device.times[1:], strict=False)}
    assert steps == {16.0}
    assert device.times[0] == 0.0

"""Scripted replays on scenario time: `watch --scenario` finds the same things at the same scenario
times at any `--speed`, however slow the host is to keep up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden import cli
from gpuwarden.agent.scripted import ScriptedBackend
from gpuwarden.local.rows import Step
from gpuwarden.local.watch import WatchConfig, watch
from gpuwarden.sim.scenario import DEFAULT_ORIGIN

POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: fast}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: idle-gpu
      utilizationFloor: {percent: 20, for: 10s}
    - name: saturated
      utilizationCeiling: {percent: 95, for: 10s}
    - name: leak
      memoryGrowth: {rate: 100Mi/m, window: 1m, minFit: 0.8}
"""
STARVED_SECONDS = 0.03
"""What each snapshot costs the starved run's event loop: at --speed 100000, the host is ~3,000 times
slower than asked."""


class Recording:
    """A display that keeps what watch shows: each finding's transition at its scenario second."""

    def __init__(self, block: float = 0.0) -> None:
        self.block = block
        self.origin = 0.0
        """The scenario's start, epoch seconds."""
        self.transitions: list[tuple[float, str, str, str]] = []
        self.samples: list[float] = []
        self.notes: list[str] = []

    def show(self, step: Step, title: str = "") -> None:
        self.samples.append(round(step.at - self.origin, 6))
        for a in step.announcements:
            t = a.transition
            self.transitions.append(
                (round(t.at - self.origin, 6), t.transition.value, t.finding.rule, a.subject)
            )
        if self.block:
            time.sleep(self.block)  # the event loop gets nothing done meanwhile: a busy host

    def note(self, text: str) -> None:
        self.notes.append(text)

    def close(self) -> None:
        pass


async def play(policy: Path, speed: str, display: Recording, wall: float) -> None:
    """``watch --scenario e2e-fast`` in this process, started at epoch second ``wall``."""
    args = cli.build_parser(["watch"]).parse_args(
        [
            *("watch", f"--policy={policy}", "--scenario=e2e-fast", f"--speed={speed}", "--duration=70s"),
            *("--listen=127.0.0.1:0", "--hook-socket=", "--plain"),
        ]
    )
    config = WatchConfig.from_args(args)
    assert config.scenario is not None
    # The clock a scenario used to be sampled by: the wall clock, sped up. A replay no longer reads it.
    started = time.monotonic()

    def fast(speed: float = float(speed)) -> float:
        return wall + (time.monotonic() - started) * speed

    backend = ScriptedBackend(config.scenario, origin=wall, clock=fast)
    backend.open()
    display.origin = backend.origin or 0.0
    async with asyncio.timeout(30):
        assert await watch(config, backend, fast, out=display) == 0


async def test_a_starved_replay_at_any_speed_finds_what_a_paced_one_finds(
    tmp_path: Path, capsys: pytest.CaptureFixture[Any]
) -> None:
    policy = tmp_path / "fast.yaml"
    policy.write_text(POLICY)
    paced, starved = Recording(), Recording(block=STARVED_SECONDS)
    # Both from the demo's start: where a scenario starts against the growth rule's buckets (aligned to
    # the epoch) can move the leak's finding by a bucket; here only the pace differs.
    wall = DEFAULT_ORIGIN
    started = time.monotonic()
    # 70 s of scenario in 7 s: slow enough that a host busy with other work (a loaded CI runner played
    # 30x at 19x) still keeps up, so the paced run must say nothing about its pace.
    await play(policy, "10", paced, wall)
    assert time.monotonic() - started >= 70 / 10 - 0.1  # it was paced
    await play(policy, "100000", starved, wall)
    capsys.readouterr()  # the summaries
    # Every second of scenario time sampled, none skipped or bunched, in both.
    assert paced.samples == starved.samples == [float(t) for t in range(71)]
    assert starved.transitions == paced.transitions
    started_at = {
        (rule, subject.split()[1]): t for t, what, rule, subject in paced.transitions if what == "Started"
    }
    assert started_at == {("idle-gpu", "41237"): 9.0, ("saturated", "70533"): 9.0, ("leak", "52810"): 60.0}
    # The starved run says that it played slower than asked, once; the paced one says nothing.
    (behind,) = [n for n in starved.notes if "plays the scenario at" in n]
    assert "x, not 100000x; every sample is still taken at its scenario time" in behind
    assert not [n for n in paced.notes if "plays the scenario at" in n]

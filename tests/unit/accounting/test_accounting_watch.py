"""``gpuwarden watch`` sums each host process's GPU time in its summary (docs/accounting.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: shared, namespace: default}
spec:
  selector: {}
  evaluationInterval: 10s
  rules:
    - name: idle
      utilizationFloor: {percent: 10, for: 30s}
"""


def test_watch_prints_each_processs_share_of_a_time_sliced_gpu(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "watch",
            f"--policy={policy}",
            "--scenario=shared-gpu",
            "--speed=20",
            "--duration=60s",
            "--listen=127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    usage = done.stdout[done.stdout.index("GPU time per process") :]

    def held(pid: int) -> tuple[float, str]:
        match = re.search(rf"pid {pid} .* on NVIDIA H200: (\d+) GPU-s held, (.*)", usage)
        assert match, usage
        return float(match[1]), match[2]

    # GPU 0 is time-sliced between 51001 (98% of the SMs) and 51002 (no kernel): half of a minute each.
    busy, busy_rest = held(51001)
    idle, idle_rest = held(51002)
    assert 28 <= busy <= 31
    assert 28 <= idle <= 31
    used = re.match(r"(\d+) used", busy_rest)
    assert used, busy_rest
    assert 55 <= float(used[1]) <= 60  # 98% of the GPU for a minute: more than its half
    assert re.match(r"0 used \(0%\), (29|30|31) idle$", idle_rest), idle_rest
    # GPU 1 has no per-process readings: its processes' activity is unknown, never taken for idle.
    assert held(52001)[1] == "activity unknown"
    assert held(52002)[1] == "activity unknown"

"""The training hook on a real GPU, through `gpuwarden watch`: three hooked torch jobs share the GPU.

Run on a GPU machine, never in CI (no driver there):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_hook_gpu.py -s

- ``leak`` (tests/gpu/hook_jobs.py) keeps a probe loss with its graph every step: allocated memory
  grows about 1.2 GiB a minute on the H200 (5 MiB, one step's graph, 4 steps a second), and
  tracemalloc names the line that keeps it. The ``tensor-leak`` rule
  (``memory: auto``, which reads allocated memory where a hook reports it) must flag it, at the rate
  the hook's own readings show, naming that line.
- ``cache`` runs the same loop with the leak fixed, but its batch grows in steps: the allocator's
  cache (reserved memory, and NVML's figure) grows while allocated memory stays flat. Nothing may
  flag it.
- ``loader``'s data-loader workers keep 64 KiB of host memory per item served. The ``host-leak``
  rule (``memory: host``) must flag it; its GPU memory is flat, so no GPU rule may.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from watch_support import Recorder, metrics, process_bytes, rate_of, ready, wait_for

pytestmark = pytest.mark.gpu

JOBS = Path(__file__).with_name("hook_jobs.py")
JOB_SECONDS = 240
WATCH_CAP = "200s"

POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: hook-fast}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: tensor-leak
      memoryGrowth: {rate: 20Mi/m, window: 1m, minFit: 0.8}
    - name: host-leak
      memoryGrowth: {memory: host, rate: 200Mi/m, window: 1m, minFit: 0.8}
"""


def start_job(kind: str, socket: Path, logs: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(JOBS), kind, f"--socket={socket}", f"--seconds={JOB_SECONDS}"],
        stdout=subprocess.PIPE,
        stderr=(logs / f"{kind}.log").open("w"),
        text=True,
    )


@pytest.fixture
def hook_socket(tmp_path: Path) -> Path:
    return tmp_path / "hook.sock"


@pytest.fixture
def watch(tmp_path: Path, hook_socket: Path) -> Iterator[subprocess.Popen[str]]:
    policy = tmp_path / "hook.yaml"
    policy.write_text(POLICY)
    argv = [sys.executable, "-m", "gpuwarden", "watch", f"--policy={policy}", "--listen=127.0.0.1:0"]
    argv += [f"--duration={WATCH_CAP}", "--plain", f"--hook-socket={hook_socket}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def test_the_hook_names_a_kept_graph_leak_ignores_a_growing_cache_and_finds_a_loader_leak(
    watch: subprocess.Popen[str], hook_socket: Path, tmp_path: Path
) -> None:
    assert watch.stdout is not None
    seen: list[str] = []
    address = None
    for line in watch.stdout:
        seen.append(line)
        if match := re.search(r"/metrics on (\S+);", line):
            address = match.group(1)
            break
    assert address, "".join(seen)
    jobs = {kind: start_job(kind, hook_socket, tmp_path) for kind in ("leak", "cache", "loader")}
    recorder: Recorder | None = None
    try:
        info = {kind: ready(job) for kind, job in jobs.items()}
        pids = {kind: int(str(i["pid"])) for kind, i in info.items()}
        leak_line = int(str(info["leak"]["leakLine"]))
        first = wait_for(address, "allocated", pids["cache"])
        recorder = Recorder(address, pids)
        recorder.start()
        started: dict[tuple[str, int], str] = {}
        t0 = time.monotonic()
        for line in watch.stdout:
            seen.append(line)
            if match := re.search(r"STARTED (\S+) pid (\d+)\b", line):
                started[(match.group(1), int(match.group(2)))] = line
            if ("tensor-leak", pids["leak"]) in started and ("host-leak", pids["loader"]) in started:
                break
        else:
            raise AssertionError("watch ended before both leaks were flagged:\n" + "".join(seen))
        found_after = time.monotonic() - t0
        measured = recorder.rate("leak")  # as the hook's own readings showed on /metrics
        body = metrics(address)
        cache = [
            (process_bytes(b, "reserved", pids["cache"]), process_bytes(b, "allocated", pids["cache"]))
            for b in (first, body)
        ]
    finally:
        for job in jobs.values():
            job.kill()
            job.wait()
        if recorder is not None:
            recorder.stop.set()
            print("\n".join(recorder.lines))
        for kind in jobs:
            print(f"--- {kind} stderr\n" + (tmp_path / f"{kind}.log").read_text()[-3000:])
    out = "".join(seen)
    print(out)
    leak = started[("tensor-leak", pids["leak"])]
    assert "allocated memory (live tensors, not the cache) grows" in leak, leak
    assert re.search(rf"top growing lines: \S*hook_jobs\.py:{leak_line} \+", leak), leak  # first
    reported = rate_of(leak)
    assert 0.7 * measured < reported < 1.3 * measured, (reported, measured)
    host = started[("host-leak", pids["loader"])]
    assert "host memory" in host, host
    # The cache grew while the tensors did not, and was never flagged; the loader's GPU memory never.
    (reserved_then, allocated_then), (reserved_now, allocated_now) = cache
    assert reserved_then is not None
    assert reserved_now is not None
    assert allocated_then is not None
    assert allocated_now is not None
    assert reserved_now > reserved_then + 64 * 2**20, cache
    assert allocated_now < allocated_then * 1.1 + 64 * 2**20, cache
    assert not [k for k in started if k[1] == pids["cache"]], started
    assert ("tensor-leak", pids["loader"]) not in started
    mib = 2**20
    print(
        f"found both in {found_after:.0f}s; leak {reported / mib:.0f}Mi/m, measured {measured / mib:.0f}Mi/m"
    )

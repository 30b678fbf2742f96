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
import time
from pathlib import Path

import pytest
from watch_support import Recorder, launch, metrics, process_bytes, rate_of, started, stop, up, watching

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


def test_the_hook_names_a_kept_graph_leak_ignores_a_growing_cache_and_finds_a_loader_leak(
    tmp_path: Path,
) -> None:
    socket = tmp_path / "hook.sock"
    seen: list[str] = []
    with watching(POLICY, tmp_path, socket, WATCH_CAP) as (watch, address):
        assert watch.stdout is not None
        argv = [f"--socket={socket}", f"--seconds={JOB_SECONDS}"]
        jobs = launch({kind: [str(JOBS), kind, *argv] for kind in ("leak", "cache", "loader")}, tmp_path)
        recorder: Recorder | None = None
        try:
            info, pids = up(jobs, address)
            leak_line = int(str(info["leak"]["leakLine"]))
            first = metrics(address)
            recorder = Recorder(address, pids)
            recorder.start()
            t0 = time.monotonic()
            wanted = {("tensor-leak", pids["leak"]), ("host-leak", pids["loader"])}
            found = started(watch.stdout, wanted, seen)
            found_after = time.monotonic() - t0
            measured = recorder.rate("leak")  # as the hook's own readings showed on /metrics
            body = metrics(address)
            cache = [
                (process_bytes(b, "reserved", pids["cache"]), process_bytes(b, "allocated", pids["cache"]))
                for b in (first, body)
            ]
        finally:
            stop(jobs, recorder, tmp_path)
    seen.append(watch.stdout.read())  # to its end
    out = "".join(seen)
    print(out)
    _, leak = found[("tensor-leak", pids["leak"])]
    assert "allocated memory (live tensors, not the cache) grows" in leak, leak
    assert re.search(rf"top growing lines: \S*hook_jobs\.py:{leak_line} \+", leak), leak  # first
    reported = rate_of(leak)
    assert 0.7 * measured < reported < 1.3 * measured, (reported, measured)
    _, host = found[("host-leak", pids["loader"])]
    assert "host memory" in host, host
    # The cache grew while the tensors did not, and was never flagged; the loader's GPU memory never.
    (reserved_then, allocated_then), (reserved_now, allocated_now) = cache
    assert reserved_then is not None
    assert reserved_now is not None
    assert allocated_then is not None
    assert allocated_now is not None
    assert reserved_now > reserved_then + 64 * 2**20, cache
    assert allocated_now < allocated_then * 1.1 + 64 * 2**20, cache
    assert not re.search(rf"STARTED \S+ pid {pids['cache']}\b", out)
    assert not re.search(rf"STARTED tensor-leak pid {pids['loader']}\b", out)
    mib = 2**20
    print(
        f"found both in {found_after:.0f}s; leak {reported / mib:.0f}Mi/m, measured {measured / mib:.0f}Mi/m"
    )

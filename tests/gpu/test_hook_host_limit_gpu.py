"""A host memory leak under a container's memory limit, on a real GPU job, through `gpuwarden watch`.

Run on a GPU machine as root where cgroup v2 can be written (never in CI: no driver there):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_hook_host_limit_gpu.py -s

tests/gpu/hook_jobs.py's ``loader`` (its data-loader worker keeps what it serves) runs in a cgroup of
its own whose ``memory.max`` is :data:`LIMIT`, as a container's limit: the hook reads that limit from
the job's own cgroup and sends it beside its RSS. The ``memory: host`` rule must flag the leak as
``HostMemoryExhaustionImminent`` with the limit and the time left, at least a minute before the
cgroup reaches its limit (its first ``max`` event: from there the kernel reclaims the job's file
pages, stalls it or kills it), and the time it states must be about the time it had left.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from watch_support import started, stop, up, watching

pytestmark = pytest.mark.gpu

JOBS = Path(__file__).with_name("hook_jobs.py")
CGROUP = Path("/sys/fs/cgroup")
LIMIT = 8 * 2**30
POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: host-limit}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: host-leak
      memoryGrowth: {rate: 100Mi/m, memory: host}
"""


def own_cgroup(name: str) -> Path:
    """A child cgroup of this process's (v2) with ``memory.max`` = :data:`LIMIT` and no swap.

    The memory controller must be enabled in the parent's ``cgroup.subtree_control``, which cgroup
    v2 refuses while the parent holds processes (a container's root cgroup does): they are moved
    to a leaf beside the child first, as an init system does.
    """
    (membership,) = [
        line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
    ]
    parent = CGROUP / membership[3:].lstrip("/")
    control = parent / "cgroup.subtree_control"
    if not os.access(parent, os.W_OK) or "memory" not in (parent / "cgroup.controllers").read_text().split():
        pytest.skip(f"cgroup v2 at {parent} is not writable here, or has no memory controller")
    if "memory" not in control.read_text().split():
        leaf = parent / "gpuwarden-leaf"
        leaf.mkdir(exist_ok=True)
        for pid in (parent / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (leaf / "cgroup.procs").write_text(pid)
        control.write_text("+memory")
    group = parent / name
    group.mkdir(exist_ok=True)
    (group / "memory.max").write_text(str(LIMIT))
    if (group / "memory.swap.max").exists():
        (group / "memory.swap.max").write_text("0")
    return group


def at_limit(group: Path, job: subprocess.Popen[str], deadline: float) -> float:
    """When ``group``'s memory first reached ``memory.max`` (its ``max`` event; the kernel then reclaims,
    thrashes or kills: a stall as much as an OOM kill ends such a job), polled twice a second."""
    while time.monotonic() < deadline:
        events = (group / "memory.events").read_text()
        if re.search(r"^max [1-9]", events, re.M):
            return time.monotonic()
        assert job.poll() is None, f"the job ended (rc {job.returncode}) below its limit: {events}"
        time.sleep(0.5)
    raise AssertionError(f"the job did not reach its limit in time: {(group / 'memory.events').read_text()}")


def test_a_host_leak_is_imminent_with_its_limit_and_time_left_before_it_reaches_it(tmp_path: Path) -> None:
    group = own_cgroup(f"gpuwarden-host-limit-{os.getpid()}")
    socket = tmp_path / "hook.sock"
    seen: list[str] = []
    # One worker keeps 30 KiB for each of 256 items a step, 4 steps a second: about 1.8 GiB a minute.
    argv = [str(JOBS), "loader", f"--socket={socket}", "--seconds=600", "--workers=1"]
    argv += ["--leak-bytes-per-item=30720", "--steps-per-second=4"]
    command = f"echo $$ > {group}/cgroup.procs && exec {sys.executable} {' '.join(argv)}"
    # Capped, so that a leak never flagged fails with watch's lines instead of waiting for the OOM.
    with watching(POLICY, tmp_path, socket, "420s") as (watch, address):
        assert watch.stdout is not None
        log = (tmp_path / "loader.log").open("w")
        jobs = {
            "loader": subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, stderr=log, text=True)
        }
        try:
            _, pids = up(jobs, address)
            onset = time.monotonic()
            found = started(watch.stdout, {("host-leak", pids["loader"])}, seen)
            flagged, text = found[("host-leak", pids["loader"])]
            full = at_limit(group, jobs["loader"], deadline=flagged + 300)
            events = (group / "memory.events").read_text()
        finally:
            stop(jobs, None, tmp_path)
            for pid in (group / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
    seen.append(watch.stdout.read())
    print("".join(seen))
    stated = re.search(r"its memory limit \((\S+)\) is reached in (?:(\d+)m)?(\d+)?s?", text)
    assert stated is not None, text
    left = int(stated.group(2) or 0) * 60 + int(stated.group(3) or 0)
    print(
        f"flagged {flagged - onset:.0f}s after the first reading, {full - flagged:.0f}s before the cgroup"
        f" reached its limit at {full - onset:.0f}s; it said {left}s; {text.strip()}; memory.events: {events}"
    )
    assert "HostMemoryExhaustionImminent" in text, text
    assert stated.group(1) == "8Gi", text
    assert full - flagged >= 60, (full - flagged, text)
    # The hook's RSS sum counts the pages the worker shares with its parent twice: it may say less.
    assert 0.4 * (full - flagged) <= left <= 1.3 * (full - flagged), (left, full - flagged, text)

"""What the GPU tests share: a `gpuwarden watch` on a hook socket, its /metrics, the jobs' ready lines
and a recorder of their memory series; and a whole `watch` run of a one-rule policy."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

LEAK_POLICY = """\
apiVersion: gpuwarden.dev/v1alpha1
kind: GPUMonitorPolicy
metadata: {name: tensor-leaks}
spec:
  selector: {}
  evaluationInterval: 1s
  rules:
    - name: tensor-leak
      memoryGrowth: {rate: 20Mi/m}
"""
"""The policy the hook's GPU tests watch their jobs by: any growth over 20Mi/m, judged every second."""


def watch_for(seconds: int, rule: str, tmp_path: Path) -> str:
    """What `gpuwarden watch` printed (stdout and stderr) over ``seconds`` with a policy of one rule
    (``rule``: its YAML flow mapping, e.g. ``{name: idle, utilizationFloor: {percent: 10, for: 20s}}``)
    over every process, evaluated every second, per-process utilization read every 2 s."""
    policy = tmp_path / "any.yaml"
    policy.write_text(
        "apiVersion: gpuwarden.dev/v1alpha1\nkind: GPUMonitorPolicy\nmetadata: {name: any}\n"
        f"spec: {{selector: {{}}, evaluationInterval: 1s, rules: [{rule}]}}\n"
    )
    argv = [sys.executable, "-m", "gpuwarden", "watch", f"--policy={policy}", "--listen=127.0.0.1:0"]
    argv += [f"--duration={seconds}s", "--plain", "--process-interval=2s"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120, check=False)
    out = done.stdout + done.stderr
    print(out)
    assert done.returncode == 0, out
    return out


@contextmanager
def watching(
    policy: str, tmp_path: Path, socket: Path, cap: str
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`gpuwarden watch` with ``policy`` on ``socket``, stopping by itself after ``cap``, and the
    address of its /metrics; interrupted (SIGINT) on the way out."""
    path = tmp_path / "policy.yaml"
    path.write_text(policy)
    argv = [sys.executable, "-m", "gpuwarden", "watch", f"--policy={path}", "--listen=127.0.0.1:0"]
    argv += [f"--duration={cap}", "--plain", f"--hook-socket={socket}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        for line in proc.stdout:
            seen.append(line)
            if match := re.search(r"/metrics on (\S+);", line):
                yield proc, match.group(1)
                break
        else:
            raise AssertionError("watch ended before it listened:\n" + "".join(seen))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def started(
    out: IO[str], wanted: set[tuple[str, int]], seen: list[str]
) -> dict[tuple[str, int], tuple[float, str]]:
    """Read watch's lines (kept in ``seen``) until each (rule, pid) of ``wanted`` has STARTED: each
    STARTED line by (rule, pid), with the monotonic time it was read. Fails if watch ends first."""
    found: dict[tuple[str, int], tuple[float, str]] = {}
    for line in out:
        seen.append(line)
        if match := re.search(r"STARTED (\S+) pid (\d+)\b", line):
            found[(match.group(1), int(match.group(2)))] = (time.monotonic(), line)
        if wanted <= found.keys():
            return found
    raise AssertionError(f"watch ended before {sorted(wanted - found.keys())} STARTED:\n" + "".join(seen))


def launch(argvs: dict[str, list[str]], logs: Path) -> dict[str, subprocess.Popen[str]]:
    """Each job's argv started by this Python, by kind, its stderr in ``logs/<kind>.log``."""
    return {
        kind: subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=(logs / f"{kind}.log").open("w"),
            text=True,
        )
        for kind, argv in argvs.items()
    }


def up(
    jobs: dict[str, subprocess.Popen[str]], address: str
) -> tuple[dict[str, dict[str, object]], dict[str, int]]:
    """Each job's ready line and PID, once /metrics carries its hook's allocated reading."""
    info = {kind: ready(job) for kind, job in jobs.items()}
    pids = {kind: int(str(i["pid"])) for kind, i in info.items()}
    for pid in pids.values():
        wait_for(address, "allocated", pid, timeout=120)
    return info, pids


def stop(jobs: dict[str, subprocess.Popen[str]], recorder: Recorder | None, logs: Path) -> None:
    """Kill the jobs; print the recorder's lines and the end of each job's log."""
    for job in jobs.values():
        job.kill()
        job.wait()
    if recorder is not None:
        recorder.stop.set()
        print("\n".join(recorder.lines))
    for log in sorted(logs.glob("*.log")):
        print(f"--- {log.name}\n" + log.read_text()[-3000:])


def metrics(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return str(response.read().decode())


def process_bytes(body: str, memory: str, pid: int) -> float | None:
    """``gpuwarden_process_gpu_memory_<memory>_bytes`` of ``pid`` on /metrics, None when absent."""
    series = f"gpuwarden_process_gpu_memory_{memory}_bytes"
    match = re.search(rf'{series}\{{[^}}]*pid="{pid}"[^}}]*\}} (\S+)', body)
    return float(match.group(1)) if match else None


def wait_for(address: str, memory: str, pid: int, timeout: float = 30.0) -> str:
    """/metrics once it carries ``pid``'s hook reading of ``memory`` (polled: watch samples each second)."""
    deadline = time.monotonic() + timeout
    while process_bytes(body := metrics(address), memory, pid) is None:
        assert time.monotonic() < deadline, f"no {memory} reading of pid {pid} on /metrics:\n{body}"
        time.sleep(0.5)
    return body


def ready(job: subprocess.Popen[str]) -> dict[str, object]:
    """The job's ready line (``{"ready": true, …}``, hook_jobs.py), past what its libraries print first."""
    assert job.stdout is not None
    for line in job.stdout:
        if line.startswith("{"):
            info = json.loads(line)
            if info.get("ready") is True:
                return dict(info)
    raise AssertionError(f"the job exited before it was ready (rc {job.wait()})")


def rate_of(text: str) -> float:
    """The rate a finding's message states (``grows 3.2Gi/m``), in bytes a minute."""
    rate = re.search(r"grows ([\d.]+)(Ki|Mi|Gi)/m", text)
    assert rate is not None, text
    return float(rate.group(1)) * {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[rate.group(2)]


class Recorder(threading.Thread):
    """Every 5 s, the jobs' memory series on /metrics, printed at the end: what a failure is read from."""

    def __init__(self, address: str, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.address, self.pids = address, pids
        self.lines: list[str] = []
        self.allocated: dict[str, list[tuple[float, float]]] = {kind: [] for kind in pids}
        """(monotonic time, allocated bytes) per job, as /metrics showed them."""
        self.stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(5.0):
            body = metrics(self.address)
            for kind, pid in self.pids.items():
                figures = {m: process_bytes(body, m, pid) for m in ("used", "allocated", "reserved")}
                if (allocated := figures["allocated"]) is not None:
                    self.allocated[kind].append((time.monotonic(), allocated))
                mib = {m: None if v is None else round(v / 2**20) for m, v in figures.items()}
                self.lines.append(f"{time.monotonic() - start:5.0f}s {kind} {pid} MiB {mib}")

    def rate(self, kind: str, until: float | None = None) -> float:
        """``kind``'s allocated memory's rate, bytes a minute, from its first recorded reading to its
        last (before ``until``, a monotonic time, when given)."""
        points = [p for p in self.allocated[kind] if until is None or p[0] <= until]
        assert len(points) >= 2, (kind, points)
        (t0, b0), (t1, b1) = points[0], points[-1]
        return (b1 - b0) / (t1 - t0) * 60

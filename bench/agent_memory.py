"""What the node agent's imports cost in resident memory, against a bare interpreter.

Not a test: it prints figures for docs/benchmarks.md ("Agent memory (imports)"). It needs
no GPU; every figure is taken in one run, from fresh child processes, side by side:

    .venv/bin/python bench/agent_memory.py                  # 3 rounds, 10 s of agent each
    .venv/bin/python bench/agent_memory.py --seconds 30 --json /tmp/agent-memory.json

Rows (each the median ``VmRSS`` over ``--rounds``, the rounds interleaved so that the
machine's state at one moment does not favour one row):

- **bare**: ``python -c`` that imports nothing of ours (the interpreter and ``site``);
- **imports**: ``import gpuwarden.agent.command``, all that ``gpuwarden agent`` loads
  before it looks at its flags;
- **imports + kubelet client**: the above, then one ``PodResourcesClient.list()`` against
  a unix socket nobody listens on. On a node the nvml backend makes that call at start,
  so this row is what the nvml path has loaded before NVML itself (which needs a GPU and
  is not measured here);
- **agent, scripted**: ``gpuwarden agent --backend scripted`` as a child, sampling at
  ``--sample-interval``, reporting to a local sink that accepts everything, and scraped on
  ``/metrics`` once a second; its ``VmRSS`` after ``--seconds``.

Each row also names the site-packages whose native extensions the process has mapped
(from ``/proc/<pid>/maps``): which heavy libraries a path pulls in, without instrumenting it.
The children run in a scratch directory with ``PYTHONPATH`` set to this checkout, so
they measure the code next to this script. To measure another version in the same
conditions, point ``PYTHONPATH`` at a copy of its tree instead
(``git archive REV gpuwarden | tar -x -C DIR``); the ``gpuwarden from`` line says which
code was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# The children print their own figures as the last line of stdout: one JSON object.
_REPORT = r"""
import json, re, sys
def _report(**extra):
    rss = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    maps = open("/proc/self/maps").read()
    print(json.dumps({"rss_kib": int(rss.split()[1]), "maps": maps, **extra}))
"""

BARE = _REPORT + "_report()\n"

IMPORTS = (
    _REPORT
    + """
import gpuwarden.agent.command
import gpuwarden
_report(source=gpuwarden.__file__)
"""
)

KUBELET = (
    _REPORT
    + """
import asyncio, socket, sys, tempfile
import gpuwarden.agent.command
from gpuwarden.agent.attribution import PodResourcesClient, PodResourcesError

async def _first_call(path):
    client = PodResourcesClient(path, timeout=2.0)
    try:
        await client.list()
    except PodResourcesError as exc:  # nobody answers: the imports are what is measured
        state = str(exc.state)
    else:
        state = "ok"
    await client.close()
    return state

with tempfile.TemporaryDirectory() as tmp:
    # A bound socket that never listens: the file exists, so the client gets as far as gRPC.
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(tmp + "/kubelet.sock")
        state = asyncio.run(_first_call(tmp + "/kubelet.sock"))
_report(state=state, grpc="grpc" in sys.modules)
"""
)

REPO = Path(__file__).resolve().parents[1]

_SITE_EXTENSION = re.compile(r"/(?:site|dist)-packages/([^/]+)/\S*\.so")


def extension_packages(maps: str) -> list[str]:
    """The site-packages top-level names with a native extension mapped (``grpc``, ``yaml``, …)."""
    return sorted({m.group(1) for m in _SITE_EXTENSION.finditer(maps)})


def child_options(scratch: Path) -> dict[str, Any]:
    """Where children run and with what ``PYTHONPATH``: see the module's docstring.

    Not the current directory: ``python -c`` and ``-m`` put it first on ``sys.path``,
    ahead of ``PYTHONPATH``, so the checkout the command is run from would always win.
    """
    return {"cwd": scratch, "env": {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(REPO)}}


def run_child(code: str, scratch: Path) -> dict[str, Any]:
    """Run ``python -c code``; its report (RSS in KiB, mapped files, extras)."""
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, **child_options(scratch)
    )
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


class _Sink(BaseHTTPRequestHandler):
    """An operator that accepts every report: the sender then runs as it does in a cluster."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(length)
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line a second per agent would bury the figures."""


@contextmanager
def operator_sink() -> Iterator[str]:
    """A local report endpoint in a thread; its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/reports"
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def run_agent(args: argparse.Namespace, operator_url: str, scratch: Path) -> dict[str, Any]:
    """``gpuwarden agent --backend scripted`` for ``args.seconds`` after ready; its RSS and maps then."""
    port = _free_port()
    # A file named relative to where this was started, not to the child's scratch directory.
    scenario = Path(args.scenario).resolve() if Path(args.scenario).exists() else args.scenario
    argv = [
        sys.executable,
        "-m",
        "gpuwarden",
        "agent",
        "--backend=scripted",
        f"--scenario={scenario}",
        "--node-name=bench",
        f"--operator-url={operator_url}",
        f"--token-file={scratch / 'token'}",
        f"--listen=127.0.0.1:{port}",
        f"--sample-interval={args.sample_interval}",
        "--log-level=warning",
        "--hook-socket=",  # no training hooks here
    ]
    child = subprocess.Popen(argv, **child_options(scratch))
    metrics = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 60
        while True:  # a harness, not a test: polling readiness is fine here
            if child.poll() is not None:
                raise RuntimeError(f"the agent exited with {child.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the agent was not ready within 60 s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        end = time.monotonic() + args.seconds
        scrapes = 0
        while time.monotonic() < end:
            with urllib.request.urlopen(metrics, timeout=5) as response:
                body = response.read().decode()
            scrapes += 1
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        rss_kib = _status_kib(child.pid, "VmRSS")
        hwm_kib = _status_kib(child.pid, "VmHWM")
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    samples = [float(m) for m in re.findall(r"^gpuwarden_agent_samples_total\S* (\S+)$", body, re.M)]
    return {
        "rss_kib": rss_kib,
        "peak_kib": hwm_kib,
        "maps": maps,
        "samples": samples[0] if samples else None,
        "scrapes": scrapes,
        "exit_code": code,
    }


def main() -> int:
    """Measure every row ``--rounds`` times, interleaved; print the table (and ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each row (3)")
    parser.add_argument("--seconds", type=float, default=10.0, help="agent run time after ready (10)")
    parser.add_argument("--scenario", default="e2e-fast", help="scenario of the scripted agent (e2e-fast)")
    parser.add_argument("--sample-interval", default="1s", help="the agent's --sample-interval (1s)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    rows: dict[str, str] = {
        "bare python": BARE,
        "import gpuwarden.agent.command": IMPORTS,
        "imports + kubelet client (nvml path, before NVML)": KUBELET,
    }
    agent_row = f"agent, scripted, after {args.seconds:g} s"
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in [*rows, agent_row]}
    with tempfile.TemporaryDirectory() as tmp, operator_sink() as url:
        scratch = Path(tmp)
        (scratch / "token").write_text("bench\n")
        for _ in range(args.rounds):
            for name, code in rows.items():
                results[name].append(run_child(code, scratch))
            results[agent_row].append(run_agent(args, url, scratch))

    source = results["import gpuwarden.agent.command"][0].get("source", "?")
    print(f"gpuwarden from {Path(source).parent}; Python {sys.version.split()[0]}; {args.rounds} rounds")
    bare = statistics.median(r["rss_kib"] for r in results["bare python"]) / 1024
    width = max(len(name) for name in results)
    print(f"{'':{width}}  {'RSS MiB':>8}  {'x bare':>6}  {'+ MiB':>6}  native extensions mapped")
    summary: dict[str, Any] = {"source": source, "python": sys.version.split()[0], "rows": {}}
    for name, runs in results.items():
        mib = statistics.median(r["rss_kib"] for r in runs) / 1024
        packages = extension_packages(runs[-1]["maps"])
        mapped = ", ".join(packages) or "-"
        print(f"{name:{width}}  {mib:8.1f}  {mib / bare:6.2f}  {mib - bare:+6.1f}  {mapped}")
        extras = {k: v for k, v in runs[-1].items() if k not in ("rss_kib", "maps", "source")}
        summary["rows"][name] = {
            "rss_mib": round(mib, 1),
            "ratio_to_bare": round(mib / bare, 2),
            "rss_mib_each": [round(r["rss_kib"] / 1024, 1) for r in runs],
            "extensions": packages,
            **extras,
        }
    for name in (agent_row, "imports + kubelet client (nvml path, before NVML)"):
        extras = {k: v for k, v in summary["rows"][name].items() if k not in ("rss_mib", "ratio_to_bare")}
        print(f"  {name}: {json.dumps({k: v for k, v in extras.items() if k != 'extensions'})}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

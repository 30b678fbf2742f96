"""`gpuwarden agent`: flags, the refusal to fall back from NVML, and a whole agent run on a scenario."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden import cli
from gpuwarden.agent import app, command
from gpuwarden.agent.backend import BackendError
from gpuwarden.agent.config import AgentConfig, UsageError, parse_listen
from gpuwarden.wire.node import parse_report


class BrokenNvml:
    name = "nvml"

    def __init__(self, **kwargs: Any) -> None:
        pass

    def open(self) -> None:
        raise BackendError("NVML failed to initialise: NVML Shared Library Not Found")


def test_nvml_failing_exits_non_zero_and_names_the_scripted_backend(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "NvmlBackend", BrokenNvml)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["agent", "--listen", "127.0.0.1:0", "--node-name", "n"]) == 1
    err = capsys.readouterr().err
    assert "NVML failed to initialise" in err
    assert "--backend scripted --scenario FILE" in err


def test_in_a_pod_nvml_failing_names_the_chart_values_that_give_the_agent_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "NvmlBackend", BrokenNvml)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # what the kubelet sets in every pod
    assert cli.main(["agent", "--listen", "127.0.0.1:0", "--node-name", "n"]) == 1
    err = capsys.readouterr().err
    assert "NVML failed to initialise" in err
    assert "--backend scripted" not in err  # no help inside a pod
    for value in (
        "agent.runtimeClassName=nvidia",
        "agent.gpuAccess.mode=cdi",
        "agent.gpuAccess.mode=privileged",
        "agent.gpuAccess.driverHostPath=/home/kubernetes/bin/nvidia",
    ):
        assert value in err
    assert "docs/install.md#where-the-agent-sees-no-gpu" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "scripted"], "--backend scripted needs --scenario"),
        (["--scenario", "demo"], "--scenario only applies to --backend scripted"),
        (["--attribution", "scenario"], "--attribution scenario needs --backend scripted"),
        (["--operator-url", "http://op/v1/reports"], "needs --node-name"),
        (["--backend", "scripted", "--scenario", "demo", "--listen", "9400"], "expected \\[HOST\\]:PORT"),
        (
            ["--node-name", "n", "--operator-url", "http://op/v1/reports", "--operator-ca-file", "/ca.crt"],
            "--operator-ca-file needs an https:// --operator-url",
        ),
        (
            ["--node-name", "n", "--operator-url", "http://op/v1/reports", "--operator-server-name", "op"],
            "--operator-server-name needs an https:// --operator-url",
        ),
        (
            ["--node-name", "n", "--operator-url", "https://op/v1/reports", "--operator-ca-file", "/nope"],
            "--operator-ca-file /nope: no such file",
        ),
    ],
)
def test_bad_flag_combinations_exit_2(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert cli.main(["agent", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_missing_scenario_file_is_a_backend_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["agent", "--backend", "scripted", "--scenario", str(tmp_path / "nope.yaml"), "--node-name", "n"]
    assert cli.main(argv) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "attribution", "attributor"),
    [
        (["--backend", "scripted", "--scenario", "demo"], "scenario", "ScenarioAttributor"),
        (
            ["--backend", "scripted", "--scenario", "demo", "--attribution", "kubelet"],
            "kubelet",
            "PodAttributor",
        ),
        ([], "kubelet", "PodAttributor"),
    ],
)
def test_pods_come_from_the_scenario_only_when_scripted_and_not_told_otherwise(
    argv: list[str], attribution: str, attributor: str, tmp_path: Path
) -> None:
    """A scripted backend on a real node (the chart's e2e) attributes its GPUs through the kubelet."""
    args = cli.build_parser(["agent"]).parse_args(
        ["agent", *argv, "--node-name", "n", f"--pod-resources-socket={tmp_path / 'kubelet.sock'}"]
    )
    config = AgentConfig.from_args(args)
    assert config.attribution == attribution
    backend = command.open_backend(config) if config.backend == "scripted" else BrokenNvml()
    chosen = app._attributor(config, backend, app._clients(config))  # type: ignore[arg-type]
    assert type(chosen).__name__ == attributor


@pytest.mark.parametrize(
    ("text", "expected"),
    [(":9400", (None, 9400)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9400", ("::1", 9400))],
)
def test_parse_listen(text: str, expected: tuple[str | None, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["9400", "host:", ":99999", ":http"])
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_listen(text)


def test_durations_are_policy_style() -> None:
    parser = cli.build_parser(["agent"])
    args = parser.parse_args(["agent", "--sample-interval", "100ms", "--process-interval", "1m"])
    assert (args.sample_interval, args.process_interval) == (0.1, 60.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--sample-interval", "0s"])


def test_by_default_each_sample_may_be_reported_as_soon_as_it_is_taken() -> None:
    """--report-interval is the least time between reports: under the sampling period, no sample waits."""
    args = cli.build_parser(["agent"]).parse_args(["agent"])
    assert args.report_interval < args.sample_interval
    config = AgentConfig.from_args(
        cli.build_parser(["agent"]).parse_args(["agent", "--report-interval", "250ms", "--node-name", "n"])
    )
    assert config.report_interval == 0.25


def test_the_hook_socket_is_the_environments_by_default_and_empty_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def hook_socket(*argv: str) -> Path | None:
        args = cli.build_parser(["agent"]).parse_args(["agent", "--node-name=n", *argv])
        return AgentConfig.from_args(args).hook_socket

    monkeypatch.setenv("GPUWARDEN_HOOK_SOCKET", "/var/run/job/hook.sock")
    assert hook_socket() == Path("/var/run/job/hook.sock")
    assert hook_socket("--hook-socket=/x/h.sock") == Path("/x/h.sock")
    assert hook_socket("--hook-socket=") is None
    monkeypatch.delenv("GPUWARDEN_HOOK_SOCKET")
    assert hook_socket() == Path("/run/gpuwarden/hook.sock")


def test_importing_the_agent_loads_neither_grpc_nor_the_scenario_machinery() -> None:
    # ~13 MiB of the agent's resident memory (docs/benchmarks.md, "Agent memory (imports)"):
    # gRPC loads on the first PodResources call, the scenario models and YAML with
    # --backend scripted. A fresh interpreter, because this one has loaded them for other tests.
    code = (
        "import sys, gpuwarden.agent.command; "
        "print(' '.join(m for m in ('grpc', 'google.protobuf', 'yaml', 'gpuwarden.sim.scenario', "
        "'gpuwarden.agent.scripted', 'kubernetes') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert done.stdout.split() == []


async def test_the_agent_runs_a_scenario_reports_serves_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    """A real agent process: scripted GPUs in, reports and /metrics out, SIGTERM → exit 0."""
    token = tmp_path / "token"
    token.write_text("test-token\n")
    reports: list[dict[str, Any]] = []
    reported = asyncio.Event()

    async def ingest(request: web.Request) -> web.Response:
        body = await request.read()
        parse_report(body)  # the operator's own validation
        assert request.headers["Authorization"] == "Bearer test-token"
        reports.append(json.loads(body))
        reported.set()
        return web.json_response({"accepted": True})

    operator = web.Application()
    operator.router.add_post("/v1/reports", ingest)
    async with TestServer(operator) as server, asyncio.timeout(60):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuwarden",
            "agent",
            "--backend=scripted",
            "--scenario=e2e-fast",
            "--node-name=gpu-node-1",
            f"--operator-url={server.make_url('/v1/reports')}",
            f"--token-file={token}",
            "--listen=127.0.0.1:0",
            "--report-interval=200ms",
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None
        log: list[str] = []
        try:
            while not (match := re.search(r"listening on (\S+);", log[-1] if log else "")):
                line = await process.stderr.readline()
                assert line, "agent exited early:\n" + "".join(log)
                log.append(line.decode())
            address = match.group(1)
            await reported.wait()

            first = reports[0]
            assert first["node"] == "gpu-node-1"
            gpus = first["snapshots"][0]["gpus"]
            assert [g["pods"][0]["name"] for g in gpus] == [
                "notebook-idle-0",
                "llm-finetune-0",
                "vision-train-0",
                "llm-server-7d9f8b6c4-x2x7q",
            ]
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://{address}/readyz") as response:
                    assert response.status == 200
                async with http.get(f"http://{address}/metrics") as response:
                    body = await response.text()
            assert 'gpuwarden_gpu_up{container="server"' in body
            assert "gpuwarden_agent_reports_sent_total" in body
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            rest = await process.stderr.read()
            code = await process.wait()
        log.append(rest.decode())
    assert code == 0, "".join(log)
    assert "stopped" in log[-1]


HOOK_GPU = "GPU-0d3f5a1e-7c21-4b8e-9a0f-3e1d2c4b5a60"

# A stand-in for gpuwarden.hook, stdlib only: for each line on stdin, one protocol line on the socket
# (connected at the first, once the test has seen the agent listen).
HOOK_CLIENT = f"""
import json, socket, sys, time
sock = socket.socket(socket.AF_UNIX)
for step, _ in enumerate(sys.stdin):
    if step == 0:
        sock.connect(sys.argv[1])
    site = {{"file": "train.py", "line": 88, "sizeBytes": 1 << 20, "growthBytes": 1 << 20, "count": 9}}
    message = {{
        "v": 1, "timestamp": time.time(), "step": step,
        "devices": [{{"uuid": "{HOOK_GPU}", "allocatedBytes": 3 << 30, "reservedBytes": 4 << 30}}],
        "hostRssBytes": 2 << 30,
        "sites": [site],
    }}
    sock.sendall(json.dumps(message).encode() + b"\\n")
    print("sent", flush=True)
"""


def hook_scenario(pid: int) -> dict[str, Any]:
    """One GPU, one pod whose process is ``pid``: a real process, so that it can speak on the socket."""
    return {
        "name": "hooked",
        "duration": "10m",
        "gpus": [
            {
                "uuid": HOOK_GPU,
                "memoryTotal": "80Gi",
                "utilization": [{"kind": "idle", "level": 60}],
                "memory": [{"kind": "idle", "level": "5Gi"}],
            }
        ],
        "pods": [
            {
                "namespace": "training",
                "name": "trainer-0",
                "container": "main",
                "gpus": [HOOK_GPU],
                "processes": [{"pid": pid, "command": "python train.py"}],
            }
        ],
    }


async def test_a_hooked_process_is_in_the_reports_and_on_metrics(tmp_path: Path, socket_dir: Path) -> None:
    """The real agent, a scripted GPU whose process is a real one, that process writing to --hook-socket."""
    hook_socket = socket_dir / "hook.sock"
    token = tmp_path / "token"
    token.write_text("t\n")
    reports: list[dict[str, Any]] = []
    reported = asyncio.Event()

    async def ingest(request: web.Request) -> web.Response:
        body = await request.read()
        parse_report(body)
        reports.append(json.loads(body))
        reported.set()
        return web.json_response({"accepted": True})

    def hooks_of(pid: int) -> list[dict[str, Any]]:
        return [
            p["hook"]
            for r in reports
            for s in r["snapshots"]
            for g in s["gpus"]
            for p in g["processes"]
            if p["pid"] == pid and "hook" in p
        ]

    operator = web.Application()
    operator.router.add_post("/v1/reports", ingest)
    client = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", HOOK_CLIENT, str(hook_socket)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert client.stdin is not None
    assert client.stdout is not None
    scenario = tmp_path / "hooked.yaml"
    scenario.write_text(yaml.safe_dump(hook_scenario(client.pid)))
    async with TestServer(operator) as server, asyncio.timeout(60):
        agent = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gpuwarden", "agent", "--backend=scripted", f"--scenario={scenario}"),
            *("--node-name=gpu-node-1", f"--operator-url={server.make_url('/v1/reports')}"),
            *(f"--token-file={token}", "--listen=127.0.0.1:0", "--sample-interval=200ms"),
            *("--report-interval=100ms", f"--hook-socket={hook_socket}"),
            stderr=asyncio.subprocess.PIPE,
        )
        assert agent.stderr is not None
        log: list[str] = []
        try:
            while not (match := re.search(r"listening on (\S+);", log[-1] if log else "")):
                line = await agent.stderr.readline()
                assert line, "agent exited early:\n" + "".join(log)
                log.append(line.decode())
            address = match.group(1)
            assert any(f"training hooks connect to {hook_socket}" in line for line in log)
            # The test process speaks too: it has no GPU, so its message is refused.
            _, own = await asyncio.open_unix_connection(str(hook_socket))
            own.write(json.dumps({"v": 1, "timestamp": time.time()}).encode() + b"\n")
            client.stdin.write(b"go\n")
            assert await client.stdout.readline() == b"sent\n"
            while not hooks_of(client.pid):
                reported.clear()
                await reported.wait()
            hook = hooks_of(client.pid)[0]
            assert hook["allocatedBytes"] == 3 * 2**30
            assert hook["reservedBytes"] == 4 * 2**30
            assert hook["hostRssBytes"] == 2 * 2**30
            assert hook["step"] == 0
            assert hook["sites"] == [
                {"file": "train.py", "line": 88, "sizeBytes": 2**20, "growthBytes": 2**20, "count": 9}
            ]
            assert hooks_of(os.getpid()) == []

            async def scrape() -> str:
                async with aiohttp.ClientSession() as http, http.get(f"http://{address}/metrics") as response:
                    return await response.text()

            body = await scrape()
            allocated = [
                (s.labels, s.value)
                for family in text_string_to_metric_families(body)
                for s in family.samples
                if s.name == "gpuwarden_process_gpu_memory_allocated_bytes"
            ]
            assert allocated == [
                (
                    {
                        "uuid": HOOK_GPU,
                        "index": "0",
                        "model": "NVIDIA H200",
                        "mig_id": "",
                        "pid": str(client.pid),
                        "namespace": "training",
                        "pod": "trainer-0",
                        "container": "main",
                    },
                    3 * 2**30,
                )
            ]
            assert "gpuwarden_agent_hook_processes 1.0" in body
            while 'gpuwarden_agent_hook_refused_total{reason="unknownProcess"} 1.0' not in body:
                reported.clear()
                await reported.wait()  # a snapshot after the test's own message: it judges it
                body = await scrape()
            assert "gpuwarden_agent_hook_messages_total 2.0" in body
            own.close()
        finally:
            client.stdin.close()
            await client.wait()
            if agent.returncode is None:
                agent.send_signal(signal.SIGTERM)
            rest = await agent.stderr.read()
            code = await agent.wait()
        log.append(rest.decode())
    assert code == 0, "".join(log)
    assert not hook_socket.exists()  # removed on the way out

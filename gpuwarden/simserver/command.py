"""``gpuwarden sim-server``: one simulated inference replica behind real HTTP, until SIGTERM/SIGINT.

The flags are the model's (:class:`~gpuwarden.sim.replica.ReplicaConfig`), named as vLLM's where
vLLM has one (``--max-num-seqs``, ``--served-model-name``, port 8000), so that a test can saturate
one replica with a few concurrent requests: ``--max-num-seqs 1 --token-time 50ms`` serves one
request at a time, each ``max_tokens`` x 50 ms.

Exit codes: 0 stopped by SIGTERM or SIGINT; 1 cannot listen; 2 bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from gpuwarden.agent.config import UsageError, duration, parse_listen
from gpuwarden.agent.http import address_text
from gpuwarden.serving import ConnectionLimiter, connection_cap, raise_fd_limit, serve
from gpuwarden.sim.replica import ReplicaConfig
from gpuwarden.simserver.server import MetricsFault, SimServer, build_app

log = logging.getLogger("gpuwarden.simserver")

DEFAULT_LISTEN = ":8000"
"""vLLM's port."""
MAX_CONNECTIONS = 4096
"""Connections open at once: a load generator's concurrency, with room."""
REQUEST_TIMEOUT = 3600.0
"""Seconds a completion may take, waiting included: a saturated replica's queue is the point of it."""

_DEFAULTS = ReplicaConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add sim-server's flags."""
    parser.description = (
        "Serve one simulated inference replica (gpuwarden.sim.replica's queueing model) over HTTP, in "
        "real time: POST /v1/completions answered after the simulated latency, GET /metrics with "
        "histograms, gauges and a counter under vLLM's names and bucket bounds, GET /health."
    )
    add = parser.add_argument
    add("--listen", default=DEFAULT_LISTEN, metavar="[HOST]:PORT", help=f"address ({DEFAULT_LISTEN})")
    add("--served-model-name", default="sim-llm", metavar="NAME", help="the model_name label (sim-llm)")
    add(
        "--max-num-seqs",
        type=_at_least_one,
        default=_DEFAULTS.max_batch,
        metavar="N",
        help=f"requests served at once; the rest wait ({_DEFAULTS.max_batch})",
    )
    add(
        "--prefill-time",
        type=duration,
        default=_DEFAULTS.prefill_seconds,
        metavar="DURATION",
        help=f"time to first token of a request served alone ({_DEFAULTS.prefill_seconds * 1000:g}ms)",
    )
    add(
        "--token-time",
        type=duration,
        default=_DEFAULTS.token_seconds,
        metavar="DURATION",
        help=f"time between output tokens of a request served alone ({_DEFAULTS.token_seconds * 1000:g}ms)",
    )
    add(
        "--batch-slowdown",
        type=_not_negative,
        default=_DEFAULTS.batch_slowdown,
        metavar="X",
        help="how much slower a full batch serves than one request, on prefill and tokens "
        f"({_DEFAULTS.batch_slowdown:g}: {_DEFAULTS.batch_slowdown * 100:g}%% slower)",
    )
    add(
        "--mean-output-tokens",
        type=_at_least_one,
        default=_DEFAULTS.mean_output_tokens,
        metavar="N",
        help=f"output tokens of a request without max_tokens, on average ({_DEFAULTS.mean_output_tokens})",
    )
    add("--seed", type=int, default=0, help="seed of the token counts drawn for requests that give none (0)")
    add(
        "--metrics-fault",
        choices=[f.value for f in MetricsFault],
        help="make /metrics misbehave, for testing a scraper: hang (never answer), huge (10 MiB), "
        "not-prometheus (an HTML page)",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _not_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number, zero or more")
    return value


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the process's exit code."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        host, port = parse_listen(args.listen)
    except UsageError as exc:
        print(f"gpuwarden sim-server: {exc}", file=sys.stderr)
        return 2
    config = ReplicaConfig(
        max_batch=args.max_num_seqs,
        prefill_seconds=args.prefill_time,
        token_seconds=args.token_time,
        batch_slowdown=args.batch_slowdown,
        mean_output_tokens=args.mean_output_tokens,
    )
    server = SimServer(config, model=args.served_model_name, seed=args.seed)
    fault = MetricsFault(args.metrics_fault) if args.metrics_fault else None
    return asyncio.run(_serve(server, fault, host, port))


async def _serve(server: SimServer, fault: MetricsFault | None, host: str | None, port: int) -> int:
    limiter = ConnectionLimiter(connection_cap(raise_fd_limit(), MAX_CONNECTIONS))
    try:
        runner = await serve(
            build_app(server, fault=fault), host, port, limiter=limiter, request_timeout=REQUEST_TIMEOUT
        )
    except OSError as exc:
        print(f"gpuwarden sim-server: cannot listen on {host or ''}:{port}: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    config = server.replica.config
    log.info(
        "%s listening on %s; %d served at once, prefill %gs, %gs a token%s",
        server.model,
        ", ".join(address_text(a) for a in runner.addresses),
        config.max_batch,
        config.prefill_seconds,
        config.token_seconds,
        f", /metrics fault {fault.value}" if fault else "",
    )
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await runner.cleanup()
    return 0

"""The `gpuwarden` command: one entry point, one subcommand per component.

Each subcommand lives next to the code it runs, as a module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

from gpuwarden import __version__

# subcommand -> (module, one-line help). Modules are imported lazily so that
# `gpuwarden --version` does not pay for Kopf or NVML imports.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("gpuwarden.agent.command", "run the node agent (NVML sampling, /metrics, reports)"),
    "operator": ("gpuwarden.operator.command", "run the Kopf operator (ingestion, evaluation, events)"),
    "demo": ("gpuwarden.local.demo", "play the scripted eight-GPU scenario through the engine"),
    "watch": ("gpuwarden.local.watch", "watch this host's GPUs with a policy file, no Kubernetes"),
    "snapshot": (
        "gpuwarden.agent.hookcontrol",
        "ask a hooked training process for a GPU memory snapshot now",
    ),
    "sim-server": ("gpuwarden.simserver.command", "serve a simulated inference replica (vLLM's metrics)"),
    "check": (
        "gpuwarden.operator.check",
        "check an install: agents sampling and reporting, policies evaluated",
    ),
    "report": (
        "gpuwarden.operator.accounting.command",
        "GPU-hours allocated, used and idle by namespace and workload",
    ),
    "restore": ("gpuwarden.operator.reclaim.restore", "undo a reclaim: put an idle workload's replicas back"),
}


class Subcommand(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Build the parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="gpuwarden", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = cast(Subcommand, importlib.import_module(module_name))
            module.add_arguments(sp)
            sp.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `gpuwarden` command and return its exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_list).parse_args(args_list)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())

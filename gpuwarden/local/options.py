"""What ``demo`` and ``watch`` share on the command line: flag types, the display choice, errors.

Durations, ``[HOST]:PORT`` and the usage error are the agent's own (:mod:`gpuwarden.agent.config`),
so that the same flag reads the same in every command. Importing the agent's command module
loads neither gRPC nor the scenario machinery (a unit test holds it to that): ~30 ms and ~1.3 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Protocol, TextIO

from gpuwarden.agent.config import UsageError, duration, parse_listen
from gpuwarden.local.rows import Step

__all__ = [
    "EXIT_BROKEN_PIPE",
    "Display",
    "UsageError",
    "broken_pipe",
    "duration",
    "parse_listen",
    "positive_float",
    "wants_live_display",
]


class Display(Protocol):
    """What the run loop needs of a display (:class:`~gpuwarden.local.display.LiveDisplay` or plain)."""

    def show(self, step: Step, title: str = "") -> None:
        """Show one step."""

    def note(self, text: str) -> None:
        """Show a line of the caller's."""

    def close(self) -> None:
        """Finish (leave the final table on screen, restore the cursor)."""


def positive_float(text: str) -> float:
    """An argparse type: a number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above zero")
    return value


def wants_live_display(out: TextIO, *, plain: bool) -> bool:
    """The live table only on a terminal that can redraw (not ``TERM=dumb``), unless ``--plain``."""
    return not plain and out.isatty() and os.environ.get("TERM", "") != "dumb"


EXIT_BROKEN_PIPE = 141
"""What a shell reports for a process killed by SIGPIPE (128 + 13): ``gpuwarden demo | head``."""


def broken_pipe() -> int:
    """The reader of stdout went away: silence the interpreter's final flush, exit as SIGPIPE would."""
    # Python's docs recommend this: point stdout at /dev/null so the flush at exit cannot fail again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE

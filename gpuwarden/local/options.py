"""What ``demo`` and ``watch`` share on the command line: flag types, the display choice, errors."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Protocol, TextIO

from gpuwarden.local.session import Step
from gpuwarden.policy.units import parse_duration


class UsageError(ValueError):
    """A flag or file that makes no sense; the message says which and why (exit code 2)."""


class Display(Protocol):
    """What the run loop needs of a display (:class:`~gpuwarden.local.display.LiveDisplay` or plain)."""

    def show(self, step: Step, title: str = "") -> None:
        """Show one step."""

    def note(self, text: str) -> None:
        """Show a line of the caller's."""

    def close(self) -> None:
        """Finish (leave the final table on screen, restore the cursor)."""


def duration(text: str) -> float:
    """An argparse type: a policy-style duration (``1s``, ``500ms``, ``2m``), longer than zero."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be longer than zero")
    return seconds


def positive_float(text: str) -> float:
    """An argparse type: a number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above zero")
    return value


def parse_listen(text: str) -> tuple[str | None, int]:
    """``:9400`` (every interface), ``127.0.0.1:9400`` or ``[::1]:9400`` -> (host or None, port).

    The agent's syntax (``gpuwarden agent --listen``), parsed here rather than imported:
    the agent's command module pulls in the kubelet client (gRPC), which watch never needs.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen {text!r}: expected [HOST]:PORT, e.g. :9400 or 127.0.0.1:9400")
    host = host.removeprefix("[").removesuffix("]")
    return (host or None), int(port)


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

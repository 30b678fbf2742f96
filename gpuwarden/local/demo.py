"""Placeholder: filled in by its issue."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this subcommand's flags."""


def run(args: argparse.Namespace) -> int:
    """Not built yet."""
    print("not implemented yet")
    return 2

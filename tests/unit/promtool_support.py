"""Prometheus' own tool for the unit tests that check an exposition, a rule or a query with it."""

from __future__ import annotations

import os
import shutil

import pytest


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing; CI must have it (Debian: apt-get install prometheus)")
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path

"""Shared by the unit tests: no test's agent or watch touches the host's hook socket; property tests
are derandomized in CI."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# In CI the property tests draw the same examples every run (Hypothesis's advice for CI): a red run
# is then the change's, reproducible, not a new draw's. On a developer's machine they keep exploring
# new examples: that is how a false positive of memoryGrowth's urgent spans was found (seed 38354, now
# an @example in test_growth_shapes.py; docs/policy.md, "Urgency").
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A fresh directory with a short path: a Unix socket's path must stay under 108 bytes, and
    pytest's ``tmp_path`` can be longer."""
    path = Path(tempfile.mkdtemp(prefix="gw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _hook_socket_of_the_test(socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The agent and watch listen on $GPUWARDEN_HOOK_SOCKET by default (else /run/gpuwarden/hook.sock):
    # each test's, and its subprocesses', in a directory of its own.
    monkeypatch.setenv("GPUWARDEN_HOOK_SOCKET", str(socket_dir / "hook.sock"))

"""Host RSS from /proc: a child that holds memory counts in its parent's tree."""

from __future__ import annotations

import os
import subprocess
import sys

from gpuwarden.hook import tree_rss_bytes
from gpuwarden.hook.host_memory import descendants

HELD = 64 * 2**20

CHILD = f"""
import sys
held = b"x" * {HELD}  # written, so resident
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_child_holding_memory_counts_in_the_tree() -> None:
    before = tree_rss_bytes()
    assert before is not None
    assert before > 0
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        assert child.pid in descendants(os.getpid())
        after = tree_rss_bytes()
        assert after is not None
        assert after - before >= HELD
    finally:
        child.kill()
        child.wait()


def test_no_such_process_reads_none() -> None:
    assert tree_rss_bytes(pid=2**31 - 2) is None

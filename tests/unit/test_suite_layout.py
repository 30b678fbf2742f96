"""The test tree itself: pytest imports test modules by basename (no packages), so one name in two
folders stops the whole run at collection, as tests/unit/test_operator_shards.py once did beside
its integration namesake; and a support module imported by name (``operator_fakes``) from a folder
on the path would shadow its namesake in another."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_modules_share_a_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    shared = {name: n for name, n in names.items() if n > 1}
    assert shared == {}, f"modules with the same name in two folders: {sorted(shared)}"

"""The test tree itself: pytest imports test modules by basename (no packages), so one name in two
folders stops the whole run at collection, as tests/unit/test_operator_shards.py once did beside
its integration namesake; and a support module imported by name (``operator_fakes``) from a folder
on the path would shadow its namesake in another.

The unit tests mirror the repository, so that a module's tests are found where the module is: a test
of ``gpuwarden/<room>/...`` lives in ``tests/unit/<room>/...``, one of another folder of the repository
(``charts/``) in ``tests/unit/charts/``, and only a test of a top-level module (``gpuwarden/serving.py``:
``test_serving*.py``) or a check of the whole repository sits in ``tests/unit/`` itself. A support
module sits in ``tests/unit/`` only when tests of more than one folder import it (the folder's
conftest puts ``tests/unit/`` on the path; a folder of its own is on it only while its tests run)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
UNIT = TESTS / "unit"
ROOT = TESTS.parent
PACKAGE = ROOT / "gpuwarden"

# Flat test files that test no one room, each with why.
REPOSITORY_WIDE = {
    "test_doc_links.py": "every Markdown file's links, and the code's links to the docs",
    "test_suite_layout.py": "the test tree itself",
    # The CRD (crds/) held to the policy parser; its room is tests/unit/crds/, where it moves once the
    # CRD's schema and the parser have one source (issue 43, item 4): the CRD's header and the parser
    # name this path today.
    "test_crd_schema.py": "the CRD against the policy parser",
}


def test_no_two_modules_share_a_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    shared = {name: n for name, n in names.items() if n > 1}
    assert shared == {}, f"modules with the same name in two folders: {sorted(shared)}"


def _mirrors(folder: Path) -> bool:
    """Whether a folder under tests/unit names a room of the package or another folder of the repository."""
    if (PACKAGE / folder).is_dir():
        return True
    return folder.parts[0] not in {"gpuwarden", "tests"} and (ROOT / folder).is_dir()


def test_every_unit_test_sits_in_the_folder_of_what_it_tests() -> None:
    top_modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    misplaced = []
    for path in sorted(UNIT.rglob("test_*.py")):
        folder = path.parent.relative_to(UNIT)
        if folder.parts:
            if not _mirrors(folder):
                misplaced.append(f"{path.relative_to(UNIT)}: no gpuwarden/{folder}/ nor {folder}/")
        elif path.name not in REPOSITORY_WIDE and not any(
            path.stem == f"test_{module}" or path.stem.startswith(f"test_{module}_") for module in top_modules
        ):
            modules = ", ".join(sorted(top_modules))
            misplaced.append(f"{path.name}: flat, but names no top-level module ({modules})")
    assert misplaced == []


def test_a_support_module_at_the_top_is_shared_by_more_than_one_folder() -> None:
    sources = {path: path.read_text() for path in UNIT.rglob("*.py")}
    lonely = []
    for support in sorted(UNIT.glob("*.py")):
        if support.name == "conftest.py" or support.name.startswith("test_"):
            continue
        importing = re.compile(rf"^(?:from {support.stem} import|import {support.stem}\b)", re.M)
        folders = {p.parent for p, text in sources.items() if p != support and importing.search(text)}
        if len(folders) < 2:
            where = sorted(str(f.relative_to(UNIT)) for f in folders)
            lonely.append(f"{support.name}: imported from {where}")
    assert lonely == []

"""Every relative link in README.md, docs/ and charts/*/README.md points at a file that exists, and every
``#anchor`` at a heading (or an explicit ``<a id=...>``/``<a name=...>``) of its target, slugged as
GitHub slugs headings: lower-cased, punctuation but ``-`` and ``_`` dropped, each space a ``-``, and
``-1``, ``-2``... after repeats. Links inside code (fenced blocks and backticks) are not links."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "charts").glob("*/README.md")],
)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
# [text](target) and [text](target "title"); images too. Reference definitions: [label]: target.
_INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
_EXPLICIT = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


def _prose(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger): markup gone, then its rules."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[*_~](?=\S)|(?<=\S)[*_~]", lambda m: m.group(0) if m.group(0) == "_" else "", text)
    kept = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = _FENCE.sub("", path.read_text())
    seen: Counter[str] = Counter()
    found = set(_EXPLICIT.findall(text))
    for _, heading in _HEADING.findall(text):
        base = slug(heading)
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return frozenset(found)


def links(path: Path) -> list[str]:
    text = _prose(path.read_text())
    return _INLINE.findall(text) + _REFERENCE.findall(text)


def test_slugs_follow_github() -> None:
    assert slug("Install: from zero to an Event") == "install-from-zero-to-an-event"
    assert slug("`gpuwarden --version` and `helm test`") == "gpuwarden---version-and-helm-test"
    assert slug("Readiness (fresh samples)") == "readiness-fresh-samples"
    assert slug("GKE (COS/Ubuntu) & EKS") == "gke-cosubuntu--eks"
    assert slug("The [chart](charts/x.md)'s values_x") == "the-charts-values_x"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(file_part)).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == []


_REPO_URL = re.compile(r"https://github\.com/gpuwarden/gpuwarden/blob/main/([\w./-]+)(?:#([\w-]+))?")


def test_links_from_the_code_and_the_chart_to_the_docs_resolve() -> None:
    """What the agent prints (its no-GPU hint) and the chart's notes link to this repository's docs."""
    sources = [*(ROOT / "gpuwarden").rglob("*.py"), *(ROOT / "charts").rglob("*.txt")]
    found = [(p, m) for p in sources for m in _REPO_URL.finditer(p.read_text())]
    assert found, "no link to the docs found"
    broken = []
    for source, match in found:
        path, anchor = ROOT / match.group(1), match.group(2)
        if not path.exists() or (anchor and anchor not in anchors(path)):
            broken.append(f"{source.relative_to(ROOT)}: {match.group(0)}")
    assert broken == []

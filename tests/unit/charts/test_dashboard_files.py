"""The chart's Grafana dashboards as files: every query parses as PromQL (promtool), panels do not
overlap, ids and refIds are unique, counters are read over a range. Whether each query returns its
data is tests/integration/test_dashboards.py's, against a real Prometheus."""

from __future__ import annotations

import json
import re
import subprocess
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import yaml
from promtool_support import promtool

DASHBOARDS = sorted(
    (Path(__file__).resolve().parents[3] / "charts" / "gpuwarden" / "dashboards").glob("*.json")
)
GRAFANA_VARIABLES = {
    "node": ".*",
    "namespace": ".*",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_parses(path: Path, tmp_path: Path) -> None:
    rules = []
    for panel in load(path)["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
            assert "$" not in expr, f"{panel['title']}: a variable the dashboard does not define: {expr}"
            rules.append({"record": f"panel:{panel['id']}:{target['refId']}", "expr": expr})
    file = tmp_path / "queries.yml"
    file.write_text(yaml.safe_dump({"groups": [{"name": path.stem, "rules": rules}]}))
    check = subprocess.run(
        [promtool(), "check", "rules", str(file)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_are_laid_out_without_overlap_and_named_once(path: Path) -> None:
    dashboard = load(path)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert len({p["title"] for p in panels}) == len(panels)
    for panel in panels:
        g = panel["gridPos"]
        assert 0 <= g["x"] < g["x"] + g["w"] <= 24, panel["title"]  # Grafana's grid is 24 wide
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    for a, b in combinations(panels, 2):
        ga, gb = a["gridPos"], b["gridPos"]
        apart = (
            ga["x"] + ga["w"] <= gb["x"]
            or gb["x"] + gb["w"] <= ga["x"]
            or ga["y"] + ga["h"] <= gb["y"]
            or gb["y"] + gb["h"] <= ga["y"]
        )
        assert apart, f"{a['title']!r} and {b['title']!r} overlap"
    # Every variable a query uses is defined (or Grafana's own).
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = {m for p in panels for t in p["targets"] for m in re.findall(r"\$\{?(\w+)", t["expr"])}
    assert used - defined <= {"__rate_interval", "__interval", "__range"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_counters_are_read_over_a_range_never_raw(path: Path) -> None:
    # A counter's raw value is what one operator process counted since it started (a restart zeroes
    # it, several replicas split it): only increase()/rate() over a range read it as a total.
    for panel in load(path)["panels"]:
        for target in panel["targets"]:
            for name, selector, window in re.findall(r"(\w+_total)\b(\{[^}]*\})?(\[)?", target["expr"]):
                assert window, f"{panel['title']}: {name}{selector} read without a range"

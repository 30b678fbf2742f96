"""gpuwarden's alerts (charts/gpuwarden/rules/gpuwarden-alerts.yaml), with Prometheus' own tool.

- ``promtool check rules`` accepts the file;
- ``promtool test rules`` passes test_alert_rules.yaml, whose input series make every alert fire (its
  labels and rendered annotations compared whole) and not fire (before its ``for``, for other
  reasons, for another job), and every alert has both kinds of case there;
- every alert has a severity, a ``for``, a summary, a description and a ``runbook_url`` at its own
  section of docs/alerts.md, which the chart's default ``runbookUrl`` also gives;
- every reason a finding can carry (the rule kinds' records, and the reasons an outcome names) is
  alerted on by exactly one finding alert, or is one of the anomaly reasons, which are not;
- the expressions select only the two scrape jobs the chart replaces with its own.

Rendering it as the chart's PrometheusRule: tests/integration/test_chart.py; firing for the real
operator's findings: tests/integration/test_alerts.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from promtool_support import promtool
from test_doc_links import anchors

from gpuwarden.policy.rules import RULE_TYPES
from gpuwarden.policy.rules.anomaly import Pattern
from gpuwarden.policy.rules.growth import model as growth

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "gpuwarden"
RULES = CHART / "rules" / "gpuwarden-alerts.yaml"
CASES = Path(__file__).with_suffix(".yaml")
RUNBOOKS = ROOT / "docs" / "alerts.md"
JOBS = {"gpuwarden-operator", "gpuwarden-agent"}
"""The scrape jobs the file selects, which the chart's template replaces with its release's."""
NOT_ALERTED = {"GPUAnomaly", *Pattern}
"""Finding reasons no alert fires on (an anomaly is a dashboard row and an Event, not a page)."""


def groups() -> dict[str, list[dict[str, Any]]]:
    return {g["name"]: g["rules"] for g in yaml.safe_load(RULES.read_text())["groups"]}


def alerts() -> list[dict[str, Any]]:
    return [rule for rules in groups().values() for rule in rules]


def names() -> list[str]:
    return [rule["alert"] for rule in alerts()]


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", CASES.name],
        cwd=CASES.parent,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(CASES.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    assert sorted(fires) == sorted(names())
    assert sorted(silent) == sorted(names())


def test_the_alert_names_are_unique() -> None:
    assert len(set(names())) == len(names())


@pytest.mark.parametrize("rule", alerts(), ids=lambda r: r["alert"])
def test_every_alert_has_a_severity_a_for_and_its_runbook(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in {"info", "warning", "critical"}
    assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", rule["for"]), rule["for"]
    assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
    base = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["prometheusRule"]["runbookUrl"]
    anchor = rule["alert"].lower()
    assert rule["annotations"]["runbook_url"] == base + anchor  # what the chart's default gives too
    assert base.endswith("/docs/alerts.md#")
    assert anchor in anchors(RUNBOOKS), f"no section {rule['alert']} in docs/alerts.md"


def test_the_runbooks_are_the_alerts() -> None:
    """One section a rule, no section for an alert that is gone."""
    headings = re.findall(r"^### (GPUWarden\w+)$", RUNBOOKS.read_text(), re.M)
    assert headings == names()


def finding_reasons() -> dict[str, set[str]]:
    """The reasons each alert on the findings fires on, from its expression."""
    out = {}
    for rule in groups()["gpuwarden-findings"]:
        assert "gpuwarden_finding_started_timestamp_seconds" in rule["expr"], rule["alert"]
        (pattern,) = re.findall(r'reason=~?"([^"]+)"', rule["expr"])
        out[rule["alert"]] = set(pattern.split("|"))
    return out


def test_every_finding_reason_is_alerted_on_once_or_said_not_to_be() -> None:
    # Every reason memoryGrowth can give is a constant of its model (its package exports only some).
    named = {value for name, value in vars(growth).items() if name.endswith("_REASON")}
    known = {t.reason for t in RULE_TYPES} | named | set(Pattern)
    alerted = finding_reasons()
    every = [reason for reasons in alerted.values() for reason in reasons]
    assert len(every) == len(set(every)), "a reason in two alerts"
    assert set(every) | NOT_ALERTED == known
    assert not set(every) & NOT_ALERTED


def test_the_expressions_select_only_the_jobs_the_chart_replaces() -> None:
    text = RULES.read_text()
    assert set(re.findall(r'job=~?"([^"]*)"', text)) == JOBS
    assert "job!" not in text

"""Least privilege that the docs can prove: every rendered RBAC rule against docs/deployment-contract.md.

The chart is rendered with the real helm in each mode (defaults, observe only, sharded, named namespaces,
every optional grant on, every optional grant off). Each rule is cut into atoms (role, API group,
resource, verb, by name or not) and held to the table "RBAC, rule by rule": a rendered atom that the
table does not list for that mode fails, and so does one the table lists for that mode that is not
rendered. A grant added to a template without a row therefore fails here; the last test adds one to a
rendering and checks that it is caught.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, Binaries

CHART = REPO_ROOT / "charts" / "gpuwarden"
CONTRACT = REPO_ROOT / "docs" / "deployment-contract.md"
RELEASE, NAMESPACE = "gpuwarden", "gpuwarden-system"
EXTRA_SCALE = {"apiGroups": ["argoproj.io"], "resources": ["rollouts/scale"]}

Atom = tuple[str, str, str, str, bool]
"""(role, API group, resource, verb, limited by name)."""

MODES: dict[str, list[str]] = {
    "defaults": [],
    "observe-only": ["--set", "rbac.observeOnly=true", "--set", "operator.nodeHealth.cordon.enabled=true"],
    "sharded": ["--set", "operator.sharding.enabled=true"],
    "named-namespaces": ["--set", "operator.watchNamespaces={ml,inference}"],
    "reclaim": ["--set", "operator.reclaim.enabled=true"],
    "everything-on": [
        "--set",
        "operator.nodeHealth.cordon.enabled=true",
        "--set",
        "operator.nodeHealth.cordon.dryRun=false",
        "--set",
        "operator.reclaim.enabled=true",
        "--set-json",
        f"operator.rbac.extraScaleTargets={json.dumps([EXTRA_SCALE])}",
    ],
    "everything-off": [
        "--set",
        "operator.nodeHealth.enabled=false",
        "--set",
        "accounting.followOwners=false",
        "--set",
        "agent.podList.enabled=false",
        "--set",
        "agent.dra.resourceSlices=false",
        "--set",
        "rbac.aggregateToDefaultRoles=false",
        "--set",
        "operator.watchNamespaces={ml}",
    ],
}


def render(helm: Path, args: Iterable[str]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def values_of(args: list[str]) -> dict[str, Any]:
    """The mode's values: the chart's defaults with the mode's ``--set``/``--set-json`` applied."""
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for flag, setting in zip(args[::2], args[1::2], strict=True):
        key, _, raw = setting.partition("=")
        value: Any = yaml.safe_load(raw) if flag == "--set-json" else _set_value(raw)
        node = values
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return values


def _set_value(raw: str) -> Any:
    if raw.startswith("{") and raw.endswith("}"):
        return [p for p in raw[1:-1].split(",") if p]
    return yaml.safe_load(raw)


def rendered_atoms(docs: list[dict[str, Any]]) -> set[Atom]:
    prefix = f"{RELEASE}-"
    atoms: set[Atom] = set()
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        role = doc["metadata"]["name"].removeprefix(prefix)
        for rule in doc.get("rules") or []:
            for group in rule.get("apiGroups") or [""]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        atoms.add((role, group, resource, verb, bool(rule.get("resourceNames"))))
    return atoms


# ----------------------------------------------------------------------------- the table


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def table_rows() -> list[dict[str, str]]:
    text = CONTRACT.read_text()
    section = text[text.index("## RBAC, rule by rule") :]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = _cells(lines[0])
    assert header[:5] == ["role", "API group", "resource", "verbs", "when"], header
    return [dict(zip(header, _cells(ln), strict=True)) for ln in lines[2:]]


CONDITIONS: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "always": lambda v: True,
    "nodeHealth": lambda v: bool(v["operator"]["nodeHealth"]["enabled"]),
    "cordon": lambda v: bool(
        v["operator"]["nodeHealth"]["enabled"]
        and v["operator"]["nodeHealth"]["cordon"]["enabled"]
        and not v["operator"]["nodeHealth"]["cordon"]["dryRun"]
    ),
    "observeOnly": lambda v: bool(v["rbac"]["observeOnly"]),
    "followOwners": lambda v: bool(v["accounting"]["followOwners"]),
    "sharding": lambda v: bool(v["operator"]["sharding"]["enabled"]),
    "reclaim": lambda v: bool(v["operator"]["reclaim"]["enabled"]),
    "allNamespaces": lambda v: not v["operator"]["watchNamespaces"],
    "podList": lambda v: bool(v["agent"]["enabled"] and v["agent"]["podList"]["enabled"]),
    "resourceSlices": lambda v: bool(
        v["agent"]["enabled"] and v["agent"]["dra"]["resourceSlices"] and v["agent"]["dra"]["drivers"]
    ),
    "aggregate": lambda v: bool(v["rbac"]["aggregateToDefaultRoles"]),
    "helmTest": lambda v: bool(v["tests"]["enabled"] and v["agent"]["enabled"]),
}


def holds(when: str, values: Mapping[str, Any]) -> bool:
    for term in (t.strip() for t in when.split(",")):
        negated = term.startswith("not ")
        name = term.removeprefix("not ").strip().strip("`")
        assert name in CONDITIONS, f"the table's 'when' names {name!r}, which this test does not know"
        if CONDITIONS[name](values) == negated:
            return False
    return True


def table_atoms(values: Mapping[str, Any]) -> set[Atom]:
    atoms: set[Atom] = set()
    for row in table_rows():
        if not holds(row["when"], values):
            continue
        (role,) = _names(row["role"])
        groups = [""] if row["API group"] == "core" else _names(row["API group"])
        resources = _names(row["resource"])
        if resources == ["operator.rbac.extraScaleTargets"]:
            for target in values["operator"]["rbac"]["extraScaleTargets"]:
                for group in target["apiGroups"]:
                    for resource in target["resources"]:
                        atoms |= {(role, group, resource, v, False) for v in ("get", "patch")}
            continue
        by_name = "by name" in row["verbs"]
        verbs = [v.strip() for v in row["verbs"].split("(")[0].split(",")]
        for group in groups:
            for resource in resources:
                atoms |= {(role, group, resource, verb, by_name) for verb in verbs}
    return atoms


def differences(docs: list[dict[str, Any]], values: Mapping[str, Any]) -> tuple[set[Atom], set[Atom]]:
    """(rendered but not in the table, in the table for this mode but not rendered)."""
    rendered, documented = rendered_atoms(docs), table_atoms(values)
    return rendered - documented, documented - rendered


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def helm(control_plane_binaries: Binaries) -> Path:
    return control_plane_binaries.helm


@pytest.mark.parametrize("mode", MODES)
def test_every_rendered_rule_is_in_the_table_and_every_row_is_rendered(helm: Path, mode: str) -> None:
    args = MODES[mode]
    docs = render(helm, args)
    extra, missing = differences(docs, values_of(args))
    assert not extra, (
        f"{mode}: rendered grants that docs/deployment-contract.md does not list: {sorted(extra)}"
    )
    assert not missing, (
        f"{mode}: rows of docs/deployment-contract.md this mode does not render: {sorted(missing)}"
    )


WRITES = ("create", "update", "patch", "delete", "deletecollection")


def test_observe_only_leaves_nothing_that_changes_a_workload_or_a_node(helm: Path) -> None:
    atoms = rendered_atoms(render(helm, MODES["observe-only"]))
    operator_writes = {(a[0], a[2]) for a in atoms if a[3] in WRITES and a[0].startswith("operator")}
    assert operator_writes == {
        ("operator", "tokenreviews"),
        ("operator", "clusterkopfpeerings"),
        ("operator-namespaced", "gpumonitorpolicies"),
        ("operator-namespaced", "gpumonitorpolicies/status"),
        ("operator-namespaced", "events"),
        ("operator-self", "pods"),  # its own pod's ingest-active label
    }
    assert not {a for a in atoms if a[2].endswith("/scale") or a[2] == "horizontalpodautoscalers"}


def test_sharded_mode_renders_no_kopf_peering(helm: Path) -> None:
    docs = render(helm, MODES["sharded"])
    assert not [d for d in docs if d["apiVersion"].startswith("kopf.dev/")]
    assert not {a for a in rendered_atoms(docs) if a[1] == "kopf.dev"}


def test_a_grant_the_table_lacks_is_caught(helm: Path) -> None:
    """The check above is no tautology: one more verb on one rendered rule fails it."""
    args = MODES["defaults"]
    docs = render(helm, args)
    values = values_of(args)
    assert differences(docs, values) == (set(), set())
    widened = copy.deepcopy(docs)
    role = next(
        d for d in widened if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuwarden-operator"
    )
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    extra, missing = differences(widened, values)
    assert extra == {("operator", "", "secrets", "get", False)}
    assert missing == set()


def test_reclaiming_is_refused_in_observe_only(helm: Path) -> None:
    """Observe only changes no workload: the chart refuses to grant reclaiming there."""
    proc = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--set", "rbac.observeOnly=true", "--set", "operator.reclaim.enabled=true"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "rbac.observeOnly changes no workload: operator.reclaim.enabled must stay false" in proc.stderr

"""The rule-kind registry (gpuwarden.policy.rules.RULE_TYPES): every kind registered whole, in its own
module, the CRD and the registry naming the same kinds, and nothing else in the engine naming one."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwarden.policy import (
    RULE_TYPES,
    PodView,
    PolicyEvaluator,
    RuleType,
    SeriesStore,
    SpecError,
    horizon_seconds,
    parse_spec,
    rule_kind,
    rule_type,
)
from gpuwarden.policy.engine import HORIZON_SLACK_SECONDS
from gpuwarden.policy.rules import type_of
from gpuwarden.policy.rules.common import JudgeContext, WindowParams
from gpuwarden.policy.spec.model import Rule
from gpuwarden.policy.spec.schema import Duration, Integer, Number
from gpuwarden.policy.store.series import PodId
from gpuwarden.units import parse_duration

ROOT = Path(__file__).resolve().parents[4]
CRD_PATH = ROOT / "crds" / "gpuwarden.dev_gpumonitorpolicies.yaml"
POLICY = ROOT / "gpuwarden" / "policy"

# The smallest valid body of each kind: a kind added to the registry needs one here too.
MINIMAL: dict[str, dict[str, Any]] = {
    "utilizationFloor": {"percent": 20},
    "utilizationCeiling": {"percent": 90},
    "idleGpus": {},
    "memoryCeiling": {"percent": 90},
    "memoryGrowth": {"rate": "100Mi/m"},
    "gpuHealth": {},
    "anomaly": {"metric": "memory"},
    "requestLatency": {"percentile": 99, "threshold": "2s", "server": "vllm"},
    "requestQueue": {"limit": 5, "server": "vllm"},
    "kvCacheUsage": {"percent": 90, "server": "vllm"},
}


def crd_rule_keys() -> list[str]:
    """The keys a rule in spec.rules[] may set besides its name, in the CRD's order."""
    with CRD_PATH.open(encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    items = schema["properties"]["spec"]["properties"]["rules"]["items"]
    return [k for k in items["properties"] if k != "name"]


def parsed(t: RuleType[Any, Any]) -> Rule:
    spec = parse_spec({"selector": {}, "rules": [{"name": "r", t.key: MINIMAL[t.key]}]})
    return spec.rules[0]


def test_the_registry_and_the_crd_name_the_same_kinds_in_the_same_order() -> None:
    keys = [t.key for t in RULE_TYPES]
    assert keys == crd_rule_keys()
    assert len(set(keys)) == len(keys)
    assert sorted(MINIMAL) == sorted(keys)


def kind_module(t: RuleType[Any, Any]) -> str:
    """The kind's module: ``gpuwarden.policy.rules.<kind>``, a module or, for a kind in parts, a package."""
    return ".".join(t.model.__module__.split(".")[:4])


@pytest.mark.parametrize("t", RULE_TYPES, ids=lambda t: t.key)
def test_a_kind_s_module_declares_its_kind_and_its_spec_s_frozen_class(t: RuleType[Any, Any]) -> None:
    module = sys.modules[kind_module(t)]
    assert module.__name__.startswith("gpuwarden.policy.rules.")
    assert t.kind in [v for k, v in vars(module).items() if k.endswith("KIND")]
    assert t in vars(module).values()
    assert dataclasses.is_dataclass(t.model)
    assert vars(t.model)["__dataclass_params__"].frozen
    assert "name" in {f.name for f in dataclasses.fields(t.model)}


def test_the_models_are_one_per_kind() -> None:
    models = [t.model for t in RULE_TYPES]
    assert len(set(models)) == len(models)


@pytest.mark.parametrize("t", RULE_TYPES, ids=lambda t: t.key)
def test_a_kind_s_module_imports_no_other_kind(t: RuleType[Any, Any]) -> None:
    # What several kinds share lives in a module of no kind (common, activity, throttling, serving).
    module = kind_module(t)
    kinds = {kind_module(other) for other in RULE_TYPES} - {module}
    path = Path(sys.modules[module].__file__ or "")
    imported = set()
    for file in path.parent.glob("*.py") if path.name == "__init__.py" else [path]:
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert not {name for name in imported if ".".join(name.split(".")[:4]) in kinds}


# What reads every kind through the registry names none: a new kind is its module, its line in
# RULE_TYPES, its CRD schema and its tests. (spec/servers.py holds the servers' metric names, by
# what each service kind reads of them: a new service kind adds its column there.)
THROUGH_THE_REGISTRY = [
    "parse.py",
    "engine.py",
    "findings.py",
    "scaling/decider.py",
    "scaling/predictive.py",
    "spec/model.py",
    "spec/fields.py",
    "spec/selector.py",
]


def code_words(path: Path) -> set[str]:
    """The names and the words of the string literals of a module's code (not its docstrings, nor
    its fields' and constants' docstrings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # bare strings
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute | ast.alias):
            words.update((node.attr if isinstance(node, ast.Attribute) else node.name).split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.update(re.findall(r"\w+", node.value))
    return words


@pytest.mark.parametrize("path", THROUGH_THE_REGISTRY)
def test_the_engine_s_other_modules_name_no_kind(path: str) -> None:
    words = code_words(POLICY / path)
    for t in RULE_TYPES:
        assert not words & {t.key, t.model.__name__}, (path, t.key)


def test_the_crd_defaults_of_each_kind_are_its_record_s() -> None:
    with CRD_PATH.open(encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kinds = schema["properties"]["spec"]["properties"]["rules"]["items"]["properties"]
    for t in RULE_TYPES:
        fields = kinds[t.key]["properties"]
        assert {k: n["default"] for k, n in fields.items() if "default" in n} == t.defaults


def bound_cases(t: RuleType[Any, Any]) -> list[tuple[str, object, bool]]:
    """(field, value, accepted) at and just past each bound its body declares."""
    cases: list[tuple[str, object, bool]] = []
    for f in t.body.fields:
        if isinstance(f, Number | Integer) and f.minimum is not None:
            cases += [(f.name, f.minimum, True), (f.name, f.minimum - 1, False)]
        if isinstance(f, Number | Integer) and f.maximum is not None:
            cases += [(f.name, f.maximum, True), (f.name, f.maximum + 1, False)]
        if isinstance(f, Integer) and f.choices:
            cases += [(f.name, c, True) for c in f.choices] + [(f.name, max(f.choices) - 1, False)]
        if isinstance(f, Duration) and f.minimum is not None:
            least = parse_duration(f.minimum)
            cases += [(f.name, f.minimum, True), (f.name, f"{round(least * 1000) - 1}ms", False)]
    return cases


@pytest.mark.parametrize("t", RULE_TYPES, ids=lambda t: t.key)
def test_descriptions_that_state_a_bound_state_the_declared_one(t: RuleType[Any, Any]) -> None:
    """`kubectl explain` readers see the bounds in words ("(0-100)", "at least 1m"): the words must be
    the declaration's, the one place a bound is written."""
    for f in t.body.fields:
        if isinstance(f, Number):
            for lo, hi in re.findall(r"\b(\d+(?:\.\d+)?) ?(?:to|-) ?(\d+(?:\.\d+)?)\b", f.description):
                assert (float(lo), float(hi)) == (f.minimum, f.maximum), (t.key, f.name)
        if isinstance(f, Duration):
            stated = re.findall(r"at least (\d+(?:ms|s|m|h))\b", f.description)
            assert stated == ([] if f.minimum is None else [f.minimum]), (t.key, f.name)


@pytest.mark.parametrize("t", RULE_TYPES, ids=lambda t: t.key)
def test_the_parser_keeps_the_bounds_the_crd_is_rendered_from(t: RuleType[Any, Any]) -> None:
    """One declaration, two readers: the CRD is rendered from the body (test_crd_schema.py holds the
    committed file to it), and the kind's parser accepts exactly its bounds."""
    cases = bound_cases(t)
    assert cases
    for name, value, accepted in cases:
        body = {**MINIMAL[t.key], name: value}
        rules = [{"name": "r", t.key: body}]
        if accepted:
            parse_spec({"selector": {}, "evaluationInterval": "1s", "rules": rules})
        else:
            with pytest.raises(SpecError, match=rf"\.{name}\b"):
                parse_spec({"selector": {}, "evaluationInterval": "1s", "rules": rules})


@pytest.mark.parametrize("t", RULE_TYPES, ids=lambda t: t.key)
def test_every_kind_is_registered_whole(t: RuleType[Any, Any]) -> None:
    rule = parsed(t)
    assert isinstance(rule, t.model)
    assert type_of(rule) is t
    assert rule_kind(rule) == t.kind
    assert rule_type(t.kind) is t
    assert t.reach(rule) > 0
    if t.window is not None:
        seconds = t.window(rule)
        assert t.body.window in ("for", "window")
        assert seconds > 0
        assert t.reach(rule) >= seconds
    assert re.fullmatch(r"(GPU|Request|KVCache)[A-Z][A-Za-z]+", t.reason)
    assert t.meaning
    assert t.colour
    memo = None if t.memo is None else t.memo()
    outcome = t.evaluate(rule, JudgeContext(PodId("ns", "p"), [], 1_800_000_000.0, WindowParams()), memo)
    assert (outcome.rule, outcome.kind, outcome.value) == ("r", t.kind, None)
    if memo is not None:
        memo.sweep()


def test_each_kind_has_its_own_event_reason() -> None:
    reasons = [t.reason for t in RULE_TYPES]
    assert len(set(reasons)) == len(reasons)  # an Event's reason names its kind


def test_the_engine_reads_each_kind_through_the_registry() -> None:
    spec = parse_spec(
        {"selector": {}, "rules": [{"name": t.key.lower(), t.key: MINIMAL[t.key]} for t in RULE_TYPES]}
    )
    longest = max(t.reach(r) for t, r in zip(RULE_TYPES, spec.rules, strict=True))
    params = WindowParams()
    assert horizon_seconds(spec, params) == pytest.approx(
        longest + params.stale_after_seconds + HORIZON_SLACK_SECONDS
    )
    evaluation = PolicyEvaluator("ns/p", spec).evaluate(
        [PodView("ns", "p")], SeriesStore(retention_seconds=3600, max_points=1000), 1_800_000_000.0
    )
    assert [o.kind for o in evaluation.outcomes] == [t.kind for t in RULE_TYPES]


TARGET = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d"}


@pytest.mark.parametrize(
    ("rules", "scale", "message"),
    [
        (
            [{"name": "f", "utilizationFloor": {"percent": 10}}],
            {"scaleDownOn": ["f"], "forecast": {}},
            "spec.actions.scale.forecast: forecast needs a utilizationCeiling rule in scaleUpOn: its ceiling"
            " is what it forecasts against",
        ),
        (
            [{"name": "f", "utilizationFloor": {"percent": 10}}],
            {"scaleUpOn": ["f"], "forecast": {"load": "requests", "requestsPerReplica": 5}},
            "spec.actions.scale.forecast: forecast with load: requests needs a requestLatency, requestQueue"
            " or kvCacheUsage rule in scaleUpOn: the pods it reads are scraped, and their server says where"
            " the rate is read",
        ),
        (
            [{"name": "q", "requestQueue": {"limit": 5, "metric": "waiting"}}],
            {"scaleUpOn": ["q"], "forecast": {"load": "requests", "requestsPerReplica": 5}},
            "spec.actions.scale.forecast.load: no request rate to read: no rule names a server (whose counter"
            " of requests served is read) nor a requestLatency histogram (whose count is)",
        ),
        (
            [{"name": "k", "kvCacheUsage": {"percent": 90, "server": "vllm"}}],
            {"scaleDownOn": ["k"]},
            'spec.actions.scale.scaleDownOn[0]: "k" is a kvCacheUsage rule: it fires when the service is'
            " short of replicas, so it can only scale up (scale down on a utilizationFloor rule)",
        ),
    ],
)
def test_the_messages_that_name_kinds_read_them_from_the_records(
    rules: list[dict[str, Any]], scale: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(
            {
                "selector": {},
                "rules": rules,
                "actions": {"scale": {"targetRef": TARGET, "maxReplicas": 4, **scale}},
            }
        )
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"requestLatency": {"percentile": 99, "threshold": "1s", "server": "triton"}},
            "requestLatency.latency",
        ),
        ({"kvCacheUsage": {"percent": 90, "server": "triton"}}, "kvCacheUsage.server"),
    ],
)
def test_a_metric_its_server_lacks_is_refused_at_the_field_its_record_names(
    body: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"selector": {}, "rules": [{"name": "r", **body}]})
    assert err.value.field == f"spec.rules[0].{field}"

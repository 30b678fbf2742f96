"""The rule-kind registry (gpuwarden.policy.rules.common.RULE_TYPES): every kind registered whole, and the
CRD, the spec's model and the registry naming the same kinds."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwarden.policy import (
    RULE_TYPES,
    PodView,
    PolicyEvaluator,
    RuleKind,
    RuleType,
    SeriesStore,
    horizon_seconds,
    parse_spec,
    rule_kind,
    rule_type,
)
from gpuwarden.policy.engine import HORIZON_SLACK_SECONDS
from gpuwarden.policy.parse import DEFAULTS
from gpuwarden.policy.rules import type_of
from gpuwarden.policy.rules.common import WindowParams
from gpuwarden.policy.spec.model import Rule
from gpuwarden.policy.store.series import PodId

CRD_PATH = Path(__file__).resolve().parents[4] / "crds" / "gpuwarden.dev_gpumonitorpolicies.yaml"

# The smallest valid body of each kind: a kind added to the registry needs one here too.
MINIMAL: dict[str, dict[str, Any]] = {
    "utilizationFloor": {"percent": 20},
    "utilizationCeiling": {"percent": 90},
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


def parsed(t: RuleType[Any]) -> Rule:
    spec = parse_spec({"selector": {}, "rules": [{"name": "r", t.key: MINIMAL[t.key]}]})
    return spec.rules[0]


def test_the_registry_the_crd_and_the_kinds_name_the_same_kinds_in_the_same_order() -> None:
    keys = [t.key for t in RULE_TYPES]
    assert keys == crd_rule_keys()
    assert keys == [k.value for k in RuleKind]
    assert sorted(MINIMAL) == sorted(keys)


def test_the_models_are_the_spec_models_rule_union_one_kind_each() -> None:
    models = [t.model for t in RULE_TYPES]
    assert len(set(models)) == len(models)
    assert set(models) == set(typing.get_args(Rule))


def test_the_crd_defaults_of_each_kind_are_its_record_s() -> None:
    for t in RULE_TYPES:
        assert DEFAULTS[f".spec.rules[].{t.key}"] is t.defaults


@pytest.mark.parametrize("t", RULE_TYPES, ids=lambda t: t.key)
def test_every_kind_is_registered_whole(t: RuleType[Any]) -> None:
    rule = parsed(t)
    assert isinstance(rule, t.model)
    assert type_of(rule) is t
    assert rule_kind(rule) is t.kind
    assert rule_type(t.kind) is t
    assert t.reach(rule) > 0
    if t.window is not None:
        name, seconds = t.window(rule)
        assert name in ("for", "window")
        assert seconds > 0
        assert t.reach(rule) >= seconds
    assert re.fullmatch(r"(GPU|Request|KVCache)[A-Z][A-Za-z]+", t.reason)
    assert t.meaning
    assert t.colour
    memo = None if t.memo is None else t.memo()
    outcome = t.evaluate(rule, PodId("ns", "p"), [], 1_800_000_000.0, WindowParams(), memo, None, None)
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

"""The GPUMonitorPolicy CRD, checked offline.

The openAPIV3Schema is translated to plain JSON Schema (Kubernetes extensions dropped, int-or-string made
a type union, unknown fields rejected as `kubectl apply`'s strict field validation does) and run with
`jsonschema`. CEL rules cannot run here: we check they are present, and that parse_spec enforces the
same invariants. The real API server checks live in tests/integration/test_crd.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpuwarden.policy.crd import regenerate, rules_schema, spec_checks, spec_fields
from gpuwarden.policy.parse import SpecError, parse_spec
from gpuwarden.policy.rules.throttling import Throttling
from gpuwarden.policy.xids import CRITICAL_XIDS
from gpuwarden.units import DURATION_PATTERN, RATE_PATTERN

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "gpuwarden.dev_gpumonitorpolicies.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("gpumonitorpolicy*.yaml"))

Schema = dict[str, Any]


def load_crd() -> dict[str, Any]:
    with CRD_PATH.open(encoding="utf-8") as f:
        crd: dict[str, Any] = yaml.safe_load(f)
    return crd


CRD = load_crd()
VERSION = CRD["spec"]["versions"][0]
SCHEMA: Schema = VERSION["schema"]["openAPIV3Schema"]


def to_json_schema(node: Schema) -> Schema:
    """Kubernetes structural schema -> JSON Schema (draft 2020-12) with unknown fields rejected."""
    out: Schema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("default", "format", "description"):
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key == "anyOf" and node.get("x-kubernetes-int-or-string"):
            continue
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


JSON_SCHEMA = to_json_schema(SCHEMA)
VALIDATOR = jsonschema.Draft202012Validator(JSON_SCHEMA)


def walk(node: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node under ``node`` with its path (``.spec.rules[].name``, ``.x.matchLabels{}``)."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


NODES = dict(walk(SCHEMA))


def example_object() -> dict[str, Any]:
    with (ROOT / "examples" / "gpumonitorpolicy.yaml").open(encoding="utf-8") as f:
        obj: dict[str, Any] = yaml.safe_load(f)
    return obj


def apply_defaults(node: Schema, value: Any) -> Any:
    """Structural defaulting as the API server does it: absent fields take their default, recursively."""
    if isinstance(value, dict) and "properties" in node:
        for name, sub in node["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(node["items"], item) for item in value]
    return value


# --- the CRD object itself -----------------------------------------------------------------------------


def test_names_scope_and_version() -> None:
    spec = CRD["spec"]
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["metadata"]["name"] == "gpumonitorpolicies.gpuwarden.dev"
    assert spec["group"] == "gpuwarden.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "GPUMonitorPolicy",
        "listKind": "GPUMonitorPolicyList",
        "plural": "gpumonitorpolicies",
        "singular": "gpumonitorpolicy",
        "shortNames": ["gmp", "gpupolicy"],
        "categories": ["gpuwarden"],
    }
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert VERSION["served"] is True
    assert VERSION["storage"] is True
    assert VERSION["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Pods", "Violating", "Replicas", "Ready", "Reason", "Age"]
    assert columns["Pods"]["jsonPath"] == ".status.matchedPods"
    assert columns["Violating"]["jsonPath"] == ".status.violatingPods"
    assert columns["Replicas"]["jsonPath"] == ".status.scale.currentReplicas"
    assert columns["Replicas"]["priority"] == 1
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Reason"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert columns["Reason"]["priority"] == 1
    assert columns["Age"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    for column in columns.values():
        # Every column must resolve to a field the schema defines.
        path = column["jsonPath"].split("[")[0]
        if not path.startswith(".metadata"):
            assert path in NODES, path


# --- the generated parts -------------------------------------------------------------------------------


def test_the_crd_is_what_the_rule_kinds_declare() -> None:
    """The rule kinds' schema is rendered from the declarations their parsers read: a bound, a default
    or a description changed on one side only fails here (`make crds` renders the file anew)."""
    text = CRD_PATH.read_text(encoding="utf-8")
    assert "# generated: spec-fields" in text
    assert "# generated: spec-checks" in text
    assert regenerate(text) == text, "crds/ is stale: run make crds"


def test_the_generated_yaml_reads_back_as_declared() -> None:
    """The renderer's YAML (folded text, plain or quoted scalars) means what the declarations say."""
    for name, node in spec_fields().items():
        assert NODES[f".spec.{name}"] == node, name
    assert NODES[".spec.rules"] == rules_schema()
    checks = NODES[".spec"]["x-kubernetes-validations"]
    assert checks[-len(spec_checks()) :] == spec_checks()


def test_a_hand_edit_inside_a_generated_region_is_undone() -> None:
    """The check above has teeth: a bound edited in the file alone is not what the kinds declare."""
    text = CRD_PATH.read_text(encoding="utf-8")
    stale = text.replace("maximum: 50\n", "maximum: 51\n", 1)
    assert stale != text
    assert regenerate(stale) == text


# --- structural rules the API server would enforce when creating the CRD --------------------------------


def test_every_field_has_a_description() -> None:
    # The root metadata is the exception: the API server rejects a CRD that says anything about it.
    missing = [path or "(root)" for path, node in NODES.items() if not node.get("description")]
    assert missing == [".metadata"]


def test_root_metadata_is_only_typed() -> None:
    assert NODES[".metadata"] == {"type": "object"}


def test_schema_is_structural() -> None:
    for path, node in NODES.items():
        if node.get("x-kubernetes-int-or-string"):
            # No anyOf either: the API server derives it, and an explicit one adds three anyOf lines to
            # the error for a value that is neither (`bytes: 1.5`).
            assert "type" not in node, path
            assert "anyOf" not in node, path
        else:
            assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), path
        if node.get("type") == "array":
            assert "items" in node, path


def test_lists_and_strings_are_bounded_for_cel_cost() -> None:
    """The CEL cost estimator needs bounds on every list and on strings that CEL rules touch."""
    spec_nodes = {p: n for p, n in NODES.items() if p.startswith(".spec")}
    for path, node in spec_nodes.items():
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if node.get("type") == "string" and "enum" not in node:
            assert "maxLength" in node, path
    assert NODES[".status.violations"]["maxItems"] == 20


def test_defaults_validate_against_their_own_schema() -> None:
    for node in NODES.values():
        if "default" in node:
            jsonschema.validate(node["default"], to_json_schema(node))


# --- durations, quantities, rates ---------------------------------------------------------------------------


DURATION_RULE = {
    "rule": f"self.matches('{DURATION_PATTERN}')",
    "message": "must be a duration such as 5m or 1h30m (units h, m, s, ms)",
}


def test_every_duration_field_carries_the_same_rule() -> None:
    """A CEL rule, not `pattern`: the API server's message for a pattern is the regex itself. Every
    field whose description tells `kubectl explain` readers it is a duration carries it, and no other."""
    with_rule = {p for p, n in NODES.items() if DURATION_RULE in n.get("x-kubernetes-validations", [])}
    said = {p for p, n in NODES.items() if n.get("type") == "string" and "a duration" in explained(p)}
    assert with_rule == said
    assert len(with_rule) >= 23  # the rule kinds' windows, holds and intervals; the spec's; the scaler's
    for path in with_rule:
        node = NODES[path]
        assert node["maxLength"] == 32, path
        # Any further rule (a bound) must not also fail, unreadably, on a malformed duration.
        for validation in node["x-kubernetes-validations"][1:]:
            assert validation["rule"].startswith(f"!self.matches('{DURATION_PATTERN}') || "), path


def explained(path: str) -> str:
    return " ".join(NODES[path].get("description", "").split())


def test_rate_and_quantity_rules_match_the_parser() -> None:
    rate = NODES[".spec.rules[].memoryGrowth.rate"]["x-kubernetes-validations"]
    assert rate[0]["rule"] == f"self.matches('{RATE_PATTERN}')"
    assert rate[1]["rule"].startswith(f"!self.matches('{RATE_PATTERN}') || ")
    # isQuantity() is resource.ParseQuantity, whose grammar parse_quantity implements.
    assert "isQuantity(self)" in cel_rules(".spec.rules[].memoryCeiling.bytes")[0]


def test_no_regex_in_messages_for_values_people_type() -> None:
    """`pattern` is left only on Kubernetes names and labels, whose grammar is the API's own."""
    with_pattern = {p for p, n in NODES.items() if "pattern" in n and p.startswith(".spec")}
    assert with_pattern == {
        ".spec.selector.matchLabels{}",
        ".spec.selector.matchExpressions[].key",
        ".spec.selector.matchExpressions[].values[]",
        ".spec.actions.scale.targetRef.kind",
        ".spec.actions.scale.targetRef.name",
    }


def scalar_defaults() -> dict[str, Any]:
    """The CRD's defaults that are not empty objects or lists, by schema path."""
    return {
        path: node["default"]
        for path, node in NODES.items()
        if "default" in node and not isinstance(node["default"], dict | list)
    }


def test_object_and_list_defaults_are_empty() -> None:
    """The declarations give defaults to scalars only; an object or a list defaults to empty, which the
    parser reads as absent (test_crd_defaults_match_parser_defaults holds the two readings equal)."""
    for path, node in NODES.items():
        if isinstance(node.get("default"), dict | list):
            assert not node["default"], path


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_descriptions_state_the_default() -> None:
    """`kubectl explain` prints descriptions, never `default`: each says its default in the same words."""
    for path, default in scalar_defaults().items():
        text = " ".join(NODES[path]["description"].split())
        assert text.endswith(f"Default: {_yaml(default)}."), (path, text)


def test_int_or_string_descriptions_say_so() -> None:
    """`kubectl explain` types a CRD's int-or-string field `<Object>`: the description must say what it is."""
    nodes = {p: n for p, n in NODES.items() if n.get("x-kubernetes-int-or-string")}
    assert set(nodes) == {
        ".spec.rules[].memoryCeiling.bytes",
        ".spec.actions.scale.scaleUpMinPods",
        ".spec.actions.scale.behavior.scaleUp.step",
        ".spec.actions.scale.behavior.scaleDown.step",
    }
    for path, node in nodes.items():
        assert node["description"].startswith("Integer or string: "), path


# --- CEL rules ------------------------------------------------------------------------------------------


def cel_rules(path: str) -> list[str]:
    return [" ".join(v["rule"].split()) for v in NODES[path].get("x-kubernetes-validations", [])]


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        (".spec.rules[]", "has(self.utilizationFloor), has(self.utilizationCeiling)"),
        (".spec.rules[]", ".filter(k, k).size() == 1"),
        (".spec.rules[].memoryCeiling", "has(self.percent) != has(self.bytes)"),
        (".spec.rules[].memoryCeiling.bytes", "quantity(self).isInteger()"),
        (".spec.rules[].memoryGrowth.rate", "!self.matches('^[0.]+[A-Za-z]*/')"),
        (".spec.rules[].memoryGrowth.window", "duration(self) >= duration('1m')"),
        (
            ".spec.rules[]",
            "has(self.memoryGrowth), has(self.gpuHealth), has(self.anomaly), has(self.requestLatency)",
        ),
        (".spec.rules[]", "has(self.requestQueue), has(self.kvCacheUsage)].filter(k, k).size() == 1"),
        (".spec.rules[].requestLatency", "!(self.server == 'triton' && self.latency != 'timeToFirstToken')"),
        (".spec.rules[].requestLatency", "!(self.server == 'tgi' && self.latency == 'timeToFirstToken')"),
        (".spec.rules[].requestLatency.threshold", "duration(self) >= duration('1ms')"),
        (".spec.rules[].requestLatency.window", "duration(self) >= duration('1s')"),
        (".spec.rules[].kvCacheUsage", "self.server in ['vllm', 'sglang']"),
        (".spec.serviceMetrics.interval", "duration(self) >= duration('1s')"),
        (".spec", "has(r.requestQueue.server) || has(r.requestQueue.metric)"),
        (".spec.rules[].gpuHealth", "!has(self.xids) || size(self.xids) > 0 || !has(self.gpuLost)"),
        (".spec.rules[].gpuHealth.clearAfter", "duration(self) >= duration('1s')"),
        (".spec.rules[].name", "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')"),
        (".spec.evaluationInterval", "duration(self) >= duration('1s')"),
        (".spec", "duration(w) >= duration(self.evaluationInterval)"),
        (".spec.actions.renotifyInterval", "duration(self) >= duration('1m')"),
        (".spec.actions.scale", "self.maxReplicas < 1 || self.minReplicas <= self.maxReplicas"),
        (".spec.actions.scale.scaleUpMinPods", "self.matches('^(100|[1-9][0-9]?)%$')"),
        (".spec.actions.scale.behavior.scaleUp.step", "self.matches('^[1-9][0-9]{0,2}%$')"),
        (".spec.actions.scale", "!self.scaleUpOn.exists(n, n in self.scaleDownOn)"),
        (".spec.actions.scale", "size(self.scaleUpOn) > 0"),
        (".spec.actions.scale.targetRef", "self.kind in ['Deployment', 'StatefulSet', 'ReplicaSet']"),
        (".spec", "self.actions.scale.scaleUpOn.all(n, self.rules.exists(r, r.name == n))"),
        (".spec", "self.actions.scale.scaleDownOn.all(n, self.rules.exists(r, r.name == n))"),
        (".spec.selector.matchExpressions[]", "self.operator in ['In', 'NotIn']"),
    ],
)
def test_cel_rule_present(path: str, fragment: str) -> None:
    assert any(fragment in rule for rule in cel_rules(path)), cel_rules(path)


def test_gpu_health_xids_left_out_are_the_critical_ones() -> None:
    """No list default (the CRD's defaults are scalars); left out, the parser counts the critical XIDs,
    which the description lists."""
    node = NODES[".spec.rules[].gpuHealth.xids"]
    assert "default" not in node
    assert ", ".join(map(str, CRITICAL_XIDS)) in " ".join(node["description"].split())
    assert node["x-kubernetes-list-type"] == "set"
    assert NODES[".spec.rules[].gpuHealth.throttling[]"]["enum"] == [t.value for t in Throttling]


def test_every_cel_rule_has_a_message() -> None:
    for path, node in NODES.items():
        for validation in node.get("x-kubernetes-validations", []):
            assert validation.get("message") or validation.get("messageExpression"), path


def test_no_cel_uses_join() -> None:
    """kube-apiserver v1.37 costs join() on a list past the whole CRD's CEL budget and rejects the CRD."""
    for path, node in NODES.items():
        for validation in node.get("x-kubernetes-validations", []):
            text = validation["rule"] + validation.get("messageExpression", "")
            assert ".join(" not in text, path


def test_rule_names_are_unique_by_list_map() -> None:
    rules = NODES[".spec.rules"]
    assert rules["x-kubernetes-list-type"] == "map"
    assert rules["x-kubernetes-list-map-keys"] == ["name"]
    assert rules["minItems"] == 1
    assert rules["maxItems"] == 32
    assert "name" in NODES[".spec.rules[]"]["required"]


def test_conditions_are_standard() -> None:
    conditions = NODES[".status.conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = NODES[".status.conditions[]"]
    assert set(item["properties"]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["reason"]["pattern"] == "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"


# --- the schema against policies --------------------------------------------------------------------------


def test_there_are_examples_to_check() -> None:
    # The parametrized test below runs once per file: no file would be no test, not a failure.
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(path: Path) -> None:
    policies = [
        doc
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and doc.get("kind") == "GPUMonitorPolicy"
    ]
    assert policies, f"{path.name} holds no GPUMonitorPolicy"
    for doc in policies:
        VALIDATOR.validate(doc)
        parse_spec(doc["spec"])


def test_status_example_is_accepted() -> None:
    obj = example_object()
    obj["status"] = {
        "observedGeneration": 3,
        "matchedPods": 4,
        "violatingPods": 1,
        "violations": [
            {
                "pod": "llm-server-7c9f-x2",
                "rule": "leak",
                "reason": "GPUMemoryGrowing",
                "message": "GPU memory grows 212Mi/m (fit 0.97); reaches 141Gi in 14m",
                "since": "2026-12-02T14:00:00Z",
                "gpu": "GPU-5fd4e1a2-0b7c-4f7e-9d3a-1c2b3d4e5f60",
            }
        ],
        "scale": {
            "currentReplicas": 3,
            "desiredReplicas": 3,
            "lastScaleTime": "2026-12-02T13:00:00Z",
            "lastScaleReason": "scaled llm-server 2→3: saturated on 2/2 pods",
        },
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Evaluating",
                "message": "4 pods, 4 rules",
                "lastTransitionTime": "2026-12-02T12:00:00Z",
                "observedGeneration": 3,
            }
        ],
    }
    VALIDATOR.validate(obj)


def test_crd_defaults_match_parser_defaults() -> None:
    """A minimal policy means the same whether the API server or parse_spec fills in the defaults."""
    minimal = {
        "selector": {"matchLabels": {"app": "x"}},
        "rules": [
            {"name": "a", "utilizationFloor": {"percent": 10}},
            {"name": "b", "utilizationCeiling": {"percent": 90}},
            {"name": "c", "memoryCeiling": {"bytes": "10Gi"}},
            {"name": "d", "memoryGrowth": {"rate": "1Mi/s"}},
        ],
        "actions": {"scale": {"targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"}}},
    }
    minimal["actions"]["scale"]["maxReplicas"] = 4  # type: ignore[index]
    minimal["actions"]["scale"]["scaleUpOn"] = ["b"]  # type: ignore[index]
    defaulted = apply_defaults(NODES[".spec"], copy.deepcopy(minimal))
    assert defaulted["actions"]["scale"]["behavior"]["scaleDown"]["cooldown"] == "5m"
    assert defaulted["rules"][0]["utilizationFloor"]["signal"] == "auto"
    assert defaulted["rules"][3]["memoryGrowth"]["memory"] == "auto"
    assert parse_spec(defaulted) == parse_spec(minimal)
    # And with no actions at all, the defaulted {} equals parse_spec's Actions().
    del minimal["actions"]
    assert parse_spec(apply_defaults(NODES[".spec"], copy.deepcopy(minimal))) == parse_spec(minimal)


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    """A mutation setting ``a.b[0].c`` in the policy object."""

    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = _tokens(path)
        target: Any = obj
        for token in parents:
            target = target[token]
        target[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = _tokens(path)
        target: Any = obj
        for token in parents:
            target = target[token]
        del target[last]

    return mutate


def _tokens(path: str) -> list[str | int]:
    tokens: list[str | int] = []
    for part in path.replace("[", ".[").split("."):
        tokens.append(int(part[1:-1]) if part.startswith("[") else part)
    return tokens


# Each of these the schema alone rejects; parse_spec must reject it too (local mode has no API server).
SCHEMA_REJECTS: dict[str, Mutation] = {
    "missing selector": _delete("spec.selector"),
    "missing rules": _delete("spec.rules"),
    "empty rules": _set("spec.rules", []),
    "too many rules": _set(
        "spec.rules", [{"name": f"r{i}", "utilizationFloor": {"percent": 1}} for i in range(33)]
    ),
    "unknown spec field": _set("spec.evaluationIntervall", "10s"),
    "unknown rule field": _set("spec.rules[0].utilizationFloor.precent", 20),
    "duration as number": _set("spec.rules[0].utilizationFloor.for", 300),
    "percent above 100": _set("spec.rules[0].utilizationFloor.percent", 101),
    "negative percent": _set("spec.rules[1].utilizationCeiling.percent", -1),
    "percent as string": _set("spec.rules[0].utilizationFloor.percent", "20"),
    "bad signal": _set("spec.rules[0].utilizationFloor.signal", "smactive"),
    "noise floor above 100": _set("spec.rules[0].utilizationFloor.noiseFloor", 150),
    "negative power": _set("spec.rules[0].utilizationFloor.powerThresholdWatts", -5),
    "hysteresis above 50": _set("spec.rules[1].utilizationCeiling.hysteresis", 60),
    "rule name too long": _set("spec.rules[0].name", "a" * 64),
    "missing rate": _delete("spec.rules[3].memoryGrowth.rate"),
    "minFit above 1": _set("spec.rules[3].memoryGrowth.minFit", 1.5),
    "bad memory": _set("spec.rules[3].memoryGrowth.memory", "bogus"),
    "memory in camelCase only": _set("spec.rules[3].memoryGrowth.memory", "Allocated"),
    "events not bool": _set("spec.actions.events", "yes"),
    "maxReplicas zero": _set("spec.actions.scale.maxReplicas", 0),
    "minReplicas zero": _set("spec.actions.scale.minReplicas", 0),
    "missing maxReplicas": _delete("spec.actions.scale.maxReplicas"),
    "missing targetRef name": _delete("spec.actions.scale.targetRef.name"),
    "scaleUpMinPods zero": _set("spec.actions.scale.scaleUpMinPods", 0),
    "bad operator": _set("spec.selector.matchExpressions[0].operator", "Equals"),
    "bad label value": _set("spec.selector.matchLabels.app", "llm server"),
    "label value not string": _set("spec.selector.matchLabels.app", 7),
}


@pytest.mark.parametrize("mutate", SCHEMA_REJECTS.values(), ids=SCHEMA_REJECTS.keys())
def test_schema_and_parser_reject(mutate: Mutation) -> None:
    obj = example_object()
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(obj)
    with pytest.raises(SpecError):
        parse_spec(obj["spec"])


# Each of these only a CEL rule (or the list-map key) rejects: jsonschema accepts, parse_spec must not.
CEL_REJECTS: dict[str, Mutation] = {
    "rule with no kind": _set("spec.rules[0]", {"name": "idle-gpu"}),
    "rule with two kinds": _set("spec.rules[1].memoryGrowth", {"rate": "1Mi/m"}),
    "duplicate rule names": _set("spec.rules[1].name", "idle-gpu"),
    "percent and bytes": _set("spec.rules[2].memoryCeiling.bytes", "120Gi"),
    "neither percent nor bytes": _set("spec.rules[2].memoryCeiling", {"for": "1m"}),
    "fractional bytes": _set("spec.rules[2].memoryCeiling", {"bytes": "1.5"}),
    "zero rate": _set("spec.rules[3].memoryGrowth.rate", "0Mi/m"),
    "short window": _set("spec.rules[3].memoryGrowth.window", "59s"),
    "sub-second evaluation": _set("spec.evaluationInterval", "500ms"),
    "short renotify": _set("spec.actions.renotifyInterval", "30s"),
    "min above max": _set("spec.actions.scale.minReplicas", 9),
    "unknown scaleUpOn rule": _set("spec.actions.scale.scaleUpOn", ["saturatd"]),
    "unknown scaleDownOn rule": _set("spec.actions.scale.scaleDownOn", ["idle"]),
    "rule in both directions": _set("spec.actions.scale.scaleDownOn", ["saturated"]),
    "no scaling rules": _set("spec.actions.scale.scaleUpOn", []),
    "In without values": _set("spec.selector.matchExpressions[0]", {"key": "a", "operator": "In"}),
    # What a pattern used to reject: a CEL rule does now, with a message written for people.
    "bad duration unit": _set("spec.evaluationInterval", "10sec"),
    "duration with days": _set("spec.rules[1].utilizationCeiling.for", "1d"),
    "duration too many digits": _set("spec.actions.renotifyInterval", "100000s"),
    "duration five parts": _set("spec.rules[2].memoryCeiling.for", "1h1m1s1ms1s"),
    "rule name uppercase": _set("spec.rules[0].name", "Idle"),
    "bad bytes": _set("spec.rules[2].memoryCeiling", {"bytes": "120GB"}),
    "bad rate unit": _set("spec.rules[3].memoryGrowth.rate", "100Mb/m"),
    "rate per day": _set("spec.rules[3].memoryGrowth.rate", "100Mi/d"),
    "scaleUpMinPods percent above 100": _set("spec.actions.scale.scaleUpMinPods", "150%"),
    "step zero percent": _set("spec.actions.scale.behavior.scaleUp.step", "0%"),
    "step as word": _set("spec.actions.scale.behavior.scaleDown.step", "one"),
    # A rule's window shorter than the evaluation interval (for: 0s is one).
    "for 0s": _set("spec.rules[0].utilizationFloor.for", "0s"),
    "for below the interval": _set("spec.rules[2].memoryCeiling.for", "5s"),
    "window below the interval": _set("spec.evaluationInterval", "1h"),
}


@pytest.mark.parametrize("mutate", CEL_REJECTS.values(), ids=CEL_REJECTS.keys())
def test_cel_only_invariants_rejected_by_parser(mutate: Mutation) -> None:
    obj = example_object()
    mutate(obj)
    if obj["spec"]["actions"]["scale"]["scaleUpOn"] == []:
        obj["spec"]["actions"]["scale"]["scaleDownOn"] = []
    VALIDATOR.validate(obj)  # the structural schema alone lets it through
    with pytest.raises(SpecError):
        parse_spec(obj["spec"])

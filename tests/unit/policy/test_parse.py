"""parse_spec, parse_policy_object and the duration/quantity/rate parsers (policy files: test_demo.py)."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.policy.parse import SpecError, parse_policy_object, parse_spec
from gpuwarden.policy.rules import spec_warnings
from gpuwarden.policy.rules.anomaly import Anomaly, AnomalyMetric
from gpuwarden.policy.rules.gpu_health import GpuHealthRule
from gpuwarden.policy.rules.growth import MemoryGrowth, MemorySource
from gpuwarden.policy.rules.idle_gpus import IdleGpus
from gpuwarden.policy.rules.memory_ceiling import MemoryCeiling
from gpuwarden.policy.rules.utilization import UtilizationCeiling, UtilizationFloor
from gpuwarden.policy.spec.model import (
    Actions,
    LabelRequirement,
    LabelSelector,
    PolicySpec,
    ScaleAction,
    ScaleDirection,
    ScaleForecast,
    ScaleTargetRef,
    Signal,
)
from gpuwarden.units import (
    DURATION_PATTERN,
    format_duration,
    parse_duration,
    parse_quantity,
    parse_rate,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "gpumonitorpolicy.yaml"
MI = 2**20


def example_spec() -> dict[str, Any]:
    with EXAMPLE.open(encoding="utf-8") as f:
        spec: dict[str, Any] = yaml.safe_load(f)["spec"]
    return spec


# --- the example, field by field -----------------------------------------------------------------------


def example_object() -> Any:
    with EXAMPLE.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_example_round_trip() -> None:
    checked = parse_policy_object(example_object())
    name, spec = checked.name, checked.spec
    assert name == "llm-serving"
    assert spec == PolicySpec(
        selector=LabelSelector(
            match_labels=(("app", "llm-server"),),
            match_expressions=(LabelRequirement(key="gpuwarden.dev/ignore", operator="DoesNotExist"),),
        ),
        evaluation_interval_seconds=10.0,
        rules=(
            UtilizationFloor(
                name="idle-gpu",
                percent=20.0,
                for_seconds=300.0,
                signal=Signal.AUTO,
                noise_floor=2.0,
                power_threshold_watts=250.0,
                hysteresis=5.0,
            ),
            UtilizationCeiling(
                name="saturated", percent=95.0, for_seconds=120.0, signal=Signal.AUTO, hysteresis=5.0
            ),
            MemoryCeiling(name="near-oom", for_seconds=60.0, percent=90.0, bytes=None, hysteresis=2.0),
            MemoryGrowth(
                name="leak",
                rate_bytes_per_second=100 * MI / 60,
                window_seconds=1800.0,
                min_fit=0.8,
                for_seconds=0.0,
            ),
            GpuHealthRule(name="broken-gpu", clear_after_seconds=600.0),
            Anomaly(
                name="unusual-memory",
                metric=AnomalyMetric.MEMORY,
                window_seconds=1800.0,
                threshold=5.0,
                min_deviation=5.0,
            ),
            IdleGpus(name="unused-gpus", for_seconds=600.0, percent=5.0, signal=Signal.AUTO, hysteresis=5.0),
        ),
        actions=Actions(
            events=True,
            renotify_seconds=3600.0,
            scale=ScaleAction(
                target_ref=ScaleTargetRef(api_version="apps/v1", kind="Deployment", name="llm-server"),
                min_replicas=1,
                max_replicas=8,
                scale_up_on=("saturated",),
                scale_down_on=("idle-gpu",),
                scale_up=ScaleDirection(
                    stabilization_seconds=0.0, step_replicas=1, step_percent=None, cooldown_seconds=60.0
                ),
                scale_down=ScaleDirection(
                    stabilization_seconds=300.0, step_replicas=1, step_percent=None, cooldown_seconds=300.0
                ),
                scale_up_min_pods=None,
                scale_up_min_pods_percent=50.0,
                dry_run=False,
                forecast=ScaleForecast(
                    ceiling_rule="saturated",
                    ceiling_percent=95.0,
                    signal=Signal.AUTO,
                    floor_rule="idle-gpu",
                    floor_percent=20.0,
                    horizon_seconds=None,
                    max_uncertainty=20.0,
                ),
            ),
        ),
    )
    # The shared sketch and the example parse to the same thing for every field the sketch sets.
    assert isinstance(spec.rules[0], UtilizationFloor)
    assert spec.rules[0].signal is Signal.AUTO


def test_minimal_spec_takes_the_crd_defaults() -> None:
    spec = parse_spec(
        {
            "selector": {},
            "rules": [
                {"name": "a", "utilizationFloor": {"percent": 10}},
                {"name": "b", "utilizationCeiling": {"percent": 90}},
                {"name": "c", "memoryCeiling": {"bytes": "120Gi"}},
                {"name": "d", "memoryGrowth": {"rate": "2Gi/h"}},
            ],
        }
    )
    assert spec.selector == LabelSelector()
    assert spec.evaluation_interval_seconds == 10.0
    assert spec.rules == (
        UtilizationFloor(name="a", percent=10.0, for_seconds=300.0, noise_floor=0.0, hysteresis=5.0),
        UtilizationCeiling(name="b", percent=90.0, for_seconds=120.0, hysteresis=5.0),
        MemoryCeiling(name="c", for_seconds=60.0, bytes=120 * 2**30, hysteresis=2.0),
        MemoryGrowth(name="d", rate_bytes_per_second=2 * 2**30 / 3600, window_seconds=1800.0, min_fit=0.8),
    )
    assert spec.actions == Actions(events=True, renotify_seconds=3600.0, scale=None)


def test_memory_growth_names_the_memory_it_watches() -> None:
    rules = [
        {"name": m, "memoryGrowth": {"rate": "1Mi/m", "memory": m}}
        for m in ("auto", "device", "allocated", "reserved", "host")
    ]
    spec = parse_spec({"selector": {}, "rules": rules})
    assert [r.memory for r in spec.rules if isinstance(r, MemoryGrowth)] == list(MemorySource)


def test_scale_defaults_and_percent_steps() -> None:
    spec = example_spec()
    spec["actions"]["scale"] = {
        "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "trainer"},
        "maxReplicas": 4,
        "scaleDownOn": ["idle-gpu"],
        "behavior": {"scaleUp": {"step": "50%"}},
    }
    scale = parse_spec(spec).actions.scale
    assert scale is not None
    assert scale.min_replicas == 1
    assert scale.scale_up_on == ()
    assert scale.scale_up_min_pods == 1
    assert scale.scale_up_min_pods_percent is None
    assert scale.scale_up == ScaleDirection(
        stabilization_seconds=0.0, step_replicas=None, step_percent=50.0, cooldown_seconds=60.0
    )
    assert scale.scale_down == ScaleDirection(
        stabilization_seconds=300.0, step_replicas=1, step_percent=None, cooldown_seconds=300.0
    )
    assert scale.dry_run is False


def test_nulls_read_as_absent() -> None:
    """The API server prunes null fields before defaulting; a YAML `for:` with no value means the default."""
    spec = example_spec()
    spec["rules"][0]["utilizationFloor"]["for"] = None
    spec["actions"]["scale"]["behavior"] = None
    parsed = parse_spec(spec)
    assert parsed.rules[0] == UtilizationFloor(
        name="idle-gpu", percent=20.0, for_seconds=300.0, noise_floor=2.0, power_threshold_watts=250.0
    )
    assert parsed.actions.scale is not None
    assert parsed.actions.scale.scale_down.cooldown_seconds == 300.0


def test_integral_float_replicas_are_integers() -> None:
    spec = example_spec()
    spec["actions"]["scale"]["maxReplicas"] = 8.0
    scale = parse_spec(spec).actions.scale
    assert scale is not None
    assert scale.max_replicas == 8
    assert isinstance(scale.max_replicas, int)


# --- every invalid spec, with its exact message --------------------------------------------------------

Edit = Callable[[dict[str, Any]], None]


def put(path: str, value: Any) -> Edit:
    """Set ``a.b[0].c`` (relative to spec) to ``value``."""

    def edit(spec: dict[str, Any]) -> None:
        parent, last = _walk(spec, path)
        parent[last] = value

    return edit


def drop(path: str) -> Edit:
    def edit(spec: dict[str, Any]) -> None:
        parent, last = _walk(spec, path)
        del parent[last]

    return edit


def edits(*steps: Edit) -> Edit:
    """Several edits, in order."""

    def edit(spec: dict[str, Any]) -> None:
        for step in steps:
            step(spec)

    return edit


def _walk(spec: dict[str, Any], path: str) -> tuple[Any, Any]:
    tokens: list[Any] = [int(t) if t.isdigit() else t for t in re.split(r"\.|\[|\]\.?", path) if t]
    target: Any = spec
    for token in tokens[:-1]:
        target = target[token]
    return target, tokens[-1]


KINDS = (
    "utilizationFloor, utilizationCeiling, idleGpus, memoryCeiling, memoryGrowth, gpuHealth, anomaly,"
    " requestLatency, requestQueue, kvCacheUsage"
)
ONE_TWO_ONE_TWO = "must be between 1 and 2147483647"

INVALID: list[tuple[str, Edit, str]] = [
    # durations
    (
        "duration unit",
        put("evaluationInterval", "10sec"),
        'spec.evaluationInterval: "10sec" is not a duration such as 10s, 5m or 1h30m (units h, m, s, ms)',
    ),
    (
        "duration days",
        put("rules[1].utilizationCeiling.for", "1d"),
        "spec.rules[1].utilizationCeiling.for:"
        ' "1d" is not a duration such as 10s, 5m or 1h30m (units h, m, s, ms)',
    ),
    (
        "duration spaces",
        put("actions.scale.behavior.scaleDown.stabilizationWindow", "5 m"),
        "spec.actions.scale.behavior.scaleDown.stabilizationWindow: "
        '"5 m" is not a duration such as 10s, 5m or 1h30m (units h, m, s, ms)',
    ),
    (
        "duration six digits",
        put("actions.renotifyInterval", "100000s"),
        "spec.actions.renotifyInterval:"
        ' "100000s" is not a duration such as 10s, 5m or 1h30m (units h, m, s, ms)',
    ),
    (
        "duration number",
        put("rules[0].utilizationFloor.for", 300),
        "spec.rules[0].utilizationFloor.for: must be a duration string such as 5m or 1h30m, not a number 300",
    ),
    (
        "evaluation too fast",
        put("evaluationInterval", "500ms"),
        'spec.evaluationInterval: "500ms" is too short; must be at least 1s',
    ),
    (
        "renotify too fast",
        put("actions.renotifyInterval", "30s"),
        'spec.actions.renotifyInterval: "30s" is too short; must be at least 1m',
    ),
    (
        "empty window",
        put("rules[3].memoryGrowth.window", "59s"),
        'spec.rules[3].memoryGrowth.window: "59s" is too short; must be at least 1m',
    ),
    (
        "floor window of nothing",
        put("rules[0].utilizationFloor.for", "0s"),
        "spec.rules[0].utilizationFloor.for: 0s is shorter than evaluationInterval (10s):"
        " a shorter window leaves samples that no evaluation reads",
    ),
    (
        "memory window below the interval",
        put("rules[2].memoryCeiling.for", "5s"),
        "spec.rules[2].memoryCeiling.for: 5s is shorter than evaluationInterval (10s):"
        " a shorter window leaves samples that no evaluation reads",
    ),
    (
        "growth window below the interval",
        edits(
            put("evaluationInterval", "1h"),
            *(
                put(f"rules[{i}].{kind}.for", "1h")
                for i, kind in enumerate(("utilizationFloor", "utilizationCeiling", "memoryCeiling"))
            ),
        ),
        "spec.rules[3].memoryGrowth.window: 30m is shorter than evaluationInterval (1h):"
        " a shorter window leaves samples that no evaluation reads",
    ),
    # rates
    (
        "rate unit",
        put("rules[3].memoryGrowth.rate", "100Mb/m"),
        'spec.rules[3].memoryGrowth.rate: "100Mb/m" is not a quantity per time unit such as 100Mi/m',
    ),
    (
        "rate per day",
        put("rules[3].memoryGrowth.rate", "1Gi/d"),
        'spec.rules[3].memoryGrowth.rate: "1Gi/d" is not a quantity per time unit such as 100Mi/m',
    ),
    (
        "rate without time",
        put("rules[3].memoryGrowth.rate", "100Mi"),
        'spec.rules[3].memoryGrowth.rate: "100Mi" is not a quantity per time unit such as 100Mi/m',
    ),
    (
        "rate zero",
        put("rules[3].memoryGrowth.rate", "0.0Mi/m"),
        'spec.rules[3].memoryGrowth.rate: "0.0Mi/m" must be greater than zero',
    ),
    (
        "rate number",
        put("rules[3].memoryGrowth.rate", 100),
        "spec.rules[3].memoryGrowth.rate: must be a quantity per time unit such as 100Mi/m, not a number",
    ),
    (
        "rate missing",
        drop("rules[3].memoryGrowth.rate"),
        "spec.rules[3].memoryGrowth.rate: required field is missing",
    ),
    # memoryCeiling
    (
        "percent and bytes",
        put("rules[2].memoryCeiling.bytes", "120Gi"),
        "spec.rules[2].memoryCeiling: memoryCeiling must set exactly one of percent or bytes; found both",
    ),
    (
        "neither percent nor bytes",
        drop("rules[2].memoryCeiling.percent"),
        "spec.rules[2].memoryCeiling: memoryCeiling must set exactly one of percent or bytes; found neither",
    ),
    (
        "bytes fractional",
        put("rules[2].memoryCeiling", {"bytes": "1.5"}),
        'spec.rules[2].memoryCeiling.bytes: "1.5" is not a whole number of bytes',
    ),
    (
        "bytes milli",
        put("rules[2].memoryCeiling", {"bytes": "100m"}),
        'spec.rules[2].memoryCeiling.bytes: "100m" is not a whole number of bytes',
    ),
    (
        "bytes GB",
        put("rules[2].memoryCeiling", {"bytes": "120GB"}),
        'spec.rules[2].memoryCeiling.bytes: "120GB" is not a quantity such as 120Gi, 80G or 85899345920',
    ),
    (
        "bytes negative",
        put("rules[2].memoryCeiling", {"bytes": "-1Gi"}),
        'spec.rules[2].memoryCeiling.bytes: "-1Gi" is negative; a byte size must not be',
    ),
    (
        "bytes zero",
        put("rules[2].memoryCeiling", {"bytes": 0}),
        "spec.rules[2].memoryCeiling.bytes: must be greater than zero",
    ),
    (
        "bytes beyond int64",
        put("rules[2].memoryCeiling", {"bytes": "10Ei"}),
        'spec.rules[2].memoryCeiling.bytes: "10Ei" is too large (at most 2^63-1 bytes)',
    ),
    (
        "bytes boolean",
        put("rules[2].memoryCeiling", {"bytes": True}),
        "spec.rules[2].memoryCeiling.bytes: must be a quantity such as 120Gi, not a boolean",
    ),
    # numbers
    (
        "percent above 100",
        put("rules[0].utilizationFloor.percent", 101),
        "spec.rules[0].utilizationFloor.percent: 101 is out of range; must be between 0 and 100",
    ),
    (
        "percent negative",
        put("rules[1].utilizationCeiling.percent", -0.5),
        "spec.rules[1].utilizationCeiling.percent: -0.5 is out of range; must be between 0 and 100",
    ),
    (
        "percent string",
        put("rules[0].utilizationFloor.percent", "20"),
        "spec.rules[0].utilizationFloor.percent: must be a number, not a string",
    ),
    (
        "percent boolean",
        put("rules[0].utilizationFloor.percent", True),
        "spec.rules[0].utilizationFloor.percent: must be a number, not a boolean",
    ),
    (
        "percent NaN",
        put("rules[1].utilizationCeiling.percent", math.nan),
        "spec.rules[1].utilizationCeiling.percent: must be a finite number, not nan",
    ),
    (
        "percent missing",
        drop("rules[1].utilizationCeiling.percent"),
        "spec.rules[1].utilizationCeiling.percent: required field is missing",
    ),
    (
        "memory percent above 100",
        put("rules[2].memoryCeiling.percent", 120),
        "spec.rules[2].memoryCeiling.percent: 120 is out of range; must be between 0 and 100",
    ),
    (
        "noise floor",
        put("rules[0].utilizationFloor.noiseFloor", 101),
        "spec.rules[0].utilizationFloor.noiseFloor: 101 is out of range; must be between 0 and 100",
    ),
    (
        "power negative",
        put("rules[0].utilizationFloor.powerThresholdWatts", -5),
        "spec.rules[0].utilizationFloor.powerThresholdWatts: -5 is out of range; must be at least 0",
    ),
    (
        "hysteresis",
        put("rules[1].utilizationCeiling.hysteresis", 60),
        "spec.rules[1].utilizationCeiling.hysteresis: 60 is out of range; must be between 0 and 50",
    ),
    (
        "memory hysteresis",
        put("rules[2].memoryCeiling.hysteresis", -1),
        "spec.rules[2].memoryCeiling.hysteresis: -1 is out of range; must be between 0 and 50",
    ),
    (
        "minFit",
        put("rules[3].memoryGrowth.minFit", 1.5),
        "spec.rules[3].memoryGrowth.minFit: 1.5 is out of range; must be between 0 and 1",
    ),
    (
        "memory",
        put("rules[3].memoryGrowth.memory", "bogus"),
        'spec.rules[3].memoryGrowth.memory: "bogus" is not one of auto, device, allocated, reserved, host',
    ),
    (
        "signal",
        put("rules[0].utilizationFloor.signal", "smactive"),
        'spec.rules[0].utilizationFloor.signal: "smactive" is not one of auto, smActive, gpuUtil',
    ),
    # rules
    (
        "unknown rule field",
        put("rules[0].utilizationFloor.precent", 20),
        'spec.rules[0].utilizationFloor.precent: unknown field (did you mean "percent"?)',
    ),
    (
        "noise floor on ceiling",
        put("rules[1].utilizationCeiling.noiseFloor", 2),
        "spec.rules[1].utilizationCeiling.noiseFloor:"
        " unknown field (expected one of: for, hysteresis, percent, signal)",
    ),
    (
        "unknown rule kind",
        put("rules[0]", {"name": "x", "powerCeiling": {"watts": 500}}),
        "spec.rules[0].powerCeiling: unknown field (expected one of: anomaly, gpuHealth, idleGpus,"
        " kvCacheUsage, memoryCeiling, memoryGrowth, name, requestLatency, requestQueue, utilizationCeiling,"
        " utilizationFloor)",
    ),
    (
        "no kind",
        put("rules[0]", {"name": "idle-gpu"}),
        f"spec.rules[0]: a rule must set exactly one of {KINDS}; found none",
    ),
    (
        "two kinds",
        put("rules[1].memoryGrowth", {"rate": "1Mi/m"}),
        f"spec.rules[1]: a rule must set exactly one of {KINDS}; found utilizationCeiling and memoryGrowth",
    ),
    (
        "duplicate name",
        put("rules[3].name", "idle-gpu"),
        'spec.rules[3].name: duplicate rule name "idle-gpu" (also spec.rules[0])',
    ),
    (
        "name uppercase",
        put("rules[0].name", "Idle"),
        "spec.rules[0].name:"
        ' "Idle" is not a valid rule name (a DNS label such as idle-gpu, at most 63 chars)',
    ),
    (
        "name too long",
        put("rules[0].name", "a" * 64),
        f"spec.rules[0].name:"
        f' "{"a" * 64}" is not a valid rule name (a DNS label such as idle-gpu, at most 63 chars)',
    ),
    ("name missing", drop("rules[2].name"), "spec.rules[2].name: required field is missing"),
    ("rules empty", put("rules", []), "spec.rules: must contain at least one rule"),
    (
        "rules too many",
        put("rules", [{"name": f"r{i}", "memoryGrowth": {"rate": "1Mi/m"}} for i in range(33)]),
        "spec.rules: has 33 items; at most 32 are allowed",
    ),
    ("rules object", put("rules", {"idle": {}}), "spec.rules: must be a list, not an object"),
    ("rule string", put("rules[0]", "idle-gpu"), "spec.rules[0]: must be an object, not a string"),
    # spec and selector
    (
        "unknown spec field",
        put("interval", "10s"),
        "spec.interval: unknown field"
        " (expected one of: actions, evaluationInterval, rules, selector, serviceMetrics)",
    ),
    ("selector missing", drop("selector"), "spec.selector: required field is missing"),
    ("selector list", put("selector", ["app=llm"]), "spec.selector: must be an object, not a list"),
    (
        "bad operator",
        put("selector.matchExpressions[0].operator", "Equals"),
        'spec.selector.matchExpressions[0].operator: "Equals" is not one of In, NotIn, Exists, DoesNotExist',
    ),
    (
        "In without values",
        put("selector.matchExpressions[0]", {"key": "tier", "operator": "In"}),
        "spec.selector.matchExpressions[0].values: must be non-empty when operator is In",
    ),
    (
        "Exists with values",
        put("selector.matchExpressions[0].values", ["x"]),
        "spec.selector.matchExpressions[0].values: must be empty when operator is DoesNotExist",
    ),
    (
        "bad label key",
        put("selector.matchLabels", {"-app": "x"}),
        'spec.selector.matchLabels[-app]: "-app" is not a valid label key such as app or example.com/tier',
    ),
    (
        "bad label prefix",
        put("selector.matchExpressions[0].key", "Example.com/tier"),
        'spec.selector.matchExpressions[0].key: "Example.com/tier" is not a valid label key such as app or '
        "example.com/tier",
    ),
    (
        "label value number",
        put("selector.matchLabels.app", 7),
        "spec.selector.matchLabels[app]: label value must be a string, not a number",
    ),
    (
        "label value spaces",
        put("selector.matchLabels.app", "llm server"),
        "spec.selector.matchLabels[app]:"
        ' "llm server" is not a valid label value (at most 63 of A-Z a-z 0-9 - _ .)',
    ),
    (
        "unknown selector field",
        put("selector.matchLabel", {"app": "x"}),
        'spec.selector.matchLabel: unknown field (did you mean "matchLabels"?)',
    ),
    # actions
    (
        "events string",
        put("actions.events", "yes"),
        "spec.actions.events: must be true or false, not a string",
    ),
    (
        "min above max",
        put("actions.scale.minReplicas", 9),
        "spec.actions.scale.minReplicas: 9 exceeds maxReplicas (8)",
    ),
    (
        "max zero",
        put("actions.scale.maxReplicas", 0),
        f"spec.actions.scale.maxReplicas: 0 is out of range; {ONE_TWO_ONE_TWO}",
    ),
    (
        "max fractional",
        put("actions.scale.maxReplicas", 2.5),
        "spec.actions.scale.maxReplicas: must be an integer, not a number",
    ),
    (
        "max missing",
        drop("actions.scale.maxReplicas"),
        "spec.actions.scale.maxReplicas: required field is missing",
    ),
    (
        "target missing",
        drop("actions.scale.targetRef"),
        "spec.actions.scale.targetRef: required field is missing",
    ),
    (
        "target name missing",
        drop("actions.scale.targetRef.name"),
        "spec.actions.scale.targetRef.name: required field is missing",
    ),
    (
        "target kind lowercase",
        put("actions.scale.targetRef.kind", "deployment"),
        'spec.actions.scale.targetRef.kind: "deployment" is not a kind such as Deployment',
    ),
    (
        "target a pod",
        put("actions.scale.targetRef", {"apiVersion": "v1", "kind": "Pod", "name": "trainer-0"}),
        'spec.actions.scale.targetRef.kind: "Pod" of "v1" has no /scale subresource',
    ),
    (
        "target a daemonset",
        put("actions.scale.targetRef.kind", "DaemonSet"),
        'spec.actions.scale.targetRef.kind: "DaemonSet" of "apps/v1" has no /scale subresource',
    ),
    (
        "target a job",
        put("actions.scale.targetRef", {"apiVersion": "batch/v1", "kind": "Job", "name": "train"}),
        'spec.actions.scale.targetRef.kind: "Job" of "batch/v1" has no /scale subresource',
    ),
    (
        "target name invalid",
        put("actions.scale.targetRef.name", "LLM_server"),
        'spec.actions.scale.targetRef.name: "LLM_server" is not a valid object name',
    ),
    (
        "scaleUpOn typo",
        put("actions.scale.scaleUpOn", ["saturatd"]),
        'spec.actions.scale.scaleUpOn[0]: "saturatd" is not a rule in spec.rules (did you mean "saturated"?)',
    ),
    (
        "scaleDownOn unknown",
        put("actions.scale.scaleDownOn", ["idle-gpu", "zzz"]),
        'spec.actions.scale.scaleDownOn[1]: "zzz" is not a rule in spec.rules',
    ),
    (
        "scaleUpOn duplicate",
        put("actions.scale.scaleUpOn", ["saturated", "saturated"]),
        'spec.actions.scale.scaleUpOn[1]: duplicate entry "saturated"',
    ),
    (
        "scaleUpOn string",
        put("actions.scale.scaleUpOn", "saturated"),
        "spec.actions.scale.scaleUpOn: must be a list, not a string",
    ),
    (
        "rule in both",
        put("actions.scale.scaleDownOn", ["idle-gpu", "saturated"]),
        'spec.actions.scale.scaleDownOn[1]: "saturated" is also in scaleUpOn; a rule cannot be in both',
    ),
    (
        "no scaling rules",
        lambda spec: spec["actions"]["scale"].update(scaleUpOn=[], scaleDownOn=[]),
        "spec.actions.scale: scale needs at least one rule in scaleUpOn or scaleDownOn",
    ),
    (
        "min pods percent",
        put("actions.scale.scaleUpMinPods", "150%"),
        'spec.actions.scale.scaleUpMinPods: "150%" is not a count such as 1 or a percentage from 1% to 100%',
    ),
    (
        "min pods zero",
        put("actions.scale.scaleUpMinPods", 0),
        f"spec.actions.scale.scaleUpMinPods: 0 is out of range; {ONE_TWO_ONE_TWO}",
    ),
    (
        "step zero",
        put("actions.scale.behavior.scaleUp.step", 0),
        f"spec.actions.scale.behavior.scaleUp.step: 0 is out of range; {ONE_TWO_ONE_TWO}",
    ),
    (
        "step word",
        put("actions.scale.behavior.scaleDown.step", "one"),
        "spec.actions.scale.behavior.scaleDown.step:"
        ' "one" is not a count such as 1 or a percentage from 1% to 999%',
    ),
    (
        "behavior typo",
        put("actions.scale.behavior.scaleup", {}),
        'spec.actions.scale.behavior.scaleup: unknown field (did you mean "scaleUp"?)',
    ),
    (
        "dryRun string",
        put("actions.scale.dryRun", "false"),
        "spec.actions.scale.dryRun: must be true or false, not a string",
    ),
]


@pytest.mark.parametrize(
    ("edit", "expected"), [(e, m) for _, e, m in INVALID], ids=[n for n, _, _ in INVALID]
)
def test_invalid_spec_message(edit: Edit, expected: str) -> None:
    spec = example_spec()
    edit(spec)
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert str(caught.value) == expected
    assert expected.startswith(caught.value.field + ": ")


def test_example_is_untouched_by_the_cases() -> None:
    """The edits work on copies: the example itself stays valid."""
    spec = example_spec()
    before = copy.deepcopy(spec)
    parse_spec(spec)
    assert spec == before


def test_spec_must_be_an_object() -> None:
    with pytest.raises(SpecError, match=r"^spec: must be an object, not a list$"):
        parse_spec([])  # type: ignore[arg-type]


# --- parse_policy_object ---------------------------------------------------------------------------------


def example_with(**changes: Any) -> Any:
    obj = example_object()
    obj.update(changes)
    return obj


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            example_with(apiVersion="gpuwarden.dev/v1"),
            'apiVersion: "gpuwarden.dev/v1" is not gpuwarden.dev/v1alpha1',
        ),
        (example_with(kind="GpuMonitorPolicy"), 'kind: "GpuMonitorPolicy" is not GPUMonitorPolicy'),
        (example_with(metadata={"namespace": "inference"}), "metadata.name: required field is missing"),
        (example_with(metadata={"name": "LLM"}), 'metadata.name: "LLM" is not a valid name'),
        (
            example_with(metadata={"name": "a", "namespace": "Inference"}),
            'metadata.namespace: "Inference" is not',
        ),
        (example_with(extra=1), "extra: unknown field"),
        (example_with(spec={"selector": {}, "rules": []}), "spec.rules: must contain at least one rule"),
        (["a", "b"], "must be an object, not a list"),
    ],
)
def test_policy_object_errors(doc: Any, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_policy_object(doc)
    assert message in str(caught.value)


def test_policy_object_ignores_status() -> None:
    """A file saved with `kubectl get -o yaml` carries status; the spec is what counts."""
    assert parse_policy_object(example_with(status={"matchedPods": 3})) == parse_policy_object(
        example_object()
    )


# --- durations -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0s", 0.0),
        ("10s", 10.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1h1m1s1ms", 3661.001),
        ("1m1h", 3660.0),  # order is free, as the pattern allows
        ("99999h", 99999 * 3600.0),
        ("5m5ms", 300.005),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "5", "m", "1.5h", "-5s", "5 s", "1d", "100000s", "1h1m1s1ms1h", "5M", "5us"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration such as"):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (5400, "1h30m"), (0.25, "250ms"), (86400, "24h")])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@given(st.integers(min_value=0, max_value=99_999 * 3_600_000 + 3_599_999))
def test_duration_format_parse_round_trip(millis: int) -> None:
    text = format_duration(millis / 1000)
    assert re.fullmatch(DURATION_PATTERN, text)
    assert parse_duration(text) == millis / 1000


_UNIT_MS = {"h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}


@given(st.lists(st.tuples(st.integers(0, 99_999), st.sampled_from(list(_UNIT_MS))), min_size=1, max_size=4))
def test_parse_duration_sums_any_valid_string(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    assert parse_duration(text) == sum(n * _UNIT_MS[unit] for n, unit in parts) / 1000


@given(st.text(alphabet="0123456789hms.- d", max_size=12))
def test_parse_duration_agrees_with_the_crd_pattern(text: str) -> None:
    if re.fullmatch(DURATION_PATTERN, text):
        assert parse_duration(text) >= 0
    else:
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(text)


# --- quantities and rates ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("1", 1),
        ("80Gi", 80 * 2**30),
        ("120G", 120 * 10**9),
        ("1.5Ki", 1536),
        (".5Ki", 512),
        ("5.", 5),
        ("+1Mi", 2**20),
        ("1k", 1000),
        ("1M", 10**6),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("1Ei", 2**60),
        ("1e3", 1000),
        ("1E3", 1000),
        ("2.5e+3", 2500),
        ("1200e-2", 12),
        ("2000m", 2),
        ("3000000u", 3),
        ("4000000000n", 4),
        ("-0", 0),
        (85899345920, 85899345920),
    ],
)
def test_parse_quantity(text: str | int, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("1.5", "not a whole number of bytes"),
        ("100m", "not a whole number of bytes"),
        ("1e-1", "not a whole number of bytes"),
        ("-1", "is negative"),
        (-1, "is negative"),
        ("8Ei", "is too large"),
        ("1e99", "exponent out of range"),
        ("1Kib", "is not a quantity"),
        ("1ki", "is not a quantity"),
        ("1KB", "is not a quantity"),
        ("1 Gi", "is not a quantity"),
        ("Gi", "is not a quantity"),
        ("", "is not a quantity"),
        ("1e", "is not a quantity"),
        ("1e1.5", "is not a quantity"),
        (True, "is not a quantity"),
    ],
)
def test_parse_quantity_rejects(text: str | int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_quantity(text)


@given(
    st.integers(0, 2**20),
    st.sampled_from([("", 1), ("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("k", 10**3)]),
)
def test_parse_quantity_suffixes(n: int, suffix: tuple[str, int]) -> None:
    assert parse_quantity(f"{n}{suffix[0]}") == n * suffix[1]


@given(st.integers(0, 10**9))
def test_parse_quantity_milli_is_whole_only_in_thousands(n: int) -> None:
    if n % 1000 == 0:
        assert parse_quantity(f"{n}m") == n // 1000
    else:
        with pytest.raises(ValueError, match="whole number"):
            parse_quantity(f"{n}m")


# The OpenAPI pattern Kubernetes publishes for resource.Quantity: looser than the parser (a decimal
# exponent), so a good source of near-misses.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


@given(st.from_regex(QUANTITY_PATTERN, fullmatch=True))
def test_parse_quantity_on_anything_the_pattern_accepts(text: str) -> None:
    """Never a crash: a value, or a ValueError saying why (negative, fractional, decimal exponent...)."""
    try:
        value = parse_quantity(text)
    except ValueError as exc:
        message = str(exc)
    else:
        assert 0 <= value < 2**63
        return
    assert text in message


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [
        ("100Mi/m", 100 * MI / 60),
        ("2Gi/h", 2 * 2**30 / 3600),
        ("500k/s", 500_000.0),
        ("1.5M/s", 1_500_000.0),
        ("1/s", 1.0),
        ("0.5Ki/s", 512.0),
        ("1Pi/h", 2**50 / 3600),
    ],
)
def test_parse_rate(text: str, bytes_per_second: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_second)


@pytest.mark.parametrize(
    "text",
    ["100Mb/m", "100Mi", "100Mi/min", "100Mi/d", "100 Mi/m", "Mi/m", "-1Mi/m", "1e3/s", "1Ei/s", ".5Mi/m"],
)
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a quantity per time unit such as 100Mi/m"):
        parse_rate(text)


@given(st.integers(1, 10**6), st.sampled_from(["s", "m", "h"]))
def test_parse_rate_is_exact(n: int, unit: str) -> None:
    seconds = {"s": 1, "m": 60, "h": 3600}[unit]
    assert parse_rate(f"{n}Mi/{unit}") == float(Fraction(n * MI, seconds))


@pytest.mark.parametrize(
    ("api_version", "kind"),
    [
        ("apps/v1", "Deployment"),
        ("apps/v1", "ReplicaSet"),
        ("v1", "ReplicationController"),
        ("argoproj.io/v1alpha1", "Rollout"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ],
)
def test_scale_targets_that_may_have_a_scale_subresource(api_version: str, kind: str) -> None:
    """The CRD's rule on targetRef lets these through; a custom resource's /scale is checked when read."""
    spec = example_spec()
    spec["actions"]["scale"] = {
        "targetRef": {"apiVersion": api_version, "kind": kind, "name": "serve"},
        "maxReplicas": 4,
        "scaleDownOn": ["idle-gpu"],
    }
    scale = parse_spec(spec).actions.scale
    assert scale is not None
    assert scale.target_ref.kind == kind


def test_a_percent_under_one_is_warned() -> None:
    spec = example_spec()
    del spec["actions"]
    spec["rules"] = [
        {"name": "idle", "utilizationFloor": {"percent": 0.2, "for": "5m"}},
        {"name": "busy", "utilizationCeiling": {"percent": 95, "for": "5m"}},
        {"name": "off", "idleGpus": {"percent": 0}},
    ]
    assert spec_warnings(parse_spec(spec)) == (
        "rule idle: percent 0.2 means 0.2%, not 20% (percent is 0 to 100)",
    )

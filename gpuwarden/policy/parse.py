"""Build a typed :class:`~gpuwarden.policy.spec.model.PolicySpec` from a GPUMonitorPolicy's camelCase spec.

``parse_spec`` applies the CRD's defaults and enforces everything its schema and CEL rules enforce
(and a little more), because local mode reads policy files that never went through an API server.
Every error is a :class:`SpecError` naming the field, in the API server's path notation.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gpuwarden.policy.spec.model import (
    BUCKET_SECONDS,
    MAX_STEPS,
    Actions,
    Anomaly,
    AnomalyMetric,
    GpuHealthRule,
    LabelRequirement,
    LabelSelector,
    MemoryCeiling,
    MemoryGrowth,
    MemorySource,
    PolicySpec,
    Rule,
    ScaleAction,
    ScaleDirection,
    ScaleForecast,
    ScaleTargetRef,
    Signal,
    Throttling,
    UtilizationCeiling,
    UtilizationFloor,
)
from gpuwarden.policy.xids import CRITICAL_XIDS
from gpuwarden.units import format_duration, parse_duration, parse_quantity, parse_rate

__all__ = [
    "API_VERSION",
    "DEFAULTS",
    "KIND",
    "PolicyObject",
    "SpecError",
    "parse_duration",
    "parse_policy_object",
    "parse_quantity",
    "parse_rate",
    "parse_selector",
    "parse_spec",
]

API_VERSION = "gpuwarden.dev/v1alpha1"
KIND = "GPUMonitorPolicy"

# Limits mirrored from the CRD; the CRD needs them for CEL cost estimates, we keep them so a policy
# file that works locally also applies to a cluster.
MAX_RULES = 32
MAX_SELECTOR_ENTRIES = 32
MAX_SELECTOR_VALUES = 64
MAX_REPLICAS = 2**31 - 1  # int32, as in the CRD and the /scale subresource
MIN_EVALUATION_INTERVAL = 1.0
MIN_RENOTIFY_INTERVAL = 60.0
# The engine fits a line through 20 bucket medians (window/20 each): under a minute, that is noise.
MIN_GROWTH_WINDOW = 60.0
# A baseline needs readings enough to say what is usual: a minute of them, at the agent's 1 s.
MIN_ANOMALY_WINDOW = 60.0
# A forecast looks at least one evaluation ahead and at most as far as it forecasts (model.MAX_STEPS).
MIN_FORECAST_HORIZON = 10.0
MAX_FORECAST_HORIZON = MAX_STEPS * BUCKET_SECONDS

# The CRD's scalar defaults, by the schema path of the object that holds them. The API server fills them
# in; local mode's policy files never went through one, so the parser does. tests/unit/test_crd_schema.py
# checks that this table and the CRD's `default`s are the same. (Empty objects and lists the CRD defaults,
# such as actions: {}, read here as absent: the same thing.)
DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    ".spec": {"evaluationInterval": "10s"},
    ".spec.rules[].utilizationFloor": {"for": "5m", "signal": "auto", "noiseFloor": 0, "hysteresis": 5},
    ".spec.rules[].utilizationCeiling": {"for": "2m", "signal": "auto", "hysteresis": 5},
    ".spec.rules[].memoryCeiling": {"for": "1m", "hysteresis": 2},
    ".spec.rules[].memoryGrowth": {"window": "30m", "minFit": 0.8, "for": "0s", "memory": "auto"},
    ".spec.rules[].anomaly": {"window": "30m", "threshold": 5, "minDeviation": 5},
    ".spec.rules[].gpuHealth": {"gpuLost": True, "memoryErrors": True, "for": "5m", "clearAfter": "10m"},
    ".spec.actions": {"events": True, "renotifyInterval": "1h"},
    ".spec.actions.scale": {"minReplicas": 1, "scaleUpMinPods": 1, "dryRun": False},
    ".spec.actions.scale.behavior.scaleUp": {"stabilizationWindow": "0s", "step": 1, "cooldown": "1m"},
    ".spec.actions.scale.behavior.scaleDown": {"stabilizationWindow": "5m", "step": 1, "cooldown": "5m"},
    ".spec.actions.scale.forecast": {"maxUncertainty": 20},
}
_SPEC = DEFAULTS[".spec"]
_FLOOR = DEFAULTS[".spec.rules[].utilizationFloor"]
_CEILING = DEFAULTS[".spec.rules[].utilizationCeiling"]
_MEMORY = DEFAULTS[".spec.rules[].memoryCeiling"]
_GROWTH = DEFAULTS[".spec.rules[].memoryGrowth"]
_ANOMALY = DEFAULTS[".spec.rules[].anomaly"]
_HEALTH = DEFAULTS[".spec.rules[].gpuHealth"]
_ACTIONS = DEFAULTS[".spec.actions"]
_SCALE = DEFAULTS[".spec.actions.scale"]
_SCALE_UP = DEFAULTS[".spec.actions.scale.behavior.scaleUp"]
_SCALE_DOWN = DEFAULTS[".spec.actions.scale.behavior.scaleDown"]
_FORECAST = DEFAULTS[".spec.actions.scale.forecast"]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_KIND = re.compile(r"[A-Z][A-Za-z0-9]*")
_MIN_PODS_PERCENT = re.compile(r"(100|[1-9][0-9]?)%")
_STEP_PERCENT = re.compile(r"[1-9][0-9]{0,2}%")

_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_RULE_KINDS = (
    "utilizationFloor",
    "utilizationCeiling",
    "memoryCeiling",
    "memoryGrowth",
    "gpuHealth",
    "anomaly",
)
MAX_XIDS = 64
MAX_XID = 2**32 - 1  # NVML reports an XID as an unsigned 32-bit number

_T = TypeVar("_T")


class SpecError(ValueError):
    """A policy the API would reject, or that cannot be evaluated; ``field`` is the path of the culprit."""

    def __init__(self, field: str, reason: str, *, source: str | None = None) -> None:
        self.field = field
        self.reason = reason
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.field}: {self.reason}" if self.field else self.reason
        return f"{self.source}: {text}" if self.source else text


def parse_spec(spec: Mapping[str, Any], *, path: str = "spec") -> PolicySpec:
    """Parse a GPUMonitorPolicy ``spec`` (camelCase, as stored by the API server or read from YAML).

    Applies the CRD's defaults; raises :class:`SpecError` naming the field for anything invalid,
    including unknown fields, duplicate rule names and scale actions naming rules that do not exist.
    """
    spec = _object(spec, path)
    _check_fields(spec, path, ("selector", "evaluationInterval", "rules", "actions"), ("selector", "rules"))
    selector = parse_selector(spec["selector"], path=f"{path}.selector")
    interval = _duration(
        spec, "evaluationInterval", path, _SPEC["evaluationInterval"], minimum=MIN_EVALUATION_INTERVAL
    )
    rules = _rules(spec["rules"], f"{path}.rules")
    _check_windows(rules, interval, f"{path}.rules")
    actions = _actions(spec.get("actions"), f"{path}.actions", rules)
    return PolicySpec(selector=selector, rules=rules, evaluation_interval_seconds=interval, actions=actions)


def parse_selector(selector: Any, *, path: str = "selector") -> LabelSelector:
    """Parse a Kubernetes LabelSelector (matchLabels, matchExpressions), validating keys and values."""
    obj = _object(selector, path)
    _check_fields(obj, path, ("matchLabels", "matchExpressions"))
    labels: list[tuple[str, str]] = []
    match_labels = obj.get("matchLabels")
    if match_labels is not None:
        ml_path = f"{path}.matchLabels"
        ml = _object(match_labels, ml_path)
        if len(ml) > MAX_SELECTOR_ENTRIES:
            raise SpecError(ml_path, f"has {len(ml)} entries; at most {MAX_SELECTOR_ENTRIES} are allowed")
        for key, value in ml.items():
            _label_key(key, f"{ml_path}[{key}]")
            labels.append((key, _label_value(value, f"{ml_path}[{key}]")))
    requirements: list[LabelRequirement] = []
    expressions = obj.get("matchExpressions")
    if expressions is not None:
        me_path = f"{path}.matchExpressions"
        items = _list(expressions, me_path, max_items=MAX_SELECTOR_ENTRIES)
        requirements = [_requirement(item, f"{me_path}[{i}]") for i, item in enumerate(items)]
    return LabelSelector(match_labels=tuple(sorted(labels)), match_expressions=tuple(requirements))


@dataclass(frozen=True, slots=True)
class PolicyObject:
    """A whole GPUMonitorPolicy object, checked: its name, namespace (None: not set) and parsed spec."""

    name: str
    namespace: str | None
    spec: PolicySpec


def parse_policy_object(doc: Any) -> PolicyObject:
    """Check a whole GPUMonitorPolicy object (apiVersion, kind, metadata; status ignored, as a file
    saved with ``kubectl get -o yaml`` carries it) and parse its spec.

    Pure: the caller reads the file (local mode: :mod:`gpuwarden.local.policies`).
    """
    obj = _object(doc, "")
    _check_fields(
        obj, "", ("apiVersion", "kind", "metadata", "spec", "status"), ("apiVersion", "kind", "spec")
    )
    if obj["apiVersion"] != API_VERSION:
        raise SpecError("apiVersion", f"{_show(obj['apiVersion'])} is not {API_VERSION}")
    if obj["kind"] != KIND:
        raise SpecError("kind", f"{_show(obj['kind'])} is not {KIND}")
    metadata = _object(obj.get("metadata"), "metadata")
    name = metadata.get("name")
    if name is None:
        raise SpecError("metadata.name", "required field is missing")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(
            "metadata.name", f"{_show(name)} is not a valid name (a DNS subdomain such as llm-serving)"
        )
    namespace = metadata.get("namespace")
    if namespace is not None and (
        not isinstance(namespace, str) or len(namespace) > 63 or not _DNS_LABEL.fullmatch(namespace)
    ):
        raise SpecError("metadata.namespace", f"{_show(namespace)} is not a namespace name")
    return PolicyObject(name, namespace, parse_spec(obj["spec"]))


# --- rules -------------------------------------------------------------------------------------------


def _rules(value: Any, path: str) -> tuple[Rule, ...]:
    """spec.rules: 1..32 rules with unique names, each with exactly one kind."""
    items = _list(value, path, max_items=MAX_RULES)
    if not items:
        raise SpecError(path, "must contain at least one rule")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        rule_path = f"{path}[{i}]"
        rule = _rule(item, rule_path)
        if rule.name in seen:
            raise SpecError(
                f"{rule_path}.name", f'duplicate rule name "{rule.name}" (also {path}[{seen[rule.name]}])'
            )
        seen[rule.name] = i
        rules.append(rule)
    return tuple(rules)


def _check_windows(rules: Sequence[Rule], interval: float, path: str) -> None:
    """Every rule's window (``for``, memoryGrowth's and anomaly's ``window``) spans an evaluation interval.

    A shorter window leaves samples between two evaluations that no evaluation reads: an idle spell or
    a leak could come and go unjudged. The CRD's CEL rule on spec enforces the same (gpuHealth, which
    reads no window, is left out of both).
    """
    for i, rule in enumerate(rules):
        if isinstance(rule, GpuHealthRule):
            continue  # no window of samples: it judges states and events as they are reported
        if isinstance(rule, MemoryGrowth):
            field, seconds = "memoryGrowth.window", rule.window_seconds
        elif isinstance(rule, Anomaly):
            field, seconds = "anomaly.window", rule.window_seconds
        else:
            field, seconds = f"{_WINDOW_KINDS[type(rule)]}.for", rule.for_seconds
        if seconds < interval:
            shorter = f"{format_duration(seconds)} is shorter than evaluationInterval"
            raise SpecError(
                f"{path}[{i}].{field}",
                f"{shorter} ({format_duration(interval)}): a shorter window leaves samples that no"
                " evaluation reads",
            )


_WINDOW_KINDS: dict[type[Rule], str] = {
    UtilizationFloor: "utilizationFloor",
    UtilizationCeiling: "utilizationCeiling",
    MemoryCeiling: "memoryCeiling",
}


def _rule(value: Any, path: str) -> Rule:
    """One rule: a name and exactly one of the rule kinds."""
    obj = _object(value, path)
    _check_fields(obj, path, ("name", *_RULE_KINDS), ("name",))
    name = obj["name"]
    if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.fullmatch(name):
        raise SpecError(
            f"{path}.name",
            f"{_show(name)} is not a valid rule name (a DNS label such as idle-gpu, at most 63 chars)",
        )
    kinds = [k for k in _RULE_KINDS if obj.get(k) is not None]
    if len(kinds) != 1:
        found = "none" if not kinds else " and ".join(kinds)
        raise SpecError(path, f"a rule must set exactly one of {', '.join(_RULE_KINDS)}; found {found}")
    kind = kinds[0]
    body = _object(obj[kind], f"{path}.{kind}")
    builder: Callable[[str, Mapping[str, Any], str], Rule] = _RULE_BUILDERS[kind]
    return builder(name, body, f"{path}.{kind}")


def _utilization_floor(name: str, obj: Mapping[str, Any], path: str) -> Rule:
    _check_fields(
        obj,
        path,
        ("percent", "for", "signal", "noiseFloor", "powerThresholdWatts", "hysteresis"),
        ("percent",),
    )
    return UtilizationFloor(
        name=name,
        percent=_number(obj, "percent", path, None, 0, 100),
        for_seconds=_duration(obj, "for", path, _FLOOR["for"]),
        signal=_signal(obj, path, _FLOOR["signal"]),
        noise_floor=_number(obj, "noiseFloor", path, _FLOOR["noiseFloor"], 0, 100),
        power_threshold_watts=_optional_number(obj, "powerThresholdWatts", path, 0, None),
        hysteresis=_number(obj, "hysteresis", path, _FLOOR["hysteresis"], 0, 50),
    )


def _utilization_ceiling(name: str, obj: Mapping[str, Any], path: str) -> Rule:
    _check_fields(obj, path, ("percent", "for", "signal", "hysteresis"), ("percent",))
    return UtilizationCeiling(
        name=name,
        percent=_number(obj, "percent", path, None, 0, 100),
        for_seconds=_duration(obj, "for", path, _CEILING["for"]),
        signal=_signal(obj, path, _CEILING["signal"]),
        hysteresis=_number(obj, "hysteresis", path, _CEILING["hysteresis"], 0, 50),
    )


def _memory_ceiling(name: str, obj: Mapping[str, Any], path: str) -> Rule:
    _check_fields(obj, path, ("percent", "bytes", "for", "hysteresis"))
    has_percent, has_bytes = obj.get("percent") is not None, obj.get("bytes") is not None
    if has_percent == has_bytes:
        found = "both" if has_percent else "neither"
        raise SpecError(path, f"memoryCeiling must set exactly one of percent or bytes; found {found}")
    size: int | None = None
    if has_bytes:
        raw = obj["bytes"]
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise SpecError(f"{path}.bytes", f"must be a quantity such as 120Gi, not {_kind(raw)}")
        try:
            size = parse_quantity(raw)
        except ValueError as exc:
            raise SpecError(f"{path}.bytes", str(exc)) from None
        if size == 0:
            raise SpecError(f"{path}.bytes", "must be greater than zero")
    return MemoryCeiling(
        name=name,
        for_seconds=_duration(obj, "for", path, _MEMORY["for"]),
        percent=_optional_number(obj, "percent", path, 0, 100),
        bytes=size,
        hysteresis=_number(obj, "hysteresis", path, _MEMORY["hysteresis"], 0, 50),
    )


def _memory_growth(name: str, obj: Mapping[str, Any], path: str) -> Rule:
    _check_fields(obj, path, ("rate", "window", "minFit", "for", "memory"), ("rate",))
    raw = obj["rate"]
    if not isinstance(raw, str):
        raise SpecError(f"{path}.rate", f"must be a quantity per time unit such as 100Mi/m, not {_kind(raw)}")
    try:
        rate = parse_rate(raw)
    except ValueError as exc:
        raise SpecError(f"{path}.rate", str(exc)) from None
    return MemoryGrowth(
        name=name,
        rate_bytes_per_second=rate,
        window_seconds=_duration(obj, "window", path, _GROWTH["window"], minimum=MIN_GROWTH_WINDOW),
        min_fit=_number(obj, "minFit", path, _GROWTH["minFit"], 0, 1),
        for_seconds=_duration(obj, "for", path, _GROWTH["for"]),
        memory=_memory_source(obj, path),
    )


def _memory_source(obj: Mapping[str, Any], path: str) -> MemorySource:
    raw = _get(obj, "memory", _GROWTH["memory"])
    try:
        return MemorySource(raw)
    except ValueError:
        choices = ", ".join(s.value for s in MemorySource)
        raise SpecError(f"{path}.memory", f"{_show(raw)} is not one of {choices}") from None


def _anomaly(name: str, obj: Mapping[str, Any], path: str) -> Rule:
    _check_fields(obj, path, ("metric", "window", "threshold", "minDeviation"), ("metric",))
    raw = obj["metric"]
    try:
        metric = AnomalyMetric(raw)
    except ValueError:
        choices = ", ".join(m.value for m in AnomalyMetric)
        raise SpecError(f"{path}.metric", f"{_show(raw)} is not one of {choices}") from None
    return Anomaly(
        name=name,
        metric=metric,
        window_seconds=_duration(obj, "window", path, _ANOMALY["window"], minimum=MIN_ANOMALY_WINDOW),
        threshold=_number(obj, "threshold", path, _ANOMALY["threshold"], 1, 100),
        min_deviation=_number(obj, "minDeviation", path, _ANOMALY["minDeviation"], 0, 100),
    )


def _gpu_health(name: str, obj: Mapping[str, Any], path: str) -> Rule:
    _check_fields(obj, path, ("xids", "gpuLost", "memoryErrors", "throttling", "for", "clearAfter"))
    raw_xids = obj.get("xids")
    xids = CRITICAL_XIDS  # absent; the CRD has no list default (its defaults are scalars: DEFAULTS)
    if raw_xids is not None:
        items = _list(raw_xids, f"{path}.xids", max_items=MAX_XIDS)
        codes: list[int] = []
        for i, code in enumerate(items):
            item_path = f"{path}.xids[{i}]"
            if isinstance(code, float) and code.is_integer():
                code = int(code)  # JSON has one number type (as _integer says)
            if isinstance(code, bool) or not isinstance(code, int):
                raise SpecError(item_path, f"must be an XID code (a whole number), not {_kind(code)}")
            if not 1 <= code <= MAX_XID:
                raise SpecError(item_path, f"{code} is out of range; must be between 1 and {MAX_XID}")
            if code in codes:
                raise SpecError(item_path, f"duplicate XID {code}")
            codes.append(code)
        xids = tuple(codes)
    raw_throttling = obj.get("throttling")
    throttling: list[Throttling] = []
    items = [] if raw_throttling is None else _list(raw_throttling, f"{path}.throttling", max_items=3)
    for i, item in enumerate(items):
        try:
            value = Throttling(item)
        except ValueError:
            choices = ", ".join(t.value for t in Throttling)
            raise SpecError(f"{path}.throttling[{i}]", f"{_show(item)} is not one of {choices}") from None
        if value in throttling:
            raise SpecError(f"{path}.throttling[{i}]", f'duplicate entry "{value}"')
        throttling.append(value)
    rule = GpuHealthRule(
        name=name,
        xids=xids,
        gpu_lost=_bool(obj, "gpuLost", path, _HEALTH["gpuLost"]),
        memory_errors=_bool(obj, "memoryErrors", path, _HEALTH["memoryErrors"]),
        throttling=tuple(throttling),
        for_seconds=_duration(obj, "for", path, _HEALTH["for"]),
        clear_after_seconds=_duration(obj, "clearAfter", path, _HEALTH["clearAfter"], minimum=1.0),
    )
    if not (rule.xids or rule.gpu_lost or rule.memory_errors or rule.throttling):
        raise SpecError(path, "gpuHealth counts nothing: set xids, gpuLost, memoryErrors or throttling")
    return rule


_RULE_BUILDERS: dict[str, Callable[[str, Mapping[str, Any], str], Rule]] = {
    "utilizationFloor": _utilization_floor,
    "utilizationCeiling": _utilization_ceiling,
    "memoryCeiling": _memory_ceiling,
    "memoryGrowth": _memory_growth,
    "anomaly": _anomaly,
    "gpuHealth": _gpu_health,
}


def _signal(obj: Mapping[str, Any], path: str, default: str) -> Signal:
    raw = _get(obj, "signal", default)
    try:
        return Signal(raw)
    except ValueError:
        choices = ", ".join(s.value for s in Signal)
        raise SpecError(f"{path}.signal", f"{_show(raw)} is not one of {choices}") from None


# --- actions -----------------------------------------------------------------------------------------


def _actions(value: Any, path: str, rules: Sequence[Rule]) -> Actions:
    """spec.actions; ``rules`` lets scale check the rules it names."""
    if value is None:
        return Actions()
    obj = _object(value, path)
    _check_fields(obj, path, ("events", "renotifyInterval", "scale"))
    events = _bool(obj, "events", path, _ACTIONS["events"])
    renotify = _duration(
        obj, "renotifyInterval", path, _ACTIONS["renotifyInterval"], minimum=MIN_RENOTIFY_INTERVAL
    )
    scale = None if obj.get("scale") is None else _scale(obj["scale"], f"{path}.scale", rules)
    return Actions(events=events, renotify_seconds=renotify, scale=scale)


def _scale(value: Any, path: str, rules: Sequence[Rule]) -> ScaleAction:
    obj = _object(value, path)
    rule_names = tuple(r.name for r in rules)
    _check_fields(
        obj,
        path,
        (
            "targetRef",
            "minReplicas",
            "maxReplicas",
            "scaleUpOn",
            "scaleDownOn",
            "scaleUpMinPods",
            "behavior",
            "dryRun",
            "forecast",
        ),
        ("targetRef", "maxReplicas"),
    )
    target = _target_ref(obj["targetRef"], f"{path}.targetRef")
    min_replicas = _integer(obj, "minReplicas", path, _SCALE["minReplicas"], 1, MAX_REPLICAS)
    max_replicas = _integer(obj, "maxReplicas", path, None, 1, MAX_REPLICAS)
    if min_replicas > max_replicas:
        raise SpecError(f"{path}.minReplicas", f"{min_replicas} exceeds maxReplicas ({max_replicas})")
    up_on = _rule_refs(obj, "scaleUpOn", path, rule_names)
    down_on = _rule_refs(obj, "scaleDownOn", path, rule_names)
    if not up_on and not down_on:
        raise SpecError(path, "scale needs at least one rule in scaleUpOn or scaleDownOn")
    for i, rule in enumerate(down_on):
        if rule in up_on:
            raise SpecError(
                f"{path}.scaleDownOn[{i}]", f'"{rule}" is also in scaleUpOn; a rule cannot be in both'
            )
    min_pods, min_pods_percent = _count_or_percent(
        obj, "scaleUpMinPods", path, _SCALE["scaleUpMinPods"], _MIN_PODS_PERCENT, "1% to 100%"
    )
    behavior = obj.get("behavior")
    b_path = f"{path}.behavior"
    b_obj: Mapping[str, Any] = {} if behavior is None else _object(behavior, b_path)
    _check_fields(b_obj, b_path, ("scaleUp", "scaleDown"))
    return ScaleAction(
        target_ref=target,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        scale_up_on=up_on,
        scale_down_on=down_on,
        scale_up=_direction(b_obj.get("scaleUp"), f"{b_path}.scaleUp", _SCALE_UP),
        scale_down=_direction(b_obj.get("scaleDown"), f"{b_path}.scaleDown", _SCALE_DOWN),
        scale_up_min_pods=min_pods,
        scale_up_min_pods_percent=min_pods_percent,
        dry_run=_bool(obj, "dryRun", path, _SCALE["dryRun"]),
        forecast=None
        if obj.get("forecast") is None
        else _forecast(obj["forecast"], f"{path}.forecast", rules, up_on, down_on),
    )


def _forecast(
    value: Any, path: str, rules: Sequence[Rule], up_on: Sequence[str], down_on: Sequence[str]
) -> ScaleForecast:
    """scale.forecast, its ceiling and floor taken from the first utilization rules scale names."""
    obj = _object(value, path)
    _check_fields(obj, path, ("horizon", "maxUncertainty"))
    by_name = {r.name: r for r in rules}
    ceilings = [r for n in up_on if isinstance(r := by_name[n], UtilizationCeiling)]
    floors = [r for n in down_on if isinstance(r := by_name[n], UtilizationFloor)]
    if not ceilings:
        raise SpecError(
            path,
            "forecast needs a utilizationCeiling rule in scaleUpOn: its ceiling is what it forecasts against",
        )
    ceiling = ceilings[0]
    floor = floors[0] if floors else None
    horizon = None
    if obj.get("horizon") is not None:
        horizon = _duration(obj, "horizon", path, "0s", minimum=MIN_FORECAST_HORIZON)
        if horizon > MAX_FORECAST_HORIZON:
            raise SpecError(f"{path}.horizon", f"must be at most {format_duration(MAX_FORECAST_HORIZON)}")
    return ScaleForecast(
        ceiling_rule=ceiling.name,
        ceiling_percent=ceiling.percent,
        signal=ceiling.signal,
        floor_rule=None if floor is None else floor.name,
        floor_percent=None if floor is None else floor.percent,
        horizon_seconds=horizon,
        max_uncertainty=_number(obj, "maxUncertainty", path, _FORECAST["maxUncertainty"], 1, 100),
    )


def _target_ref(value: Any, path: str) -> ScaleTargetRef:
    obj = _object(value, path)
    _check_fields(obj, path, ("apiVersion", "kind", "name"), ("apiVersion", "kind", "name"))
    api_version = _string(obj, "apiVersion", path, max_length=253)
    kind = _string(obj, "kind", path, max_length=63)
    if not _KIND.fullmatch(kind):
        raise SpecError(f"{path}.kind", f"{_show(kind)} is not a kind such as Deployment")
    name = _string(obj, "name", path, max_length=253)
    if not _DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(f"{path}.name", f"{_show(name)} is not a valid object name")
    return ScaleTargetRef(api_version=api_version, kind=kind, name=name)


def _rule_refs(obj: Mapping[str, Any], key: str, path: str, rule_names: Sequence[str]) -> tuple[str, ...]:
    """scaleUpOn / scaleDownOn: a set of names of rules that exist."""
    list_path = f"{path}.{key}"
    raw = obj.get(key)
    items = [] if raw is None else _list(raw, list_path, max_items=MAX_RULES)
    names: list[str] = []
    for i, item in enumerate(items):
        item_path = f"{list_path}[{i}]"
        if not isinstance(item, str):
            raise SpecError(item_path, f"must be a rule name, not {_kind(item)}")
        if item in names:
            raise SpecError(item_path, f'duplicate entry "{item}"')
        if item not in rule_names:
            raise SpecError(
                item_path, f'"{item}" is not a rule in spec.rules{_did_you_mean(item, rule_names)}'
            )
        names.append(item)
    return tuple(names)


def _direction(value: Any, path: str, defaults: Mapping[str, Any]) -> ScaleDirection:
    """behavior.scaleUp / behavior.scaleDown with that direction's defaults."""
    obj: Mapping[str, Any] = {} if value is None else _object(value, path)
    _check_fields(obj, path, ("stabilizationWindow", "step", "cooldown"))
    replicas, percent = _count_or_percent(obj, "step", path, defaults["step"], _STEP_PERCENT, "1% to 999%")
    return ScaleDirection(
        stabilization_seconds=_duration(obj, "stabilizationWindow", path, defaults["stabilizationWindow"]),
        step_replicas=replicas,
        step_percent=percent,
        cooldown_seconds=_duration(obj, "cooldown", path, defaults["cooldown"]),
    )


def _count_or_percent(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: int,
    percent_re: re.Pattern[str],
    percent_range: str,
) -> tuple[int | None, float | None]:
    """An int-or-string field: a count >= 1 or a percentage string; exactly one is set."""
    raw = _get(obj, key, default)
    field = f"{path}.{key}"
    if isinstance(raw, str):
        if not percent_re.fullmatch(raw):
            raise SpecError(
                field, f"{_show(raw)} is not a count such as 1 or a percentage from {percent_range}"
            )
        return None, float(raw[:-1])
    return _integer({key: raw}, key, path, None, 1, MAX_REPLICAS), None


# --- selector ------------------------------------------------------------------------------------------


def _requirement(value: Any, path: str) -> LabelRequirement:
    obj = _object(value, path)
    _check_fields(obj, path, ("key", "operator", "values"), ("key", "operator"))
    key = obj["key"]
    _label_key(key, f"{path}.key")
    operator = obj["operator"]
    if operator not in _OPERATORS:
        raise SpecError(f"{path}.operator", f"{_show(operator)} is not one of {', '.join(_OPERATORS)}")
    raw_values = obj.get("values")
    values_path = f"{path}.values"
    items = [] if raw_values is None else _list(raw_values, values_path, max_items=MAX_SELECTOR_VALUES)
    values = tuple(_label_value(v, f"{values_path}[{i}]") for i, v in enumerate(items))
    if operator in ("In", "NotIn") and not values:
        raise SpecError(values_path, f"must be non-empty when operator is {operator}")
    if operator in ("Exists", "DoesNotExist") and values:
        raise SpecError(values_path, f"must be empty when operator is {operator}")
    return LabelRequirement(key=key, operator=operator, values=values)


def _label_key(key: Any, path: str) -> None:
    """A label key: an optional DNS-subdomain prefix (<= 253) and '/', then a name (<= 63)."""
    if not isinstance(key, str):
        raise SpecError(path, f"label key must be a string, not {_kind(key)}")
    prefix, slash, name = key.rpartition("/")
    ok = bool(_LABEL_NAME.fullmatch(name)) and len(name) <= 63
    if slash:
        ok = ok and len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(prefix))
    if not ok:
        raise SpecError(path, f"{_show(key)} is not a valid label key such as app or example.com/tier")


def _label_value(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise SpecError(path, f"label value must be a string, not {_kind(value)}")
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        raise SpecError(path, f"{_show(value)} is not a valid label value (at most 63 of A-Z a-z 0-9 - _ .)")
    return value


# --- scalars -------------------------------------------------------------------------------------------


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, not {_kind(value)}")
    for key in value:
        if not isinstance(key, str):
            raise SpecError(path, f"field names must be strings, not {_kind(key)} {key!r}")
    return value


def _list(value: Any, path: str, *, max_items: int) -> Sequence[Any]:
    if not isinstance(value, list | tuple):
        raise SpecError(path, f"must be a list, not {_kind(value)}")
    if len(value) > max_items:
        raise SpecError(path, f"has {len(value)} items; at most {max_items} are allowed")
    return value


def _check_fields(
    obj: Mapping[str, Any], path: str, allowed: Collection[str], required: Collection[str] = ()
) -> None:
    """Unknown fields are errors (the API server would prune them silently: a typo would go unnoticed)."""
    for key in obj:
        if key not in allowed:
            field = f"{path}.{key}" if path else key
            hint = _did_you_mean(key, allowed) or f" (expected one of: {', '.join(sorted(allowed))})"
            raise SpecError(field, f"unknown field{hint}")
    for key in required:
        if obj.get(key) is None:
            raise SpecError(f"{path}.{key}" if path else key, "required field is missing")


def _did_you_mean(word: str, choices: Collection[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _get(obj: Mapping[str, Any], key: str, default: _T) -> Any | _T:
    """A field's value; absent and null (which the API server prunes before defaulting) read as default."""
    value = obj.get(key)
    return default if value is None else value


def _number(
    obj: Mapping[str, Any], key: str, path: str, default: float | None, lo: float, hi: float
) -> float:
    value = _optional_number(obj, key, path, lo, hi)
    if value is not None:
        return value
    if default is None:
        raise SpecError(f"{path}.{key}", "required field is missing")
    return default


def _optional_number(
    obj: Mapping[str, Any], key: str, path: str, lo: float, hi: float | None
) -> float | None:
    raw = obj.get(key)
    if raw is None:
        return None
    field = f"{path}.{key}"
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise SpecError(field, f"must be a number, not {_kind(raw)}")
    value = float(raw)
    if not math.isfinite(value):
        raise SpecError(field, f"must be a finite number, not {raw}")
    if value < lo or (hi is not None and value > hi):
        bounds = f"between {lo:g} and {hi:g}" if hi is not None else f"at least {lo:g}"
        raise SpecError(field, f"{raw} is out of range; must be {bounds}")
    return value


def _integer(obj: Mapping[str, Any], key: str, path: str, default: int | None, lo: int, hi: int) -> int:
    raw = obj.get(key)
    field = f"{path}.{key}"
    if raw is None:
        if default is None:
            raise SpecError(field, "required field is missing")
        return default
    # JSON has one number type; the API server accepts 3.0 for an integer field, so we do too.
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise SpecError(field, f"must be an integer, not {_kind(raw)}")
    if not lo <= raw <= hi:
        raise SpecError(field, f"{raw} is out of range; must be between {lo} and {hi}")
    return raw


def _bool(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    raw = _get(obj, key, default)
    if not isinstance(raw, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, not {_kind(raw)}")
    return raw


def _string(obj: Mapping[str, Any], key: str, path: str, *, max_length: int) -> str:
    raw = obj.get(key)
    field = f"{path}.{key}"
    if not isinstance(raw, str):
        raise SpecError(field, f"must be a string, not {_kind(raw)}")
    if not raw:
        raise SpecError(field, "must not be empty")
    if len(raw) > max_length:
        raise SpecError(field, f"is {len(raw)} characters long; at most {max_length} are allowed")
    return raw


def _duration(obj: Mapping[str, Any], key: str, path: str, default: str, *, minimum: float = 0.0) -> float:
    raw = _get(obj, key, default)
    field = f"{path}.{key}"
    if not isinstance(raw, str):
        # YAML reads `for: 300` as a number: say what is wrong rather than guess seconds.
        raise SpecError(field, f"must be a duration string such as 5m or 1h30m, not {_kind(raw)} {raw!r}")
    try:
        seconds = parse_duration(raw)
    except ValueError as exc:
        raise SpecError(field, str(exc)) from None
    if seconds < minimum:
        raise SpecError(field, f'"{raw}" is too short; must be at least {format_duration(minimum)}')
    return seconds


def _kind(value: Any) -> str:
    """How a JSON/YAML value's type reads in a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)

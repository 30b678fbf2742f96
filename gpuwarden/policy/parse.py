"""Build a typed :class:`~gpuwarden.policy.spec.model.PolicySpec` from a GPUMonitorPolicy's camelCase spec.

``parse_spec`` applies the CRD's defaults and enforces everything its schema and CEL rules enforce
(and a little more), because local mode reads policy files that never went through an API server.
It reads the fields through their declarations (:mod:`gpuwarden.policy.spec.declarations`, the rule
kinds' bodies), from which the CRD's schema is rendered: a bound or a default is written once.
Every error is a :class:`SpecError` naming the field, in the API server's path notation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from gpuwarden.policy.rules import RULE_TYPES, RuleType, rule_metric, service_rule, type_of
from gpuwarden.policy.spec.declarations import (
    ACTIONS,
    BEHAVIOR,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    EVALUATION_INTERVAL,
    EVENTS,
    FORECAST,
    GRACE_PERIOD,
    HORIZON,
    LOAD,
    MAX_PER_HOUR,
    MAX_REPLICAS,
    MAX_RULES,
    MAX_UNCERTAINTY,
    METRICS_PATH,
    METRICS_PORT,
    METRICS_SCHEME,
    METRICS_SERVER,
    MIN_REPLICAS,
    RECLAIM,
    RECLAIM_ACTION,
    RECLAIM_DRY_RUN,
    RECLAIM_RULES,
    RENOTIFY_INTERVAL,
    REQUESTS_PER_REPLICA,
    RULE_NAME,
    SCALE,
    SCALE_DOWN,
    SCALE_DOWN_ON,
    SCALE_DRY_RUN,
    SCALE_UP,
    SCALE_UP_MIN_PODS,
    SCALE_UP_ON,
    SCRAPE_INTERVAL,
    SERVICE_METRICS,
    TARGET_API_VERSION,
    TARGET_KIND,
    TARGET_NAME,
    TARGET_REF,
)
from gpuwarden.policy.spec.fields import (
    SpecError,
    as_list,
    as_object,
    check_fields,
    did_you_mean,
    show,
    string,
    type_name,
)
from gpuwarden.policy.spec.model import (
    Actions,
    ForecastLoad,
    LabelRequirement,
    LabelSelector,
    PolicySpec,
    ReclaimAction,
    ReclaimMethod,
    Rule,
    ScaleAction,
    ScaleDirection,
    ScaleForecast,
    ScaleTargetRef,
    ServiceMetricsSource,
    Signal,
)
from gpuwarden.policy.spec.schema import Duration, IntOrPercent, Names, Object
from gpuwarden.policy.spec.servers import Metric, request_counters
from gpuwarden.units import format_duration

__all__ = [
    "API_VERSION",
    "KIND",
    "PolicyObject",
    "SpecError",
    "parse_policy_object",
    "parse_selector",
    "parse_spec",
]

API_VERSION = "gpuwarden.dev/v1alpha1"
KIND = "GPUMonitorPolicy"

# Limits of the selector (Kubernetes' own LabelSelector, written by hand in the CRD): the CRD needs them
# for CEL cost estimates, we keep them so a policy file that works locally also applies to a cluster.
MAX_SELECTOR_ENTRIES = 32
MAX_SELECTOR_VALUES = 64

_DNS_LABEL = re.compile(DNS_LABEL)
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_RULE_TYPES: Mapping[str, RuleType[Any, Any]] = {t.key: t for t in RULE_TYPES}


def _kinds(has: Callable[[RuleType[Any, Any]], object]) -> str:
    """The kinds whose record ``has``, for a message: ``a, b or c``."""
    keys = [t.key for t in RULE_TYPES if has(t)]
    return " or ".join(filter(None, (", ".join(keys[:-1]), keys[-1])))


_CEILING_KINDS = _kinds(lambda t: t.forecast_ceiling is not None)
_SERVICE_KINDS = _kinds(lambda t: t.metric is not None)
_COUNTING_KINDS = _kinds(lambda t: t.counts_requests)
_IDLE_KINDS = _kinds(lambda t: t.idle is not None)


def parse_spec(spec: Mapping[str, Any], *, path: str = "spec") -> PolicySpec:
    """Parse a GPUMonitorPolicy ``spec`` (camelCase, as stored by the API server or read from YAML).

    Applies the CRD's defaults; raises :class:`SpecError` naming the field for anything invalid,
    including unknown fields, duplicate rule names and scale actions naming rules that do not exist.
    """
    spec = as_object(spec, path)
    check_fields(
        spec,
        path,
        ("selector", EVALUATION_INTERVAL.name, SERVICE_METRICS.name, "rules", ACTIONS.name),
        ("selector", "rules"),
    )
    selector = parse_selector(spec["selector"], path=f"{path}.selector")
    interval = EVALUATION_INTERVAL.read(spec, path)
    metrics = SERVICE_METRICS.get(spec, path)
    source = None if metrics is None else _service_metrics(metrics, f"{path}.{SERVICE_METRICS.name}")
    rules = _with_servers(_rules(spec["rules"], f"{path}.rules"), source, path)
    _check_windows(rules, interval, f"{path}.rules")
    actions = _actions(ACTIONS.read(spec, path), f"{path}.{ACTIONS.name}", rules)
    return PolicySpec(
        selector=selector,
        rules=rules,
        evaluation_interval_seconds=interval,
        actions=actions,
        service_metrics=source,
    )


def parse_selector(selector: Any, *, path: str = "selector") -> LabelSelector:
    """Parse a Kubernetes LabelSelector (matchLabels, matchExpressions), validating keys and values."""
    obj = as_object(selector, path)
    check_fields(obj, path, ("matchLabels", "matchExpressions"))
    labels: list[tuple[str, str]] = []
    match_labels = obj.get("matchLabels")
    if match_labels is not None:
        ml_path = f"{path}.matchLabels"
        ml = as_object(match_labels, ml_path)
        if len(ml) > MAX_SELECTOR_ENTRIES:
            raise SpecError(ml_path, f"has {len(ml)} entries; at most {MAX_SELECTOR_ENTRIES} are allowed")
        for key, value in ml.items():
            _label_key(key, f"{ml_path}[{key}]")
            labels.append((key, _label_value(value, f"{ml_path}[{key}]")))
    requirements: list[LabelRequirement] = []
    expressions = obj.get("matchExpressions")
    if expressions is not None:
        me_path = f"{path}.matchExpressions"
        items = as_list(expressions, me_path, max_items=MAX_SELECTOR_ENTRIES)
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
    obj = as_object(doc, "")
    check_fields(
        obj, "", ("apiVersion", "kind", "metadata", "spec", "status"), ("apiVersion", "kind", "spec")
    )
    if obj["apiVersion"] != API_VERSION:
        raise SpecError("apiVersion", f"{show(obj['apiVersion'])} is not {API_VERSION}")
    if obj["kind"] != KIND:
        raise SpecError("kind", f"{show(obj['kind'])} is not {KIND}")
    metadata = as_object(obj.get("metadata"), "metadata")
    name = metadata.get("name")
    if name is None:
        raise SpecError("metadata.name", "required field is missing")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(
            "metadata.name", f"{show(name)} is not a valid name (a DNS subdomain such as llm-serving)"
        )
    namespace = metadata.get("namespace")
    if namespace is not None and (
        not isinstance(namespace, str) or len(namespace) > 63 or not _DNS_LABEL.fullmatch(namespace)
    ):
        raise SpecError("metadata.namespace", f"{show(namespace)} is not a namespace name")
    return PolicyObject(name, namespace, parse_spec(obj["spec"]))


# --- service metrics ---------------------------------------------------------------------------------


def _service_metrics(obj: Mapping[str, Any], path: str) -> ServiceMetricsSource:
    """spec.serviceMetrics: where to scrape the pods' own metrics, and the service rules' preset."""
    metrics_path = None
    if obj.get(METRICS_PATH.name) is not None:
        metrics_path = string(obj, METRICS_PATH.name, path, max_length=METRICS_PATH.max_length)
        if not METRICS_PATH.matches(metrics_path):
            raise SpecError(
                f"{path}.{METRICS_PATH.name}",
                f"{show(metrics_path)} is not a URL path such as /metrics (no query, no space)",
            )
    return ServiceMetricsSource(
        port=METRICS_PORT.get(obj, path),
        path=metrics_path,
        scheme=METRICS_SCHEME.read(obj, path).value,
        interval_seconds=SCRAPE_INTERVAL.get(obj, path),
        server=METRICS_SERVER.get(obj, path),
    )


# --- rules -------------------------------------------------------------------------------------------


def _rules(value: Any, path: str) -> tuple[Rule, ...]:
    """spec.rules: 1..32 rules with unique names, each with exactly one kind."""
    items = as_list(value, path, max_items=MAX_RULES)
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


def _with_servers(
    rules: tuple[Rule, ...], source: ServiceMetricsSource | None, path: str
) -> tuple[Rule, ...]:
    """The service rules that name neither ``server`` nor ``metric`` take ``serviceMetrics.server``; each
    must then read a metric its server exports (Triton has no end-to-end latency histogram)."""
    default = None if source is None else source.server
    out: list[Rule] = []
    for i, rule in enumerate(rules):
        service = service_rule(rule)
        if service is not None:
            kind = type_of(rule)
            field = f"{path}.rules[{i}].{kind.key}"
            if service.server is None and service.metric is None:
                if default is None:
                    raise SpecError(
                        field,
                        "names no metric: set its server (one of vllm, sglang, triton, tgi) or its metric,"
                        " or spec.serviceMetrics.server",
                    )
                # Every kind's spec is a frozen dataclass (its record's model).
                rule = replace(cast(Any, rule), server=default)
            found = rule_metric(rule)
            if isinstance(found, str):
                raise SpecError(f"{field}.{kind.refused_at}", found)
        out.append(rule)
    return tuple(out)


def _check_windows(rules: Sequence[Rule], interval: float, path: str) -> None:
    """Every rule's window (``for``, memoryGrowth's and anomaly's ``window``) spans an evaluation interval.

    A shorter window leaves samples between two evaluations that no evaluation reads: an idle spell or
    a leak could come and go unjudged. The CRD's CEL rule on spec enforces the same (gpuHealth, which
    reads no window, is left out of both).
    """
    for i, rule in enumerate(rules):
        kind = type_of(rule)
        if kind.window is None:
            continue
        seconds = kind.window(rule)
        field = f"{kind.key}.{kind.body.window}"
        if seconds < interval:
            shorter = f"{format_duration(seconds)} is shorter than evaluationInterval"
            raise SpecError(
                f"{path}[{i}].{field}",
                f"{shorter} ({format_duration(interval)}): a shorter window leaves samples that no"
                " evaluation reads",
            )


def _rule(value: Any, path: str) -> Rule:
    """One rule: a name and exactly one of the rule kinds."""
    obj = as_object(value, path)
    check_fields(obj, path, ("name", *_RULE_TYPES), ("name",))
    name = obj["name"]
    if not isinstance(name, str) or not RULE_NAME.matches(name):
        raise SpecError(
            f"{path}.name",
            f"{show(name)} is not a valid rule name (a DNS label such as idle-gpu, at most"
            f" {RULE_NAME.max_length} chars)",
        )
    kinds = [k for k in _RULE_TYPES if obj.get(k) is not None]
    if len(kinds) != 1:
        found = "none" if not kinds else " and ".join(kinds)
        raise SpecError(path, f"a rule must set exactly one of {', '.join(_RULE_TYPES)}; found {found}")
    kind = kinds[0]
    body = as_object(obj[kind], f"{path}.{kind}")
    rule: Rule = _RULE_TYPES[kind].parse(name, body, f"{path}.{kind}")
    return rule


# --- actions -----------------------------------------------------------------------------------------


def _actions(obj: Mapping[str, Any], path: str, rules: Sequence[Rule]) -> Actions:
    """spec.actions (checked; ``{}`` when absent); ``rules`` lets scale and reclaim check the rules
    they name."""
    scale = SCALE.get(obj, path)
    reclaim = RECLAIM.get(obj, path)
    return Actions(
        events=EVENTS.read(obj, path),
        renotify_seconds=RENOTIFY_INTERVAL.read(obj, path),
        scale=None if scale is None else _scale(scale, f"{path}.{SCALE.name}", rules),
        reclaim=None if reclaim is None else _reclaim(reclaim, f"{path}.{RECLAIM.name}", rules),
    )


def _reclaim(obj: Mapping[str, Any], path: str, rules: Sequence[Rule]) -> ReclaimAction:
    names = _rule_refs(obj, RECLAIM_RULES, path, tuple(r.name for r in rules))
    if not names:
        raise SpecError(f"{path}.{RECLAIM_RULES.name}", "must name at least one rule")
    method = RECLAIM_ACTION.read(obj, path)
    by_name = {r.name: r for r in rules}
    for i, name in enumerate(names):
        kind = type_of(by_name[name])
        if kind.idle is None:
            raise SpecError(
                f"{path}.rules[{i}]", f'"{name}" is a {kind.key} rule; reclaim acts on {_IDLE_KINDS} rules'
            )
        if kind.idle != "pod" and method is not ReclaimMethod.ANNOTATE:
            raise SpecError(
                f"{path}.rules[{i}]",
                f'"{name}" is a {kind.key} rule (another GPU of the pod works): only action Annotate fits it',
            )
    return ReclaimAction(
        rules=names,
        method=method,
        grace_seconds=GRACE_PERIOD.read(obj, path),
        max_per_hour=MAX_PER_HOUR.read(obj, path),
        dry_run=RECLAIM_DRY_RUN.read(obj, path),
    )


def _scale(obj: Mapping[str, Any], path: str, rules: Sequence[Rule]) -> ScaleAction:
    rule_names = tuple(r.name for r in rules)
    target = _target_ref(TARGET_REF.read(obj, path), f"{path}.{TARGET_REF.name}")
    min_replicas = MIN_REPLICAS.read(obj, path)
    max_replicas = MAX_REPLICAS.read(obj, path)
    if min_replicas > max_replicas:
        raise SpecError(f"{path}.minReplicas", f"{min_replicas} exceeds maxReplicas ({max_replicas})")
    up_on = _rule_refs(obj, SCALE_UP_ON, path, rule_names)
    down_on = _rule_refs(obj, SCALE_DOWN_ON, path, rule_names)
    if not up_on and not down_on:
        raise SpecError(path, "scale needs at least one rule in scaleUpOn or scaleDownOn")
    by_name = {r.name: r for r in rules}
    for i, rule in enumerate(down_on):
        if rule in up_on:
            raise SpecError(
                f"{path}.scaleDownOn[{i}]", f'"{rule}" is also in scaleUpOn; a rule cannot be in both'
            )
        kind = type_of(by_name[rule])
        if kind.up_only is not None:
            raise SpecError(f"{path}.scaleDownOn[{i}]", f'"{rule}" is a {kind.key} rule: {kind.up_only}')
    min_pods, min_pods_percent = SCALE_UP_MIN_PODS.read(obj, path)
    behavior = BEHAVIOR.read(obj, path)
    b_path = f"{path}.{BEHAVIOR.name}"
    forecast = FORECAST.get(obj, path)
    return ScaleAction(
        target_ref=target,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        scale_up_on=up_on,
        scale_down_on=down_on,
        scale_up=_direction(behavior, b_path, SCALE_UP),
        scale_down=_direction(behavior, b_path, SCALE_DOWN),
        scale_up_min_pods=min_pods,
        scale_up_min_pods_percent=min_pods_percent,
        dry_run=SCALE_DRY_RUN.read(obj, path),
        forecast=None
        if forecast is None
        else _forecast(forecast, f"{path}.{FORECAST.name}", rules, up_on, down_on),
    )


def _forecast(
    obj: Mapping[str, Any], path: str, rules: Sequence[Rule], up_on: Sequence[str], down_on: Sequence[str]
) -> ScaleForecast:
    """scale.forecast, its ceiling and floor taken from the first utilization rules scale names
    (requests load: its ceiling is requestsPerReplica)."""
    load = LOAD.read(obj, path)
    horizon = HORIZON.get(obj, path)
    uncertainty = MAX_UNCERTAINTY.read(obj, path)
    if load is ForecastLoad.REQUESTS:
        return _request_forecast(obj, path, rules, up_on, horizon, uncertainty)
    if obj.get(REQUESTS_PER_REPLICA.name) is not None:  # FORECAST's Check
        raise SpecError(f"{path}.requestsPerReplica", "is for load: requests only")
    by_name = {r.name: r for r in rules}
    ceilings = [(n, c(by_name[n])) for n in up_on if (c := type_of(by_name[n]).forecast_ceiling) is not None]
    floors = [(n, f(by_name[n])) for n in down_on if (f := type_of(by_name[n]).forecast_floor) is not None]
    if not ceilings:
        raise SpecError(
            path,
            f"forecast needs a {_CEILING_KINDS} rule in scaleUpOn: its ceiling is what it forecasts against",
        )
    ceiling, (ceiling_percent, signal) = ceilings[0]
    floor, floor_percent = floors[0] if floors else (None, None)
    return ScaleForecast(
        ceiling_rule=ceiling,
        ceiling_percent=ceiling_percent,
        signal=signal,
        floor_rule=floor,
        floor_percent=floor_percent,
        horizon_seconds=horizon,
        max_uncertainty=uncertainty,
    )


def _request_forecast(
    obj: Mapping[str, Any],
    path: str,
    rules: Sequence[Rule],
    up_on: Sequence[str],
    horizon: float | None,
    uncertainty: float,
) -> ScaleForecast:
    """A forecast of the requests the pods serve: their servers' counters of requests served, else
    the count of the latency histograms their rules read."""
    per_replica = REQUESTS_PER_REPLICA.get(obj, path)
    if per_replica is None:  # FORECAST's Check
        raise SpecError(f"{path}.requestsPerReplica", "required field is missing with load: requests")
    by_name = {r.name: r for r in rules}
    service = [s for r in rules if (s := service_rule(r)) is not None]
    scrapers = [n for n in up_on if service_rule(by_name[n]) is not None]
    if not scrapers:
        raise SpecError(
            path,
            f"forecast with load: requests needs a {_SERVICE_KINDS} rule in"
            " scaleUpOn: the pods it reads are scraped, and their server says where the rate is read",
        )
    servers = [r.server for r in service if r.server is not None and r.metric is None]
    histograms = [m for r in rules if type_of(r).counts_requests and isinstance(m := rule_metric(r), Metric)]
    names = (*request_counters(servers), *(n for m in histograms for n in m.names))
    if not names:
        raise SpecError(
            f"{path}.load",
            "no request rate to read: no rule names a server (whose counter of requests served is"
            f" read) nor a {_COUNTING_KINDS} histogram (whose count is)",
        )
    return ScaleForecast(
        ceiling_rule=scrapers[0],
        ceiling_percent=per_replica,
        signal=Signal.AUTO,
        horizon_seconds=horizon,
        max_uncertainty=uncertainty,
        load=ForecastLoad.REQUESTS,
        request_metrics=tuple(dict.fromkeys(names)),
    )


def _target_ref(obj: Mapping[str, Any], path: str) -> ScaleTargetRef:
    api_version = string(obj, TARGET_API_VERSION.name, path, max_length=TARGET_API_VERSION.max_length)
    kind = string(obj, TARGET_KIND.name, path, max_length=TARGET_KIND.max_length)
    if not TARGET_KIND.matches(kind):
        raise SpecError(f"{path}.kind", f"{show(kind)} is not a kind such as Deployment")
    if not _scalable(api_version, kind):  # TARGET_REF's Check
        raise SpecError(f"{path}.kind", f"{show(kind)} of {show(api_version)} has no /scale subresource")
    name = string(obj, TARGET_NAME.name, path, max_length=TARGET_NAME.max_length)
    if not TARGET_NAME.matches(name):
        raise SpecError(f"{path}.name", f"{show(name)} is not a valid object name")
    return ScaleTargetRef(api_version=api_version, kind=kind, name=name)


_SCALABLE_APPS = frozenset({"Deployment", "StatefulSet", "ReplicaSet"})
_BUILTIN_GROUP = re.compile(r"^([a-z.]+\.k8s\.io|batch|autoscaling|policy|extensions)/")


def _scalable(api_version: str, kind: str) -> bool:
    """Whether a target may have a /scale subresource, as the CRD's rule on targetRef judges it:
    Kubernetes' own groups have four scalable kinds; a custom resource's is checked when it is read."""
    if api_version == "v1":
        return kind == "ReplicationController"
    if api_version.startswith("apps/"):
        return kind in _SCALABLE_APPS
    return not _BUILTIN_GROUP.match(api_version)


def _rule_refs(obj: Mapping[str, Any], field: Names, path: str, rule_names: Sequence[str]) -> tuple[str, ...]:
    """scaleUpOn, scaleDownOn, reclaim's rules: a set of names of rules that exist."""
    list_path = f"{path}.{field.name}"
    raw = obj.get(field.name)
    items = [] if raw is None else as_list(raw, list_path, max_items=field.max_items)
    names: list[str] = []
    for i, item in enumerate(items):
        item_path = f"{list_path}[{i}]"
        if not isinstance(item, str):
            raise SpecError(item_path, f"must be a rule name, not {type_name(item)}")
        if item in names:
            raise SpecError(item_path, f'duplicate entry "{item}"')
        if item not in rule_names:
            raise SpecError(
                item_path, f'"{item}" is not a rule in spec.rules{did_you_mean(item, rule_names)}'
            )
        names.append(item)
    return tuple(names)


def _direction(behavior: Mapping[str, Any], path: str, direction: Object) -> ScaleDirection:
    """behavior.scaleUp / behavior.scaleDown, with that direction's defaults."""
    obj = direction.read(behavior, path)
    path = f"{path}.{direction.name}"
    stabilization, step, cooldown = (direction.field(n) for n in ("stabilizationWindow", "step", "cooldown"))
    replicas, percent = cast(IntOrPercent, step).read(obj, path)
    return ScaleDirection(
        stabilization_seconds=cast(Duration, stabilization).read(obj, path),
        step_replicas=replicas,
        step_percent=percent,
        cooldown_seconds=cast(Duration, cooldown).read(obj, path),
    )


# --- selector ------------------------------------------------------------------------------------------


def _requirement(value: Any, path: str) -> LabelRequirement:
    obj = as_object(value, path)
    check_fields(obj, path, ("key", "operator", "values"), ("key", "operator"))
    key = obj["key"]
    _label_key(key, f"{path}.key")
    operator = obj["operator"]
    if operator not in _OPERATORS:
        raise SpecError(f"{path}.operator", f"{show(operator)} is not one of {', '.join(_OPERATORS)}")
    raw_values = obj.get("values")
    values_path = f"{path}.values"
    items = [] if raw_values is None else as_list(raw_values, values_path, max_items=MAX_SELECTOR_VALUES)
    values = tuple(_label_value(v, f"{values_path}[{i}]") for i, v in enumerate(items))
    if operator in ("In", "NotIn") and not values:
        raise SpecError(values_path, f"must be non-empty when operator is {operator}")
    if operator in ("Exists", "DoesNotExist") and values:
        raise SpecError(values_path, f"must be empty when operator is {operator}")
    return LabelRequirement(key=key, operator=operator, values=values)


def _label_key(key: Any, path: str) -> None:
    """A label key: an optional DNS-subdomain prefix (<= 253) and '/', then a name (<= 63)."""
    if not isinstance(key, str):
        raise SpecError(path, f"label key must be a string, not {type_name(key)}")
    prefix, slash, name = key.rpartition("/")
    ok = bool(_LABEL_NAME.fullmatch(name)) and len(name) <= 63
    if slash:
        ok = ok and len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(prefix))
    if not ok:
        raise SpecError(path, f"{show(key)} is not a valid label key such as app or example.com/tier")


def _label_value(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise SpecError(path, f"label value must be a string, not {type_name(value)}")
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        raise SpecError(path, f"{show(value)} is not a valid label value (at most 63 of A-Z a-z 0-9 - _ .)")
    return value

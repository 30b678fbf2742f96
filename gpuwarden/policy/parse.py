"""Build a typed :class:`~gpuwarden.policy.spec.model.PolicySpec` from a GPUMonitorPolicy's camelCase spec.

``parse_spec`` applies the CRD's defaults and enforces everything its schema and CEL rules enforce
(and a little more), because local mode reads policy files that never went through an API server.
Every error is a :class:`SpecError` naming the field, in the API server's path notation.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from gpuwarden.policy.rules import RULE_TYPES, RuleType, rule_metric, service_rule, type_of
from gpuwarden.policy.spec.fields import (
    SpecError,
    as_list,
    as_object,
    boolean,
    check_fields,
    did_you_mean,
    duration,
    integer,
    member,
    number,
    show,
    string,
    type_name,
    value_or,
)
from gpuwarden.policy.spec.model import (
    BUCKET_SECONDS,
    MAX_STEPS,
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
    Server,
    ServiceMetricsSource,
    Signal,
)
from gpuwarden.policy.spec.schema import Text
from gpuwarden.policy.spec.servers import Metric, request_counters
from gpuwarden.units import format_duration

__all__ = [
    "API_VERSION",
    "DEFAULTS",
    "KIND",
    "RULE_NAME",
    "PolicyObject",
    "SpecError",
    "parse_policy_object",
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
# A forecast looks at least one evaluation ahead and at most as far as it forecasts (model.MAX_STEPS).
MIN_FORECAST_HORIZON = 10.0
MAX_FORECAST_HORIZON = MAX_STEPS * BUCKET_SECONDS
MIN_SCRAPE_INTERVAL = 1.0
MAX_METRICS_PATH = 256
MAX_REQUEST_RATE = 1_000_000.0
MIN_RECLAIM_GRACE = 10.0
MAX_RECLAIMS_PER_HOUR = 1000

# The CRD's scalar defaults, by the schema path of the object that holds them. The API server fills them
# in; local mode's policy files never went through one, so the parser does. tests/unit/test_crd_schema.py
# checks that this table and the CRD's `default`s are the same. (Empty objects and lists the CRD defaults,
# such as actions: {}, read here as absent: the same thing.) A rule kind's are its RuleType's.
DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    ".spec": {"evaluationInterval": "10s"},
    **{f".spec.rules[].{t.key}": t.defaults for t in RULE_TYPES},
    ".spec.serviceMetrics": {"scheme": "http"},
    ".spec.actions": {"events": True, "renotifyInterval": "1h"},
    ".spec.actions.scale": {"minReplicas": 1, "scaleUpMinPods": 1, "dryRun": False},
    ".spec.actions.scale.behavior.scaleUp": {"stabilizationWindow": "0s", "step": 1, "cooldown": "1m"},
    ".spec.actions.scale.behavior.scaleDown": {"stabilizationWindow": "5m", "step": 1, "cooldown": "5m"},
    ".spec.actions.scale.forecast": {"maxUncertainty": 20, "load": "utilization"},
    ".spec.actions.reclaim": {"gracePeriod": "10m", "maxPerHour": 5, "dryRun": True},
}
_SPEC = DEFAULTS[".spec"]
_ACTIONS = DEFAULTS[".spec.actions"]
_SCALE = DEFAULTS[".spec.actions.scale"]
_SCALE_UP = DEFAULTS[".spec.actions.scale.behavior.scaleUp"]
_SCALE_DOWN = DEFAULTS[".spec.actions.scale.behavior.scaleDown"]
_FORECAST = DEFAULTS[".spec.actions.scale.forecast"]
_RECLAIM = DEFAULTS[".spec.actions.reclaim"]
_SERVICE_METRICS = DEFAULTS[".spec.serviceMetrics"]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_KIND = re.compile(r"[A-Z][A-Za-z0-9]*")

RULE_NAME = Text(
    "name",
    "The rule's name (a DNS label): it appears in Events and status, is what actions.scale refers to,"
    " and names the snooze annotation snooze.gpuwarden.dev/<name>.",
    max_length=63,
    pattern=_DNS_LABEL.pattern,
    message="must be a DNS label such as idle-gpu: lower-case letters, digits and '-', starting and ending"
    " with a letter or digit",
    required=True,
)
"""A rule's ``name``, as the CRD declares it (:mod:`gpuwarden.policy.crd`)."""
_MIN_PODS_PERCENT = re.compile(r"(100|[1-9][0-9]?)%")
_STEP_PERCENT = re.compile(r"[1-9][0-9]{0,2}%")
_METRICS_PATH = re.compile(r"/[!$&'()*+,;=:@A-Za-z0-9._~/%-]*")


class Scheme(enum.StrEnum):
    """serviceMetrics.scheme."""

    HTTP = "http"
    HTTPS = "https"


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
        ("selector", "evaluationInterval", "serviceMetrics", "rules", "actions"),
        ("selector", "rules"),
    )
    selector = parse_selector(spec["selector"], path=f"{path}.selector")
    interval = duration(
        spec, "evaluationInterval", path, _SPEC["evaluationInterval"], minimum=MIN_EVALUATION_INTERVAL
    )
    source = None
    if spec.get("serviceMetrics") is not None:
        source = _service_metrics(spec["serviceMetrics"], f"{path}.serviceMetrics")
    rules = _with_servers(_rules(spec["rules"], f"{path}.rules"), source, path)
    _check_windows(rules, interval, f"{path}.rules")
    actions = _actions(spec.get("actions"), f"{path}.actions", rules)
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


def _service_metrics(value: Any, path: str) -> ServiceMetricsSource:
    """spec.serviceMetrics: where to scrape the pods' own metrics, and the service rules' preset."""
    obj = as_object(value, path)
    check_fields(obj, path, ("port", "path", "scheme", "interval", "server"))
    port = None if obj.get("port") is None else integer(obj, "port", path, None, 1, 65535)
    metrics_path = None
    if obj.get("path") is not None:
        metrics_path = string(obj, "path", path, max_length=MAX_METRICS_PATH)
        if not _METRICS_PATH.fullmatch(metrics_path):
            raise SpecError(
                f"{path}.path",
                f"{show(metrics_path)} is not a URL path such as /metrics (no query, no space)",
            )
    interval = None
    if obj.get("interval") is not None:
        interval = duration(obj, "interval", path, "0s", minimum=MIN_SCRAPE_INTERVAL)
    return ServiceMetricsSource(
        port=port,
        path=metrics_path,
        scheme=member(Scheme, value_or(obj, "scheme", _SERVICE_METRICS["scheme"]), f"{path}.scheme").value,
        interval_seconds=interval,
        server=None if obj.get("server") is None else member(Server, obj["server"], f"{path}.server"),
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
            f"{show(name)} is not a valid rule name (a DNS label such as idle-gpu, at most 63 chars)",
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


def _actions(value: Any, path: str, rules: Sequence[Rule]) -> Actions:
    """spec.actions; ``rules`` lets scale check the rules it names."""
    if value is None:
        return Actions()
    obj = as_object(value, path)
    check_fields(obj, path, ("events", "renotifyInterval", "scale", "reclaim"))
    events = boolean(obj, "events", path, _ACTIONS["events"])
    renotify = duration(
        obj, "renotifyInterval", path, _ACTIONS["renotifyInterval"], minimum=MIN_RENOTIFY_INTERVAL
    )
    scale = None if obj.get("scale") is None else _scale(obj["scale"], f"{path}.scale", rules)
    reclaim = None if obj.get("reclaim") is None else _reclaim(obj["reclaim"], f"{path}.reclaim", rules)
    return Actions(events=events, renotify_seconds=renotify, scale=scale, reclaim=reclaim)


def _reclaim(value: Any, path: str, rules: Sequence[Rule]) -> ReclaimAction:
    obj = as_object(value, path)
    check_fields(obj, path, ("rules", "action", "gracePeriod", "maxPerHour", "dryRun"), ("rules", "action"))
    names = _rule_refs(obj, "rules", path, tuple(r.name for r in rules))
    if not names:
        raise SpecError(f"{path}.rules", "must name at least one rule")
    method = member(ReclaimMethod, obj["action"], f"{path}.action")
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
        grace_seconds=duration(obj, "gracePeriod", path, _RECLAIM["gracePeriod"], minimum=MIN_RECLAIM_GRACE),
        max_per_hour=integer(obj, "maxPerHour", path, _RECLAIM["maxPerHour"], 1, MAX_RECLAIMS_PER_HOUR),
        dry_run=boolean(obj, "dryRun", path, _RECLAIM["dryRun"]),
    )


def _scale(value: Any, path: str, rules: Sequence[Rule]) -> ScaleAction:
    obj = as_object(value, path)
    rule_names = tuple(r.name for r in rules)
    check_fields(
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
    min_replicas = integer(obj, "minReplicas", path, _SCALE["minReplicas"], 1, MAX_REPLICAS)
    max_replicas = integer(obj, "maxReplicas", path, None, 1, MAX_REPLICAS)
    if min_replicas > max_replicas:
        raise SpecError(f"{path}.minReplicas", f"{min_replicas} exceeds maxReplicas ({max_replicas})")
    up_on = _rule_refs(obj, "scaleUpOn", path, rule_names)
    down_on = _rule_refs(obj, "scaleDownOn", path, rule_names)
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
    min_pods, min_pods_percent = _count_or_percent(
        obj, "scaleUpMinPods", path, _SCALE["scaleUpMinPods"], _MIN_PODS_PERCENT, "1% to 100%"
    )
    behavior = obj.get("behavior")
    b_path = f"{path}.behavior"
    b_obj: Mapping[str, Any] = {} if behavior is None else as_object(behavior, b_path)
    check_fields(b_obj, b_path, ("scaleUp", "scaleDown"))
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
        dry_run=boolean(obj, "dryRun", path, _SCALE["dryRun"]),
        forecast=None
        if obj.get("forecast") is None
        else _forecast(obj["forecast"], f"{path}.forecast", rules, up_on, down_on),
    )


def _forecast(
    value: Any, path: str, rules: Sequence[Rule], up_on: Sequence[str], down_on: Sequence[str]
) -> ScaleForecast:
    """scale.forecast, its ceiling and floor taken from the first utilization rules scale names
    (requests load: its ceiling is requestsPerReplica)."""
    obj = as_object(value, path)
    check_fields(obj, path, ("horizon", "maxUncertainty", "load", "requestsPerReplica"))
    load = member(ForecastLoad, value_or(obj, "load", _FORECAST["load"]), f"{path}.load")
    horizon = None
    if obj.get("horizon") is not None:
        horizon = duration(obj, "horizon", path, "0s", minimum=MIN_FORECAST_HORIZON)
        if horizon > MAX_FORECAST_HORIZON:
            raise SpecError(f"{path}.horizon", f"must be at most {format_duration(MAX_FORECAST_HORIZON)}")
    uncertainty = number(obj, "maxUncertainty", path, _FORECAST["maxUncertainty"], 1, 100)
    if load is ForecastLoad.REQUESTS:
        return _request_forecast(obj, path, rules, up_on, horizon, uncertainty)
    if obj.get("requestsPerReplica") is not None:
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
    if obj.get("requestsPerReplica") is None:
        raise SpecError(f"{path}.requestsPerReplica", "required field is missing with load: requests")
    per_replica = number(obj, "requestsPerReplica", path, None, 0, MAX_REQUEST_RATE)
    if per_replica <= 0:
        raise SpecError(f"{path}.requestsPerReplica", "must be above 0")
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


def _target_ref(value: Any, path: str) -> ScaleTargetRef:
    obj = as_object(value, path)
    check_fields(obj, path, ("apiVersion", "kind", "name"), ("apiVersion", "kind", "name"))
    api_version = string(obj, "apiVersion", path, max_length=253)
    kind = string(obj, "kind", path, max_length=63)
    if not _KIND.fullmatch(kind):
        raise SpecError(f"{path}.kind", f"{show(kind)} is not a kind such as Deployment")
    if not _scalable(api_version, kind):
        raise SpecError(f"{path}.kind", f"{show(kind)} of {show(api_version)} has no /scale subresource")
    name = string(obj, "name", path, max_length=253)
    if not _DNS_SUBDOMAIN.fullmatch(name):
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


def _rule_refs(obj: Mapping[str, Any], key: str, path: str, rule_names: Sequence[str]) -> tuple[str, ...]:
    """scaleUpOn / scaleDownOn: a set of names of rules that exist."""
    list_path = f"{path}.{key}"
    raw = obj.get(key)
    items = [] if raw is None else as_list(raw, list_path, max_items=MAX_RULES)
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


def _direction(value: Any, path: str, defaults: Mapping[str, Any]) -> ScaleDirection:
    """behavior.scaleUp / behavior.scaleDown with that direction's defaults."""
    obj: Mapping[str, Any] = {} if value is None else as_object(value, path)
    check_fields(obj, path, ("stabilizationWindow", "step", "cooldown"))
    replicas, percent = _count_or_percent(obj, "step", path, defaults["step"], _STEP_PERCENT, "1% to 999%")
    return ScaleDirection(
        stabilization_seconds=duration(obj, "stabilizationWindow", path, defaults["stabilizationWindow"]),
        step_replicas=replicas,
        step_percent=percent,
        cooldown_seconds=duration(obj, "cooldown", path, defaults["cooldown"]),
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
    raw = value_or(obj, key, default)
    field = f"{path}.{key}"
    if isinstance(raw, str):
        if not percent_re.fullmatch(raw):
            raise SpecError(
                field, f"{show(raw)} is not a count such as 1 or a percentage from {percent_range}"
            )
        return None, float(raw[:-1])
    return integer({key: raw}, key, path, None, 1, MAX_REPLICAS), None


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

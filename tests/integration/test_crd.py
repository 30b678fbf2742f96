"""The GPUMonitorPolicy CRD against a real kube-apiserver.

The schema, its CEL rules, `kubectl explain`, the printer columns and the status
subresource are all enforced by the API server, so only a real one can test them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane, wait_for

from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.rules.gpu_health import GpuHealthRule
from gpuwarden.policy.rules.idle_gpus import IdleGpus
from gpuwarden.policy.xids import CRITICAL_XIDS

pytestmark = pytest.mark.integration

CRD_DIR = REPO_ROOT / "crds"
CRD_FILE = CRD_DIR / "gpuwarden.dev_gpumonitorpolicies.yaml"
EXAMPLE = REPO_ROOT / "examples" / "gpumonitorpolicy.yaml"
CRD_NAME = "gpumonitorpolicies.gpuwarden.dev"
API_VERSION = "gpuwarden.dev/v1alpha1"

Policy = dict[str, Any]


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> str:
    """The CRD applied from crds/ and Established."""
    if not CRD_FILE.is_file():
        pytest.fail(f"{CRD_FILE} is missing")
    applied = control_plane.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
    assert applied.returncode == 0, applied.stderr
    waited = control_plane.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{CRD_NAME}")
    assert waited.returncode == 0, waited.stderr + control_plane.logs()
    # Established is not yet published: `kubectl explain` needs the OpenAPI, which follows a moment later.
    wait_for(
        lambda: control_plane.kubectl("explain", "gmp.spec").returncode == 0,
        timeout=60,
        what="the CRD's OpenAPI schema",
    )
    return CRD_NAME


def base_policy(name: str = "p") -> Policy:
    """A minimal valid policy; each invalid case breaks exactly one thing in it."""
    return {
        "apiVersion": API_VERSION,
        "kind": "GPUMonitorPolicy",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": "llm-server"}},
            "evaluationInterval": "10s",
            "rules": [
                {"name": "idle-gpu", "utilizationFloor": {"percent": 20, "for": "5m"}},
                {"name": "saturated", "utilizationCeiling": {"percent": 95, "for": "2m"}},
                {"name": "near-oom", "memoryCeiling": {"percent": 90, "for": "1m"}},
                {"name": "leak", "memoryGrowth": {"rate": "100Mi/m", "window": "30m", "minFit": 0.8}},
            ],
            "actions": {
                "events": True,
                "scale": {
                    "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm-server"},
                    "minReplicas": 1,
                    "maxReplicas": 8,
                    "scaleUpOn": ["saturated"],
                    "scaleDownOn": ["idle-gpu"],
                },
            },
        },
    }


def create(cp: ControlPlane, namespace: str, obj: Policy, *extra: str) -> Any:
    return cp.kubectl("create", "-n", namespace, "-f", "-", *extra, input=yaml.safe_dump(obj))


def get_json(cp: ControlPlane, namespace: str, name: str) -> Policy:
    got = cp.kubectl("get", "-n", namespace, "gmp", name, "-o", "json", check=True)
    result: Policy = json.loads(got.stdout)
    return result


# ------------------------------------------------------------------------- positive


def test_crd_applies_and_is_established(control_plane: ControlPlane, crd: str) -> None:
    got = control_plane.kubectl(
        "get", f"crd/{crd}", "-o", 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout == "True"
    # Served under the short name too.
    resources = control_plane.kubectl("api-resources", "--api-group=gpuwarden.dev", check=True)
    assert "gpumonitorpolicies" in resources.stdout
    assert "gmp" in resources.stdout


EXAMPLES = sorted(
    path
    for path in (REPO_ROOT / "examples").glob("*.yaml")
    if any(doc and doc.get("kind") == "GPUMonitorPolicy" for doc in yaml.safe_load_all(path.read_text()))
)
if EXAMPLE not in EXAMPLES:
    EXAMPLES.insert(0, EXAMPLE)  # missing: the test fails on it instead of silently skipping


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_policy_applies(control_plane: ControlPlane, crd: str, namespace: str, path: Path) -> None:
    example = yaml.safe_load(path.read_text())
    # The example names its own namespace; put it in this test's.
    example["metadata"].pop("namespace", None)
    applied = control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(example))
    assert applied.returncode == 0, applied.stderr
    stored = get_json(control_plane, namespace, example["metadata"]["name"])
    # Stored = the example plus schema defaults.
    assert is_subset(example["spec"], stored["spec"]), (example["spec"], stored["spec"])


def is_subset(expected: Any, actual: Any) -> bool:
    """Whether every field of ``expected`` is in ``actual`` with the same value."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and is_subset(v, actual[k]) for k, v in expected.items()
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(is_subset(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return bool(expected == actual)


def test_unknown_field_is_rejected(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    policy = base_policy("typo")
    rule = policy["spec"]["rules"][0]
    rule["utilisationFloor"] = rule.pop("utilizationFloor")  # British spelling
    created = create(control_plane, namespace, policy)
    assert created.returncode != 0
    assert 'unknown field "spec.rules[0].utilisationFloor"' in created.stderr, created.stderr


def test_base_policy_is_valid_and_defaulted(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    policy = base_policy()
    del policy["spec"]["evaluationInterval"]
    del policy["spec"]["rules"][0]["utilizationFloor"]["for"]
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr
    spec = get_json(control_plane, namespace, "p")["spec"]
    assert spec["evaluationInterval"] == "10s"
    assert spec["rules"][0]["utilizationFloor"]["for"] == "5m"
    assert spec["rules"][0]["utilizationFloor"]["signal"] == "auto"
    assert spec["rules"][3]["memoryGrowth"]["memory"] == "auto"


def test_forecast_and_anomaly_are_valid_and_defaulted(
    control_plane: ControlPlane, crd: str, namespace: str
) -> None:
    policy = base_policy("ahead")
    policy["spec"]["rules"].append({"name": "odd", "anomaly": {"metric": "utilization"}})
    policy["spec"]["actions"]["scale"]["forecast"] = {}
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr
    spec = get_json(control_plane, namespace, "ahead")["spec"]
    assert spec["actions"]["scale"]["forecast"] == {"load": "utilization", "maxUncertainty": 20}
    assert spec["rules"][4]["anomaly"] == {
        "metric": "utilization",
        "window": "30m",
        "threshold": 5,
        "minDeviation": 5,
    }
    # With a horizon; the parser reads what the API server stored as the operator will.
    policy = base_policy("ahead-3m")
    policy["spec"]["actions"]["scale"]["forecast"] = {"horizon": "3m", "maxUncertainty": 15}
    assert create(control_plane, namespace, policy).returncode == 0
    scale = parse_spec(get_json(control_plane, namespace, "ahead-3m")["spec"]).actions.scale
    assert scale is not None
    assert scale.forecast is not None
    f = scale.forecast
    assert (f.horizon_seconds, f.max_uncertainty, f.ceiling_rule, f.ceiling_percent) == (
        180.0,
        15.0,
        "saturated",
        95.0,
    )
    assert (f.floor_rule, f.floor_percent) == ("idle-gpu", 20.0)


def test_service_rules_are_valid_and_defaulted(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    policy = base_policy("service")
    policy["spec"]["serviceMetrics"] = {"server": "vllm", "port": 8000}
    policy["spec"]["rules"] += [
        {"name": "slow", "requestLatency": {"percentile": 99, "threshold": "2s"}},
        {"name": "queue", "requestQueue": {"limit": 5}},
        {"name": "kv", "kvCacheUsage": {"percent": 90, "metric": "my_kv", "unit": "percent"}},
    ]
    policy["spec"]["actions"]["scale"]["scaleUpOn"] = ["slow", "queue"]
    policy["spec"]["actions"]["scale"]["forecast"] = {"load": "requests", "requestsPerReplica": 4}
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr
    stored = get_json(control_plane, namespace, "service")["spec"]
    assert stored["serviceMetrics"] == {"server": "vllm", "port": 8000, "scheme": "http"}
    rules = {r["name"]: r for r in stored["rules"]}
    assert rules["slow"]["requestLatency"] == {
        "percentile": 99,
        "threshold": "2s",
        "window": "5m",
        "for": "2m",
        "latency": "endToEnd",
        "hysteresis": 10,
    }
    assert rules["queue"]["requestQueue"] == {"limit": 5, "for": "1m", "per": "replica", "hysteresis": 10}
    assert rules["kv"]["kvCacheUsage"] == {
        "percent": 90,
        "for": "2m",
        "metric": "my_kv",
        "unit": "percent",
        "hysteresis": 5,
    }
    assert stored["actions"]["scale"]["forecast"] == {
        "load": "requests",
        "requestsPerReplica": 4,
        "maxUncertainty": 20,
    }
    # What the API server stored, the parser reads alike (the operator's view of it).
    assert parse_spec(stored).service_metrics is not None


def test_gpu_health_is_defaulted(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    policy = base_policy()
    policy["spec"]["rules"].append({"name": "broken-gpu", "gpuHealth": {}})
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr
    stored = get_json(control_plane, namespace, "p")["spec"]["rules"][4]["gpuHealth"]
    assert stored == {  # no xids: left out, they are the critical ones (the parser's, below)
        "gpuLost": True,
        "memoryErrors": True,
        "for": "5m",
        "clearAfter": "10m",
    }
    parsed = parse_spec(get_json(control_plane, namespace, "p")["spec"]).rules[4]
    assert parsed == GpuHealthRule("broken-gpu")
    assert isinstance(parsed, GpuHealthRule)
    assert parsed.xids == CRITICAL_XIDS


def test_idle_gpus_is_defaulted(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    policy = base_policy()
    policy["spec"]["rules"].append({"name": "unused", "idleGpus": {}})
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr
    stored = get_json(control_plane, namespace, "p")["spec"]
    assert stored["rules"][4]["idleGpus"] == {"percent": 5, "for": "10m", "signal": "auto", "hysteresis": 5}
    assert parse_spec(stored).rules[4] == IdleGpus("unused", for_seconds=600)
    described = explained(control_plane, "gmp.spec.rules.idleGpus")
    assert "the pod holds more GPUs than its work uses" in described
    assert "percent + hysteresis" in explained(control_plane, "gmp.spec.rules.idleGpus.hysteresis")


def test_memory_ceiling_accepts_bytes_quantity(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    policy = base_policy()
    policy["spec"]["rules"][2]["memoryCeiling"] = {"bytes": "120Gi", "for": "1m"}
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr


# ------------------------------------------------------------------------- negative


def _set(path: str, value: Any) -> Callable[[Policy], None]:
    """Mutation: set a dotted path (list indices as numbers) to value."""

    def mutate(p: Policy) -> None:
        *parents, last = path.split(".")
        node: Any = p
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(*paths: str) -> Callable[[Policy], None]:
    """Mutation: delete dotted paths."""

    def mutate(p: Policy) -> None:
        for path in paths:
            *parents, last = path.split(".")
            node: Any = p
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            del node[last]

    return mutate


def _all(*mutations: Callable[[Policy], None]) -> Callable[[Policy], None]:
    """Mutation: several, in order."""

    def mutate(p: Policy) -> None:
        for m in mutations:
            m(p)

    return mutate


def _many_rules(p: Policy) -> None:
    p["spec"]["rules"] = [{"name": f"r{i}", "utilizationFloor": {"percent": 10}} for i in range(33)]
    p["spec"]["actions"]["scale"]["scaleUpOn"] = ["r0"]
    p["spec"]["actions"]["scale"]["scaleDownOn"] = ["r1"]


def _forecast(**fields: Any) -> Callable[[Policy], None]:
    return _set("spec.actions.scale.forecast", dict(fields))


INVALID: list[tuple[str, Callable[[Policy], None], str]] = [
    (
        "forecast-without-a-ceiling-rule",
        _all(_forecast(), _set("spec.actions.scale.scaleUpOn", ["near-oom"])),
        "actions.scale.forecast needs a utilizationCeiling rule in scaleUpOn: its percent is the ceiling",
    ),
    (
        "forecast-without-scale-up-rules",
        _all(_forecast(), _delete("spec.actions.scale.scaleUpOn")),
        "actions.scale.forecast needs a utilizationCeiling rule in scaleUpOn",
    ),
    ("forecast-horizon-too-long", _forecast(horizon="2h"), "horizon must be between 10s and 1h"),
    ("forecast-horizon-too-short", _forecast(horizon="5s"), "horizon must be between 10s and 1h"),
    (
        "forecast-horizon-malformed",
        _forecast(horizon="3 min"),
        "must be a duration such as 5m or 1h30m (units h, m, s, ms)",
    ),
    (
        "forecast-uncertainty-zero",
        _forecast(maxUncertainty=0),
        "spec.actions.scale.forecast.maxUncertainty in body should be greater than or equal to 1",
    ),
    (
        "anomaly-metric-unknown",
        _set("spec.rules.3", {"name": "leak", "anomaly": {"metric": "power"}}),
        'spec.rules[3].anomaly.metric: Unsupported value: "power": supported values: "utilization", "memory"',
    ),
    (
        "anomaly-metric-missing",
        _set("spec.rules.3", {"name": "leak", "anomaly": {"window": "10m"}}),
        "spec.rules[3].anomaly.metric: Required value",
    ),
    (
        "anomaly-window-below-1m",
        _set("spec.rules.3", {"name": "leak", "anomaly": {"metric": "memory", "window": "30s"}}),
        "window must be at least 1m",
    ),
    (
        "anomaly-window-below-the-interval",
        _all(
            _set("spec.evaluationInterval", "5m"),
            _set("spec.rules", [{"name": "odd", "anomaly": {"metric": "memory", "window": "2m"}}]),
            _delete("spec.actions.scale"),
        ),
        "rule odd: anomaly.window must be at least evaluationInterval (5m)",
    ),
    (
        "anomaly-threshold-below-1",
        _set("spec.rules.3", {"name": "leak", "anomaly": {"metric": "memory", "threshold": 0.5}}),
        "spec.rules[3].anomaly.threshold in body should be greater than or equal to 1",
    ),
    (
        "anomaly-and-another-kind",
        _set("spec.rules.3.anomaly", {"metric": "memory"}),
        "a rule must set exactly one of utilizationFloor, utilizationCeiling, idleGpus, memoryCeiling, "
        "memoryGrowth, gpuHealth, anomaly",
    ),
    ("selector-missing", _delete("spec.selector"), "spec.selector: Required value"),
    ("rules-missing", _delete("spec.rules"), "spec.rules: Required value"),
    ("rules-empty", _set("spec.rules", []), "spec.rules in body should have at least 1 items"),
    ("rules-too-many", _many_rules, "spec.rules: Too many: 33: must have at most 32 items"),
    (
        "rule-name-duplicate",
        _set("spec.rules.3", {"name": "idle-gpu", "utilizationCeiling": {"percent": 95}}),
        'spec.rules[3]: Duplicate value: {"name":"idle-gpu"}',
    ),
    (
        "rule-name-not-dns-label",
        _set("spec.rules.3.name", "Leak_Rule"),
        'spec.rules[3].name: Invalid value: "Leak_Rule": must be a DNS label such as idle-gpu',
    ),
    (
        "rule-without-kind",
        _set("spec.rules.3", {"name": "leak"}),
        "a rule must set exactly one of utilizationFloor, utilizationCeiling, idleGpus, memoryCeiling",
    ),
    (
        "rule-with-two-kinds",
        _set(
            "spec.rules.0",
            {
                "name": "idle-gpu",
                "utilizationFloor": {"percent": 20},
                "utilizationCeiling": {"percent": 95},
            },
        ),
        "a rule must set exactly one of utilizationFloor, utilizationCeiling, idleGpus, memoryCeiling",
    ),
    (
        "percent-above-100",
        _set("spec.rules.1.utilizationCeiling.percent", 150),
        "spec.rules[1].utilizationCeiling.percent: Invalid value: 150: "
        "spec.rules[1].utilizationCeiling.percent in body should be less than or equal to 100",
    ),
    (
        "percent-negative",
        _set("spec.rules.0.utilizationFloor.percent", -1),
        "spec.rules[0].utilizationFloor.percent in body should be greater than or equal to 0",
    ),
    (
        "duration-bad-format",
        _set("spec.evaluationInterval", "10 seconds"),
        'spec.evaluationInterval: Invalid value: "10 seconds": '
        "must be a duration such as 5m or 1h30m (units h, m, s, ms)",
    ),
    (
        "evaluation-interval-below-1s",
        _set("spec.evaluationInterval", "500ms"),
        "evaluationInterval must be at least 1s",
    ),
    (
        "rule-for-bad-format",
        _set("spec.rules.2.memoryCeiling.for", "1 minute"),
        'spec.rules[2].memoryCeiling.for: Invalid value: "1 minute": must be a duration such as 5m',
    ),
    (
        "utilization-floor-for-0s",
        _set("spec.rules.0.utilizationFloor.for", "0s"),
        "spec.rules: Invalid value: rule idle-gpu: utilizationFloor.for must be at least "
        "evaluationInterval (10s): a shorter window leaves samples that no evaluation reads",
    ),
    (
        "idle-gpus-for-below-interval",
        _set("spec.rules.3", {"name": "unused", "idleGpus": {"for": "5s"}}),
        "rule unused: idleGpus.for must be at least evaluationInterval (10s)",
    ),
    (
        "idle-gpus-percent-above-100",
        _set("spec.rules.3", {"name": "unused", "idleGpus": {"percent": 101}}),
        "spec.rules[3].idleGpus.percent in body should be less than or equal to 100",
    ),
    (
        "memory-ceiling-for-below-interval",
        _set("spec.rules.2.memoryCeiling.for", "5s"),
        "rule near-oom: memoryCeiling.for must be at least evaluationInterval (10s)",
    ),
    (
        "memory-ceiling-percent-and-bytes",
        _set("spec.rules.2.memoryCeiling", {"percent": 90, "bytes": "120Gi"}),
        "memoryCeiling must set exactly one of percent or bytes",
    ),
    (
        "memory-ceiling-neither",
        _set("spec.rules.2.memoryCeiling", {"for": "1m"}),
        "memoryCeiling must set exactly one of percent or bytes",
    ),
    (
        "memory-ceiling-bytes-zero",
        _set("spec.rules.2.memoryCeiling", {"bytes": "0"}),
        'spec.rules[2].memoryCeiling.bytes: Invalid value: "0": '
        "must be a whole number of bytes greater than zero: an integer, or a quantity such as 120Gi",
    ),
    (
        "memory-ceiling-bytes-fraction",
        _set("spec.rules.2.memoryCeiling", {"bytes": "1.5"}),
        'spec.rules[2].memoryCeiling.bytes: Invalid value: "1.5": must be a whole number of bytes',
    ),
    (
        "memory-ceiling-bytes-not-a-quantity",
        _set("spec.rules.2.memoryCeiling", {"bytes": "120GB"}),
        'spec.rules[2].memoryCeiling.bytes: Invalid value: "120GB": must be a whole number of bytes',
    ),
    (
        "memory-growth-rate-bad-format",
        _set("spec.rules.3.memoryGrowth.rate", "100MB per minute"),
        'spec.rules[3].memoryGrowth.rate: Invalid value: "100MB per minute": '
        "must be a rate such as 100Mi/m, 2Gi/h or 500k/s",
    ),
    (
        "memory-growth-rate-zero",
        _set("spec.rules.3.memoryGrowth.rate", "0Mi/m"),
        "rate must be greater than zero",
    ),
    (
        "memory-growth-window-below-1m",
        _set("spec.rules.3.memoryGrowth.window", "30s"),
        'spec.rules[3].memoryGrowth.window: Invalid value: "30s": window must be at least 1m',
    ),
    (
        "rule-windows-below-interval",
        _set("spec.evaluationInterval", "1h"),  # the first rule whose window is shorter is named
        "rule idle-gpu: utilizationFloor.for must be at least evaluationInterval (1h)",
    ),
    (
        "memory-growth-window-below-interval",
        _all(
            _set("spec.evaluationInterval", "2m"),
            _set("spec.rules.2.memoryCeiling.for", "2m"),
            _set("spec.rules.3.memoryGrowth.window", "1m"),
        ),
        "rule leak: memoryGrowth.window must be at least evaluationInterval (2m)",
    ),
    (
        "memory-growth-minfit-above-1",
        _set("spec.rules.3.memoryGrowth.minFit", 1.5),
        "spec.rules[3].memoryGrowth.minFit in body should be less than or equal to 1",
    ),
    (
        "memory-growth-memory-unknown",
        _set("spec.rules.3.memoryGrowth.memory", "bogus"),
        'spec.rules[3].memoryGrowth.memory: Unsupported value: "bogus": '
        'supported values: "auto", "device", "allocated", "reserved", "host"',
    ),
    (
        "utilization-signal-unknown",
        _set("spec.rules.0.utilizationFloor.signal", "magic"),
        'spec.rules[0].utilizationFloor.signal: Unsupported value: "magic": '
        'supported values: "auto", "smActive", "gpuUtil"',
    ),
    (
        "min-replicas-above-max",
        _set("spec.actions.scale.minReplicas", 9),
        "minReplicas must not exceed maxReplicas",
    ),
    (
        "scale-up-min-pods-percent-above-100",
        _set("spec.actions.scale.scaleUpMinPods", "150%"),
        'spec.actions.scale.scaleUpMinPods: Invalid value: "150%": '
        "must be a count such as 1 or a percentage from 1% to 100%",
    ),
    (
        "step-percent-zero",
        _set("spec.actions.scale.behavior", {"scaleDown": {"step": "0%"}}),
        'spec.actions.scale.behavior.scaleDown.step: Invalid value: "0%": '
        "must be a count such as 1 or a percentage from 1% to 999%",
    ),
    (
        "scale-up-on-unknown-rule",
        _set("spec.actions.scale.scaleUpOn", ["saturated", "no-such-rule"]),
        "actions.scale.scaleUpOn names a rule that is not in spec.rules: no-such-rule",
    ),
    (
        "scale-down-on-unknown-rule",
        _set("spec.actions.scale.scaleDownOn", ["ghost"]),
        "actions.scale.scaleDownOn names a rule that is not in spec.rules: ghost",
    ),
    (
        "rule-in-both-scale-directions",
        _set("spec.actions.scale.scaleDownOn", ["saturated"]),
        "a rule cannot be in both scaleUpOn and scaleDownOn",
    ),
    (
        "scale-without-rules",
        _delete("spec.actions.scale.scaleUpOn", "spec.actions.scale.scaleDownOn"),
        "scale needs at least one rule in scaleUpOn or scaleDownOn",
    ),
    (
        "scale-target-a-pod",
        _set("spec.actions.scale.targetRef", {"apiVersion": "v1", "kind": "Pod", "name": "trainer-0"}),
        "targetRef must name a kind with a /scale subresource",
    ),
    (
        "scale-target-a-job",
        _set("spec.actions.scale.targetRef", {"apiVersion": "batch/v1", "kind": "Job", "name": "train"}),
        "targetRef must name a kind with a /scale subresource",
    ),
    (
        "scale-target-missing",
        _delete("spec.actions.scale.targetRef"),
        "spec.actions.scale.targetRef: Required value",
    ),
    (
        "renotify-interval-below-1m",
        _set("spec.actions.renotifyInterval", "30s"),
        "renotifyInterval must be at least 1m",
    ),
    (
        "gpu-health-counts-nothing",
        _set(
            "spec.rules.3", {"name": "h", "gpuHealth": {"xids": [], "gpuLost": False, "memoryErrors": False}}
        ),
        "gpuHealth counts nothing: set xids, gpuLost, memoryErrors or throttling",
    ),
    (
        "gpu-health-clear-after-zero",
        _set("spec.rules.3", {"name": "h", "gpuHealth": {"clearAfter": "0s"}}),
        "clearAfter must be at least 1s",
    ),
    (
        "gpu-health-xid-twice",
        _set("spec.rules.3", {"name": "h", "gpuHealth": {"xids": [79, 79]}}),
        "spec.rules[3].gpuHealth.xids[1]: Duplicate value: 79",
    ),
    (
        "gpu-health-unknown-throttling",
        _set("spec.rules.3", {"name": "h", "gpuHealth": {"throttling": ["hot"]}}),
        'spec.rules[3].gpuHealth.throttling[0]: Unsupported value: "hot"',
    ),
    (
        "match-expression-in-without-values",
        _set("spec.selector.matchExpressions", [{"key": "tier", "operator": "In"}]),
        "values must be non-empty when operator is In or NotIn",
    ),
    (
        "match-expression-bad-operator",
        _set("spec.selector.matchExpressions", [{"key": "tier", "operator": "Maybe"}]),
        'spec.selector.matchExpressions[0].operator: Unsupported value: "Maybe"',
    ),
    # The rules on the pods' own metrics (issue 30) and where they are scraped.
    (
        "service-rule-without-a-metric",
        _set("spec.rules.3", {"name": "slow", "requestLatency": {"percentile": 99, "threshold": "2s"}}),
        "a requestLatency, requestQueue or kvCacheUsage rule names no metric: set its server",
    ),
    (
        "latency-percentile-unknown",
        _set(
            "spec.rules.3",
            {"name": "slow", "requestLatency": {"percentile": 98, "threshold": "2s", "server": "vllm"}},
        ),
        "spec.rules[3].requestLatency.percentile: Unsupported value: 98",
    ),
    (
        "latency-threshold-zero",
        _set(
            "spec.rules.3",
            {"name": "slow", "requestLatency": {"percentile": 99, "threshold": "0s", "server": "vllm"}},
        ),
        "threshold must be at least 1ms",
    ),
    (
        "latency-triton-end-to-end",
        _set(
            "spec.rules.3",
            {"name": "slow", "requestLatency": {"percentile": 99, "threshold": "2s", "server": "triton"}},
        ),
        "spec.rules[3].requestLatency.latency: Invalid value: Triton exports no end-to-end",
    ),
    (
        "latency-window-shorter-than-the-interval",
        _set(
            "spec.rules.3",
            {
                "name": "slow",
                "requestLatency": {"percentile": 99, "threshold": "2s", "server": "vllm", "window": "5s"},
            },
        ),
        "rule slow: requestLatency.window must be at least evaluationInterval (10s)",
    ),
    (
        "kv-cache-tgi",
        _set("spec.rules.3", {"name": "kv", "kvCacheUsage": {"percent": 90, "server": "tgi"}}),
        "spec.rules[3].kvCacheUsage.server: Invalid value: Triton and TGI export no KV-cache usage",
    ),
    (
        "queue-metric-not-a-name",
        _set("spec.rules.3", {"name": "q", "requestQueue": {"limit": 5, "metric": "my queue"}}),
        "must be a Prometheus metric name such as vllm:num_requests_waiting",
    ),
    (
        "service-metrics-port-zero",
        _set("spec.serviceMetrics", {"port": 0}),
        "spec.serviceMetrics.port in body should be greater than or equal to 1",
    ),
    (
        "service-metrics-path-relative",
        _set("spec.serviceMetrics", {"path": "metrics"}),
        'spec.serviceMetrics.path: Invalid value: "metrics": must be a URL path such as /metrics',
    ),
    (
        "service-metrics-interval-too-short",
        _set("spec.serviceMetrics", {"interval": "500ms"}),
        "serviceMetrics.interval must be at least 1s",
    ),
    (
        "service-metrics-server-unknown",
        _set("spec.serviceMetrics", {"server": "vllm2"}),
        'spec.serviceMetrics.server: Unsupported value: "vllm2"',
    ),
    (
        "service-rule-in-scale-down",
        _all(
            _set("spec.rules.3", {"name": "q", "requestQueue": {"limit": 5, "server": "vllm"}}),
            _set("spec.actions.scale.scaleDownOn", ["q"]),
        ),
        "actions.scale.scaleDownOn names a requestLatency, requestQueue or kvCacheUsage rule",
    ),
    (
        "requests-forecast-without-requests-per-replica",
        _all(
            _set("spec.rules.3", {"name": "q", "requestQueue": {"limit": 5, "server": "vllm"}}),
            _set("spec.actions.scale.scaleUpOn", ["q"]),
            _forecast(load="requests"),
        ),
        "requestsPerReplica is required with load requests, and only there",
    ),
    (
        "requests-forecast-without-a-service-rule",
        _forecast(load="requests", requestsPerReplica=4),
        "actions.scale.forecast with load: requests needs a requestLatency, requestQueue or kvCacheUsage",
    ),
    (
        "requests-per-replica-zero",
        _all(
            _set("spec.rules.3", {"name": "q", "requestQueue": {"limit": 5, "server": "vllm"}}),
            _set("spec.actions.scale.scaleUpOn", ["q"]),
            _forecast(load="requests", requestsPerReplica=0),
        ),
        "requestsPerReplica must be above 0",
    ),
]


SUBMIT = {
    "create": ("create",),
    # What the docs recommend for CRDs, and what GitOps tools (Flux, Argo CD's ServerSideApply) use.
    "server-side-apply": ("apply", "--server-side"),
}
# Server-side apply refuses duplicate keys of a list-map (or entries of a list-set) while building its
# typed patch, before any validation, in words of its own: test_duplicate_rule_names_under_server_side_apply
# ("duplicate entries for key [=79]" for gpuHealth.xids).
TYPED_PATCH_CASES = {"rule-name-duplicate", "gpu-health-xid-twice"}
CASES = [
    pytest.param(mutate, fragment, how, id=f"{case}-{how}")
    for case, mutate, fragment in INVALID
    for how in SUBMIT
    if not (how == "server-side-apply" and case in TYPED_PATCH_CASES)
]


def submit(cp: ControlPlane, namespace: str, obj: Policy, how: str) -> Any:
    return cp.kubectl(*SUBMIT[how], "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def api_errors(stderr: str) -> list[str]:
    """The API server's errors for a rejected object, less its notice that CEL rules were skipped."""
    _, _, rest = stderr.partition(" is invalid: ")
    lines = [line[2:] for line in rest.splitlines() if line.startswith("* ")] or [rest.strip()]
    return [line for line in lines if "some validation rules were not checked" not in line]


@pytest.mark.parametrize(("mutate", "fragment", "how"), CASES)
def test_invalid_policy_is_rejected(
    control_plane: ControlPlane,
    crd: str,
    namespace: str,
    mutate: Callable[[Policy], None],
    fragment: str,
    how: str,
) -> None:
    policy = copy.deepcopy(base_policy("bad"))
    mutate(policy)
    created = submit(control_plane, namespace, policy, how)
    assert created.returncode != 0, f"accepted an invalid policy:\n{yaml.safe_dump(policy)}"
    # The API server's rejection, not a client-side error, and not server-side apply's typed patch.
    assert 'The GPUMonitorPolicy "bad" is invalid' in created.stderr, created.stderr
    assert fragment in created.stderr, created.stderr
    # Written for people: no regex.
    assert "should match '" not in created.stderr, created.stderr
    absent = control_plane.kubectl("get", "-n", namespace, "gmp", "bad")
    assert absent.returncode != 0
    assert "NotFound" in absent.stderr


def test_duplicate_rule_names_under_server_side_apply(
    control_plane: ControlPlane, crd: str, namespace: str
) -> None:
    policy = base_policy("bad")
    policy["spec"]["rules"][3] = {"name": "idle-gpu", "utilizationCeiling": {"percent": 95}}
    applied = submit(control_plane, namespace, policy, "server-side-apply")
    assert applied.returncode != 0
    assert '.spec.rules: duplicate entries for key [name="idle-gpu"]' in applied.stderr, applied.stderr
    assert "valueUnstructured" not in applied.stderr, applied.stderr


@pytest.mark.parametrize("how", SUBMIT)
def test_a_value_neither_integer_nor_string_is_one_error(
    control_plane: ControlPlane, crd: str, namespace: str, how: str
) -> None:
    """An int-or-string field given 1.5: one error, not the anyOf's three more."""
    policy = base_policy("bad")
    policy["spec"]["rules"][2]["memoryCeiling"] = {"bytes": 1.5}
    created = submit(control_plane, namespace, policy, how)
    assert created.returncode != 0
    assert api_errors(created.stderr) == [
        'spec.rules[2].memoryCeiling.bytes: Invalid value: "number": '
        'spec.rules[2].memoryCeiling.bytes in body must be of type integer,string: "number"'
    ], created.stderr


@pytest.mark.parametrize("how", SUBMIT)
def test_max_replicas_zero_is_one_error(
    control_plane: ControlPlane, crd: str, namespace: str, how: str
) -> None:
    """minReplicas was never set (its default is 1): only maxReplicas is wrong."""
    policy = base_policy("bad")
    del policy["spec"]["actions"]["scale"]["minReplicas"]
    policy["spec"]["actions"]["scale"]["maxReplicas"] = 0
    created = submit(control_plane, namespace, policy, how)
    assert created.returncode != 0
    assert api_errors(created.stderr) == [
        "spec.actions.scale.maxReplicas: Invalid value: 0: "
        "spec.actions.scale.maxReplicas in body should be greater than or equal to 1"
    ], created.stderr


def test_rule_window_equal_to_the_interval_is_accepted(
    control_plane: ControlPlane, crd: str, namespace: str
) -> None:
    policy = base_policy()
    policy["spec"]["evaluationInterval"] = "1m"
    policy["spec"]["rules"][2]["memoryCeiling"]["for"] = "60s"  # the same duration, written otherwise
    policy["spec"]["rules"][3]["memoryGrowth"]["window"] = "1m"
    created = create(control_plane, namespace, policy)
    assert created.returncode == 0, created.stderr


# ----------------------------------------------------------------- kubectl features


def test_explain_prints_descriptions(control_plane: ControlPlane, crd: str) -> None:
    explained = control_plane.kubectl("explain", "gpumonitorpolicy.spec.rules")
    assert explained.returncode == 0, explained.stderr
    out = explained.stdout
    assert "GROUP:      gpuwarden.dev" in out or "gpuwarden.dev" in out
    assert "FIELD: rules <[]Object>" in out
    assert "The conditions to check on every selected pod." in " ".join(out.split())
    for field in (
        "name",
        "utilizationFloor",
        "utilizationCeiling",
        "idleGpus",
        "memoryCeiling",
        "memoryGrowth",
    ):
        assert f"  {field}\t" in out or f"  {field} " in out, out
    nested = control_plane.kubectl("explain", "gmp.spec.rules.memoryGrowth.minFit", check=True)
    assert "How straight the growth must be" in " ".join(nested.stdout.split())


def explained(cp: ControlPlane, field: str) -> str:
    """`kubectl explain` of a field, its whitespace collapsed."""
    return " ".join(cp.kubectl("explain", field, check=True).stdout.split())


def test_explain_shows_defaults_and_int_or_string(control_plane: ControlPlane, crd: str) -> None:
    """`kubectl explain` prints descriptions only (no `default`, and `<Object>` for an int-or-string
    field): the descriptions carry both."""
    spec = explained(control_plane, "gmp.spec")
    assert re.search(r"evaluationInterval <string> [^<]* Default: 10s\. ", spec), spec
    floor = explained(control_plane, "gmp.spec.rules.utilizationFloor")
    assert re.search(r"for <string> [^<]*at least evaluationInterval[^<]* Default: 5m\. ", floor), floor
    assert re.search(r"signal <string> enum: [^<]* Default: auto\.", floor), floor
    up = explained(control_plane, "gmp.spec.actions.scale.behavior.scaleUp")
    assert re.search(
        r"step <Object> Integer or string: replicas added per scaling step[^<]* Default: 1\.", up
    )
    assert re.search(r"cooldown <string> [^<]* Default: 1m\.", up), up
    memory = explained(control_plane, "gmp.spec.rules.memoryCeiling.bytes")
    assert "Integer or string: the threshold as an absolute size" in memory, memory
    forecast = explained(control_plane, "gmp.spec.actions.scale.forecast")
    assert "Scale ahead of the load" in forecast, forecast
    assert re.search(r"horizon <string> [^<]*observed replica start-up time", forecast), forecast
    assert re.search(r"maxUncertainty <number> [^<]* Default: 20\.", forecast), forecast
    anomaly = explained(control_plane, "gmp.spec.rules.anomaly")
    assert "robust z-score" in anomaly, anomaly
    assert "GPUPeriodicSpikes" in anomaly, anomaly
    assert re.search(r"metric <string> -required- enum: utilization, memory", anomaly), anomaly
    growth = explained(control_plane, "gmp.spec.rules.memoryGrowth")
    assert re.search(
        # kubectl explain cuts an enum's list short ("auto, device, allocated, reserved, ....").
        r"memory <string> enum: auto, device, [^<]*Which memory the rule watches"
        r"[^<]*live tensors[^<]* Default: auto\.",
        growth,
    ), growth


def test_explain_describes_the_service_rules(control_plane: ControlPlane, crd: str) -> None:
    """Every field issue 30 added, described for `kubectl explain`, with its default."""
    source = explained(control_plane, "gmp.spec.serviceMetrics")
    assert "prometheus.io/port" in source, source
    assert re.search(r"port <integer> [^<]*wins over the pod's prometheus.io/port", source), source
    assert re.search(r"path <string> [^<]*Default: the annotation, else /metrics\.", source), source
    assert re.search(r"scheme <string> enum: http, https [^<]* Default: http\.", source), source
    assert re.search(r"interval <string> [^<]*Default: the policy's evaluationInterval\.", source), source
    assert re.search(r"server <string> enum: vllm, sglang, [^<]*archived upstream", source), source
    latency = explained(control_plane, "gmp.spec.rules.requestLatency")
    assert "histogram_quantile(percentile/100, increase(<histogram>_bucket[window]))" in latency, latency
    assert re.search(r"percentile <integer> -required- enum: 50, 90, ", latency), latency
    assert re.search(r"threshold <string> -required- [^<]*500ms", latency), latency
    assert re.search(r"window <string> [^<]* Default: 5m\.", latency), latency
    assert re.search(r"for <string> [^<]* Default: 2m\.", latency), latency
    assert re.search(r"latency <string> enum: endToEnd, [^<]* Default: endToEnd\.", latency), latency
    assert re.search(r"metric <string> [^<]*without _bucket[^<]*Wins over server\.", latency), latency
    assert re.search(r"hysteresis <number> [^<]* Default: 10\.", latency), latency
    queue = explained(control_plane, "gmp.spec.rules.requestQueue")
    assert re.search(r"limit <number> -required- ", queue), queue
    assert re.search(r"per <string> enum: replica, pod [^<]* Default: replica\.", queue), queue
    assert re.search(r"for <string> [^<]* Default: 1m\.", queue), queue
    kv = explained(control_plane, "gmp.spec.rules.kvCacheUsage")
    assert re.search(r"percent <number> -required- ", kv), kv
    assert re.search(r"unit <string> enum: ratio, percent [^<]* Default: ratio\.", kv), kv
    assert "server <string>" in kv, kv
    forecast = explained(control_plane, "gmp.spec.actions.scale.forecast")
    assert re.search(r"load <string> enum: utilization, requests [^<]* Default: utilization\.", forecast)
    assert re.search(r"requestsPerReplica <number> [^<]*one replica serves", forecast), forecast


def test_printer_columns(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    create(control_plane, namespace, base_policy("cols"), "--save-config")
    status = {
        "matchedPods": 3,
        "violatingPods": 1,
        "scale": {"currentReplicas": 2},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Evaluating",
                "message": "ok",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
    }
    control_plane.kubectl(
        "patch", "-n", namespace, "gmp", "cols", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}), check=True,
    )  # fmt: skip
    table = control_plane.kubectl("get", "-n", namespace, "gpumonitorpolicies", check=True).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PODS", "VIOLATING", "READY", "AGE"]
    assert row.split()[:4] == ["cols", "3", "1", "True"]
    wide = control_plane.kubectl("get", "-n", namespace, "gmp", "-o", "wide", check=True).stdout
    wide_header, wide_row = wide.splitlines()[:2]
    assert wide_header.split() == ["NAME", "PODS", "VIOLATING", "REPLICAS", "READY", "REASON", "AGE"]
    assert wide_row.split()[:6] == ["cols", "3", "1", "2", "True", "Evaluating"]


def test_status_only_through_status_subresource(
    control_plane: ControlPlane, crd: str, namespace: str, tmp_path: Path
) -> None:
    created = create(control_plane, namespace, base_policy("st"))
    assert created.returncode == 0, created.stderr

    # A normal update (replace) that carries a status: the main resource ignores it.
    current = get_json(control_plane, namespace, "st")
    current["status"] = {"matchedPods": 7}
    current["spec"]["evaluationInterval"] = "20s"
    replaced = control_plane.kubectl("replace", "-f", "-", input=json.dumps(current))
    assert replaced.returncode == 0, replaced.stderr
    after = get_json(control_plane, namespace, "st")
    assert after["spec"]["evaluationInterval"] == "20s"
    assert "status" not in after or "matchedPods" not in after["status"]

    # A merge patch of status on the main resource: also ignored.
    control_plane.kubectl(
        "patch", "-n", namespace, "gmp", "st", "--type=merge", "-p", '{"status":{"matchedPods":5}}',
        check=True,
    )  # fmt: skip
    assert "matchedPods" not in get_json(control_plane, namespace, "st").get("status", {})

    # Through the status subresource it sticks, and the spec is left alone.
    generation = after["metadata"]["generation"]
    control_plane.kubectl(
        "patch", "-n", namespace, "gmp", "st", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"matchedPods": 5, "observedGeneration": generation}}),
        check=True,
    )  # fmt: skip
    final = get_json(control_plane, namespace, "st")
    assert final["status"]["matchedPods"] == 5
    assert final["status"]["observedGeneration"] == generation
    # Status writes don't bump the generation.
    assert final["metadata"]["generation"] == generation

    # The status subresource validates against the status schema as well.
    bad = control_plane.kubectl(
        "patch", "-n", namespace, "gmp", "st", "--subresource=status", "--type=merge",
        "-p", '{"status":{"matchedPods":-1}}',
    )  # fmt: skip
    assert bad.returncode != 0
    assert "status.matchedPods: Invalid value: -1" in bad.stderr, bad.stderr
    assert "should be greater than or equal to 0" in bad.stderr, bad.stderr


# -------------------------------------------------------------- harness sanity checks
# Not about the CRD: they pin down what the control-plane fixture promises other tests.


def test_server_reports_its_version(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("version", "-o", "json", check=True).stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert version["serverVersion"]["gitVersion"] != "v0.0.0-master+$Format:%H$"
    assert version["clientVersion"]["gitVersion"] == version["serverVersion"]["gitVersion"]


def test_service_account_token_request_and_review(control_plane: ControlPlane, namespace: str) -> None:
    # No controller-manager: ServiceAccounts are not created for us.
    control_plane.kubectl("create", "serviceaccount", "-n", namespace, "robot", check=True)
    token = control_plane.kubectl(
        "create", "token", "-n", namespace, "robot", "--audience=gpuwarden-test", "--duration=10m", check=True
    ).stdout.strip()
    assert token.count(".") == 2  # a JWT
    review = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token, "audiences": ["gpuwarden-test"]},
    }
    reviewed = control_plane.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(review), check=True)
    status = json.loads(reviewed.stdout)["status"]
    assert status["authenticated"] is True, status
    assert status["user"]["username"] == f"system:serviceaccount:{namespace}:robot"
    # RBAC is on: the service account may not list pods until granted.
    denied = control_plane.kubectl(
        "auth", "can-i", "list", "pods", "-n", namespace, f"--as=system:serviceaccount:{namespace}:robot"
    )
    assert denied.stdout.strip() == "no"


@pytest.mark.parametrize("how", SUBMIT)
@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("spec.evaluationInterval", "spec.evaluationInterval", "10 seconds"),
        ("spec.rules.3.memoryGrowth.window", "spec.rules[3].memoryGrowth.window", "half an hour"),
        ("spec.rules.0.utilizationFloor.for", "spec.rules[0].utilizationFloor.for", "5 minutes"),
        ("spec.actions.renotifyInterval", "spec.actions.renotifyInterval", "1 hour"),
    ],
)
def test_malformed_duration_is_reported_once(
    control_plane: ControlPlane, crd: str, namespace: str, path: str, field: str, value: str, how: str
) -> None:
    """One error, in words: neither the minimum's rule nor the window >= evaluationInterval rule also
    fails (with a type-conversion error the user cannot act on), and no regex."""
    policy = copy.deepcopy(base_policy("bad"))
    _set(path, value)(policy)
    created = submit(control_plane, namespace, policy, how)
    assert created.returncode != 0
    assert api_errors(created.stderr) == [
        f'{field}: Invalid value: "{value}": must be a duration such as 5m or 1h30m (units h, m, s, ms)'
    ], created.stderr

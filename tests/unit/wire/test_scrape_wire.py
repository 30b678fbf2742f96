"""Schema version 6 and the scrape plan: the pods' scrapes on a snapshot, and the plan in a report's answer,
each bounded and refused with the field named."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gpuwarden.wire.node import GpuSample, NodeReport, ReportError, Snapshot, dump_report, parse_report
from gpuwarden.wire.scrape import (
    MAX_TARGETS,
    PlanError,
    ScrapeFailure,
    ScrapePlan,
    ScrapeTarget,
    ServiceCounter,
    ServiceGauge,
    ServiceHistogram,
    ServiceSample,
    dump_plan,
    parse_plan,
)

T0 = 1_764_770_000.0
GOOD = ServiceSample(
    namespace="serving",
    name="llm-0",
    uid="u-0",
    at=T0,
    histograms=[
        ServiceHistogram(
            name="vllm:e2e_request_latency_seconds", bounds=[0.5, 1.0], counts=[3, 5], count=6, sum=4.5
        )
    ],
    counters=[ServiceCounter(name="vllm:request_success_total", value=6)],
    gauges=[ServiceGauge(name="vllm:num_requests_waiting", values=[2, 0])],
)
FAILED = ServiceSample(namespace="serving", name="llm-1", uid="u-1", at=T0, error=ScrapeFailure.TIMEOUT)


def report(version: int, services: list[ServiceSample]) -> bytes:
    snapshot = Snapshot(timestamp=T0, gpus=[GpuSample(uuid="GPU-0", index=0)], services=services)
    return dump_report(
        NodeReport(schema_version=version, node="n", agent_id="a", seq=0, snapshots=[snapshot])
    )


def test_scrapes_ride_on_a_snapshot_and_round_trip() -> None:
    body = report(6, [GOOD, FAILED])
    assert b'"services":[{"namespace":"serving"' in body
    assert b'"error":"Timeout"' in body
    assert parse_report(body).snapshots[0].services == [GOOD, FAILED]


@pytest.mark.parametrize("version", [4, 5])
def test_an_older_version_may_not_carry_them(version: int) -> None:
    assert parse_report(report(version, [])).schema_version == version
    with pytest.raises(ReportError, match=f"services: not part of schemaVersion {version}"):
        parse_report(report(version, [GOOD]))


def mangled(path: list[Any], new: Any) -> bytes:
    document = json.loads(report(6, [GOOD]))
    node = document["snapshots"][0]["services"][0]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("path", "new", "field"),
    [
        (["histograms", 0, "counts"], [5, 3], "counts: cumulative"),
        (["histograms", 0, "counts"], [3, 7], "none exceeds count"),
        (["histograms", 0, "bounds"], [1.0, 0.5], "bounds: must ascend"),
        (["histograms", 0, "counts"], [3], "one per bound"),
        (["histograms", 0, "bounds"], [float(i) for i in range(65)], "bounds"),
        (["gauges", 0, "values"], [1.0] * 17, "values"),
        (["gauges", 0, "values"], [], "values"),
        (["counters", 0, "value"], -1, "value"),
        (["counters", 0, "name"], "has space", "name"),
        (["error"], "Exploded", "error"),
        (["error"], "Timeout", "a failed scrape carries no metrics"),
        (["uid"], "", "uid"),
    ],
)
def test_a_bad_scrape_is_refused_naming_the_field(path: list[Any], new: Any, field: str) -> None:
    with pytest.raises(ReportError, match=field):
        parse_report(mangled(path, new))


def a_target(**changes: Any) -> dict[str, Any]:
    wire = {
        "namespace": "serving",
        "name": "llm-0",
        "uid": "u-0",
        "ip": "10.244.1.7",
        "port": 8000,
        "path": "/metrics",
        "scheme": "http",
        "metrics": ["vllm:e2e_request_latency_seconds"],
        "intervalSeconds": 5.0,
    }
    return wire | changes


def test_a_plan_round_trips_as_the_answers_scrape_value() -> None:
    plan = ScrapePlan(targets=[ScrapeTarget.model_validate(a_target(), by_alias=True)])
    answer = json.loads('{"accepted": 1, "scrape": ' + dump_plan(plan) + "}")
    assert parse_plan(answer["scrape"]) == plan
    assert plan.targets[0].url() == "http://10.244.1.7:8000/metrics"


def test_an_ipv6_target_has_its_address_in_brackets() -> None:
    target = parse_plan({"targets": [a_target(ip="fd00::7", path="/metrics?format=text")]}).targets[0]
    assert target.url() == "http://[fd00::7]:8000/metrics?format=text"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"ip": "pod.example.com"}, "targets.0.ip"),
        ({"ip": "10.0.0.1:80"}, "targets.0.ip"),
        ({"port": 0}, "targets.0.port"),
        ({"port": "8000"}, "targets.0.port"),  # strict: JSON types as declared
        ({"path": "metrics"}, "targets.0.path"),
        ({"path": "/a b"}, "targets.0.path"),
        ({"path": "/@evil.example.com/"}, None),  # a path, not a host: allowed, stays on the pod
        ({"scheme": "file"}, "targets.0.scheme"),
        ({"metrics": []}, "targets.0.metrics"),
        ({"metrics": ["x"] * 33}, "targets.0.metrics"),
        ({"intervalSeconds": 0.1}, "targets.0.intervalSeconds"),
        ({"interval_seconds": 5.0}, "targets.0"),  # camelCase only
    ],
)
def test_a_bad_target_refuses_the_plan_naming_the_field(changes: dict[str, Any], field: str | None) -> None:
    if field is None:
        target = parse_plan({"targets": [a_target(**changes)]}).targets[0]
        assert target.url() == "http://10.244.1.7:8000/@evil.example.com/"
        return
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        parse_plan({"targets": [a_target(**changes)]})


def test_a_plan_is_bounded() -> None:
    with pytest.raises(PlanError, match="targets"):
        parse_plan({"targets": [a_target(uid=f"u-{i}") for i in range(MAX_TARGETS + 1)]})
    with pytest.raises(PlanError, match="scrape"):
        parse_plan([a_target()])


def test_a_histogram_model_checks_itself_when_built() -> None:
    with pytest.raises(ValidationError):
        ServiceHistogram(name="h", bounds=[1.0], counts=[2.0], count=1.0, sum=0.0)

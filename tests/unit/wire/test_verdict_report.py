"""The VerdictReport wire schema: strict, bounded, versioned, the field named when refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuwarden.wire.verdicts import (
    MAX_PODS,
    SCHEMA_VERSION,
    PodVerdict,
    RuleVerdict,
    VerdictError,
    VerdictReport,
    dump_verdicts,
    parse_verdicts,
)


def report(**kw: Any) -> VerdictReport:
    rule = RuleVerdict(
        rule="idle", kind="utilizationFloor", holds=True, clears=False, value=3.0, threshold=20.0,
        unit="percent", gpus=["GPU-1"], message="mean GPU utilization 3% over 10s, floor 20%",
    )  # fmt: skip
    fields: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "shard": "op-b",
        "at": 1_800_000_000.0,
        "namespace": "ns",
        "policy": "pol",
        "generation": 1,
        "pods": [PodVerdict(pod="q", rules=[rule]), PodVerdict(pod="r")],
    } | kw
    return VerdictReport(**fields)


def wire(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(dump_verdicts(report()))
    return body | kw


def test_a_report_goes_over_the_wire_and_back_in_camel_case() -> None:
    body = dump_verdicts(report())
    assert b'"schemaVersion":1' in body
    assert b'"secondsToFull"' not in body  # None fields left out
    assert parse_verdicts(body) == report()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"at": "1800000000"}, "at"),  # strict: no strings for numbers
        ({"generation": 1.0}, "generation"),
        ({"extra": 1}, "extra"),
        ({"shard": ""}, "shard"),
        ({"pods": [{"pod": "q", "rules": [{"rule": "idle"}]}]}, "pods.0.rules.0"),
    ],
)
def test_what_is_not_the_schema_is_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(VerdictError, match=rf"^{field}"):
        parse_verdicts(json.dumps(wire(**change)))


def test_figures_are_finite_and_bounded() -> None:
    body = json.dumps(wire()).replace("3.0", "NaN")
    with pytest.raises(VerdictError, match="value"):
        parse_verdicts(body)
    with pytest.raises(ValueError, match="finite"):
        RuleVerdict(
            rule="r", kind="utilizationFloor", holds=False, clears=True, value=float("inf"), threshold=1.0,
            unit="percent",
        )  # fmt: skip
    with pytest.raises(VerdictError, match="value"):
        parse_verdicts(json.dumps(wire()).replace("3.0", "1e300"))


def test_lists_are_capped() -> None:
    many = [{"pod": f"p{i}"} for i in range(MAX_PODS + 1)]
    with pytest.raises(VerdictError, match=r"^pods"):
        parse_verdicts(json.dumps(wire(pods=many)))


def test_another_schema_version_is_refused() -> None:
    with pytest.raises(VerdictError, match="schemaVersion: 2 is not supported"):
        parse_verdicts(json.dumps(wire(schemaVersion=2)))

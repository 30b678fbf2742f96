"""Label-selector matching, against the semantics of k8s.io/apimachinery's LabelSelectorAsSelector."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.policy.parse import parse_selector
from gpuwarden.policy.spec.model import LabelRequirement, LabelSelector
from gpuwarden.policy.spec.selector import requirement_matches, selector_matches

POD = {"app": "llm-server", "tier": "gpu", "example.com/team": "search"}


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        # An empty selector selects everything, even a pod without labels.
        ({}, {}, True),
        ({}, POD, True),
        ({"matchLabels": {}}, POD, True),
        ({"matchExpressions": []}, POD, True),
        # matchLabels: every pair, exact values, case-sensitive.
        ({"matchLabels": {"app": "llm-server"}}, POD, True),
        ({"matchLabels": {"app": "llm-server", "tier": "gpu"}}, POD, True),
        ({"matchLabels": {"app": "llm-server", "tier": "cpu"}}, POD, False),
        ({"matchLabels": {"app": "LLM-server"}}, POD, False),
        ({"matchLabels": {"missing": "x"}}, POD, False),
        ({"matchLabels": {"example.com/team": "search"}}, POD, True),
        # The empty string is a valid value and must be present to match.
        ({"matchLabels": {"canary": ""}}, {"canary": ""}, True),
        ({"matchLabels": {"canary": ""}}, {}, False),
        # In: present and one of the values.
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "tpu"]}]}, POD, True),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["cpu"]}]}, POD, False),
        ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}, POD, False),
        # NotIn: absent, or present with none of the values.
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["cpu"]}]}, POD, True),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gpu"]}]}, POD, False),
        ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, POD, True),
        # Exists / DoesNotExist look at the key only; an empty value still exists.
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, POD, True),
        ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, POD, False),
        ({"matchExpressions": [{"key": "canary", "operator": "Exists"}]}, {"canary": ""}, True),
        ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, POD, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, POD, False),
        # matchLabels and matchExpressions are ANDed; so are the expressions.
        (
            {
                "matchLabels": {"app": "llm-server"},
                "matchExpressions": [{"key": "gpuwarden.dev/ignore", "operator": "DoesNotExist"}],
            },
            POD,
            True,
        ),
        (
            {
                "matchLabels": {"app": "llm-server"},
                "matchExpressions": [{"key": "gpuwarden.dev/ignore", "operator": "DoesNotExist"}],
            },
            {**POD, "gpuwarden.dev/ignore": "true"},
            False,
        ),
        (
            {
                "matchExpressions": [
                    {"key": "tier", "operator": "In", "values": ["gpu"]},
                    {"key": "app", "operator": "NotIn", "values": ["llm-server"]},
                ]
            },
            POD,
            False,
        ),
        # A key can be both in matchLabels and in an expression; both must hold.
        (
            {
                "matchLabels": {"tier": "gpu"},
                "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gpu"]}],
            },
            POD,
            False,
        ),
    ],
)
def test_selector_matches(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert selector_matches(parse_selector(selector), labels) is expected


def test_unknown_operator_never_matches() -> None:
    """The model could be built by hand; an operator parse_spec would reject must not select pods."""
    assert requirement_matches(LabelRequirement(key="tier", operator="Equals", values=("gpu",)), POD) is False


_keys = st.sampled_from(["app", "tier", "zone", "example.com/team"])
_values = st.sampled_from(["a", "b", "c", ""])
_labels = st.dictionaries(_keys, _values, max_size=4)


@given(st.dictionaries(_keys, _values, max_size=3), _labels)
def test_match_labels_equals_in_with_one_value(match_labels: dict[str, str], labels: dict[str, str]) -> None:
    """As Kubernetes defines it: each matchLabels pair is an In requirement with a single value."""
    as_labels = LabelSelector(match_labels=tuple(sorted(match_labels.items())))
    as_expressions = LabelSelector(
        match_expressions=tuple(
            LabelRequirement(key=k, operator="In", values=(v,)) for k, v in match_labels.items()
        )
    )
    assert selector_matches(as_labels, labels) == selector_matches(as_expressions, labels)


@given(_keys, st.lists(_values, min_size=1, max_size=3), _labels)
def test_not_in_is_the_negation_of_in(key: str, values: list[str], labels: dict[str, str]) -> None:
    in_ = LabelRequirement(key=key, operator="In", values=tuple(values))
    not_in = LabelRequirement(key=key, operator="NotIn", values=tuple(values))
    assert requirement_matches(in_, labels) != requirement_matches(not_in, labels)


@given(_keys, _labels)
def test_does_not_exist_is_the_negation_of_exists(key: str, labels: dict[str, str]) -> None:
    exists = LabelRequirement(key=key, operator="Exists")
    absent = LabelRequirement(key=key, operator="DoesNotExist")
    assert requirement_matches(exists, labels) != requirement_matches(absent, labels)

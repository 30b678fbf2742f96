"""What a reclaim writes on a workload and what restoring writes back: each action's merge patch,
and restore's, applied to the object as the API server applies a merge patch (RFC 7386)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

from gpuwarden.operator.reclaim.marks import opted_out, reclaim_patch, reclaimed, restore_patch
from gpuwarden.operator.reclaim.restore import kind_named
from gpuwarden.policy import ReclaimMethod

AT = "2030-03-17T17:46:40Z"


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def obj(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": "w", "namespace": "ns", "resourceVersion": "7", "annotations": {"team": "a"}}
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, "spec": spec}


@pytest.mark.parametrize(
    ("api_version", "kind", "spec", "method", "changed", "words"),
    [
        (
            "apps/v1",
            "Deployment",
            {"replicas": 3},
            ReclaimMethod.SCALE_TO_ZERO,
            {"replicas": 0},
            "scaled to zero (3→0)",
        ),
        ("apps/v1", "StatefulSet", {}, ReclaimMethod.SCALE_TO_ZERO, {"replicas": 0}, "scaled to zero (1→0)"),
        ("batch/v1", "Job", {"suspend": False}, ReclaimMethod.SUSPEND, {"suspend": True}, "suspended"),
        ("ray.io/v1", "RayCluster", {}, ReclaimMethod.SUSPEND, {"suspend": True}, "suspended"),
        (
            "kueue.x-k8s.io/v1beta2",
            "Workload",
            {},
            ReclaimMethod.SUSPEND,
            {"active": False},
            "deactivated (Kueue)",
        ),
        ("apps/v1", "Deployment", {"replicas": 2}, ReclaimMethod.ANNOTATE, {"replicas": 2}, "annotated"),
    ],
)
def test_reclaim_records_the_change_and_restore_undoes_it(
    api_version: str,
    kind: str,
    spec: dict[str, Any],
    method: ReclaimMethod,
    changed: dict[str, Any],
    words: str,
) -> None:
    before = obj(api_version, kind, spec)
    body, said = reclaim_patch(method, before, by="idle: idle on 1/1 pods", at=AT)
    assert said == words
    assert body["metadata"]["resourceVersion"] == "7"  # a workload changed meanwhile is not overwritten
    after = merge(before, body)
    assert {k: after["spec"].get(k) for k in changed} == changed
    assert reclaimed(after)
    assert after["metadata"]["annotations"]["gpuwarden.dev/reclaimed-by"] == "idle: idle on 1/1 pods"

    undo = restore_patch(after)
    assert undo is not None
    restored = merge(after, undo[0])
    assert restored["metadata"]["annotations"] == {"team": "a"}
    # What was set before is set again; a field that was absent reads as its default.
    defaults = {"replicas": 1, "suspend": False, "active": True}
    for key in changed:
        assert restored["spec"].get(key, defaults[key]) == spec.get(key, defaults[key])
    assert restore_patch(restored) is None


def test_opt_out_is_the_annotation_false() -> None:
    o = obj("apps/v1", "Deployment", {})
    assert not opted_out(o)
    marked = copy.deepcopy(o)
    marked["metadata"]["annotations"]["gpuwarden.dev/reclaim"] = "False"
    assert opted_out(marked)


@pytest.mark.parametrize(
    ("word", "kind"),
    [
        ("deploy", "Deployment"),
        ("deployments", "Deployment"),
        ("sts", "StatefulSet"),
        ("job", "Job"),
        ("jobsets.jobset.x-k8s.io", "JobSet"),
        ("RayCluster", "RayCluster"),
        ("workload", "Workload"),
    ],
)
def test_restore_takes_kinds_as_kubectl_does(word: str, kind: str) -> None:
    found = kind_named(word)
    assert found is not None
    assert found.kind == kind


def test_restore_refuses_kinds_reclaim_does_not_act_on() -> None:
    assert kind_named("replicaset") is None
    assert kind_named("pod") is None
    assert kind_named("jobs.example.com") is None

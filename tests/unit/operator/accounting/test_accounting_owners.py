"""Top-owner resolution: the chains Kubernetes builds, read through a reader that answers like the API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from gpuwarden.operator.accounting import OwnerResolver, Workload
from gpuwarden.operator.accounting.owners import Unresolved
from gpuwarden.operator.kube import ApiError


def obj(labels: Mapping[str, str] | None = None, owner: tuple[str, str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": dict(labels or {})}
    if owner is not None:
        api_version, kind, name = owner
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Other", "name": "not-the-controller"},
            {"apiVersion": api_version, "kind": kind, "name": name, "controller": True},
        ]
    return {"metadata": meta}


class Api:
    """Objects by path; counts reads; a status instead of an object raises it as the API client does."""

    def __init__(self, objects: Mapping[str, dict[str, Any] | int]) -> None:
        self.objects = dict(objects)
        self.reads: list[str] = []

    async def get(self, path: str) -> dict[str, Any]:
        self.reads.append(path)
        found = self.objects.get(path, 404)
        if isinstance(found, int):
            raise ApiError(found, "refused")
        return found


POD = "/api/v1/namespaces/ml/pods/"
RS = "/apis/apps/v1/namespaces/ml/replicasets/"
STS = "/apis/apps/v1/namespaces/ml/statefulsets/"


async def test_a_deployments_pods_are_accounted_to_it_and_its_replicaset_is_read_once() -> None:
    api = Api(
        {
            POD + "web-abc-1": obj({"team": "search"}, ("apps/v1", "ReplicaSet", "web-abc")),
            POD + "web-abc-2": obj({"team": "search"}, ("apps/v1", "ReplicaSet", "web-abc")),
            RS + "web-abc": obj(owner=("apps/v1", "Deployment", "web")),
        }
    )
    resolver = OwnerResolver(api, group_label="team")
    assert await resolver.workload("ml", "web-abc-1") == Workload("Deployment", "web", "search")
    assert await resolver.workload("ml", "web-abc-2") == Workload("Deployment", "web", "search")
    assert api.reads.count(RS + "web-abc") == 1


async def test_without_following_owners_only_the_pod_is_read_and_its_controller_is_the_top() -> None:
    """--no-accounting-owners: the chart grants no get on replicasets, jobs or statefulsets then."""
    api = Api(
        {
            POD + "web-abc-1": obj(owner=("apps/v1", "ReplicaSet", "web-abc")),
            RS + "web-abc": obj(owner=("apps/v1", "Deployment", "web")),
        }
    )
    resolver = OwnerResolver(api, follow_owners=False)
    assert await resolver.workload("ml", "web-abc-1") == Workload("ReplicaSet", "web-abc")
    assert api.reads == [POD + "web-abc-1"]


async def test_a_cronjobs_job_pods_go_to_the_cronjob_and_a_plain_job_is_its_own_top() -> None:
    api = Api(
        {
            POD + "nightly-1-x": obj(owner=("batch/v1", "Job", "nightly-1")),
            "/apis/batch/v1/namespaces/ml/jobs/nightly-1": obj(owner=("batch/v1", "CronJob", "nightly")),
            POD + "once-x": obj(owner=("batch/v1", "Job", "once")),
            "/apis/batch/v1/namespaces/ml/jobs/once": obj(),
        }
    )
    resolver = OwnerResolver(api)
    assert await resolver.workload("ml", "nightly-1-x") == Workload("CronJob", "nightly")
    assert await resolver.workload("ml", "once-x") == Workload("Job", "once")


async def test_a_leaderworkerset_above_its_statefulset_and_a_daemonset_without_a_read() -> None:
    api = Api(
        {
            POD + "lws-0": obj(owner=("apps/v1", "StatefulSet", "lws")),
            "/apis/apps/v1/namespaces/ml/statefulsets/lws": obj(
                owner=("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "lws")
            ),
            POD + "ds-x": obj(owner=("apps/v1", "DaemonSet", "ds")),
        }
    )
    resolver = OwnerResolver(api)
    assert await resolver.workload("ml", "lws-0") == Workload("LeaderWorkerSet", "lws")
    assert await resolver.workload("ml", "ds-x") == Workload("DaemonSet", "ds")
    assert api.reads == [POD + "lws-0", "/apis/apps/v1/namespaces/ml/statefulsets/lws", POD + "ds-x"]


async def test_a_bare_pod_a_gone_pod_and_an_unreadable_owner() -> None:
    api = Api(
        {
            POD + "bare": obj({"team": "x"}),
            POD + "orphan": obj(owner=("apps/v1", "ReplicaSet", "forbidden")),
            RS + "forbidden": 403,
        }
    )
    resolver = OwnerResolver(api, group_label="team")
    assert await resolver.workload("ml", "bare") == Workload("Pod", "bare", "x")
    assert await resolver.workload("ml", "gone") == Workload("Pod", "gone")
    assert await resolver.workload("ml", "orphan") == Workload("ReplicaSet", "forbidden")


async def test_a_leaderworkerset_workers_pod_goes_up_through_its_leader_pod() -> None:
    # LeaderWorkerSet: the leader StatefulSet is the set's; each group's workers are a StatefulSet
    # controlled by the group's leader pod.
    lws = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llm")
    api = Api(
        {
            POD + "llm-0": obj(owner=("apps/v1", "StatefulSet", "llm")),
            POD + "llm-0-1": obj(owner=("apps/v1", "StatefulSet", "llm-0")),
            STS + "llm": obj(owner=lws),
            STS + "llm-0": obj(owner=("v1", "Pod", "llm-0")),
        }
    )
    resolver = OwnerResolver(api)
    assert await resolver.workload("ml", "llm-0-1") == Workload("LeaderWorkerSet", "llm")
    assert await resolver.workload("ml", "llm-0") == Workload("LeaderWorkerSet", "llm")
    assert api.reads == [POD + "llm-0-1", STS + "llm-0", POD + "llm-0", STS + "llm", POD + "llm-0"]


@pytest.mark.parametrize("status", [0, 429, 500, 503])
async def test_an_api_that_cannot_answer_now_leaves_the_pod_unresolved(status: int) -> None:
    api = Api({POD + "web-1": obj(owner=("apps/v1", "ReplicaSet", "web-abc")), RS + "web-abc": status})
    with pytest.raises(Unresolved):
        await OwnerResolver(api).workload("ml", "web-1")
    api.objects[POD + "web-2"] = status
    with pytest.raises(Unresolved):
        await OwnerResolver(api).workload("ml", "web-2")

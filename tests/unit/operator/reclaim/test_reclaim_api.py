"""Which Kueue API version reclaiming lists Workloads at: v1beta2, v1beta1 only where v1beta2 is not
served (on a Kueue that stores v1beta2, v1beta1's validation fails an admitted Workload's update; the
integration test meets it on real Kueue), and none where Kueue is not installed."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwarden.clients import Credentials
from gpuwarden.operator.kube import ApiError, JsonObject, KubeApi
from gpuwarden.operator.reclaim import KubeReclaimApi, Owner
from gpuwarden.operator.reclaim.api import ReclaimApiError

JOB = Owner("batch/v1", "Job", "ns", "train", "uid-1")


def workload(version: str, owner_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"kueue.x-k8s.io/{version}",
        "kind": "Workload",
        "metadata": {"name": "job-train-1", "ownerReferences": [{"kind": "Job", "uid": owner_uid}]},
    }


class ServedVersions(KubeApi):
    """An API server serving Kueue's Workloads at the ``served`` versions (or failing with a status)."""

    def __init__(self, served: dict[str, list[dict[str, Any]] | int]) -> None:
        super().__init__(Credentials("https://127.0.0.1:1", token="t"))
        self.served = served
        self.paths: list[str] = []

    async def get(self, path: str) -> JsonObject:
        self.paths.append(path)
        version = path.split("/")[3]
        answer = self.served.get(version, 404)
        if isinstance(answer, int):
            raise ApiError(answer, "refused")
        return {"items": answer}


async def test_v1beta2_is_listed_first() -> None:
    kube = ServedVersions({"v1beta2": [workload("v1beta2", "uid-1")], "v1beta1": []})
    found = await KubeReclaimApi(kube).kueue_workload(JOB)
    assert found == workload("v1beta2", "uid-1")
    assert kube.paths == ["/apis/kueue.x-k8s.io/v1beta2/namespaces/ns/workloads"]


async def test_v1beta1_where_v1beta2_is_not_served() -> None:
    kube = ServedVersions({"v1beta1": [workload("v1beta1", "other"), workload("v1beta1", "uid-1")]})
    found = await KubeReclaimApi(kube).kueue_workload(JOB)
    assert found == workload("v1beta1", "uid-1")
    assert [p.split("/")[3] for p in kube.paths] == ["v1beta2", "v1beta1"]


async def test_none_without_kueue_and_an_error_otherwise() -> None:
    assert await KubeReclaimApi(ServedVersions({})).kueue_workload(JOB) is None
    with pytest.raises(ReclaimApiError, match="listing Kueue Workloads"):
        await KubeReclaimApi(ServedVersions({"v1beta2": 403})).kueue_workload(JOB)

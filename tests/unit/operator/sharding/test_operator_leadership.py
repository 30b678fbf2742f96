"""Kopf's peering rule, mirrored; the pod label follows the verdict."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.kube.client import ApiError
from gpuwarden.operator.sharding.leadership import Leadership, peering_paused

NOW = datetime(2027, 1, 1, 12, 0, tzinfo=UTC)


def at(moment: datetime) -> Callable[[], float]:
    """The operator's clock, stopped at ``moment``."""
    return lambda: moment.timestamp()


def peer(priority: int, seen_ago: float = 5, lifetime: int = 60) -> dict[str, Any]:
    return {
        "priority": priority,
        "lifetime": lifetime,
        "lastseen": (NOW - timedelta(seconds=seen_ago)).isoformat(),
    }


@pytest.mark.parametrize(
    ("peers", "paused"),
    [
        ({}, False),
        ({"me": peer(10)}, False),
        ({"me": peer(10), "other": peer(5)}, False),
        ({"me": peer(10), "other": peer(20)}, True),
        ({"me": peer(10), "other": peer(10)}, True),  # same priority: Kopf pauses both
        ({"me": peer(10), "other": peer(20, seen_ago=61)}, False),  # dead
        ({"me": peer(10), "other": peer(20, lifetime=0)}, False),  # left gracefully
        ({"me": peer(10), "other": {"priority": 20}}, True),  # no lastseen: counts as seen now
        ({"me": peer(10), "other": "garbage"}, False),
    ],
)
def test_kopf_rule(peers: dict[str, Any], paused: bool) -> None:
    assert peering_paused(peers, identity="me", priority=10, now=NOW) is paused


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.labels: list[tuple[str, str, dict[str, str | None]]] = []

    async def get(self, path: str) -> dict[str, Any]:
        if path not in self.objects:
            raise ApiError(404, "not found")
        return self.objects[path]

    async def patch_pod_labels(
        self, ns: str, name: str, labels: dict[str, str | None], *, manager: str
    ) -> None:
        self.labels.append((ns, name, labels))


CONFIG = OperatorConfig(identity="me", priority=10, pod_name="op-0", pod_namespace="sys", peering="gw")
CLUSTER_PATH = "/apis/kopf.dev/v1/clusterkopfpeerings/gw"


async def test_no_peering_object_pauses_like_kopf() -> None:
    leadership = Leadership(CONFIG, FakeApi(), clock=at(NOW))  # type: ignore[arg-type]
    assert await leadership.decide() is False


async def test_namespaced_peering_pauses_if_any_namespace_says_so() -> None:
    api = FakeApi()
    config = OperatorConfig(namespaces=("a", "b"), identity="me", priority=10, peering="gw")
    api.objects["/apis/kopf.dev/v1/namespaces/a/kopfpeerings/gw"] = {"status": {}}
    api.objects["/apis/kopf.dev/v1/namespaces/b/kopfpeerings/gw"] = {"status": {"x": peer(99)}}
    leadership = Leadership(config, api, clock=at(NOW))  # type: ignore[arg-type]
    assert await leadership.decide() is False
    api.objects["/apis/kopf.dev/v1/namespaces/b/kopfpeerings/gw"] = {"status": {}}
    assert await leadership.decide() is True


async def test_a_peer_is_live_until_its_lifetime_runs_out_on_the_operators_clock() -> None:
    api = FakeApi()
    api.objects[CLUSTER_PATH] = {"status": {"me": peer(10), "other": peer(20, seen_ago=0, lifetime=60)}}
    now = [NOW]
    leadership = Leadership(CONFIG, api, clock=lambda: now[0].timestamp())  # type: ignore[arg-type]
    assert await leadership.decide() is False
    now[0] = NOW + timedelta(seconds=59)
    assert await leadership.decide() is False
    now[0] = NOW + timedelta(seconds=60)  # the higher peer's lifetime is over: this one acts
    assert await leadership.decide() is True


async def test_label_follows_the_verdict_and_is_removed_on_exit() -> None:
    api = FakeApi()
    changes: list[bool] = []
    leadership = Leadership(CONFIG, api, clock=at(NOW), on_change=changes.append)  # type: ignore[arg-type]
    api.objects[CLUSTER_PATH] = {"status": {"me": {"priority": 10}}}
    await leadership._set_active(await leadership.decide())
    await leadership._reconcile_label()
    await leadership._reconcile_label()  # no change, no patch
    assert leadership.active
    assert api.labels == [("sys", "op-0", {"gpuwarden.dev/ingest-active": "true"})]
    api.objects[CLUSTER_PATH] = {"status": {"me": {"priority": 10}, "new": {"priority": 11}}}
    await leadership._set_active(await leadership.decide())
    await leadership._reconcile_label()
    assert not leadership.active
    assert api.labels[-1] == ("sys", "op-0", {"gpuwarden.dev/ingest-active": None})
    assert changes == [True, False]
    await leadership.step_down()
    assert api.labels[-1][2] == {"gpuwarden.dev/ingest-active": None}


async def test_no_pod_name_means_no_label() -> None:
    api = FakeApi()
    leadership = Leadership(OperatorConfig(identity="me", priority=1), api, clock=at(NOW))  # type: ignore[arg-type]
    leadership.active = True
    await leadership._reconcile_label()
    assert api.labels == []

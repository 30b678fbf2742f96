"""A deleted policy's daemon ends by itself: the operator puts no finalizer on policies (handlers.py's
_no_finalizers), so Kopf does not stop the daemon on deletion; the DELETED event does, and a 404 on
the status write should that event be missed. A namesake created since keeps running."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_fakes import PODS, POLICY, T0, StatusApi, feed

from gpuwarden.operator.composition import Operator, build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.handlers import registry
from gpuwarden.operator.kube import ApiError
from gpuwarden.operator.policies.runner import EXISTENCE_CHECK_S
from gpuwarden.operator.resources import PolicyKey

KEY = PolicyKey("ns", "pol")


def test_no_handler_makes_kopf_put_a_finalizer_on_anything() -> None:
    spawning = registry._spawning.get_all_handlers()
    changing = registry._changing.get_all_handlers()
    assert [h.id for h in spawning] == ["evaluate"]  # the daemon is still registered
    assert [h.id for h in spawning if h.requires_finalizer] == []
    assert [h.id for h in changing if h.requires_finalizer] == []


def _operator(api: Any) -> Operator:
    return build_operator(OperatorConfig(), api=api, clock=lambda: T0)


def _running(operator: Operator, body: dict[str, Any]) -> asyncio.Task[None]:
    runner = operator.runner(KEY)
    return asyncio.create_task(runner.run(body=body, pods=PODS, policies={}))


@pytest.mark.looptime
async def test_the_deleted_event_ends_the_daemon_and_clears_its_findings() -> None:
    operator = _operator(StatusApi())
    feed(operator.state, T0 - 20, T0, util=3)
    task = _running(operator, dict(POLICY))
    await asyncio.sleep(5)
    assert operator.state.runs_policy("ns", "pol")
    assert (
        operator.parts.metrics.exposition().count(b'gpuwarden_operator_findings{namespace="ns",policy="pol"')
        == 1
    )

    operator.state.end_policy("another-uid")  # a namesake's deletion: not this one's
    await asyncio.sleep(5)
    assert not task.done()

    operator.state.end_policy("pol-uid")
    await asyncio.wait_for(task, timeout=1)  # at once, not at the next interval
    assert not operator.state.runs_policy("ns", "pol")
    assert b'policy="pol"' not in operator.parts.metrics.exposition()


@pytest.mark.looptime
async def test_an_old_daemon_ending_leaves_its_namesakes_pacing() -> None:
    operator = _operator(StatusApi())
    old = _running(operator, dict(POLICY))
    await asyncio.sleep(1)
    renamed = dict(POLICY, metadata={**POLICY["metadata"], "uid": "new-uid"})
    new = _running(operator, renamed)  # created again under the same name before the old one's event
    await asyncio.sleep(1)
    operator.state.end_policy("pol-uid")
    await asyncio.wait_for(old, timeout=1)
    assert operator.state.runs_policy("ns", "pol")
    operator.state.end_policy("new-uid")
    await asyncio.wait_for(new, timeout=1)
    assert not operator.state.runs_policy("ns", "pol")


class GoneApi(StatusApi):
    async def patch_status(self, *args: Any, status: Any = None, manager: str, **kw: Any) -> dict[str, Any]:
        raise ApiError(404, 'gpumonitorpolicies.gpuwarden.dev "pol" not found')


@pytest.mark.looptime
async def test_a_status_write_answered_404_ends_the_daemon() -> None:
    operator = _operator(GoneApi())
    feed(operator.state, T0 - 20, T0, util=3)  # a finding, so the first round writes the status
    task = _running(operator, dict(POLICY))
    await asyncio.wait_for(task, timeout=1)
    assert not operator.state.runs_policy("ns", "pol")


class ListedApi(StatusApi):
    """Answers GETs of the policy from ``objects`` (a path's absence: 404), as the API server would."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, dict[str, Any]] = {}
        self.gets = 0

    async def get(self, path: str) -> dict[str, Any]:
        self.gets += 1
        if path not in self.objects:
            raise ApiError(404, "not found")
        return self.objects[path]


POLICY_PATH = "/apis/gpuwarden.dev/v1alpha1/namespaces/ns/gpumonitorpolicies/pol"


@pytest.mark.looptime
async def test_a_policy_gone_without_its_event_ends_its_daemon_within_five_minutes() -> None:
    api = ListedApi()
    api.objects[POLICY_PATH] = {"metadata": {"uid": "pol-uid"}}
    operator = _operator(api)  # no readings: a quiet policy, whose status never changes after the first write
    task = _running(operator, dict(POLICY))
    await asyncio.sleep(EXISTENCE_CHECK_S + 30)
    assert not task.done()
    assert api.gets == 1  # once per five minutes, not per round

    del api.objects[POLICY_PATH]  # deleted, and the DELETED event never came
    await asyncio.wait_for(task, timeout=EXISTENCE_CHECK_S + 2)
    assert not operator.state.runs_policy("ns", "pol")


@pytest.mark.looptime
async def test_a_namesake_in_its_place_ends_the_old_daemon_too() -> None:
    api = ListedApi()
    api.objects[POLICY_PATH] = {"metadata": {"uid": "someone-else"}}
    operator = _operator(api)
    task = _running(operator, dict(POLICY))
    await asyncio.wait_for(task, timeout=EXISTENCE_CHECK_S + 2)

"""DRA devices to GPUs: ResourceSlice generations, the resolver's order and its counting, and the
ResourceSlice list and watch against a real HTTP server that answers as the API server does."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any

import pytest
from aiohttp import web

from gpuwarden.agent.attribution import (
    Allocations,
    DraDevice,
    DraGpu,
    DraResolver,
    MigPlacement,
    PodAttributor,
    PodResourcesState,
    ResourceSlices,
    SlicesState,
    UnresolvedReason,
    mig_placement,
    published_devices,
)
from gpuwarden.agent.attribution.dra import RESOURCE_SLICES_PATH, ResourceSlicesError
from gpuwarden.agent.nvml import nvml_minor_numbers
from gpuwarden.wire.node import GpuSample, PodRef, ProcessSample, Snapshot

NVIDIA = "gpu.nvidia.com"
NODE = "node-a"
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
MIG0 = "MIG-22222222-2222-2222-2222-222222222222"


def device(name: str, **attributes: str) -> dict[str, Any]:
    return {"name": name, "attributes": {k: {"string": v} for k, v in attributes.items()}}


def slice_(
    name: str, devices: list[dict[str, Any]], *, generation: int = 1, count: int = 1, driver: str = NVIDIA
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "spec": {
            "driver": driver,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": generation, "resourceSliceCount": count},
            "devices": devices,
        },
    }


def dra(name: str) -> DraDevice:
    return DraDevice(NVIDIA, NODE, name)


def test_devices_carry_their_uuid_and_a_mig_device_its_parent() -> None:
    found = published_devices(
        [
            slice_(
                "s",
                [
                    device("gpu-0", uuid=GPU0),
                    device("gpu-0-mig-1g18gb-19-0", uuid=MIG0, parentUUID=GPU0),
                    device("gpu-1", **{f"{NVIDIA}/uuid": GPU1}),  # a qualified name is the same attribute
                    device("gpu-1-mig-1g18gb-19-1"),  # dynamic MIG: no uuid until prepared
                ],
            )
        ]
    )
    assert found == {
        dra("gpu-0"): DraGpu(GPU0),
        dra("gpu-0-mig-1g18gb-19-0"): DraGpu(MIG0, parent_uuid=GPU0),
        dra("gpu-1"): DraGpu(GPU1),
        dra("gpu-1-mig-1g18gb-19-1"): None,
    }


def test_a_generation_bump_one_slice_at_a_time_never_drops_the_known_devices() -> None:
    # NVIDIA's driver rewrites a two-slice pool in place, one slice at a time: for a while neither
    # generation is complete, and every device must stay known, the newer generation's entry winning
    a1 = slice_("a", [device("gpu-0", uuid="GPU-old"), device("gpu-1", uuid=GPU1)], generation=1, count=2)
    b1 = slice_("b", [device("gpu-2", uuid="GPU-2")], generation=1, count=2)
    a2 = slice_("a", [device("gpu-0", uuid=GPU0), device("gpu-1", uuid=GPU1)], generation=2, count=2)
    b2 = slice_("b", [device("gpu-2", uuid="GPU-2")], generation=2, count=2)

    everything = {dra("gpu-0"): DraGpu(GPU0), dra("gpu-1"): DraGpu(GPU1), dra("gpu-2"): DraGpu("GPU-2")}
    assert published_devices([a1, b1]) == {**everything, dra("gpu-0"): DraGpu("GPU-old")}
    assert published_devices([a2, b1]) == everything  # mid-bump: nothing complete, nothing lost
    assert published_devices([b1, a2]) == everything  # whatever order the watch keeps them in
    assert published_devices([a2, b2]) == everything
    # a driver that publishes the new generation beside the old one: the newer entry wins either way
    new_a = slice_("new-a", [device("gpu-0", uuid=GPU0)], generation=3, count=2)
    assert published_devices([a2, b2, new_a])[dra("gpu-0")] == DraGpu(GPU0)
    assert published_devices([new_a, a1])[dra("gpu-0")] == DraGpu(GPU0)


class Slices(ResourceSlices):
    """Slices set by the test, as a synced watch would have them."""

    def __init__(
        self, devices: dict[DraDevice, DraGpu | None], state: SlicesState = SlicesState.SYNCED
    ) -> None:
        super().__init__(NODE, "https://unused", token_path=None, ca_path=None)
        self.devices = devices
        self.state = state


def holder(name: str, claim: str = "gpu") -> PodRef:
    return PodRef(namespace="ml", name=name, container="c", claim=claim)


def claimed(*entries: tuple[str, tuple[PodRef, ...]]) -> Allocations:
    return Allocations(claimed={dra(name): refs for name, refs in entries})


def test_slices_first_then_names_through_minor_numbers_else_counted() -> None:
    counted: list[UnresolvedReason] = []
    slices = Slices({dra("gpu-0"): DraGpu(GPU0), dra("gpu-2"): None})
    resolver = DraResolver(slices, minor_numbers=lambda: {1: GPU1, 3: "GPU-3"}, on_unresolved=counted.append)

    resolved = resolver.resolve(
        claimed(
            ("gpu-0", (holder("a"),)),
            ("gpu-1", (holder("b"),)),  # not in the slices: its name gives minor 1
            ("gpu-2", (holder("c"),)),  # published without a uuid; minor 2 unknown to NVML
            ("gpu-1-mig-1g18gb-19-0", (holder("d"),)),  # a MIG name does not name its UUID
        )
    )

    assert resolved.devices == {GPU0: (holder("a"),), GPU1: (holder("b"),)}
    assert resolver.unresolved == {
        dra("gpu-2"): UnresolvedReason.NO_UUID,
        dra("gpu-1-mig-1g18gb-19-0"): UnresolvedReason.UNKNOWN_DEVICE,
    }
    assert sorted(counted) == sorted([UnresolvedReason.NO_UUID, UnresolvedReason.UNKNOWN_DEVICE])


def test_an_unresolved_device_is_counted_and_logged_once_and_again_after_it_resolved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counted: list[UnresolvedReason] = []
    slices = Slices({}, state=SlicesState.NOT_SERVED)
    resolver = DraResolver(slices, on_unresolved=counted.append)
    allocations = claimed(("gpu-5", (holder("a", claim="big"),)))

    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert resolver.resolve(allocations).devices == {}
    assert counted == [UnresolvedReason.SLICES_UNAVAILABLE]
    (record,) = caplog.records
    assert "gpu.nvidia.com/node-a/gpu-5 cannot be resolved" in record.getMessage()
    assert "ml/a/c (claim big)" in record.getMessage()

    # listed now, but without a uuid for it: another reason, counted again
    slices.state, slices.devices = SlicesState.SYNCED, {dra("gpu-5"): None}
    resolver.resolve(allocations)
    assert counted == [UnresolvedReason.SLICES_UNAVAILABLE, UnresolvedReason.NO_UUID]
    slices.devices = {dra("gpu-5"): DraGpu(GPU0)}
    assert resolver.resolve(allocations).devices == {GPU0: (holder("a", claim="big"),)}
    slices.devices = {}
    resolver.resolve(allocations)
    assert counted[2:] == [UnresolvedReason.UNKNOWN_DEVICE]


def test_dynamic_mig_names_resolve_through_their_placement_in_nvml() -> None:
    counted: list[UnresolvedReason] = []
    asked: list[set[MigPlacement]] = []
    # the driver publishes a dynamic MIG device with parentUUID and profile but no uuid, and never again
    slices = Slices({dra("gpu-1-mig-1g18gb-19-2"): None, dra("gpu-1-mig-1g18gb-19-3"): None})

    def mig_devices(wanted: Collection[MigPlacement]) -> Mapping[tuple[int, int, int], str]:
        asked.append(set(wanted))
        return {(1, 19, 2): MIG0}  # placement 3 is not created (yet)

    resolver = DraResolver(slices, mig_devices=mig_devices, on_unresolved=counted.append)
    resolved = resolver.resolve(
        claimed(
            ("gpu-1-mig-1g18gb-19-2", (holder("a"),)),
            ("gpu-1-mig-1g18gb-19-3", (holder("b"),)),
            ("gpu-0", (holder("c"),)),  # not published; no minor numbers to go by here
        )
    )

    assert resolved.devices == {MIG0: (holder("a"),)}
    assert asked == [{MigPlacement(1, 19, 2), MigPlacement(1, 19, 3)}]  # one NVML walk for all of them
    assert resolver.unresolved == {
        dra("gpu-1-mig-1g18gb-19-3"): UnresolvedReason.MIG_NOT_FOUND,
        dra("gpu-0"): UnresolvedReason.UNKNOWN_DEVICE,
    }
    assert sorted(counted) == sorted([UnresolvedReason.MIG_NOT_FOUND, UnresolvedReason.UNKNOWN_DEVICE])

    # published devices that resolve from the slices never cost an NVML walk
    published = Slices({dra("gpu-0-mig-1g18gb-19-0"): DraGpu(MIG0, parent_uuid=GPU0)})
    resolver = DraResolver(published, mig_devices=mig_devices)
    assert resolver.resolve(claimed(("gpu-0-mig-1g18gb-19-0", (holder("a"),)))).devices == {
        MIG0: (holder("a"),)
    }
    assert len(asked) == 1


@pytest.mark.parametrize(
    ("name", "placement"),
    [
        ("gpu-0-mig-1g18gb-19-0", MigPlacement(0, 19, 0)),
        ("gpu-7-mig-1g18gb-me-20-6", MigPlacement(7, 20, 6)),  # "1g.18gb+me": the profile's own dashes
        ("gpu-12-mig-3g71gb-9-4", MigPlacement(12, 9, 4)),
        ("gpu-0", None),
        ("gpu-0-mig-a", None),
        ("mig-0-gpu-1g18gb-19-0", None),
    ],
)
def test_dynamic_mig_names_as_the_driver_writes_them(name: str, placement: MigPlacement | None) -> None:
    assert mig_placement(name) == placement


def test_other_drivers_are_not_resolved_by_name() -> None:
    counted: list[UnresolvedReason] = []
    resolver = DraResolver(None, minor_numbers=lambda: {0: GPU0}, on_unresolved=counted.append)
    other = Allocations(claimed={DraDevice("gpu.example.com", NODE, "gpu-0"): (holder("a"),)})

    assert resolver.resolve(other).devices == {}
    assert counted == [UnresolvedReason.SLICES_UNAVAILABLE]


class StaticSource:
    """An allocation source that always answers the same."""

    def __init__(self, allocations: Allocations) -> None:
        self.allocations = allocations
        self.state = PodResourcesState.OK

    async def list(self) -> Allocations:
        return self.allocations


async def test_a_shared_claim_and_a_mig_device_are_attributed_like_device_plugin_ones() -> None:
    slices = Slices({dra("gpu-0"): DraGpu(GPU0), dra("gpu-1-mig-a"): DraGpu(MIG0, parent_uuid=GPU1)})
    source = StaticSource(
        claimed(
            ("gpu-0", (holder("left", "shared"), holder("right", "shared"))),
            ("gpu-1-mig-a", (holder("llm"),)),
        )
    )
    attributor = PodAttributor(source, dra=DraResolver(slices))
    await attributor.refresh()

    annotated = attributor.annotate(
        Snapshot(
            timestamp=1.0,
            gpus=[
                GpuSample(uuid=GPU0, index=0, processes=[ProcessSample(pid=4_000_001)]),
                GpuSample(uuid=GPU1, index=1),
                GpuSample(uuid=GPU1, index=1, mig_id=MIG0),
            ],
        )
    )
    shared, parent, mig = annotated.gpus
    assert shared.pods == [holder("left", "shared"), holder("right", "shared")]
    assert shared.processes[0].pod is None  # two holders and no cgroup to tell: not guessed
    assert parent.pods == []
    assert mig.pods == [holder("llm")]


# -- the list and watch, against an HTTP server ------------------------------------------------


class ApiServer:
    """Answers the ResourceSlice list and one watch as the API server does; the test feeds the watch."""

    def __init__(self) -> None:
        self.status = 200
        self.items: list[dict[str, Any]] = []
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.queries: list[dict[str, str]] = []
        self.auth: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.queries.append(dict(request.query))
        self.auth.append(request.headers.get("Authorization", ""))
        if self.status != 200:
            return web.json_response({"kind": "Status", "code": self.status}, status=self.status)
        if request.query.get("watch") != "1":
            return web.json_response({"metadata": {"resourceVersion": "10"}, "items": self.items})
        response = web.StreamResponse()
        await response.prepare(request)
        while (event := await self.events.get()) is not None:
            await response.write(json.dumps(event).encode() + b"\n")
        return response


@pytest.fixture
async def api() -> AsyncIterator[tuple[ApiServer, str]]:
    server = ApiServer()
    app = web.Application()
    app.router.add_get(RESOURCE_SLICES_PATH, server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield server, f"http://127.0.0.1:{port}"
    server.events.put_nowait(None)
    await runner.cleanup()


async def test_lists_then_follows_the_watch_of_this_node_only(
    api: tuple[ApiServer, str], tmp_path: Any
) -> None:
    server, url = api
    server.items = [slice_("s1", [device("gpu-0", uuid=GPU0)])]
    token = tmp_path / "token"
    token.write_text("secret\n")
    slices = ResourceSlices(NODE, url, token_path=token, ca_path=None)
    task = asyncio.create_task(slices.run())
    try:
        async with asyncio.timeout(10):
            await slices.synced.wait()
        assert slices.state is SlicesState.SYNCED
        assert slices.devices == {dra("gpu-0"): DraGpu(GPU0)}

        server.events.put_nowait({"type": "ADDED", "object": slice_("s2", [device("gpu-1", uuid=GPU1)])})
        async with asyncio.timeout(10):
            while dra("gpu-1") not in slices.devices:
                await slices.changed()
        server.events.put_nowait({"type": "DELETED", "object": slice_("s1", [])})
        async with asyncio.timeout(10):
            while dra("gpu-0") in slices.devices:
                await slices.changed()
        assert slices.devices == {dra("gpu-1"): DraGpu(GPU1)}
    finally:
        task.cancel()
        await slices.close()
    listed, watched = server.queries[:2]
    assert listed == {"fieldSelector": f"spec.nodeName={NODE}"}
    assert watched["fieldSelector"] == f"spec.nodeName={NODE}"
    assert (watched["watch"], watched["resourceVersion"]) == ("1", "10")
    assert server.auth[0] == "Bearer secret"


@pytest.mark.parametrize(
    ("status", "state", "said"),
    [(404, SlicesState.NOT_SERVED, "serves no resource.k8s.io/v1"), (403, SlicesState.ERROR, "HTTP 403")],
)
async def test_no_resource_k8s_io_v1_is_said_plainly(
    api: tuple[ApiServer, str], status: int, state: SlicesState, said: str
) -> None:
    server, url = api
    server.status = status
    slices = ResourceSlices(NODE, url, token_path=None, ca_path=None)
    try:
        with pytest.raises(ResourceSlicesError, match=said) as raised:
            await slices.list()
    finally:
        await slices.close()
    assert raised.value.state is state
    assert slices.state is state
    assert not slices.synced.is_set()


async def test_an_answer_that_is_no_slice_list_is_an_error_not_a_crash(api: tuple[ApiServer, str]) -> None:
    server, url = api
    server.items = [{"metadata": {}}]  # no name
    slices = ResourceSlices(NODE, url, token_path=None, ca_path=None)
    try:
        with pytest.raises(ResourceSlicesError, match="unexpected answer"):
            await slices.list()
    finally:
        await slices.close()
    assert slices.state is SlicesState.ERROR


def test_names_through_minor_numbers_when_nvml_cannot_answer_are_counted_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # NVML not initialised here (no GPU, no backend open): the real library answers Uninitialized,
    # as it would for a lost driver; the claim is counted unresolved and the refresh goes on
    counted: list[UnresolvedReason] = []
    resolver = DraResolver(None, minor_numbers=nvml_minor_numbers, on_unresolved=counted.append)

    with caplog.at_level(logging.WARNING):
        assert resolver.resolve(claimed(("gpu-0", (holder("a"),)))).devices == {}

    assert counted == [UnresolvedReason.SLICES_UNAVAILABLE]
    assert any("NVML cannot count GPUs" in r.getMessage() for r in caplog.records)

"""The PodResources client against a real gRPC server of our own on a unix socket."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from gpuwarden.agent.attribution.kubelet import (
    DraDevice,
    PodResourcesClient,
    PodResourcesError,
    PodResourcesState,
    allocations_from_response,
    is_nvidia_gpu_resource,
    physical_device,
)
from gpuwarden.agent.podresources import podresources_pb2 as pb
from gpuwarden.agent.podresources import podresources_pb2_grpc as pb_grpc
from gpuwarden.wire.node import PodRef

GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
MIG0 = "MIG-99999999-8888-7777-6666-555555555555"


def _pod(namespace: str, name: str, *containers: pb.ContainerResources) -> pb.PodResources:
    return pb.PodResources(namespace=namespace, name=name, containers=list(containers))


def _container(name: str, *devices: tuple[str, list[str]]) -> pb.ContainerResources:
    return pb.ContainerResources(
        name=name,
        devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices],
    )


NODE = pb.ListPodResourcesResponse(
    pod_resources=[
        # a whole GPU, and a sidecar without devices
        _pod("ml", "trainer-0", _container("train", ("nvidia.com/gpu", [GPU0])), _container("sidecar")),
        # time-slicing: two pods hold replicas of the same GPU
        _pod("ml", "notebook-a", _container("jupyter", ("nvidia.com/gpu", [f"{GPU1}::0"]))),
        _pod("ml", "notebook-b", _container("jupyter", ("nvidia.com/gpu.shared", [f"{GPU1}::3"]))),
        # a MIG slice (mixed strategy)
        _pod("infer", "llm-0", _container("server", ("nvidia.com/mig-1g.18gb", [MIG0]))),
        # not a GPU: ignored for devices, still listed as a pod
        _pod(
            "net",
            "router",
            _container("app", ("example.com/sriov", ["0000:3b:00.1"]), ("nvidia.com/ib", ["mlx5_0"])),
        ),
        # deviceIDStrategy=index
        _pod("ml", "legacy", _container("c", ("nvidia.com/gpu", ["7"]))),
        # DRA: no device IDs, a (driver, pool, device) per claim; kept for the drivers asked for only
        _pod(
            "ml",
            "dra",
            pb.ContainerResources(
                name="c",
                dynamic_resources=[
                    pb.DynamicResource(
                        claim_name="gpu",
                        claim_namespace="ml",
                        claim_resources=[
                            pb.ClaimResource(
                                driver_name="gpu.nvidia.com",
                                pool_name="node-a",
                                device_name="gpu-0",
                                cdi_devices=[pb.CDIDevice(name="k8s.gpu.nvidia.com/claim=x-gpu-0")],
                            ),
                            pb.ClaimResource(
                                driver_name="nic.example.com", pool_name="node-a", device_name="eth1"
                            ),
                        ],
                    )
                ],
            ),
        ),
    ]
)


class FakeKubelet(pb_grpc.PodResourcesListerServicer):
    """A PodResources server whose answer, or failure, the test sets."""

    def __init__(self) -> None:
        self.response = NODE
        self.abort_with: grpc.StatusCode | None = None
        self.hang = asyncio.Event()  # set to make List never answer
        self.calls = 0

    async def List(  # the generated servicer's method name, hence not snake_case
        self, request: pb.ListPodResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListPodResourcesResponse:
        self.calls += 1
        if self.abort_with is not None:
            await context.abort(self.abort_with, "feature gate KubeletPodResources is off")
        if self.hang.is_set():
            await asyncio.Event().wait()
        return self.response


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    # sun_path holds 107 bytes; pytest's tmp_path can be longer than that.
    if len(str(tmp_path)) < 80:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="pr", dir="/tmp") as short:
        yield Path(short)


async def _serve(path: Path, kubelet: FakeKubelet) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


@pytest.fixture
async def kubelet(sock_dir: Path) -> AsyncIterator[FakeKubelet]:
    fake = FakeKubelet()
    server = await _serve(sock_dir / "kubelet.sock", fake)
    yield fake
    await server.stop(grace=None)


@pytest.fixture
async def client(sock_dir: Path) -> AsyncIterator[PodResourcesClient]:
    c = PodResourcesClient(sock_dir / "kubelet.sock", timeout=2.0)
    yield c
    await c.close()


async def test_list_maps_gpus_to_containers(kubelet: FakeKubelet, client: PodResourcesClient) -> None:
    allocations = await client.list()

    assert client.state is PodResourcesState.OK
    assert allocations.pods_for(GPU0, 0) == (PodRef(namespace="ml", name="trainer-0", container="train"),)
    # time-slicing replicas collapse onto their GPU, both holders listed
    assert allocations.pods_for(GPU1, 1) == (
        PodRef(namespace="ml", name="notebook-a", container="jupyter"),
        PodRef(namespace="ml", name="notebook-b", container="jupyter"),
    )
    # a MIG device is matched by its own UUID, not its parent's
    assert allocations.pods_for(GPU0, 0, mig_id=MIG0) == (
        PodRef(namespace="infer", name="llm-0", container="server"),
    )
    assert allocations.pods_for("GPU-unallocated", 7) == (
        PodRef(namespace="ml", name="legacy", container="c"),
    )
    assert allocations.pods_for("GPU-unallocated", 3) == ()
    assert set(allocations.devices) == {GPU0, GPU1, MIG0, "7"}
    assert allocations.containers[("ml", "trainer-0")] == ("train", "sidecar")
    assert allocations.containers[("net", "router")] == ("app",)
    assert allocations.claimed == {}  # no DRA driver asked for


async def test_dra_devices_of_the_drivers_asked_for_are_kept_with_their_claim(
    kubelet: FakeKubelet, sock_dir: Path
) -> None:
    client = PodResourcesClient(sock_dir / "kubelet.sock", dra_drivers=frozenset({"gpu.nvidia.com"}))
    try:
        allocations = await client.list()
    finally:
        await client.close()

    holder = PodRef(namespace="ml", name="dra", container="c", claim="gpu")
    assert allocations.claimed == {DraDevice("gpu.nvidia.com", "node-a", "gpu-0"): (holder,)}
    assert allocations.containers[("ml", "dra")] == ("c",)
    # not a device key until resolved (dra.DraResolver): the DRA name is no UUID
    assert set(allocations.devices) == {GPU0, GPU1, MIG0, "7"}


async def test_socket_missing_is_its_own_state(tmp_path: Path) -> None:
    client = PodResourcesClient(tmp_path / "absent.sock")

    with pytest.raises(PodResourcesError) as raised:
        await client.list()

    assert raised.value.state is PodResourcesState.SOCKET_MISSING
    assert client.state is PodResourcesState.SOCKET_MISSING
    assert "absent.sock" in str(raised.value)


async def test_stale_socket_is_unavailable(sock_dir: Path) -> None:
    # The kubelet died and left its socket file behind: connections are refused.
    path = sock_dir / "kubelet.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    client = PodResourcesClient(path, timeout=2.0)
    try:
        with pytest.raises(PodResourcesError) as raised:
            await client.list()
    finally:
        await client.close()
    assert raised.value.state is PodResourcesState.UNAVAILABLE


async def test_kubelet_error_is_reported(kubelet: FakeKubelet, client: PodResourcesClient) -> None:
    kubelet.abort_with = grpc.StatusCode.UNIMPLEMENTED

    with pytest.raises(PodResourcesError) as raised:
        await client.list()

    assert raised.value.state is PodResourcesState.ERROR
    assert "UNIMPLEMENTED" in str(raised.value)


async def test_slow_kubelet_times_out(kubelet: FakeKubelet, sock_dir: Path) -> None:
    kubelet.hang.set()
    # A real gRPC deadline: the C core keeps its own clock, so fake loop time cannot drive it.
    client = PodResourcesClient(sock_dir / "kubelet.sock", timeout=0.2)
    try:
        with pytest.raises(PodResourcesError) as raised:
            await client.list()
    finally:
        await client.close()
    assert raised.value.state is PodResourcesState.UNAVAILABLE
    assert "DEADLINE_EXCEEDED" in str(raised.value)


async def test_recovers_when_the_kubelet_comes_back(sock_dir: Path) -> None:
    client = PodResourcesClient(sock_dir / "kubelet.sock", timeout=2.0)
    with pytest.raises(PodResourcesError):
        await client.list()
    fake = FakeKubelet()
    server = await _serve(sock_dir / "kubelet.sock", fake)
    try:
        allocations = await client.list()
    finally:
        await client.close()
        await server.stop(grace=None)
    assert client.state is PodResourcesState.OK
    assert GPU0 in allocations.devices


def test_target_is_an_absolute_unix_uri() -> None:
    assert PodResourcesClient().target == "unix:///var/lib/kubelet/pod-resources/kubelet.sock"


@pytest.mark.parametrize(
    ("resource", "is_gpu"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/gpu.shared", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("nvidia.com/mig-3g.40gb", True),
        ("nvidia.com/ib", False),
        ("amd.com/gpu", False),
        ("gpu", False),
    ],
)
def test_is_nvidia_gpu_resource(resource: str, is_gpu: bool) -> None:
    assert is_nvidia_gpu_resource(resource) is is_gpu


def test_device_key_strips_replica_suffix() -> None:
    assert physical_device(f"{GPU0}::12") == GPU0
    assert physical_device(MIG0) == MIG0
    assert physical_device("3") == "3"


def test_pods_without_names_are_skipped() -> None:
    response = pb.ListPodResourcesResponse(
        pod_resources=[_pod("", "", _container("c", ("nvidia.com/gpu", [GPU0])))]
    )
    assert allocations_from_response(response).devices == {}

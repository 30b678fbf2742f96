"""PodAttributor: PodResources + cgroups + the pod list, on a temp /proc and /sys/fs/cgroup."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc.aio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpuwarden.agent.attribution import (
    Allocations,
    CgroupIdentity,
    CgroupReader,
    NodePods,
    PodAttributor,
    PodResourcesClient,
    PodResourcesError,
    PodResourcesState,
    allocations_from_response,
)
from gpuwarden.agent.podresources import podresources_pb2 as pb
from gpuwarden.agent.podresources import podresources_pb2_grpc as pb_grpc
from gpuwarden.policy import SeriesKey, points_from_snapshot
from gpuwarden.wire.node import GpuSample, PodHostMemory, PodRef, ProcessSample, Snapshot

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"  # whole, to trainer-0
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"  # time-sliced: notebook-a and notebook-b
GPU2 = "GPU-22222222-2222-2222-2222-222222222222"  # allocated, idle: idle-0
GPU3 = "GPU-33333333-3333-3333-3333-333333333333"  # MIG parent
MIG3 = "MIG-33333333-aaaa-aaaa-aaaa-333333333333"  # to llm-0

UIDS = {
    "trainer-0": "aaaaaaaa-0000-0000-0000-000000000001",
    "notebook-a": "aaaaaaaa-0000-0000-0000-000000000002",
    "notebook-b": "aaaaaaaa-0000-0000-0000-000000000003",
    "idle-0": "aaaaaaaa-0000-0000-0000-000000000004",
    "debug": "aaaaaaaa-0000-0000-0000-000000000005",  # privileged, sees every GPU, holds none
    "llm-0": "aaaaaaaa-0000-0000-0000-000000000006",
}
MEMORY = {
    "trainer-0": 8 << 30,
    "notebook-a": 2 << 30,
    "notebook-b": 3 << 30,
    "idle-0": 1 << 30,
    "debug": 5 << 20,
}


def cid(n: int) -> str:
    return f"{n:064x}"


# pid → (pod, container id) for processes in pods
PIDS: dict[int, tuple[str, str]] = {
    100: ("trainer-0", cid(100)),
    101: ("notebook-a", cid(101)),
    102: ("notebook-b", cid(102)),
    105: ("debug", cid(105)),
    106: ("llm-0", cid(106)),
}
HOST_PID = 103
GONE_PID = 104  # no /proc entry: exited, or outside our PID view

LIST = pb.ListPodResourcesResponse(
    pod_resources=[
        pb.PodResources(
            namespace="ml",
            name="trainer-0",
            containers=[
                pb.ContainerResources(
                    name="train",
                    devices=[pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[GPU0])],
                ),
                pb.ContainerResources(name="logger"),
            ],
        ),
        *(
            pb.PodResources(
                namespace="ml",
                name=name,
                containers=[
                    pb.ContainerResources(
                        name="jupyter",
                        devices=[
                            pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[f"{GPU1}::{i}"])
                        ],
                    )
                ],
            )
            for i, name in enumerate(["notebook-a", "notebook-b"])
        ),
        pb.PodResources(
            namespace="ml",
            name="idle-0",
            containers=[
                pb.ContainerResources(
                    name="main",
                    devices=[pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[GPU2])],
                )
            ],
        ),
        pb.PodResources(namespace="ops", name="debug", containers=[pb.ContainerResources(name="shell")]),
        pb.PodResources(
            namespace="infer",
            name="llm-0",
            containers=[
                pb.ContainerResources(
                    name="server",
                    devices=[pb.ContainerDevices(resource_name="nvidia.com/mig-1g.18gb", device_ids=[MIG3])],
                )
            ],
        ),
    ]
)

NAMESPACES = {
    "trainer-0": "ml",
    "notebook-a": "ml",
    "notebook-b": "ml",
    "idle-0": "ml",
    "debug": "ops",
    "llm-0": "infer",
}


def ref(name: str, container: str = "") -> PodRef:
    return PodRef(namespace=NAMESPACES[name], name=name, container=container)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def node(tmp_path: Path) -> CgroupReader:
    """A node's /proc and cgroup v2 tree (systemd driver, containerd)."""
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    _write(cg / "cgroup.controllers", "memory\n")
    for name, uid in UIDS.items():
        pod_dir = (
            f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
        )
        if name in MEMORY:
            _write(cg / pod_dir / "memory.current", f"{MEMORY[name]}\n")
        for pid, (pod, container_id) in PIDS.items():
            if pod == name:
                _write(proc / str(pid) / "cgroup", f"0::/{pod_dir}/cri-containerd-{container_id}.scope\n")
    _write(proc / str(HOST_PID) / "cgroup", "0::/system.slice/some-daemon.service\n")
    return CgroupReader(proc_root=proc, cgroup_root=cg)


class StaticAllocations:
    """An AllocationSource answering from memory, or failing as told."""

    def __init__(self, response: pb.ListPodResourcesResponse = LIST) -> None:
        self.response = response
        self.fail: PodResourcesState | None = None
        self.state = PodResourcesState.NOT_ASKED

    async def list(self) -> Allocations:
        if self.fail is not None:
            self.state = self.fail
            raise PodResourcesError(self.fail, "kubelet away")
        self.state = PodResourcesState.OK
        return allocations_from_response(self.response)


def lookup(uid: str) -> PodRef | None:
    """A plain pod lookup: UID → pod, as a callable."""
    by_uid = {u: ref(name) for name, u in UIDS.items()}
    return by_uid.get(uid)


class Directory:
    """A PodDirectory: a lookup that refreshes and knows container names."""

    def __init__(self) -> None:
        self.refreshes = 0

    async def refresh(self) -> None:
        self.refreshes += 1

    def __call__(self, pod_uid: str) -> PodRef | None:
        return lookup(pod_uid)

    def container_name(self, container_id: str) -> str | None:
        return {cid(105): "shell", cid(100): "train"}.get(container_id)


def snapshot(*gpus: GpuSample) -> Snapshot:
    return Snapshot(timestamp=1_700_000_000.0, gpus=list(gpus))


def gpu(uuid: str, index: int, *pids: int, mig_id: str | None = None) -> GpuSample:
    return GpuSample(uuid=uuid, index=index, mig_id=mig_id, processes=[ProcessSample(pid=p) for p in pids])


def pods_of(annotated: Snapshot) -> dict[int, PodRef | None]:
    return {p.pid: p.pod for g in annotated.gpus for p in g.processes}


async def test_allocated_idle_gpu_names_its_pod(node: CgroupReader) -> None:
    attributor = PodAttributor(StaticAllocations(), cgroups=node, pod_lookup=lookup)
    await attributor.refresh()

    out = attributor.annotate(snapshot(gpu(GPU2, 2)))

    assert out.gpus[0].pods == [ref("idle-0", "main")]
    assert out.gpus[0].processes == []
    assert out.pod_host_memory == [
        PodHostMemory(namespace="ml", name="idle-0", memory_bytes=MEMORY["idle-0"])
    ]


async def test_without_a_pod_list_the_sole_holder_rule_applies(node: CgroupReader) -> None:
    attributor = PodAttributor(StaticAllocations(), cgroups=node)
    await attributor.refresh()

    out = attributor.annotate(snapshot(gpu(GPU0, 0, 100, HOST_PID, GONE_PID), gpu(GPU1, 1, 101, 102)))

    assert pods_of(out) == {
        100: ref("trainer-0", "train"),  # the one container allocated GPU0
        HOST_PID: None,  # on a pod's GPU, but its cgroup says host
        GONE_PID: ref("trainer-0", "train"),  # no cgroup to go by: the allocation decides
        101: None,  # time-sliced GPU, two holders: not guessed
        102: None,
    }
    assert out.gpus[1].pods == [ref("notebook-a", "jupyter"), ref("notebook-b", "jupyter")]
    # No pod list: pod UIDs have no names yet. The UID learned from pid 100 names
    # trainer-0's memory from the next refresh on.
    assert out.pod_host_memory == []
    await attributor.refresh()
    again = attributor.annotate(snapshot(gpu(GPU0, 0, 100)))
    assert again.pod_host_memory == [
        PodHostMemory(namespace="ml", name="trainer-0", memory_bytes=MEMORY["trainer-0"])
    ]


async def test_a_pod_list_attributes_shared_gpus_and_outsiders(node: CgroupReader) -> None:
    attributor = PodAttributor(StaticAllocations(), cgroups=node, pod_lookup=lookup)
    await attributor.refresh()

    out = attributor.annotate(snapshot(gpu(GPU0, 0, 100, 105), gpu(GPU1, 1, 101, 102)))

    assert pods_of(out) == {
        100: ref("trainer-0", "train"),  # of trainer-0's two containers, the one holding GPU0
        105: ref("debug", "shell"),  # holds no GPU; its pod has one container
        101: ref("notebook-a", "jupyter"),
        102: ref("notebook-b", "jupyter"),
    }
    assert {(m.name, m.memory_bytes) for m in out.pod_host_memory} == {
        (name, MEMORY[name]) for name in ["trainer-0", "debug", "notebook-a", "notebook-b"]
    }


async def test_pods_time_slicing_one_gpu_each_get_their_own_series(node: CgroupReader) -> None:
    # Replicas GPU1::0 and GPU1::1 are one GPU: both notebooks are on it, each with its own process's
    # memory and per-process SM utilization, and the one that runs no kernel (0%) is the idle one.
    attributor = PodAttributor(StaticAllocations(), cgroups=node, pod_lookup=lookup)
    await attributor.refresh()
    shared = GpuSample(
        uuid=GPU1,
        index=1,
        utilization_gpu=95.0,
        memory_used_bytes=12 << 30,
        memory_total_bytes=80 << 30,
        processes=[
            ProcessSample(pid=101, used_memory_bytes=8 << 30, sm_util=95.0),
            ProcessSample(pid=102, used_memory_bytes=3 << 30, sm_util=0.0),
        ],
    )
    points = dict(points_from_snapshot(attributor.annotate(snapshot(shared))))
    a, b = (points[SeriesKey("ml", name, GPU1)] for name in ("notebook-a", "notebook-b"))
    assert (a.mem_used, a.gpu_util) == (8 << 30, 95.0)
    assert (b.mem_used, b.gpu_util) == (3 << 30, 0.0)
    # Without the pod list nobody's process can be named on a shared GPU: unknown, not idle.
    blind = PodAttributor(StaticAllocations(), cgroups=node)
    await blind.refresh()
    points = dict(points_from_snapshot(blind.annotate(snapshot(shared))))
    assert [p.gpu_util for p in points.values()] == [None, None]


async def test_a_pod_directory_is_refreshed_and_names_containers(node: CgroupReader) -> None:
    directory = Directory()
    # trainer-0 with its GPU in two containers: elimination cannot choose, container IDs can.
    both = pb.ListPodResourcesResponse()
    both.CopyFrom(LIST)
    both.pod_resources[0].containers[1].devices.add(resource_name="nvidia.com/gpu", device_ids=[GPU0])
    attributor = PodAttributor(StaticAllocations(both), cgroups=node, pod_lookup=directory)

    await attributor.refresh()
    out = attributor.annotate(snapshot(gpu(GPU0, 0, 100)))

    assert directory.refreshes == 1
    assert pods_of(out) == {100: ref("trainer-0", "train")}


async def test_unnamed_container_stays_pod_level(node: CgroupReader) -> None:
    both = pb.ListPodResourcesResponse()
    both.CopyFrom(LIST)
    both.pod_resources[0].containers[1].devices.add(resource_name="nvidia.com/gpu", device_ids=[GPU0])
    attributor = PodAttributor(StaticAllocations(both), cgroups=node, pod_lookup=lookup)
    await attributor.refresh()

    assert pods_of(attributor.annotate(snapshot(gpu(GPU0, 0, 100)))) == {100: ref("trainer-0")}


async def test_mig_devices_are_matched_by_their_own_uuid(node: CgroupReader) -> None:
    attributor = PodAttributor(StaticAllocations(), cgroups=node)
    await attributor.refresh()

    out = attributor.annotate(snapshot(gpu(GPU3, 3, mig_id=MIG3), gpu(GPU3, 3, 106, mig_id=MIG3)))

    assert out.gpus[0].pods == [ref("llm-0", "server")]
    assert pods_of(out) == {106: ref("llm-0", "server")}


async def test_annotate_copies_and_keeps_what_the_backend_set(node: CgroupReader) -> None:
    attributor = PodAttributor(StaticAllocations(), cgroups=node, pod_lookup=lookup)
    await attributor.refresh()
    scripted = PodRef(namespace="demo", name="scripted", container="c")
    original = Snapshot(
        timestamp=1.0,
        gpus=[
            GpuSample(uuid=GPU0, index=0, pods=[scripted], processes=[ProcessSample(pid=100, pod=scripted)]),
            gpu(GPU2, 2),
        ],
        pod_host_memory=[PodHostMemory(namespace="demo", name="scripted", memory_bytes=1)],
    )
    before = original.model_dump()

    out = attributor.annotate(original)

    assert original.model_dump() == before
    assert out.gpus[0].pods == [scripted]
    assert out.gpus[0].processes[0].pod == scripted
    assert out.gpus[1].pods == [ref("idle-0", "main")]
    assert out.pod_host_memory == original.pod_host_memory


async def test_kubelet_away_keeps_the_last_allocations(node: CgroupReader) -> None:
    source = StaticAllocations()
    attributor = PodAttributor(source, cgroups=node)
    await attributor.refresh()

    source.fail = PodResourcesState.SOCKET_MISSING
    await attributor.refresh()

    assert attributor.pod_resources_state is PodResourcesState.SOCKET_MISSING
    assert attributor.annotate(snapshot(gpu(GPU2, 2))).gpus[0].pods == [ref("idle-0", "main")]


class FailingDirectory(Directory):
    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    async def refresh(self) -> None:
        await super().refresh()
        if self.fail:
            raise RuntimeError("HTTP 403: pods is forbidden")


async def test_outages_are_logged_once_not_every_refresh(
    node: CgroupReader, caplog: pytest.LogCaptureFixture
) -> None:
    source = StaticAllocations()
    source.fail = PodResourcesState.UNAVAILABLE
    directory = FailingDirectory()
    attributor = PodAttributor(source, cgroups=node, pod_lookup=directory)

    with caplog.at_level(logging.INFO, logger="gpuwarden.agent.attribution"):
        for _ in range(3):
            await attributor.refresh()
        source.fail = None
        directory.fail = False
        await attributor.refresh()

    assert directory.refreshes == 4
    assert [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records] == [
        ("WARNING", "PodResources"),
        ("WARNING", "pod list"),
        ("INFO", "PodResources"),
        ("INFO", "pod list"),
    ]


async def test_no_kubelet_at_all(node: CgroupReader) -> None:
    attributor = PodAttributor(None, cgroups=node, pod_lookup=lookup)
    await attributor.refresh()

    out = attributor.annotate(snapshot(gpu(GPU0, 0, 100)))

    assert attributor.pod_resources_state is PodResourcesState.NOT_ASKED
    assert out.gpus[0].pods == []
    assert pods_of(out) == {100: ref("trainer-0")}  # container unknown without PodResources


class CountingReader(CgroupReader):
    def __init__(self, inner: CgroupReader) -> None:
        self.inner = inner
        self.reads: list[int] = []

    def identity(self, pid: int) -> CgroupIdentity | None:
        self.reads.append(pid)
        return self.inner.identity(pid)

    def pod_memory(self) -> dict[str, int]:
        return self.inner.pod_memory()


async def test_each_pid_is_read_once_until_it_goes_away(node: CgroupReader) -> None:
    reader = CountingReader(node)
    attributor = PodAttributor(StaticAllocations(), cgroups=reader, pod_lookup=lookup)
    await attributor.refresh()

    for _ in range(3):
        attributor.annotate(snapshot(gpu(GPU0, 0, 100, 105)))
    await attributor.refresh()
    attributor.annotate(snapshot(gpu(GPU0, 0, 100)))  # 105 exited
    await attributor.refresh()
    await attributor.refresh()  # 100 not seen since the last refresh: forgotten
    attributor.annotate(snapshot(gpu(GPU0, 0, 100, 105)))

    assert reader.reads == [100, 105, 100, 105]


# --- end to end: a real gRPC kubelet and a real HTTP API server ---


class Kubelet(pb_grpc.PodResourcesListerServicer):
    async def List(  # the generated servicer's method name, hence not snake_case
        self, request: pb.ListPodResourcesRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ListPodResourcesResponse:
        return LIST


@pytest.fixture
def short_tmp(tmp_path: Path) -> Iterator[Path]:
    import tempfile

    # sun_path holds 107 bytes; pytest's tmp_path can be longer than that.
    with tempfile.TemporaryDirectory(prefix="at", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
async def kubelet_socket(short_tmp: Path) -> AsyncIterator[Path]:
    server = grpc.aio.server()
    pb_grpc.add_PodResourcesListerServicer_to_server(Kubelet(), server)
    path = short_tmp / "kubelet.sock"
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    yield path
    await server.stop(grace=None)


def _pod_list() -> dict[str, object]:
    return {
        "kind": "PodList",
        "items": [
            {
                "metadata": {"uid": uid, "name": name, "namespace": NAMESPACES[name]},
                "status": {
                    "containerStatuses": [
                        {"name": "shell" if name == "debug" else "x", "containerID": f"containerd://{c}"}
                        for pid, (pod, c) in PIDS.items()
                        if pod == name
                    ]
                },
            }
            for name, uid in UIDS.items()
        ],
    }


async def test_end_to_end(node: CgroupReader, kubelet_socket: Path, tmp_path: Path) -> None:
    async def pods(request: web.Request) -> web.Response:
        assert request.query["fieldSelector"] == "spec.nodeName=gpu-node-1"
        return web.json_response(_pod_list())

    app = web.Application()
    app.router.add_get("/api/v1/pods", pods)
    token = tmp_path / "token"
    token.write_text("t")
    async with TestServer(app, host="127.0.0.1") as api:
        node_pods = NodePods("gpu-node-1", str(api.make_url("")), token_path=token, ca_path=None)
        kubelet = PodResourcesClient(kubelet_socket, timeout=5.0)
        attributor = PodAttributor(kubelet, cgroups=node, pod_lookup=node_pods)
        try:
            await attributor.refresh()
            out = attributor.annotate(snapshot(gpu(GPU0, 0, 100, 105), gpu(GPU1, 1, 101), gpu(GPU2, 2)))
        finally:
            await kubelet.close()
            await node_pods.close()

    assert attributor.pod_resources_state is PodResourcesState.OK
    assert pods_of(out) == {
        100: ref("trainer-0", "x"),  # named by its container ID in the pod list
        105: ref("debug", "shell"),
        101: ref("notebook-a", "x"),
    }
    assert out.gpus[2].pods == [ref("idle-0", "main")]
    assert {m.name for m in out.pod_host_memory} == {
        "trainer-0",
        "debug",
        "notebook-a",
        "notebook-b",
        "idle-0",
    }
    # what goes on the wire validates
    assert Snapshot.model_validate_json(out.model_dump_json(by_alias=True)) == out

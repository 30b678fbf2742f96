"""Which pod was allocated which GPU: the kubelet's PodResources v1 API over its unix socket.

The kubelet answers ``v1.PodResourcesLister/List`` with every pod on the node,
its containers, and the device IDs each container was allocated. For NVIDIA's
device plugin those IDs are GPU UUIDs (``GPU-…``), MIG device UUIDs (``MIG-…``),
``<uuid>::<n>`` replicas under time-slicing, or plain indexes ("0") when the
plugin runs with ``deviceIDStrategy=index``. This is the only source that knows
about a pod which holds a GPU and runs nothing on it.

Devices allocated through Dynamic Resource Allocation come in ``dynamic_resources``
instead: per claim, the (driver, pool, device) triplets of the ResourceSlices, with no
UUID. Those of the DRA drivers asked for are kept as :class:`DraDevice` keys, each with
its containers and their claim; :mod:`~gpuwarden.agent.attribution.dra` resolves them to
UUIDs.

gRPC and the generated stubs are imported on the first call that reaches the socket,
not with this module: they are about 11 MiB of the agent's resident memory, which the
scripted backend and a node without the kubelet socket never need.
"""

from __future__ import annotations

import enum
import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwarden.wire.node import PodRef

if TYPE_CHECKING:
    import grpc.aio

    from gpuwarden.agent.podresources import podresources_pb2

DEFAULT_SOCKET_PATH = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
"""Where the kubelet serves PodResources; the DaemonSet mounts the directory read-only."""

# The kubelet caps its own answers at 16 MiB (podresources.DefaultMaxMsgSize); match it so a
# node with many pods is not refused by our default 4 MiB receive limit.
_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_REPLICA_SEPARATOR = "::"

# The RPC is bound here rather than through the generated PodResourcesListerStub, which is
# untyped; the path is the kubelet's (proto package `v1`), checked against the generated
# servicer by the tests.
_LIST_METHOD = "/v1.PodResourcesLister/List"


class PodResourcesState(enum.StrEnum):
    """What the last PodResources call found; anything but ``ok`` means allocations are not current."""

    NOT_ASKED = "not_asked"
    OK = "ok"
    SOCKET_MISSING = "socket_missing"  # no kubelet socket: not mounted, or kubelet not up yet
    UNAVAILABLE = "unavailable"  # socket present but the kubelet did not answer in time
    ERROR = "error"  # the kubelet answered with an error (e.g. UNIMPLEMENTED, PERMISSION_DENIED)


class PodResourcesError(RuntimeError):
    """A PodResources call failed; ``state`` says how."""

    def __init__(self, state: PodResourcesState, message: str) -> None:
        super().__init__(message)
        self.state = state


def is_nvidia_gpu_resource(resource_name: str) -> bool:
    """Whether an extended resource name is an NVIDIA GPU: whole GPUs, shared replicas, or MIG profiles."""
    vendor, _, kind = resource_name.partition("/")
    return vendor == "nvidia.com" and (kind == "gpu" or kind.startswith(("gpu.", "mig-")))


def physical_device(plugin_id: str) -> str:
    """The physical device behind a device-plugin ID: ``GPU-x::3`` (a time-slicing replica) is ``GPU-x``."""
    return plugin_id.split(_REPLICA_SEPARATOR, 1)[0]


@dataclass(frozen=True, order=True)
class DraDevice:
    """One device of a DRA driver, as PodResources and the driver's ResourceSlices name it."""

    driver: str
    pool: str
    device: str

    def __str__(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"


def _sorted_refs(refs: set[PodRef]) -> tuple[PodRef, ...]:
    return tuple(sorted(refs, key=lambda r: (r.namespace, r.name, r.container, r.claim or "")))


@dataclass(frozen=True)
class Allocations:
    """One PodResources answer, indexed for attribution. Immutable, so it can be swapped whole."""

    devices: Mapping[str, tuple[PodRef, ...]] = field(default_factory=dict)
    """Device key (GPU UUID, MIG UUID, or index) → containers allocated it, sorted. Several under sharing."""
    containers: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    """(namespace, pod name) → names of all its containers, with or without devices."""
    claimed: Mapping[DraDevice, tuple[PodRef, ...]] = field(default_factory=dict)
    """DRA device → containers whose claims hold it (``PodRef.claim`` set), not yet resolved to a UUID."""

    def with_devices(self, extra: Mapping[str, tuple[PodRef, ...]]) -> Allocations:
        """A copy with more device keys (resolved DRA devices), merged with those already there."""
        if not extra:
            return self
        merged: defaultdict[str, set[PodRef]] = defaultdict(set)
        for source in (self.devices, extra):
            for key, refs in source.items():
                merged[key].update(refs)
        devices = {key: _sorted_refs(refs) for key, refs in merged.items()}
        return Allocations(devices=devices, containers=self.containers, claimed=self.claimed)

    def pods_for(self, uuid: str, index: int, mig_id: str | None = None) -> tuple[PodRef, ...]:
        """Containers allocated this GPU, or this MIG device when ``mig_id`` is given."""
        if mig_id is not None:
            return self.devices.get(mig_id, ())
        return self.devices.get(uuid) or self.devices.get(str(index), ())


def allocations_from_response(
    response: podresources_pb2.ListPodResourcesResponse, dra_drivers: frozenset[str] = frozenset()
) -> Allocations:
    """Index a List answer by NVIDIA device, and by DRA device for the drivers in ``dra_drivers``.

    Other devices (NICs, FPGAs, other DRA drivers' devices) are ignored.
    """
    devices: defaultdict[str, set[PodRef]] = defaultdict(set)
    claimed: defaultdict[DraDevice, set[PodRef]] = defaultdict(set)
    containers: dict[tuple[str, str], tuple[str, ...]] = {}
    for pod in response.pod_resources:
        if not pod.name or not pod.namespace:
            continue
        containers[(pod.namespace, pod.name)] = tuple(c.name for c in pod.containers)
        for container in pod.containers:
            ref = PodRef(namespace=pod.namespace, name=pod.name, container=container.name)
            for allocated in container.devices:
                if not is_nvidia_gpu_resource(allocated.resource_name):
                    continue
                for device_id in allocated.device_ids:
                    devices[physical_device(device_id)].add(ref)
            for dynamic in container.dynamic_resources:
                for resource in dynamic.claim_resources:
                    if resource.driver_name not in dra_drivers or not resource.device_name:
                        continue
                    device = DraDevice(resource.driver_name, resource.pool_name, resource.device_name)
                    claimed[device].add(ref.model_copy(update={"claim": dynamic.claim_name or None}))
    return Allocations(
        devices={key: _sorted_refs(refs) for key, refs in devices.items()},
        containers=containers,
        claimed={device: _sorted_refs(refs) for device, refs in claimed.items()},
    )


class PodResourcesClient:
    """A client of the kubelet's PodResources socket that keeps its state explicit.

    One channel is opened on first use (it must be created inside the running
    loop) and reused; gRPC reconnects by itself when the kubelet restarts.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] = DEFAULT_SOCKET_PATH,
        *,
        timeout: float = 5.0,
        dra_drivers: frozenset[str] = frozenset(),
    ) -> None:
        self._path = Path(socket_path)
        self._dra_drivers = dra_drivers
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._list_rpc: grpc.aio.UnaryUnaryMultiCallable | None = None
        self.state = PodResourcesState.NOT_ASKED
        """What the last call found (``gpuwarden_agent_pod_resources_state``); its error is raised."""

    @property
    def target(self) -> str:
        """The gRPC target, e.g. ``unix:///var/lib/kubelet/pod-resources/kubelet.sock``."""
        return f"unix://{self._path.absolute()}"

    async def list(self) -> Allocations:
        """Ask the kubelet for every pod's allocations; raise :class:`PodResourcesError` if it cannot."""
        try:
            response = await self._list()
        except PodResourcesError as exc:
            self.state = exc.state
            raise
        self.state = PodResourcesState.OK
        return allocations_from_response(response, self._dra_drivers)

    async def _list(self) -> podresources_pb2.ListPodResourcesResponse:
        # Checked up front so that "the socket is not there" is its own state, not a
        # gRPC UNAVAILABLE after a connect timeout.
        if not self._path.exists():
            raise PodResourcesError(PodResourcesState.SOCKET_MISSING, f"no kubelet socket at {self._path}")
        # Here rather than at the top: see the module's docstring. After the first call these
        # are lookups in sys.modules.
        import grpc.aio

        from gpuwarden.agent.podresources import podresources_pb2

        if self._list_rpc is None:
            self._channel = grpc.aio.insecure_channel(
                self.target, options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)]
            )
            self._list_rpc = self._channel.unary_unary(
                _LIST_METHOD,
                request_serializer=podresources_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=podresources_pb2.ListPodResourcesResponse.FromString,
            )
        try:
            response: podresources_pb2.ListPodResourcesResponse = await self._list_rpc(
                podresources_pb2.ListPodResourcesRequest(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            state = (
                PodResourcesState.UNAVAILABLE
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                else PodResourcesState.ERROR
            )
            raise PodResourcesError(state, f"PodResources List: {code.name}: {exc.details()}") from None
        return response

    async def close(self) -> None:
        """Close the channel; a later :meth:`list` opens a new one."""
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._list_rpc = None

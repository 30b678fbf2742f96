"""A DRA driver's kubelet plugin for the test node: the scripted scenario's GPUs as DRA devices.

Why our own: the brief's first choice, kubernetes-sigs/dra-example-driver built from its Go module,
cannot be had here: the Go module proxy answers ``go list -m -versions
sigs.k8s.io/dra-example-driver`` with ``403 Forbidden: This module version is not available``
(recorded in docs/testing.md). So this module speaks the kubelet's real DRA APIs itself, over
gRPC on unix sockets, as deviceplugin.py does for device plugins:

- plugin registration v1 (``pluginregistration_v1.proto``): a socket in the kubelet's
  ``plugins_registry`` directory, where the kubelet's plugin watcher finds it, calls ``GetInfo``
  (type ``DRAPlugin``, the driver's name, the DRA socket, service ``v1.DRAPlugin``) and then
  ``NotifyRegistrationStatus``;
- the DRA plugin service v1 (``dra_v1.proto``): the kubelet calls ``NodePrepareResources`` for
  each claim of a pod it admits; the plugin reads the ResourceClaim's allocation from the API
  server and answers with its devices (no CDI devices: there is no device node to inject).

The devices themselves are published as a ResourceSlice (:func:`resource_slice`), as a driver's
controller does; the scheduler allocates from it and the kubelet then reports the allocations in
PodResources ``dynamic_resources``, which is what the agent reads. It runs in the test's process
(threads), started by :meth:`DraPlugin.start` and stopped by :meth:`DraPlugin.stop`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

# grpcio-tools compiles the protos at import; the modules and services it returns are untyped.
_dra_pb, _dra_services = grpc.protos_and_services("dra_v1.proto")
_reg_pb, _reg_services = grpc.protos_and_services("pluginregistration_v1.proto")
dra_pb: Any = _dra_pb
dra_services: Any = _dra_services
reg_pb: Any = _reg_pb
reg_services: Any = _reg_services

DRA_SERVICE = "v1.DRAPlugin"
"""The service name the kubelet chooses by (k8s.io/kubelet/pkg/apis/dra/v1 DRAPluginService)."""
PLUGIN_TYPE = "DRAPlugin"

ClaimReader = Callable[[str, str], dict[str, Any] | None]
"""(namespace, name) → the ResourceClaim as the API server has it, or None."""


class _Registration(reg_services.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver: str, endpoint: Path, registered: threading.Event) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = registered
        self.error = ""

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver, endpoint=str(self.endpoint), supported_versions=[DRA_SERVICE]
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.error = request.error
        if request.plugin_registered:
            self.registered.set()
        return reg_pb.RegistrationStatusResponse()


class _Driver(dra_services.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, driver: str, claims: ClaimReader) -> None:
        self.driver = driver
        self.claims = claims
        self.prepared: list[str] = []
        """``namespace/name`` of every claim prepared, in order (what the tests check the kubelet asked)."""
        self.unprepared: list[str] = []
        """``namespace/name`` of every claim unprepared, in order."""

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        answers = {}
        for claim in request.claims:
            answers[claim.uid] = self._prepare(claim)
        return dra_pb.NodePrepareResourcesResponse(claims=answers)

    def _prepare(self, claim: Any) -> Any:
        found = self.claims(claim.namespace, claim.name)
        if not found or found.get("metadata", {}).get("uid") != claim.uid:
            return dra_pb.NodePrepareResourceResponse(error=f"claim {claim.namespace}/{claim.name} not found")
        results = found.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
        devices = [
            dra_pb.Device(request_names=[r["request"]], pool_name=r["pool"], device_name=r["device"])
            for r in results
            if r.get("driver") == self.driver
        ]
        self.prepared.append(f"{claim.namespace}/{claim.name}")
        return dra_pb.NodePrepareResourceResponse(devices=devices)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        answers = {c.uid: dra_pb.NodeUnprepareResourceResponse() for c in request.claims}
        self.unprepared.extend(f"{c.namespace}/{c.name}" for c in request.claims)
        return dra_pb.NodeUnprepareResourcesResponse(claims=answers)


class DraPlugin:
    """The kubelet plugin of DRA driver ``driver``, serving under the kubelet's ``root``."""

    def __init__(self, driver: str, claims: ClaimReader, root: Path) -> None:
        self.driver = driver
        self.socket = root / "plugins" / driver / "dra.sock"
        self.registration_socket = root / "plugins_registry" / f"{driver}-reg.sock"
        self.registered = threading.Event()
        """Set once the kubelet says it registered the plugin."""
        self._registration = _Registration(driver, self.socket, self.registered)
        self._service = _Driver(driver, claims)
        self._servers: list[grpc.Server] = []

    @property
    def prepared(self) -> list[str]:
        """``namespace/name`` of every claim the kubelet had prepared."""
        return self._service.prepared

    @property
    def unprepared(self) -> list[str]:
        """``namespace/name`` of every claim the kubelet had unprepared (its pods gone)."""
        return self._service.unprepared

    @property
    def registration_error(self) -> str:
        """What the kubelet said when it refused the plugin, if it did."""
        return self._registration.error

    def start(self) -> None:
        """Serve the DRA service, then the registration socket the kubelet's watcher picks up."""
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        services: list[tuple[Path, Callable[[Any], None]]] = [
            (self.socket, lambda s: dra_services.add_DRAPluginServicer_to_server(self._service, s)),
            (
                self.registration_socket,
                lambda s: reg_services.add_RegistrationServicer_to_server(self._registration, s),
            ),
        ]
        for path, add in services:
            path.unlink(missing_ok=True)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            add(server)
            server.add_insecure_port(f"unix://{path}")
            server.start()
            self._servers.append(server)

    def stop(self) -> None:
        """Stop serving; removing the registration socket unregisters the plugin from the kubelet."""
        self.registration_socket.unlink(missing_ok=True)
        for server in reversed(self._servers):
            server.stop(grace=1).wait()
        self._servers = []
        self.socket.unlink(missing_ok=True)


def resource_slice(
    driver: str, node: str, devices: Sequence[tuple[str, str | None]], *, generation: int = 1
) -> dict[str, Any]:
    """A ResourceSlice (resource.k8s.io/v1) of one pool named after the node, as NVIDIA's driver names it.

    ``devices``: (name, uuid) pairs; a device with uuid None is published without one. Every device
    also carries an ``index`` (its position), which claims select by.
    """
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": name,
                    "attributes": {"index": {"int": i}, **({"uuid": {"string": uuid}} if uuid else {})},
                }
                for i, (name, uuid) in enumerate(devices)
            ],
        },
    }


def device_class(driver: str) -> dict[str, Any]:
    """A DeviceClass named after the driver, selecting all of its devices."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def one_device(driver: str, index: int | None = None) -> dict[str, Any]:
    """A claim spec for one device of the driver's class, the one at ``index`` when given."""
    exactly: dict[str, Any] = {"deviceClassName": driver}
    if index is not None:
        exactly["selectors"] = [{"cel": {"expression": f'device.attributes["{driver}"].index == {index}'}}]
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}

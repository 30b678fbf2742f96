"""A device plugin for the test node: the scripted scenario's GPUs as ``nvidia.com/gpu``.

No GPU exists on CI, but the kubelet's side of GPU allocation can still be the real one: this
process speaks the kubelet's device-plugin API v1beta1 (gRPC over unix sockets, the
``deviceplugin_v1beta1.proto`` beside it) and advertises one healthy device per GPU of an
agent scenario, with the scenario's UUIDs as device IDs, as NVIDIA's plugin does with real
UUIDs. The kubelet then counts them in the Node's capacity, allocates them to pods that
request ``nvidia.com/gpu`` and reports the allocation through PodResources ``List``, which
is what the agent reads. Allocate answers only ``NVIDIA_VISIBLE_DEVICES`` (there is no device
node to mount).

Usage (run by :class:`node.Node`; the kubelet must own ``--plugin-dir``)::

    python tests/integration/deviceplugin.py --scenario demo [--plugin-dir DIR]

It serves ``DIR/gpuwarden-gpu.sock``, registers it with the kubelet at ``DIR/kubelet.sock``,
and registers again whenever the kubelet restarts (a starting kubelet empties ``DIR``, which
is how a plugin learns of it). SIGTERM or SIGINT ends it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

# grpcio-tools compiles the proto at import; the module and services it returns are untyped.
_pb, _services = grpc.protos_and_services("deviceplugin_v1beta1.proto")
pb: Any = _pb
services: Any = _services

API_VERSION = "v1beta1"
RESOURCE_NAME = "nvidia.com/gpu"
HEALTHY = "Healthy"
DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
SOCKET_NAME = "gpuwarden-gpu.sock"
#: How often the plugin looks for its socket (gone: the kubelet restarted) and for the kubelet's.
WATCH_INTERVAL_S = 0.5


def log(message: str) -> None:
    print(f"deviceplugin: {message}", flush=True)


class GpuDevicePlugin(services.DevicePluginServicer):  # type: ignore[misc]
    """The DevicePlugin service: a fixed set of healthy devices."""

    def __init__(self, device_ids: Sequence[str], stop: threading.Event) -> None:
        self.device_ids = list(device_ids)
        self.stop = stop

    def GetDevicePluginOptions(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def ListAndWatch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        log(f"ListAndWatch: {len(self.device_ids)} devices")
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=HEALTHY) for i in self.device_ids])
        # The devices never change; the stream stays open until the kubelet or we end it.
        while context.is_active() and not self.stop.wait(WATCH_INTERVAL_S):
            pass

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        responses = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            unknown = [i for i in ids if i not in self.device_ids]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
            log(f"Allocate: {ids}")
            responses.append(pb.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}))
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.PreStartContainerResponse()


def register(plugin_dir: Path, stop: threading.Event) -> bool:
    """Register our socket with the kubelet once its socket is there; False if stopped first."""
    kubelet_socket = plugin_dir / "kubelet.sock"
    while not stop.is_set():
        if kubelet_socket.exists():
            try:
                with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
                    services.RegistrationStub(channel).Register(
                        pb.RegisterRequest(
                            version=API_VERSION,
                            endpoint=SOCKET_NAME,
                            resource_name=RESOURCE_NAME,
                            options=pb.DevicePluginOptions(),
                        ),
                        timeout=10,
                    )
            except grpc.RpcError as exc:
                log(f"Register failed, retrying: {exc.code().name}: {exc.details()}")
            else:
                log(f"registered {RESOURCE_NAME} at {kubelet_socket}")
                return True
        stop.wait(WATCH_INTERVAL_S)
    return False


def serve(plugin_dir: Path, device_ids: Sequence[str], stop: threading.Event) -> None:
    """Serve and register, again after every kubelet restart, until ``stop`` is set."""
    socket = plugin_dir / SOCKET_NAME
    while not stop.is_set():
        socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        services.add_DevicePluginServicer_to_server(GpuDevicePlugin(device_ids, stop), server)
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        log(f"serving {len(device_ids)} devices at {socket}")
        if register(plugin_dir, stop):
            while socket.exists() and not stop.wait(WATCH_INTERVAL_S):
                pass
            if not stop.is_set():
                log("socket removed: the kubelet restarted; registering again")
        server.stop(grace=1).wait()
    socket.unlink(missing_ok=True)


def scenario_uuids(scenario: str) -> list[str]:
    """The GPU UUIDs of an agent scenario (a packaged name such as ``demo``, or a file)."""
    from gpuwarden.sim.scenario import load_scenario

    return [gpu.uuid for gpu in load_scenario(scenario).spec.gpus]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", required=True, help="agent scenario whose GPUs to advertise")
    parser.add_argument("--plugin-dir", type=Path, default=DEFAULT_PLUGIN_DIR)
    args = parser.parse_args(argv)
    uuids = scenario_uuids(args.scenario)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    started = time.monotonic()
    serve(args.plugin_dir, uuids, stop)
    log(f"stopped after {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

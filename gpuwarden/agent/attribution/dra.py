"""GPUs allocated by Dynamic Resource Allocation: (driver, pool, device) → UUID.

The kubelet's PodResources answer names a DRA-allocated device by its driver, pool and
device name, as the driver's ResourceSlices publish it; NVML knows GPUs by UUID. Two ways
from one to the other, tried in this order:

- the node's ResourceSlices (``resource.k8s.io/v1`` only), watched with the field selector
  ``spec.nodeName=<node>``: a device's ``uuid`` attribute (``GPU-…`` or, for a static MIG
  device, ``MIG-…``), the newest generation's where a pool is being republished;
- NVIDIA's naming convention (a convention of its driver's code, not an API contract), for the
  driver names given, through NVML without the API server: ``gpu-<minor>`` is the GPU with that
  minor number; ``gpu-<minor>-mig-<profile>-<profile id>-<start>`` is a dynamic MIG device, which
  the driver publishes with ``parentUUID`` and ``profile`` but no ``uuid`` (it exists only once a
  claim is prepared, and its slice is never republished): the MIG device of that parent whose GPU
  instance has that GPU-instance profile ID and placement start, as the driver itself finds it.

A device that neither resolves is never dropped silently: it is counted (with a reason)
and logged when it first fails, again when the reason changes, and again after it resolved
in between.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import re
import ssl
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from gpuwarden.agent.account import SERVICE_ACCOUNT_DIR, bearer, in_cluster_api
from gpuwarden.agent.attribution.kubelet import Allocations, DraDevice
from gpuwarden.wire.node import PodRef

log = logging.getLogger(__name__)

NVIDIA_DRIVER = "gpu.nvidia.com"
"""NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu): the default of ``--dra-drivers``."""

RESOURCE_SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"

_NVIDIA_GPU_NAME = re.compile(r"gpu-(\d+)")
# gpu-<parent minor>-mig-<profile, dots dropped>-<GPU instance profile ID>-<placement start>: the name
# NVIDIA's driver gives a dynamic MIG device (its MigSpecTuple's canonical name).
_NVIDIA_MIG_NAME = re.compile(r"gpu-(\d+)-mig-(.+)-(\d+)-(\d+)")
_UUID = "uuid"
_PARENT_UUID = "parentUUID"
# How long to wait before listing again after a failure, and after finding no resource.k8s.io/v1.
_RETRY_S = 10.0
_NOT_SERVED_RETRY_S = 300.0
# The API server ends a watch after this many seconds; the next one starts from where it ended.
_WATCH_TIMEOUT_S = 300


class UnresolvedReason(enum.StrEnum):
    """Why a DRA device has no UUID: the ``reason`` of ``gpuwarden_agent_dra_unresolved_devices_total``."""

    SLICES_UNAVAILABLE = "slices_unavailable"
    """No ResourceSlices to read (no API access, not served, not listed yet) and no name to go by."""
    UNKNOWN_DEVICE = "unknown_device"
    """The node's ResourceSlices publish no such device."""
    NO_UUID = "no_uuid"
    """The device is published without a ``uuid`` attribute and its name gives none either."""
    MIG_NOT_FOUND = "mig_not_found"
    """A dynamic MIG device whose parent GPU has no MIG device at that profile and placement (not
    created yet, or NVML cannot read the parent's GPU instances)."""


@dataclass(frozen=True)
class DraGpu:
    """What a DRA device is in NVML's terms."""

    uuid: str
    """``GPU-…`` for a whole GPU, ``MIG-…`` for a MIG device."""
    parent_uuid: str | None = None
    """A MIG device's GPU."""


def _attribute(device: Mapping[str, Any], driver: str, name: str) -> str | None:
    # An unqualified attribute name is in the driver's own domain; both spellings are valid.
    attributes = device.get("attributes") or {}
    value = attributes.get(name) or attributes.get(f"{driver}/{name}") or {}
    string = value.get("string") if isinstance(value, Mapping) else None
    return string if isinstance(string, str) and string else None


def published_devices(slices: Iterable[Mapping[str, Any]]) -> dict[DraDevice, DraGpu | None]:
    """Every device the slices publish; None for one without a ``uuid``.

    A pool is published as ``resourceSliceCount`` slices of one ``generation``. While a driver
    moves a pool to a new generation, slices of both coexist: NVIDIA's driver rewrites a
    multi-slice pool's slices in place, one at a time, so that for a while no generation is
    complete. A device's UUID does not depend on the rest of its pool, so every device present is
    kept, the entry of the newest generation that names it winning: a generation bump never makes
    the known devices drop out (they did, 208 to 0 and back, when only a complete generation counted).
    """
    found: dict[DraDevice, DraGpu | None] = {}
    generation_of: dict[DraDevice, int] = {}
    for item in slices:
        spec = item.get("spec") or {}
        pool = spec.get("pool") or {}
        driver, generation = spec.get("driver", ""), int(pool.get("generation", 0))
        for device in spec.get("devices") or []:
            key = DraDevice(driver, pool.get("name", ""), device.get("name", ""))
            if generation_of.get(key, generation) > generation:
                continue
            uuid = _attribute(device, driver, _UUID)
            found[key] = DraGpu(uuid, _attribute(device, driver, _PARENT_UUID)) if uuid else None
            generation_of[key] = generation
    return found


class SlicesState(enum.StrEnum):
    """What the ResourceSlice watch found: ``gpuwarden_agent_dra_resource_slices_state``."""

    NOT_LISTED = "not_listed"
    SYNCED = "synced"
    NOT_SERVED = "not_served"  # the API server serves no resource.k8s.io/v1 (an older cluster, or turned off)
    ERROR = "error"  # any other failure: forbidden (the chart's RBAC), unreachable, an unexpected answer


class ResourceSlicesError(RuntimeError):
    """A list or watch of ResourceSlices failed; ``state`` says how."""

    def __init__(self, state: SlicesState, message: str) -> None:
        super().__init__(message)
        self.state = state


class ResourceSlices:
    """This node's ResourceSlices, listed then watched (``spec.nodeName=<node>``): their devices.

    :meth:`run` keeps the watch going for good (start it as a task); :attr:`devices` is the
    last synced view. The token is re-read on every request because the kubelet rotates it.
    Needs ``list`` and ``watch`` on ``resourceslices`` (the chart grants them with
    ``agent.dra.resourceSlices``).
    """

    def __init__(
        self,
        node: str,
        api_server: str,
        *,
        token_path: str | os.PathLike[str] | None = SERVICE_ACCOUNT_DIR / "token",
        ca_path: str | os.PathLike[str] | None = SERVICE_ACCOUNT_DIR / "ca.crt",
        timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._node = node
        self._url = api_server.rstrip("/") + RESOURCE_SLICES_PATH
        self._token_path = Path(token_path) if token_path is not None else None
        self._ssl = ssl_context or (
            ssl.create_default_context(cafile=ca_path) if ca_path is not None else None
        )
        self._timeout = timeout
        self._slices: dict[str, Mapping[str, Any]] = {}
        self._session: aiohttp.ClientSession | None = None
        self.devices: Mapping[DraDevice, DraGpu | None] = {}
        """The last synced view: empty until the first list."""
        self.state = SlicesState.NOT_LISTED
        self.synced = asyncio.Event()
        """Set once the first list has been read (tests and start-up wait on it)."""
        self._changed = asyncio.Event()

    @classmethod
    def in_cluster(
        cls, node: str, *, service_account_dir: str | os.PathLike[str] = SERVICE_ACCOUNT_DIR
    ) -> ResourceSlices | None:
        """As the pod's ServiceAccount; None (logged) where there is no API server or token."""
        api = in_cluster_api(service_account_dir, "no ResourceSlice watch")
        if api is None:
            return None
        url, account = api
        return cls(node, url, token_path=account / "token", ca_path=account / "ca.crt")

    async def run(self) -> None:
        """List, then watch, for good; a failure is logged once per state and retried."""
        while True:
            try:
                version: str | None = await self.list()
                while version is not None:
                    version = await self._watch(version)
            except ResourceSlicesError as exc:
                self._failed(exc)
                await asyncio.sleep(_NOT_SERVED_RETRY_S if exc.state is SlicesState.NOT_SERVED else _RETRY_S)

    def _failed(self, exc: ResourceSlicesError) -> None:
        if exc.state is not self.state:  # once per change of state, not at every retry
            log.warning("ResourceSlices: %s", exc)
        self.state = exc.state

    async def list(self) -> str:
        """List this node's slices once and replace the view; return the list's resourceVersion.

        A failure sets :attr:`state` (logged when it changes) and raises :class:`ResourceSlicesError`.
        """
        try:
            body = await self._get({"fieldSelector": f"spec.nodeName={self._node}"})
            items = body.get("items") or []
            try:
                slices = {item["metadata"]["name"]: item for item in items}
                devices = published_devices(slices.values())
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ResourceSlicesError(
                    SlicesState.ERROR, f"listing: unexpected answer: {type(exc).__name__}: {exc}"
                ) from None
        except ResourceSlicesError as exc:
            self._failed(exc)
            raise
        self._slices = slices
        self._set(devices)
        if self.state is not SlicesState.SYNCED:
            log.info("ResourceSlices: %d on node %s, %d devices", len(items), self._node, len(self.devices))
        self.state = SlicesState.SYNCED
        self.synced.set()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, since: str) -> str | None:
        """Follow one watch; return where to go on from, or None when a new list is needed."""
        version = since
        params = {
            "fieldSelector": f"spec.nodeName={self._node}",
            "watch": "1",
            "resourceVersion": since,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(_WATCH_TIMEOUT_S),
        }
        session = self._open()
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._timeout, sock_read=_WATCH_TIMEOUT_S + 30
        )
        try:
            async with session.get(
                self._url, params=params, headers=self._headers(), timeout=timeout
            ) as response:
                if response.status != 200:
                    raise _http_error(response.status, await response.read())
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, item = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        return None  # e.g. 410 Gone: the version is too old; list again
                    version = str(item.get("metadata", {}).get("resourceVersion", version))
                    if kind in ("ADDED", "MODIFIED"):
                        self._slices[item["metadata"]["name"]] = item
                    elif kind == "DELETED":
                        self._slices.pop(item["metadata"]["name"], None)
                    else:
                        continue  # BOOKMARK
                    self._update()
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ResourceSlicesError(SlicesState.ERROR, f"watching: {type(exc).__name__}: {exc}") from None
        return version

    def _update(self) -> None:
        self._set(published_devices(self._slices.values()))

    def _set(self, devices: Mapping[DraDevice, DraGpu | None]) -> None:
        self.devices = devices
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def changed(self) -> None:
        """Return at the next change of the slices: a list, or a watch event that changed one."""
        await self._changed.wait()

    async def _get(self, params: Mapping[str, str]) -> dict[str, Any]:
        session = self._open()
        try:
            async with session.get(
                self._url,
                params=params,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=self._timeout),
            ) as response:
                body = await response.read()
                if response.status != 200:
                    raise _http_error(response.status, body)
            answer: dict[str, Any] = json.loads(body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ResourceSlicesError(SlicesState.ERROR, f"listing: {type(exc).__name__}: {exc}") from None
        return answer

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_path is not None:
            try:
                headers["Authorization"] = bearer(self._token_path)
            except OSError as exc:
                raise ResourceSlicesError(
                    SlicesState.ERROR, f"cannot read the ServiceAccount token: {exc}"
                ) from None
        return headers

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl or True))
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _http_error(status: int, body: bytes) -> ResourceSlicesError:
    if status == 404:
        return ResourceSlicesError(
            SlicesState.NOT_SERVED,
            "the API server serves no resource.k8s.io/v1 (HTTP 404): DRA devices are resolved "
            "by name only (gpu-<minor>); Kubernetes 1.34+ serves it by default",
        )
    return ResourceSlicesError(SlicesState.ERROR, f"HTTP {status}: {body[:200]!r}")


MinorNumbers = Callable[[], Mapping[int, str]]
"""GPU minor number (``/dev/nvidia<minor>``) → GPU UUID, as NVML reports them."""


class MigPlacement(NamedTuple):
    """Where a dynamic MIG device sits: what NVIDIA's driver names it by, and finds it by in NVML."""

    parent_minor: int
    profile_id: int
    """The GPU instance profile ID (``nvmlGpuInstanceInfo_t.profileId``; 19 is 1g on an H100/H200)."""
    start: int
    """The GPU instance's placement start (its first memory slice)."""


MigDevices = Callable[[Collection[MigPlacement]], Mapping[tuple[int, int, int], str]]
"""The MIG UUIDs of the placements asked for that exist now, as NVML reports them."""


def mig_placement(name: str) -> MigPlacement | None:
    """The placement a dynamic MIG device name of NVIDIA's driver carries, or None for another name."""
    match = _NVIDIA_MIG_NAME.fullmatch(name)
    if match is None:
        return None
    return MigPlacement(int(match.group(1)), int(match.group(3)), int(match.group(4)))


class DraResolver:
    """Turns an answer's DRA devices into device keys (UUIDs) that attribution already knows.

    ``slices``: the node's ResourceSlices, or None without API access. ``minor_numbers``: NVML's
    minor numbers, for the drivers in ``by_name`` (NVIDIA's ``gpu-<minor>`` names); ``mig_devices``:
    NVML's MIG devices by placement, for their dynamic MIG names (read only for the names that the
    slices do not resolve, so a node without dynamic MIG never pays for it).
    ``on_unresolved``: called with the reason whenever a device newly fails to resolve, or fails
    for another reason than at the last :meth:`resolve` (the counter).
    """

    def __init__(
        self,
        slices: ResourceSlices | None,
        *,
        minor_numbers: MinorNumbers | None = None,
        mig_devices: MigDevices | None = None,
        by_name: frozenset[str] = frozenset({NVIDIA_DRIVER}),
        on_unresolved: Callable[[UnresolvedReason], None] | None = None,
    ) -> None:
        self._slices = slices
        self._minor_numbers = minor_numbers
        self._mig_devices = mig_devices
        self._by_name = by_name
        self._on_unresolved = on_unresolved
        self._unresolved: dict[DraDevice, UnresolvedReason] = {}

    @property
    def unresolved(self) -> Mapping[DraDevice, UnresolvedReason]:
        """The devices of the last :meth:`resolve` that have no UUID, and why."""
        return self._unresolved

    def resolve(self, allocations: Allocations) -> Allocations:
        """``allocations`` with each resolvable DRA device added under its UUID (``MIG-…`` for MIG)."""
        if not allocations.claimed:
            self._unresolved = {}
            return allocations
        found: dict[DraDevice, str] = {}
        reasons: dict[DraDevice, UnresolvedReason] = {}
        by_minor: dict[DraDevice, int] = {}
        by_placement: dict[DraDevice, MigPlacement] = {}
        for device in allocations.claimed:
            uuid, reason = self._from_slices(device)
            if uuid is not None:
                found[device] = uuid
                continue
            reasons[device] = reason
            if device.driver not in self._by_name:
                continue
            if (placement := mig_placement(device.device)) is not None:
                by_placement[device] = placement
            elif (match := _NVIDIA_GPU_NAME.fullmatch(device.device)) is not None:
                by_minor[device] = int(match.group(1))
        if by_minor and self._minor_numbers is not None:
            minors = self._minor_numbers()
            found.update((d, minors[m]) for d, m in by_minor.items() if m in minors)
        if by_placement and self._mig_devices is not None:
            migs = self._mig_devices(set(by_placement.values()))
            for device, placement in by_placement.items():
                if placement in migs:
                    found[device] = migs[placement]
                else:
                    reasons[device] = UnresolvedReason.MIG_NOT_FOUND
        extra: dict[str, tuple[PodRef, ...]] = {}
        unresolved: dict[DraDevice, UnresolvedReason] = {}
        for device, refs in allocations.claimed.items():
            uuid = found.get(device)
            if uuid is None:
                reason = reasons[device]
                unresolved[device] = reason
                if self._unresolved.get(device) is not reason:
                    self._report(device, refs, reason)
                continue
            extra[uuid] = (*extra.get(uuid, ()), *refs)
        self._unresolved = unresolved
        return allocations.with_devices(extra)

    def _from_slices(self, device: DraDevice) -> tuple[str | None, UnresolvedReason]:
        if self._slices is None or self._slices.state is not SlicesState.SYNCED:
            return None, UnresolvedReason.SLICES_UNAVAILABLE
        if device not in self._slices.devices:
            return None, UnresolvedReason.UNKNOWN_DEVICE
        gpu = self._slices.devices[device]
        return (gpu.uuid if gpu is not None else None), UnresolvedReason.NO_UUID

    def _report(self, device: DraDevice, refs: tuple[PodRef, ...], reason: UnresolvedReason) -> None:
        holders = ", ".join(f"{r.namespace}/{r.name}/{r.container} (claim {r.claim})" for r in refs)
        log.warning("DRA device %s cannot be resolved to a GPU (%s); held by %s", device, reason, holders)
        if self._on_unresolved is not None:
            self._on_unresolved(reason)

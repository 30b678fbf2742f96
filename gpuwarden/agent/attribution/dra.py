"""GPUs allocated by Dynamic Resource Allocation: (driver, pool, device) → UUID.

The kubelet's PodResources answer names a DRA-allocated device by its driver, pool and
device name, as the driver's ResourceSlices publish it; NVML knows GPUs by UUID. Two ways
from one to the other, tried in this order:

- the node's ResourceSlices (``resource.k8s.io/v1`` only), watched with the field selector
  ``spec.nodeName=<node>``: a device's ``uuid`` attribute (``GPU-…`` or, for a static MIG
  device, ``MIG-…``), from the newest complete generation of its pool only;
- NVIDIA's naming convention (``gpu-<minor>``, a convention of its driver's code, not an API
  contract), for the driver names given: the GPU with that minor number in NVML, without the
  API server. A MIG device's name does not name its UUID, so MIG needs the ResourceSlices.

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
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gpuwarden.agent.attribution.kubelet import Allocations, DraDevice
from gpuwarden.agent.attribution.nodepods import SERVICE_ACCOUNT_DIR, in_cluster_api
from gpuwarden.wire.node import PodRef

log = logging.getLogger(__name__)

NVIDIA_DRIVER = "gpu.nvidia.com"
"""NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu): the default of ``--dra-drivers``."""

RESOURCE_SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"

_NVIDIA_GPU_NAME = re.compile(r"gpu-(\d+)")
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
    """The node's ResourceSlices have no such device in their pool's newest complete generation."""
    NO_UUID = "no_uuid"
    """The device is published without a ``uuid`` attribute (e.g. a dynamic MIG device)."""


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


def devices_of(slices: Iterable[Mapping[str, Any]]) -> dict[DraDevice, DraGpu | None]:
    """Every device of the newest complete generation of each pool; None for one without a ``uuid``.

    A pool is published as ``resourceSliceCount`` slices of one ``generation``; while a driver
    replaces a generation, slices of the old and the new one coexist, and a pool whose newest
    generation is not all there yet is read from its newest complete one.
    """
    by_generation: defaultdict[tuple[str, str], defaultdict[int, list[Mapping[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for item in slices:
        spec = item.get("spec") or {}
        pool = spec.get("pool") or {}
        by_generation[(spec.get("driver", ""), pool.get("name", ""))][int(pool.get("generation", 0))].append(
            spec
        )
    found: dict[DraDevice, DraGpu | None] = {}
    for (driver, pool), generations in by_generation.items():
        complete = [
            g
            for g, specs in generations.items()
            if len(specs) >= max(int(s.get("pool", {}).get("resourceSliceCount", 1)) for s in specs)
        ]
        if not complete:
            continue
        for spec in generations[max(complete)]:
            for device in spec.get("devices") or []:
                uuid = _attribute(device, driver, _UUID)
                gpu = DraGpu(uuid, _attribute(device, driver, _PARENT_UUID)) if uuid else None
                found[DraDevice(driver, pool, device.get("name", ""))] = gpu
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
    """This node's ResourceSlices, listed then watched (``spec.nodeName=<node>``), as :func:`devices_of`.

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
                devices = devices_of(slices.values())
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
        self._set(devices_of(self._slices.values()))

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
                headers["Authorization"] = f"Bearer {self._token_path.read_text().strip()}"
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


class DraResolver:
    """Turns an answer's DRA devices into device keys (UUIDs) that attribution already knows.

    ``slices``: the node's ResourceSlices, or None without API access. ``minor_numbers``: NVML's
    minor numbers, for the drivers in ``by_name`` (NVIDIA's ``gpu-<minor>`` names).
    ``on_unresolved``: called with the reason whenever a device newly fails to resolve, or fails
    for another reason than at the last :meth:`resolve` (the counter).
    """

    def __init__(
        self,
        slices: ResourceSlices | None,
        *,
        minor_numbers: MinorNumbers | None = None,
        by_name: frozenset[str] = frozenset({NVIDIA_DRIVER}),
        on_unresolved: Callable[[UnresolvedReason], None] | None = None,
    ) -> None:
        self._slices = slices
        self._minor_numbers = minor_numbers
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
        minors: Mapping[int, str] | None = None
        extra: dict[str, tuple[PodRef, ...]] = {}
        unresolved: dict[DraDevice, UnresolvedReason] = {}
        for device, refs in allocations.claimed.items():
            uuid, reason = self._from_slices(device)
            if uuid is None and device.driver in self._by_name and self._minor_numbers is not None:
                if minors is None:
                    minors = self._minor_numbers()
                uuid = _by_minor(device.device, minors)
            if uuid is None:
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


def _by_minor(name: str, minors: Mapping[int, str]) -> str | None:
    match = _NVIDIA_GPU_NAME.fullmatch(name)
    return minors.get(int(match.group(1))) if match else None


def nvml_minor_numbers() -> dict[int, str]:
    """Every GPU's minor number → UUID, read from NVML (initialised by the agent's backend already).

    A GPU NVML cannot read (lost, or NVML itself gone) is left out rather than raised: its devices
    are then counted unresolved by the caller, and the other GPUs' claims still resolve.
    """
    import pynvml

    found: dict[int, str] = {}
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        log.warning("NVML cannot count GPUs for DRA device names (%s)", e)
        return found
    for index in range(count):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            minor = int(pynvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError as e:
            log.warning("NVML cannot read GPU %d's minor number for DRA device names (%s)", index, e)
            continue
        found[minor] = uuid if isinstance(uuid, str) else uuid.decode()
    return found

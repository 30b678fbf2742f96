"""GPU health from NVML: XIDs on an event thread of their own, memory errors and clock events per sample.

**XIDs** come as NVML events (``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents`` for
``nvmlEventTypeXidCriticalError``, ``nvmlEventSetWait``). Waiting blocks, so
:class:`XidWatcher` waits on a daemon thread of its own, ``wait_ms`` at a time so that it
notices :meth:`XidWatcher.stop`; the sampling thread only :meth:`~XidWatcher.drain`\\ s what
arrived (a lock held for a dict swap). A GPU that does not support the event type, or
refuses the registration (some VMs), gets no XIDs; the reason is logged and kept in
:attr:`XidWatcher.notes`. No XID can be injected on a real GPU: the scripted backend plays
them (``health: [{kind: xid, …}]`` in a scenario).

**Per sample** (:func:`read_health`, device-wide, on the GPU's own entry): the aggregate
uncorrected ECC count (the volatile one is ``GpuSample.ecc_uncorrected``), retired pages
(before Ampere) and remapped rows (Ampere and later), and the clock event reasons
(``nvmlDeviceGetCurrentClocksEventReasons``, or its older name ``…ThrottleReasons``). They
go through the backend's reader, so NVML's errors map to states as every other reading's
do: not supported → ``None`` and not asked again, GPU lost → the whole sample is lost.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from gpuwarden.wire.node import ClockEventReason, GpuHealth, XidEvent

log = logging.getLogger(__name__)

Reader = Callable[..., Any]
"""The backend's reader: ``read(field_name, nvml_function, *args)``, None when NVML refused."""

CLOCK_EVENT_BITS: tuple[tuple[int, ClockEventReason], ...] = (
    (0x001, ClockEventReason.GPU_IDLE),
    (0x002, ClockEventReason.APPLICATIONS_CLOCKS_SETTING),
    (0x004, ClockEventReason.SW_POWER_CAP),
    (0x008, ClockEventReason.HW_SLOWDOWN),
    (0x010, ClockEventReason.SYNC_BOOST),
    (0x020, ClockEventReason.SW_THERMAL_SLOWDOWN),
    (0x040, ClockEventReason.HW_THERMAL_SLOWDOWN),
    (0x080, ClockEventReason.HW_POWER_BRAKE_SLOWDOWN),
    (0x100, ClockEventReason.DISPLAY_CLOCK_SETTING),
)
"""nvmlClocksEventReason* bits (nvml.h), in bit order."""

XID_CRITICAL_ERROR = 0x8
"""nvmlEventTypeXidCriticalError."""
_NVML_ERROR_TIMEOUT = 10
_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
_NVML_AGGREGATE_ECC = 1
_PENDING_LIMIT = 256  # XIDs kept per GPU between two drains (GpuHealth.xids' limit on the wire)


def clock_event_reasons(mask: int) -> list[ClockEventReason]:
    """The reasons set in an nvmlClocksEventReason bit mask; unknown bits are left out."""
    return [reason for bit, reason in CLOCK_EVENT_BITS if mask & bit]


def _function(nvml: Any, *names: str) -> Any:
    """The first of ``names`` this pynvml has (older ones lack the newer names), or None."""
    for name in names:
        fn = getattr(nvml, name, None)
        if fn is not None:
            return fn
    return None


def read_health(nvml: Any, handle: Any, read: Reader) -> GpuHealth | None:
    """A GPU's memory-error and clock-event readings (no XIDs: the watcher's); None if it gave none."""
    uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    aggregate = read(
        "ecc_uncorrected_aggregate",
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        uncorrected,
        getattr(nvml, "NVML_AGGREGATE_ECC", _NVML_AGGREGATE_ECC),
    )
    fields: dict[str, Any] = {"ecc_uncorrected_aggregate": None if aggregate is None else int(aggregate)}

    retired_fn = _function(nvml, "nvmlDeviceGetRetiredPages")
    if retired_fn is not None:
        cause = getattr(
            nvml,
            "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
            _NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        pages = read("retired_pages", retired_fn, handle, cause)
        fields["retired_pages_double_bit"] = None if pages is None else len(pages)
    pending_fn = _function(nvml, "nvmlDeviceGetRetiredPagesPendingStatus")
    if pending_fn is not None:
        pending = read("retired_pages_pending", pending_fn, handle)
        fields["retired_pages_pending"] = None if pending is None else bool(pending)

    rows_fn = _function(nvml, "nvmlDeviceGetRemappedRows")
    if rows_fn is not None:
        rows = read("remapped_rows", rows_fn, handle)
        if rows is not None:
            _, uncorrectable, pending_remap, failed = rows
            fields["remapped_rows_uncorrectable"] = int(uncorrectable)
            fields["row_remap_pending"] = bool(pending_remap)
            fields["row_remap_failed"] = bool(failed)

    reasons_fn = _function(
        nvml, "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    if reasons_fn is not None:
        mask = read("clock_event_reasons", reasons_fn, handle)
        fields["clock_event_reasons"] = None if mask is None else clock_event_reasons(int(mask))

    if all(value is None for value in fields.values()):
        return None
    return GpuHealth(**fields)


def with_xids(health: GpuHealth | None, xids: list[XidEvent]) -> GpuHealth | None:
    """``health`` with ``xids`` added (a health of XIDs alone when there was none)."""
    if not xids:
        return health
    if health is None:
        return GpuHealth(xids=xids)
    return health.model_copy(update={"xids": [*health.xids, *xids]})


def _handle_key(handle: Any) -> int:
    """What identifies a device handle in an event: its pointer for a pynvml handle, else the object."""
    try:
        value = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
    return value if value is not None else id(handle)


class XidWatcher:
    """Waits for NVML XID events on a thread of its own and keeps them until the sampler drains them.

    ``nvml`` is the pynvml module (tests pass a fake); ``clock`` stamps each event when it
    arrives; ``wait_ms`` is how long one ``nvmlEventSetWait`` blocks, which bounds how long
    :meth:`stop` takes.
    """

    def __init__(self, nvml: Any, *, clock: Callable[[], float] = time.time, wait_ms: int = 500) -> None:
        self._nvml = nvml
        self._clock = clock
        self._wait_ms = wait_ms
        self._set: Any = None
        self._uuids: dict[int, str] = {}
        self._lock = threading.Lock()
        self._pending: dict[str, collections.deque[XidEvent]] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.notes: dict[str, str] = {}
        """Per GPU UUID: ``registered``, or why it gets no XID events."""
        self.received = 0
        """XID events received since :meth:`start` (read by the GPU test and for logs)."""

    @property
    def running(self) -> bool:
        """Whether the event thread is waiting for events."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, devices: Iterable[tuple[str, Any]]) -> None:
        """Register every ``(uuid, handle)`` for XID events and start waiting; never raises for NVML."""
        nvml = self._nvml
        devices = list(devices)
        if _function(nvml, "nvmlEventSetCreate") is None:
            for uuid, _ in devices:
                self.notes[uuid] = "unavailable (this pynvml has no event API)"
            return
        try:
            self._set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML cannot create an event set (%s); no XID events", exc)
            for uuid, _ in devices:
                self.notes[uuid] = f"no event set ({exc})"
            return
        for uuid, handle in devices:
            self.notes[uuid] = self._register(uuid, handle)
            log.info("GPU %s: XID events %s", uuid, self.notes[uuid])
        if not self._uuids:
            self._free()
            return
        self._thread = threading.Thread(target=self._run, name="gpuwarden-xid-events", daemon=True)
        self._thread.start()

    def _register(self, uuid: str, handle: Any) -> str:
        nvml = self._nvml
        try:
            supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
            if not supported & XID_CRITICAL_ERROR:
                return "not supported by this GPU"
            nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR, self._set)
        except nvml.NVMLError as exc:
            return f"not available ({exc})"
        self._uuids[_handle_key(handle)] = uuid
        return "registered"

    def _run(self) -> None:
        nvml = self._nvml
        failures = 0
        while not self._stopping.is_set():
            try:
                data = nvml.nvmlEventSetWait(self._set, self._wait_ms)
            except nvml.NVMLError as exc:
                if exc.value == getattr(nvml, "NVML_ERROR_TIMEOUT", _NVML_ERROR_TIMEOUT):
                    failures = 0
                    continue
                # A lost GPU can make every wait fail at once: log the first, then back off.
                if failures == 0:
                    log.warning("waiting for NVML events failed (%s); retrying every second", exc)
                failures += 1
                self._stopping.wait(1.0)
                continue
            failures = 0
            if int(data.eventType) & XID_CRITICAL_ERROR:
                self._received(data)

    def _received(self, data: Any) -> None:
        uuid = self._uuids.get(_handle_key(data.device))
        if uuid is None:
            try:
                uuid = str(self._nvml.nvmlDeviceGetUUID(data.device))
            except self._nvml.NVMLError:
                log.warning("XID %d on a GPU this agent cannot name; dropped", int(data.eventData))
                return
        event = XidEvent(code=int(data.eventData), timestamp=self._clock())
        log.warning("GPU %s: XID %d", uuid, event.code)
        with self._lock:
            self._pending.setdefault(uuid, collections.deque(maxlen=_PENDING_LIMIT)).append(event)
            self.received += 1

    def drain(self) -> dict[str, list[XidEvent]]:
        """The XIDs received since the last drain, by GPU UUID, oldest first."""
        with self._lock:
            if not self._pending:
                return {}
            pending, self._pending = self._pending, {}
        return {uuid: list(events) for uuid, events in pending.items()}

    def stop(self) -> None:
        """Stop waiting and free the event set; safe to call twice, and before :meth:`start`."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self._wait_ms / 1000 + 2.0)
            if self._thread.is_alive():
                log.warning("the XID event thread did not stop; its event set is left to nvmlShutdown")
                self._thread = None
                self._set = None
                return
            self._thread = None
        self._free()

    def _free(self) -> None:
        if self._set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._set)
        except self._nvml.NVMLError as exc:
            log.warning("nvmlEventSetFree failed: %s", exc)
        self._set = None

"""The common XID codes: what each means and what to do about it, in words for Events and status.

Source: NVIDIA's XID documentation, "Xid Errors" and "Analyzing Xid Errors with the Xid Catalog"
(https://docs.nvidia.com/deploy/xid-errors/index.html,
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), which lists every code with
its trigger conditions and NVIDIA's resolution (restart the application, reset the GPU, reboot
the node, contact support). The wording below is ours, shortened to fit a message; the catalog
is the reference, and it changes with driver versions.

``critical`` marks the codes after which the GPU itself is suspect (it needs a reset, or the node
a reboot, before it can be trusted with work): :data:`CRITICAL_XIDS`, the default of a
``gpuHealth`` rule's ``xids`` and of the operator's ``--node-health-xids``. The others are mostly
raised by an application's own fault (13, 31, 43), as a follow-on of another error (45), or as an
early warning (63, 92, 94).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CRITICAL_XIDS", "SOURCE", "XIDS", "XidInfo", "describe_xid"]

SOURCE = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One XID code: its meaning, the recommended action, and whether the GPU is suspect after it."""

    code: int
    meaning: str
    action: str
    critical: bool


_TABLE = (
    XidInfo(
        13,
        "graphics engine exception (often an out-of-range access or illegal instruction)",
        "restart the application; check it, a hardware fault is unlikely",
        False,
    ),
    XidInfo(
        31,
        "GPU memory page fault (the application accessed an invalid address)",
        "restart the application; check it with compute-sanitizer",
        False,
    ),
    XidInfo(
        43,
        "GPU stopped processing the application's work (its channel was stopped after an error)",
        "restart the application; the GPU itself is usually fine",
        False,
    ),
    XidInfo(
        45,
        "channel removed pre-emptively (a process ended or was killed, often after another error)",
        "none on its own; look for the error that came before it",
        False,
    ),
    XidInfo(
        48,
        "double-bit ECC error: an uncorrectable error in GPU memory",
        "reset the GPU (the row is remapped or the page retired at reset); replace it if it recurs",
        True,
    ),
    XidInfo(
        61,
        "internal micro-controller breakpoint or warning",
        "reset the GPU if work hangs; update the driver and firmware",
        False,
    ),
    XidInfo(
        62,
        "internal micro-controller halted",
        "reset the GPU; contact NVIDIA support if it recurs",
        True,
    ),
    XidInfo(
        63,
        "memory row remapping or page retirement recorded (the repair waits for a GPU reset)",
        "reset the GPU when convenient to apply the repair",
        False,
    ),
    XidInfo(
        64,
        "memory row remapping or page retirement failed",
        "reset the GPU; replace it if it recurs",
        True,
    ),
    XidInfo(
        74,
        "NVLink error",
        "reset the GPU; check the NVLink and NVSwitch health; contact support if it recurs",
        True,
    ),
    XidInfo(
        79,
        "GPU has fallen off the bus (unreachable over PCIe)",
        "drain and reboot the node; check power, cooling and the PCIe slot; replace the GPU if it recurs",
        True,
    ),
    XidInfo(
        92,
        "high single-bit ECC error rate (corrected, but rising)",
        "keep watching; plan to replace the GPU if the rate keeps rising",
        False,
    ),
    XidInfo(
        94,
        "contained uncorrectable ECC error (only the application using that memory was stopped)",
        "restart the application; reset the GPU when convenient",
        False,
    ),
    XidInfo(
        95,
        "uncontained uncorrectable ECC error (every application on the GPU is affected)",
        "reset the GPU; replace it if it recurs",
        True,
    ),
    XidInfo(
        119,
        "GSP (GPU System Processor) did not answer in time",
        "reset the GPU; update the driver and firmware if it recurs",
        True,
    ),
    XidInfo(
        120,
        "GSP (GPU System Processor) error",
        "reset the GPU; update the driver and firmware if it recurs",
        True,
    ),
    XidInfo(
        140,
        "unrecovered ECC error in GPU memory",
        "reset the GPU; replace it if it recurs",
        True,
    ),
)

XIDS: Mapping[int, XidInfo] = {info.code: info for info in _TABLE}
"""The codes gpuwarden explains, by code."""

CRITICAL_XIDS: tuple[int, ...] = tuple(sorted(code for code, info in XIDS.items() if info.critical))
"""48, 62, 64, 74, 79, 95, 119, 120, 140: after these the GPU needs a reset or the node a reboot."""


def describe_xid(code: int) -> str:
    """``XID 79 (GPU has fallen off the bus …; drain and reboot the node …)``, or a pointer to the catalog."""
    info = XIDS.get(code)
    if info is None:
        return f"XID {code} (see NVIDIA's XID catalog for its meaning)"
    return f"XID {code} ({info.meaning}; {info.action})"

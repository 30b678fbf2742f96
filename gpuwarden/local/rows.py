"""What one snapshot changed, as the display shows it: the devices (:class:`GpuRow`, and each
subject's own readings on a shared one, :class:`ShareRow`), the findings that started, re-notified or
cleared (:class:`Announcement`), and the simulated scale targets (:class:`TargetRow`), in a
:class:`Step`."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.policy import (
    FindingTransition,
    ScaleDecision,
)
from gpuwarden.wire.node import DeviceState


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One device as last sampled, with the active findings that speak for it."""

    device: str
    """Device key: the GPU (or MIG device) UUID."""
    name: str
    model: str
    state: DeviceState
    utilization: float | None
    sm_active: float | None
    memory_used: float | None
    memory_total: float | None
    subjects: tuple[str, ...]
    """Display names of the pods or processes on it."""
    findings: tuple[str, ...]
    """Rules with an active finding on it."""
    allocated: float | None = None
    """What live tensors hold, summed over the processes whose training hook reports it (None: no hook)."""
    reserved: float | None = None
    """What the processes' caching allocators hold, from their hooks (None: no hook)."""
    shares: tuple[ShareRow, ...] = ()
    """On a shared GPU (more than one subject), each subject's own readings; empty otherwise."""


@dataclass(frozen=True, slots=True)
class ShareRow:
    """One pod or process on a shared GPU: its own readings, as the engine judges them."""

    subject: str
    """Display name."""
    utilization: float | None
    """Its per-process SM utilization (the sum over its processes), as last read."""
    memory_used: float | None
    """The sum of its processes' memory."""
    findings: tuple[str, ...]
    """Rules with an active finding on it, on this GPU."""
    allocated: float | None = None
    """Its processes' live tensors, from their training hook (None: not hooked)."""
    reserved: float | None = None
    """Its processes' allocator cache, from their training hook (None: not hooked)."""


@dataclass(frozen=True, slots=True)
class ScaleNote:
    """A scale decision that changes the simulated target's replicas (:mod:`~gpuwarden.local.scaler`)."""

    policy: str
    target: str
    """``Deployment inference/llm-server``."""
    decision: ScaleDecision
    at: float
    applied: bool
    """Whether the simulated target took it (False: the policy is ``dryRun``, its replicas stay)."""
    namespace: str = ""
    """The target's namespace (the policy's; ``""`` for a policy without one)."""
    name: str = ""
    """The target's name."""


@dataclass(frozen=True, slots=True)
class TargetRow:
    """A simulated scale target's replicas at one step, for the table and the status lines."""

    policy: str
    target: str
    replicas: int
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Announcement:
    """A finding that started, re-notified or cleared, with the names the display needs."""

    transition: FindingTransition
    subject: str
    devices: tuple[str, ...]
    """Display names of the GPUs it speaks for (``GPU 1``)."""


@dataclass(frozen=True, slots=True)
class Step:
    """What one snapshot changed."""

    at: float
    rows: tuple[GpuRow, ...]
    announcements: tuple[Announcement, ...]
    scaling: tuple[ScaleNote, ...]
    evaluated: bool
    """Whether any policy was evaluated at this snapshot."""
    targets: tuple[TargetRow, ...] = ()
    """The simulated scale targets after this step (none before a scaling policy matched a pod)."""

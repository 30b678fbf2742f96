"""Who a finding is about in local mode, and how the display names them.

Subjects are pods (``demo``: the scenario's pods, with their labels) or host processes
(``watch``: ``pid/<pid>`` in namespace ``""``, see :func:`gpuwarden.policy.process_subject`).
A process is shown as ``pid 474 python3 -c import torch...``: its executable's basename and
arguments, cut at :data:`COMMAND_WIDTH` (a ``python -c`` script would make every line hundreds
of characters long); the whole command line is kept for the summary.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from gpuwarden.policy import (
    PROCESS_NAMESPACE,
    PodId,
    PodView,
    Point,
    SeriesKey,
    pods_of,
    points_from_processes,
    points_from_snapshot,
    process_subject,
)
from gpuwarden.wire.node import DeviceState, GpuSample, ProcessSample, Snapshot

COMMAND_WIDTH = 60
"""Characters of a process's command in its display name and its /metrics label, ``...`` included."""
ELLIPSIS = "..."
"""ASCII, as the rest of local mode's output (display.py): a log stays legible in any encoding."""


class SubjectKind(enum.StrEnum):
    """What a finding is about in local mode."""

    PODS = "pod"
    PROCESSES = "process"


PodsOf = Callable[[Snapshot], Sequence[PodView]]
"""The pods that exist at a snapshot's time, with their labels (what a pod list would say)."""


def pods_in(snapshot: Snapshot) -> list[PodView]:
    """The pods a snapshot names (allocated a GPU or running on one), without labels."""
    seen: dict[PodId, None] = {}
    for gpu in snapshot.gpus:
        for ref in gpu.pods:
            seen.setdefault(PodId(ref.namespace, ref.name), None)
        for proc in gpu.processes:
            if proc.pod is not None:
                seen.setdefault(PodId(proc.pod.namespace, proc.pod.name), None)
    return [PodView(namespace=p.namespace, name=p.name) for p in seen]


def processes_in(snapshot: Snapshot) -> list[PodView]:
    """Every process on a healthy device of the snapshot, as a subject (``pid/<pid>``)."""
    pids = sorted({p.pid for gpu in snapshot.gpus if gpu.state is DeviceState.OK for p in gpu.processes})
    return [PodView(namespace=PROCESS_NAMESPACE, name=process_subject(pid)) for pid in pids]


def one_line(command: str) -> str:
    """A command line on one line, runs of whitespace as one space (``python -c`` scripts have newlines)."""
    return " ".join(command.split())


def short_command(command: str, width: int = COMMAND_WIDTH) -> str:
    """``/usr/bin/python3 train.py --lr 3e-4`` as ``python3 train.py --lr 3e-4``, cut to ``width``.

    The executable's directory is left out (its basename says what runs); the arguments say
    which script, so they stay, as far as ``width`` allows; a cut one ends in :data:`ELLIPSIS`.
    """
    words = command.split()
    if not words:
        return ""
    words[0] = words[0].rstrip("/").rsplit("/", 1)[-1] or words[0]
    text = " ".join(words)
    if len(text) <= width:
        return text
    return text[: max(0, width - len(ELLIPSIS))].rstrip() + ELLIPSIS


def device_name(gpu: GpuSample) -> str:
    """How the display names a device: ``GPU 0``, or ``GPU 0 MIG-…`` for a MIG instance."""
    return f"GPU {gpu.index}" if gpu.mig_id is None else f"GPU {gpu.index} {gpu.mig_id}"


def _process_subject(proc: ProcessSample) -> PodId:
    return PodId(PROCESS_NAMESPACE, process_subject(proc.pid))


def _pod_of(proc: ProcessSample) -> PodId | None:
    return PodId(proc.pod.namespace, proc.pod.name) if proc.pod is not None else None


def _processes_on(gpu: GpuSample) -> list[PodId]:
    return [_process_subject(p) for p in gpu.processes]


@dataclass(frozen=True, slots=True)
class Attribution:
    """How a snapshot's readings are attributed to one :class:`SubjectKind`'s subjects: the loop asks
    this, never which kind it runs."""

    listed: PodsOf
    """The subjects at a snapshot's time, when no pod list says them."""
    points: Callable[[Snapshot], Iterator[tuple[SeriesKey, Point]]]
    """Each subject's points in a snapshot."""
    on_device: Callable[[GpuSample], list[PodId]]
    """Whose health record a device's report is."""
    of_process: Callable[[ProcessSample], PodId | None]
    """The subject a process belongs to (None: a process of no pod)."""


ATTRIBUTION = {
    SubjectKind.PODS: Attribution(pods_in, points_from_snapshot, pods_of, _pod_of),
    SubjectKind.PROCESSES: Attribution(processes_in, points_from_processes, _processes_on, _process_subject),
}
"""Each subject kind's attribution."""

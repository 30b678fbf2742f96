"""From agent snapshots to series points: which pod (or process) each GPU reading belongs to.

Attribution of one GPU (or MIG device, keyed by its ``mig_id``) in one snapshot:

- **Not ok** (``lost``, ``unknown``): no point at all. Its readings are absent,
  so the series shows a gap, never zeros.
- **Its pods** are those the kubelet allocated it to (``pods``), then any other
  pod that runs a process on it, each once, in that order.
- **One pod**: the device's readings are that pod's (gpuUtil, smActive, memory
  used and total, power). A GPU allocated to a pod that runs nothing on it
  reads idle, which is exactly the waste to find.
- **Several pods** (time-slicing, MPS, a privileged pod that sees every GPU):
  per pod, memory used is the sum of its processes' used memory and gpuUtil
  the sum of their per-process SM utilization (capped at 100), each None when
  any of its processes lacks that reading (per-process utilization is sampled
  less often than the device). A pod with no process on the GPU reads 0 for
  whatever the device reported, unless a process there is nobody's (the agent
  could not tell whose: no pod list, a pod too new for it): it might be that
  pod's, so the pod's readings are unknown rather than idle. smActive and power cannot be split per pod and
  are None; memory total is the device's. Such points say so (``util_source``
  ``processes``, or ``noProcess``), so that a finding names the signal that decided it.
- **Per-process SM utilization** (``sm_util``) is 0 for a process that NVML's
  per-process reading of its GPU left out (it ran no kernel in the window: the
  agent sets that, :func:`gpuwarden.agent.backend.merge_process_utilization`),
  and None only when its GPU could not be read that way (unsupported, as on
  MIG; failed) or was not read at that sample.
- **No pod**: no point (host processes are local mode's business, below).

Local ``watch`` mode has no pods: :func:`points_from_processes` makes each
host process a subject, namespace ``""`` and pod ``pid/<pid>``, with the same
rules (a process alone on a device gets the device's readings).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from gpuwarden.nodereport import DeviceState, GpuSample, NodeReport, ProcessSample, Snapshot
from gpuwarden.policy.series import PodId, Point, SeriesKey, UtilizationSource

PROCESS_NAMESPACE = ""
"""The namespace of process subjects in local mode."""


def process_subject(pid: int) -> str:
    """The pod name standing for a host process in local mode: ``pid/<pid>``."""
    return f"pid/{pid}"


def device_id(gpu: GpuSample) -> str:
    """The series' GPU id: the MIG device UUID for a MIG instance, else the GPU UUID."""
    return gpu.mig_id or gpu.uuid


def points_from_report(report: NodeReport) -> Iterator[tuple[SeriesKey, Point]]:
    """Every pod's points in a node report, snapshot by snapshot (oldest first)."""
    for snapshot in report.snapshots:
        yield from points_from_snapshot(snapshot)


def points_from_snapshot(snapshot: Snapshot) -> Iterator[tuple[SeriesKey, Point]]:
    """Every pod's points in one snapshot (see the module doc for attribution)."""
    t = snapshot.timestamp
    for gpu in snapshot.gpus:
        if gpu.state is not DeviceState.OK:
            continue
        device = gpu.mig_id or gpu.uuid
        refs = gpu.pods
        if len(refs) == 1:
            # The common case, a GPU allocated to one pod that runs whatever runs on it: that pod
            # alone (what pods_of() would say), without building the pod list. Runs per GPU per report.
            ref = refs[0]
            namespace, name = ref.namespace, ref.name
            for proc in gpu.processes:
                owner = proc.pod
                if owner is not None and (owner.name != name or owner.namespace != namespace):
                    break
            else:
                yield SeriesKey(namespace, name, device), device_point(t, gpu)
                continue
        pods = pods_of(gpu)
        if len(pods) == 1:
            yield SeriesKey(pods[0].namespace, pods[0].name, device), device_point(t, gpu)
            continue
        unowned = any(p.pod is None for p in gpu.processes)
        for pod in pods:
            mine = [p for p in gpu.processes if p.pod is not None and (p.pod.namespace, p.pod.name) == pod]
            point = share_point(t, gpu, mine, unowned_processes=unowned)
            yield SeriesKey(pod.namespace, pod.name, device), point


def points_from_processes(snapshot: Snapshot) -> Iterator[tuple[SeriesKey, Point]]:
    """Local mode: one subject per host process per device, namespace ``""``, pod ``pid/<pid>``."""
    for gpu in snapshot.gpus:
        if gpu.state is not DeviceState.OK or not gpu.processes:
            continue
        device = device_id(gpu)
        by_pid: dict[int, list[ProcessSample]] = {}
        for proc in gpu.processes:
            by_pid.setdefault(proc.pid, []).append(proc)
        for pid, procs in by_pid.items():
            key = SeriesKey(PROCESS_NAMESPACE, process_subject(pid), device)
            if len(by_pid) == 1:
                yield key, device_point(snapshot.timestamp, gpu)
            else:
                yield key, share_point(snapshot.timestamp, gpu, procs)


def pods_of(gpu: GpuSample) -> list[PodId]:
    """The pods a GPU's readings concern: allocated ones first, then those running processes on it."""
    seen: dict[PodId, None] = {}
    for ref in gpu.pods:
        seen.setdefault(PodId(ref.namespace, ref.name), None)
    for proc in gpu.processes:
        if proc.pod is not None:
            seen.setdefault(PodId(proc.pod.namespace, proc.pod.name), None)
    return list(seen)


def device_point(t: float, gpu: GpuSample) -> Point:
    """The whole device's readings as one point."""
    used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
    # Positional, and the int-to-float conversions inline: this runs once per GPU per report.
    return Point(
        t,
        gpu.utilization_gpu,
        gpu.sm_active,
        None if used is None else float(used),
        None if total is None else float(total),
        gpu.power_watts,
    )


def share_point(
    t: float, gpu: GpuSample, processes: Sequence[ProcessSample], *, unowned_processes: bool = False
) -> Point:
    """One subject's share of a device: the sums over its processes (see the module doc).

    ``unowned_processes``: the device runs processes nobody could be named for; a subject
    with none of its own then reads unknown, not idle (one of them may be its).
    """
    if processes:
        mems = [p.used_memory_bytes for p in processes]
        utils = [p.sm_util for p in processes]
        mem = None if any(m is None for m in mems) else float(sum(m for m in mems if m is not None))
        util = None if any(u is None for u in utils) else min(100.0, sum(u for u in utils if u is not None))
        source = UtilizationSource.PROCESSES
    elif unowned_processes:
        mem = util = None
        source = UtilizationSource.NO_PROCESS
    else:
        # Nothing of its own runs there: idle and empty, as far as the device could be read at all.
        mem = None if gpu.memory_used_bytes is None else 0.0
        util = None if gpu.utilization_gpu is None and gpu.sm_active is None else 0.0
        source = UtilizationSource.NO_PROCESS
    return Point(
        t=t,
        gpu_util=util,
        mem_used=mem,
        mem_total=_float(gpu.memory_total_bytes),
        util_source=source,
    )


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)

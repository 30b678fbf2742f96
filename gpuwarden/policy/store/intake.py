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
  agent sets that, :func:`gpuwarden.wire.node.merge_process_utilization`),
  and None only when its GPU could not be read that way (unsupported, as on
  MIG; failed) or was not read at that sample.
- **No pod**: no point (host processes are local mode's business, below).

- **Hook readings** (``ProcessSample.hook``, schema 3) ride on the subject's
  point as a :class:`~gpuwarden.policy.store.series.HookPoint`, only where one of its
  processes on the GPU carries them: allocated and reserved are the sums over
  the subject's processes on that GPU (None when one of them lacks the
  reading: a partial sum would look like a drop); host is the subject's whole
  host memory, the same on each of its GPUs' points: the hook's
  ``hostRssBytes`` is per process and repeated on each GPU entry of that
  process, so each pid counts once, summed over the pod's hooked processes.
  Its limit (``hostLimitBytes``, schema 5) is the one every such process
  reports with its RSS (one container's, the common case); None when they
  differ (several containers: no one limit the pod's sum meets), when one
  lacks it (an older hook), or when the sum is already over it (the
  copy-on-write pages a forked worker shares, counted per process, can
  make it so); the series keeps the last limit known
  (:attr:`~gpuwarden.policy.store.series.Window.host_limit`).
  The sites are the subject's processes' newest, the largest
  :data:`KEPT_SITES` by growth.

**The pods' own metrics** (``Snapshot.services``, schema 6) become the service store's
:class:`~gpuwarden.policy.store.service.ServiceScrape` one for one (:func:`service_scrape`, of the
names asked for): a histogram's ``+Inf`` bucket, sent as ``count``, is its last bound again.

Local ``watch`` mode has no pods: :func:`points_from_processes` makes each
host process a subject, namespace ``""`` and pod ``pid/<pid>``, with the same
rules (a process alone on a device gets the device's readings).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence

from gpuwarden.policy.store.series import HookPoint, PodId, Point, SeriesKey, UtilizationSource
from gpuwarden.policy.store.service import Histogram, ServiceScrape
from gpuwarden.wire.node import DeviceState, GpuSample, NodeReport, ProcessSample, Snapshot, device_key
from gpuwarden.wire.scrape import ServiceSample

KEPT_SITES = 3
"""Allocation sites kept per series: as many as a finding's message names."""

PROCESS_NAMESPACE = ""
"""The namespace of process subjects in local mode."""


def process_subject(pid: int) -> str:
    """The pod name standing for a host process in local mode: ``pid/<pid>``."""
    return f"pid/{pid}"


def points_from_report(report: NodeReport) -> Iterator[tuple[SeriesKey, Point]]:
    """Every pod's points in a node report, snapshot by snapshot (oldest first)."""
    for snapshot in report.snapshots:
        yield from points_from_snapshot(snapshot)


def points_from_snapshot(snapshot: Snapshot) -> Iterator[tuple[SeriesKey, Point]]:
    """Every pod's points in one snapshot (see the module doc for attribution)."""
    t = snapshot.timestamp
    hosts: dict[PodId, HostMemory] | None = None  # the pods' host memory, once a hooked process is seen
    for gpu in snapshot.gpus:
        if gpu.state is not DeviceState.OK:
            continue
        device = gpu.mig_id or gpu.uuid  # device_key(gpu), inlined: this runs per GPU per report
        refs = gpu.pods
        if len(refs) == 1:
            # The common case, a GPU allocated to one pod that runs whatever runs on it: that pod
            # alone (what pods_of() would say), without building the pod list. Runs per GPU per report.
            ref = refs[0]
            namespace, name = ref.namespace, ref.name
            for proc in gpu.processes:
                owner = proc.pod
                if proc.hook is not None or (
                    owner is not None and (owner.name != name or owner.namespace != namespace)
                ):
                    break
            else:
                yield SeriesKey(namespace, name, device), device_point(t, gpu)
                continue
        pods = pods_of(gpu)
        hooked = any(p.hook is not None for p in gpu.processes)
        if hooked and hosts is None:
            hosts = pod_host_memory(snapshot)
        if len(pods) == 1:
            point = device_point(t, gpu)
            if hosts is not None and hooked:
                point.hook = hook_point(gpu.processes, *hosts.get(pods[0], NO_HOST))
            yield SeriesKey(pods[0].namespace, pods[0].name, device), point
            continue
        unowned = any(p.pod is None for p in gpu.processes)
        for pod in pods:
            mine = [p for p in gpu.processes if p.pod is not None and (p.pod.namespace, p.pod.name) == pod]
            point = share_point(t, gpu, mine, unowned_processes=unowned)
            if hosts is not None and any(p.hook is not None for p in mine):
                point.hook = hook_point(mine, *hosts.get(pod, NO_HOST))
            yield SeriesKey(pod.namespace, pod.name, device), point


HostMemory = tuple[float | None, float | None]
"""A subject's host memory and the limit it counts against (see the module doc)."""
NO_HOST: HostMemory = (None, None)


def pod_host_memory(snapshot: Snapshot) -> dict[PodId, HostMemory]:
    """Each pod's host memory by its hooked processes: ``hostRssBytes`` once per pid, summed per pod,
    and the one ``hostLimitBytes`` they report (see the module doc).

    The hook's reading is the process's (and its children's) and rides on each of its GPUs'
    entries, so a process on 8 GPUs appears 8 times: counted once.
    """
    seen: dict[int, tuple[PodId, int, int | None]] = {}
    for gpu in snapshot.gpus:
        for proc in gpu.processes:
            hook, pod = proc.hook, proc.pod
            if hook is not None and hook.host_rss_bytes is not None and pod is not None:
                seen[proc.pid] = (PodId(pod.namespace, pod.name), hook.host_rss_bytes, hook.host_limit_bytes)
    rss: dict[PodId, float] = {}
    limits: dict[PodId, set[int | None]] = {}
    for pod_id, held, limit in seen.values():
        rss[pod_id] = rss.get(pod_id, 0.0) + held
        limits.setdefault(pod_id, set()).add(limit)
    return {pod_id: (held, host_limit(held, limits[pod_id])) for pod_id, held in rss.items()}


def host_limit(held: float, limits: set[int | None]) -> float | None:
    """The one limit ``limits`` holds, when ``held`` is within it; else None (see the module doc)."""
    if len(limits) != 1:
        return None
    (limit,) = limits
    return None if limit is None or held > limit else float(limit)


def hook_point(
    processes: Sequence[ProcessSample], host: float | None, limit: float | None = None
) -> HookPoint:
    """One subject's hook readings on one GPU from its processes there (see the module doc)."""
    hooks = [p.hook for p in processes]
    allocated = reserved = None
    if all(h is not None and h.allocated_bytes is not None for h in hooks):
        allocated = float(sum(h.allocated_bytes or 0 for h in hooks if h is not None))
    if all(h is not None and h.reserved_bytes is not None for h in hooks):
        reserved = float(sum(h.reserved_bytes or 0 for h in hooks if h is not None))
    # Each hook ranks its own sites (the job's own lines first, not the largest bytes first): several
    # processes' lists are merged rank by rank, each keeping its order.
    ranked = [(rank, site) for h in hooks if h is not None for rank, site in enumerate(h.sites)]
    ranked.sort(key=lambda pair: pair[0])
    sites = tuple(site for _, site in ranked[:KEPT_SITES])
    return HookPoint(allocated, reserved, host, sites, limit)


def points_from_processes(snapshot: Snapshot) -> Iterator[tuple[SeriesKey, Point]]:
    """Local mode: one subject per host process per device, namespace ``""``, pod ``pid/<pid>``."""
    for gpu in snapshot.gpus:
        if gpu.state is not DeviceState.OK or not gpu.processes:
            continue
        device = device_key(gpu)
        by_pid: dict[int, list[ProcessSample]] = {}
        for proc in gpu.processes:
            by_pid.setdefault(proc.pid, []).append(proc)
        for pid, procs in by_pid.items():
            key = SeriesKey(PROCESS_NAMESPACE, process_subject(pid), device)
            if len(by_pid) == 1:
                point = device_point(snapshot.timestamp, gpu)
            else:
                point = share_point(snapshot.timestamp, gpu, procs)
            hook = procs[0].hook
            if hook is not None:
                host = None if hook.host_rss_bytes is None else float(hook.host_rss_bytes)
                limit = None if host is None else host_limit(host, {hook.host_limit_bytes})
                point.hook = hook_point(procs, host, limit)
            yield key, point


def service_scrape(sample: ServiceSample, names: Collection[str]) -> ServiceScrape:
    """One pod's scrape as the service store keeps it (see the module doc), of the metric ``names``
    asked for alone."""
    return ServiceScrape(
        at=sample.at,
        histograms={
            h.name: Histogram((*h.bounds, math.inf), (*h.counts, h.count), h.sum)
            for h in sample.histograms
            if h.name in names
        },
        counters={c.name: c.value for c in sample.counters if c.name in names},
        gauges={g.name: tuple(g.values) for g in sample.gauges if g.name in names},
        error=None if sample.error is None else sample.error.value,
    )


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

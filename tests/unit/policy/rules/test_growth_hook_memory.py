"""memoryGrowth on the training hook's readings: which memory a rule watches, and what it says.

Reports are built with the wire models (schema 3, ``ProcessSample.hook``), serialised and parsed as
the operator does, then attributed by :mod:`gpuwarden.policy.store.intake` into a real store.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import pytest

from gpuwarden.policy import PodView, PolicyEvaluator, Transition
from gpuwarden.policy.rules import growth, rule_type
from gpuwarden.policy.rules.common import Outcome, WindowParams
from gpuwarden.policy.rules.growth import MESSAGE_SITES, MemoryGrowth, MemorySource, evaluate_growth
from gpuwarden.policy.spec.model import Actions, LabelSelector, PolicySpec
from gpuwarden.policy.store.intake import hook_point, points_from_processes, points_from_report
from gpuwarden.policy.store.series import Column, HookPoint, PodId, Point, SeriesKey, SeriesStore
from gpuwarden.wire.node import (
    SCHEMA_VERSION,
    AllocationSite,
    GpuSample,
    HookSample,
    NodeReport,
    PodRef,
    ProcessSample,
    Snapshot,
    dump_report,
    parse_report,
)

T0 = 1_749_999_960.0
MI = 2**20
GI = 2**30
CARD = 141 * GI
POD = PodId("ns", "train")
REF = PodRef(namespace="ns", name="train", container="main")
PARAMS = WindowParams()
SECONDS = 600  # ten minutes of 1 s samples: the 4m and 8m spans are covered

Sample = Callable[[int], list[GpuSample]]


def rule(memory: MemorySource, rate_mi_per_min: float = 100) -> MemoryGrowth:
    return MemoryGrowth(
        name="leak",
        rate_bytes_per_second=rate_mi_per_min * MI / 60,
        window_seconds=1800,
        min_fit=0.8,
        memory=memory,
    )


def gpu(uuid: str, used: int, processes: Sequence[ProcessSample]) -> GpuSample:
    return GpuSample(
        uuid=uuid,
        index=int(uuid[-1]),
        memory_used_bytes=used,
        memory_total_bytes=CARD,
        utilization_gpu=90.0,
        pods=[REF],
        processes=list(processes),
    )


def feed(sample: Sample, seconds: int = SECONDS) -> SeriesStore:
    """``seconds`` of 1 s snapshots, sent as a minute's reports through the wire and into a store."""
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    for first in range(0, seconds, 60):
        snapshots = [
            Snapshot(timestamp=T0 + i, gpus=sample(i)) for i in range(first, min(first + 60, seconds))
        ]
        report = NodeReport(
            schema_version=SCHEMA_VERSION, node="n1", agent_id="a", seq=first, snapshots=snapshots
        )
        store.extend(points_from_report(parse_report(dump_report(report))))
    return store


def judge(store: SeriesStore, growth: MemoryGrowth, seconds: int = SECONDS) -> Outcome:
    return evaluate_growth(growth, POD, store.series_of(*POD), T0 + seconds - 1, PARAMS)


def per_minute(outcome: Outcome) -> float:
    assert outcome.value is not None
    return outcome.value * 60 / MI


def caching(allocated: float) -> int:
    """What a caching allocator reserves for ``allocated``: whole 2Gi segments, never given back."""
    return int(math.ceil(allocated / (2 * GI)) * 2 * GI)


def tensor_leak(i: int) -> list[GpuSample]:
    """A loss kept with its graph every step: live tensors grow 200Mi/m over a 20Gi model."""
    allocated = 20 * GI + 200 * MI * i // 60 + (i % 7) * MI  # the step's transient activations
    hook = HookSample(
        timestamp=T0 + i,
        allocated_bytes=allocated,
        reserved_bytes=caching(allocated),
        host_rss_bytes=6 * GI,
    )
    proc = ProcessSample(pid=10, used_memory_bytes=caching(allocated) + 500 * MI, pod=REF, hook=hook)
    return [gpu("GPU-0", caching(allocated) + 500 * MI, [proc])]


def test_allocated_rule_finds_a_tensor_leak_with_its_rate_and_time_to_full() -> None:
    outcome = judge(feed(tensor_leak), rule(MemorySource.ALLOCATED))
    assert outcome.holds
    assert per_minute(outcome) == pytest.approx(200, rel=0.05)
    assert outcome.signal == "allocated"
    assert outcome.message.startswith("allocated memory (live tensors, not the cache) grows 200Mi/m over")
    # The card's total against the newest allocated reading, as for NVML's figure: (141Gi - ~22Gi) / 200Mi/m.
    assert outcome.seconds_to_full == pytest.approx(
        (CARD - (20 * GI + 200 * MI * 599 / 60)) / (200 * MI / 60), rel=0.06
    )
    assert "the card (141Gi) is full in 10h" in outcome.message


def cache_plateau(i: int) -> list[GpuSample]:
    """No leak: live tensors level at 30Gi; the allocator's cache grows in 20Mi segments, 300Mi/m."""
    allocated = 30 * GI + (i % 5) * 64 * MI
    reserved = 32 * GI + 20 * MI * (i * 300 // 20 // 60)
    hook = HookSample(timestamp=T0 + i, allocated_bytes=allocated, reserved_bytes=reserved)
    proc = ProcessSample(pid=10, used_memory_bytes=reserved + 500 * MI, pod=REF, hook=hook)
    return [gpu("GPU-0", reserved + 500 * MI, [proc])]


def test_a_growing_cache_with_flat_tensors_does_not_fire_on_auto() -> None:
    store = feed(cache_plateau)
    auto = judge(store, rule(MemorySource.AUTO))
    assert auto.value is not None
    assert not auto.holds
    assert auto.signal == "allocated"
    assert auto.message.startswith("allocated memory (live tensors, not the cache) is flat")
    # The same samples as NVML and the allocator's cache see them: a leak by their figures.
    for source in (MemorySource.DEVICE, MemorySource.RESERVED):
        seen = judge(store, rule(source))
        assert seen.holds, source
        assert per_minute(seen) == pytest.approx(300, rel=0.1)
    assert judge(store, rule(MemorySource.DEVICE)).message.startswith("GPU memory grows")
    assert judge(store, rule(MemorySource.RESERVED)).message.startswith(
        "reserved memory (the allocator's cache) grows"
    )


def host_leak(i: int) -> list[GpuSample]:
    """A trainer on two GPUs (one pid, its RSS on both entries) leaks 100Mi/m; a helper holds 2Gi."""
    trainer = HookSample(
        timestamp=T0 + i, allocated_bytes=10 * GI, host_rss_bytes=8 * GI + 100 * MI * i // 60
    )
    helper = HookSample(timestamp=T0 + i, allocated_bytes=GI, host_rss_bytes=2 * GI)
    return [
        gpu("GPU-0", 12 * GI, [ProcessSample(pid=10, used_memory_bytes=12 * GI, pod=REF, hook=trainer)]),
        gpu(
            "GPU-1",
            14 * GI,
            [
                ProcessSample(pid=10, used_memory_bytes=12 * GI, pod=REF, hook=trainer),
                ProcessSample(pid=11, used_memory_bytes=2 * GI, pod=REF, hook=helper),
            ],
        ),
    ]


def test_host_rule_counts_each_process_once_and_finds_its_slope() -> None:
    store = feed(host_leak)
    for key, window in store.series_of(*POD):
        hosts = window.values(Column.HOST, 0, len(window))
        assert hosts[0] == 10 * GI, key  # 8Gi + 2Gi: the trainer once, not once per GPU
    outcome = judge(store, rule(MemorySource.HOST, rate_mi_per_min=50))
    assert outcome.holds
    assert per_minute(outcome) == pytest.approx(100, rel=0.05)  # counted twice, it would read 200
    assert outcome.seconds_to_full is None
    assert outcome.total_bytes is None
    assert outcome.gpu_count == 1  # the pod's host memory, judged once
    assert outcome.message.startswith("host memory (the hooked processes and their workers) grows 100Mi/m")
    assert outcome.message.endswith("no memory limit is known, so no time to full")
    assert outcome.reason == "HostMemoryLeakSuspected"  # not the GPU's leak reason


def limited(sample: Sample, trainer: int | None, helper: int | None) -> Sample:
    """``sample`` with each hook reporting its memory limit: pid 10's ``trainer``, the others' ``helper``."""

    def limited_sample(i: int) -> list[GpuSample]:
        gpus = []
        for g in sample(i):
            procs = [
                p.model_copy(
                    update={
                        "hook": p.hook.model_copy(
                            update={"host_limit_bytes": trainer if p.pid == 10 else helper}
                        )
                    }
                )
                if p.hook is not None
                else p
                for p in g.processes
            ]
            gpus.append(g.model_copy(update={"processes": procs}))
        return gpus

    return limited_sample


def test_host_rule_times_the_pods_memory_limit() -> None:
    """Both processes run under the container's 16Gi: the pod's 10Gi grows 100Mi/m toward it."""
    outcome = judge(feed(limited(host_leak, 16 * GI, 16 * GI)), rule(MemorySource.HOST, rate_mi_per_min=50))
    assert outcome.holds
    assert outcome.total_bytes == 16 * GI
    newest = 10 * GI + 100 * MI * 599 // 60
    assert outcome.seconds_to_full == pytest.approx((16 * GI - newest) / (100 * MI / 60), rel=0.05)
    assert re.search(r"100Mi/m over .*; its memory limit \(16Gi\) is reached in 5\dm\d+s$", outcome.message)
    assert outcome.reason == "HostMemoryLeakSuspected"  # 50 minutes: not imminent


@pytest.mark.parametrize(
    ("trainer", "helper"),
    [(16 * GI, 8 * GI), (16 * GI, None), (9 * GI, 9 * GI)],
    ids=["two containers' limits", "an older hook beside", "the sum already over it"],
)
def test_no_one_limit_the_pods_sum_meets_is_no_time_to_full(trainer: int, helper: int | None) -> None:
    outcome = judge(feed(limited(host_leak, trainer, helper)), rule(MemorySource.HOST, rate_mi_per_min=50))
    assert outcome.holds
    assert outcome.total_bytes is None
    assert outcome.seconds_to_full is None
    assert outcome.message.endswith("no memory limit is known, so no time to full")


def test_a_pod_past_its_limit_is_at_it_not_without_one() -> None:
    """The pod's RSS sum passes the limit its hooks report (shared pages counted twice, or the OOM
    killer about to strike): the limit last known stays, and the time left is nil."""
    outcome = judge(
        feed(limited(host_leak, 10 * GI + GI // 2, 10 * GI + GI // 2)), rule(MemorySource.HOST, 50)
    )
    assert outcome.holds
    assert outcome.total_bytes == 10 * GI + GI // 2
    assert outcome.seconds_to_full == 0
    assert outcome.message.endswith("; at its memory limit (10.5Gi)")
    assert outcome.reason == "HostMemoryExhaustionImminent"


def fast_host_leak(i: int) -> list[GpuSample]:
    """A data loader keeping what it reads: 3Gi/m from 4Gi, its container's limit 16Gi (full at 4m)."""
    hook = HookSample(timestamp=T0 + i, host_rss_bytes=4 * GI + 3 * GI * i // 60, host_limit_bytes=16 * GI)
    return [gpu("GPU-0", 12 * GI, [ProcessSample(pid=10, used_memory_bytes=12 * GI, pod=REF, hook=hook)])]


def test_a_host_leak_about_to_reach_its_limit_is_imminent_within_a_minute() -> None:
    """The urgent spans, against the limit as against a card; without a limit (an older hook) no urgency:
    nothing holds before the 4-minute span, when the job would be dead."""
    store = feed(fast_host_leak, 70)
    outcome = judge(store, rule(MemorySource.HOST), 70)
    assert outcome.holds
    assert outcome.reason == "HostMemoryExhaustionImminent"
    assert outcome.seconds_to_full == pytest.approx(
        (16 * GI - (4 * GI + 3 * GI * 69 / 60)) / (3 * GI / 60), rel=0.05
    )
    assert re.search(
        r"grows 3Gi/m over (40s|1m20s), .*; its memory limit \(16Gi\) is reached in 2m", outcome.message
    )

    def unlimited(i: int) -> list[GpuSample]:
        return limited(fast_host_leak, None, None)(i)

    assert not judge(feed(unlimited, 70), rule(MemorySource.HOST), 70).holds


def test_every_other_memory_keeps_the_gpu_leak_reason() -> None:
    assert judge(feed(tensor_leak), rule(MemorySource.ALLOCATED)).reason is None  # the kind's own
    assert rule_type(growth.KIND).reason == "GPUMemoryLeakSuspected"


def unhooked(i: int) -> list[GpuSample]:
    used = 20 * GI + 200 * MI * i // 60
    return [gpu("GPU-0", used, [ProcessSample(pid=10, used_memory_bytes=used, pod=REF)])]


def test_a_memory_the_subject_does_not_report_is_no_data_never_another() -> None:
    store = feed(unhooked)
    for source in (MemorySource.ALLOCATED, MemorySource.RESERVED, MemorySource.HOST):
        outcome = judge(store, rule(source))
        assert outcome.value is None, source
        assert not outcome.holds
        assert not outcome.clears
        assert outcome.message == "no data to judge"
    auto = judge(store, rule(MemorySource.AUTO))
    assert auto.holds
    assert auto.signal == "device"
    assert auto.message.startswith("GPU memory grows 200Mi/m")
    assert not store.series_of(*POD)[0][1].hooked  # no hook columns where no hook ran


def test_a_hook_without_host_readings_leaves_the_host_rule_without_data() -> None:
    outcome = judge(feed(tensor_leak_without_rss), rule(MemorySource.HOST, rate_mi_per_min=1))
    assert outcome.value is None


def tensor_leak_without_rss(i: int) -> list[GpuSample]:
    (sample,) = tensor_leak(i)
    procs = [
        p.model_copy(update={"hook": p.hook and p.hook.model_copy(update={"host_rss_bytes": None})})
        for p in sample.processes
    ]
    return [sample.model_copy(update={"processes": procs})]


SITES = [
    AllocationSite(file="/app/src/train.py", line=88, size_bytes=60 * MI, growth_bytes=50 * MI, count=1200),
    AllocationSite(file="/app/src/metrics.py", line=12, size_bytes=9 * MI, growth_bytes=8 * MI, count=40),
    AllocationSite(
        file="/app/" + "d" * 300 + "/loop.py", line=7, size_bytes=3 * MI, growth_bytes=2 * MI, count=1
    ),
    AllocationSite(file="/app/src/extra.py", line=1, size_bytes=MI, growth_bytes=MI, count=3),
]


def leak_with_sites(i: int) -> list[GpuSample]:
    (sample,) = tensor_leak(i)
    (proc,) = sample.processes
    assert proc.hook is not None
    # Sent in the hook's order (it ranks them); only the newest reading's count.
    sites = SITES if i == SECONDS - 1 else SITES[3:]
    hook = proc.hook.model_copy(update={"sites": sites})
    return [sample.model_copy(update={"processes": [proc.model_copy(update={"hook": hook})]})]


def test_the_message_names_the_top_growing_lines_of_the_newest_reading() -> None:
    outcome = judge(feed(leak_with_sites), rule(MemorySource.ALLOCATED))
    assert outcome.holds
    _, lines = outcome.message.split("; top growing lines: ")
    assert lines.startswith("src/train.py:88 +50Mi (1,200 blocks), src/metrics.py:12 +8Mi (40 blocks), …")
    assert lines.endswith("d/loop.py:7 +2Mi (1 block)")
    assert lines.count(":") == MESSAGE_SITES
    assert "extra.py" not in lines
    assert len(lines) < 200


def test_the_message_keeps_the_hooks_order_not_the_largest_bytes_first() -> None:
    # The hook puts the job's own line (one small tensor a step) before a library line that grew more
    # bytes (what a kept graph holds inside the model's forward): the engine must not re-sort them.
    job = AllocationSite(file="/app/train.py", line=41, size_bytes=MI, growth_bytes=MI // 2, count=300)
    library = AllocationSite(
        file="/usr/lib/python3/site-packages/transformers/models/gpt2/modeling_gpt2.py",
        line=240,
        size_bytes=900 * MI,
        growth_bytes=800 * MI,
        count=9000,
    )

    def ranked(i: int) -> list[GpuSample]:
        (sample,) = tensor_leak(i)
        (proc,) = sample.processes
        assert proc.hook is not None
        hook = proc.hook.model_copy(update={"sites": [job, library]})
        return [sample.model_copy(update={"processes": [proc.model_copy(update={"hook": hook})]})]

    outcome = judge(feed(ranked), rule(MemorySource.ALLOCATED))
    assert outcome.holds
    _, lines = outcome.message.split("; top growing lines: ")
    assert lines == "app/train.py:41 +512Ki (300 blocks), gpt2/modeling_gpt2.py:240 +800Mi (9,000 blocks)"


def test_the_message_says_what_each_gpu_line_holds_before_the_growing_host_lines() -> None:
    # While the allocator's history is recorded (docs/hook.md, "Requests"), the hook's GPU lines come
    # first: what each line holds on the card and how fast it grew, the frameless blocks by that name.
    gpu = AllocationSite(
        file="/app/train.py",
        line=35,
        size_bytes=int(41.2 * GI),
        growth_bytes=40 * GI,
        count=300,
        memory="gpu",
        growth_bytes_per_minute=int(36.9 * GI),
    )
    frameless = AllocationSite(
        file="<no Python frames>", line=0, size_bytes=312 * MI, growth_bytes=0, count=9, memory="gpu"
    )
    host = AllocationSite(file="/app/train.py", line=36, size_bytes=MI, growth_bytes=MI // 2, count=300)

    def lined(i: int) -> list[GpuSample]:
        (sample,) = tensor_leak(i)
        (proc,) = sample.processes
        assert proc.hook is not None
        hook = proc.hook.model_copy(update={"sites": [gpu, frameless, host]})
        return [sample.model_copy(update={"processes": [proc.model_copy(update={"hook": hook})]})]

    outcome = judge(feed(lined), rule(MemorySource.ALLOCATED))
    assert outcome.holds
    assert outcome.message.endswith(
        "; on the GPU by line: app/train.py:35 holds 41.2Gi (+36.9Gi/m), <no Python frames> holds 312Mi"
        "; top growing lines: app/train.py:36 +512Ki (300 blocks)"
    )


def test_two_processes_sites_are_merged_rank_by_rank_each_keeping_its_hooks_order() -> None:
    def process(pid: int, *lines: int) -> ProcessSample:
        sites = [
            AllocationSite(file=f"/app/rank{pid}.py", line=n, size_bytes=n * MI, growth_bytes=n * MI, count=n)
            for n in lines
        ]
        hook = HookSample(timestamp=T0, allocated_bytes=GI, sites=sites)
        return ProcessSample(pid=pid, used_memory_bytes=2 * GI, hook=hook)

    # Each hook put a small line first (its job's own): neither may lose it to the other's larger lines.
    point = hook_point([process(1, 1, 90, 80), process(2, 2, 70)], None)
    assert [(s.file, s.line) for s in point.sites] == [
        ("/app/rank1.py", 1),
        ("/app/rank2.py", 2),
        ("/app/rank1.py", 90),
    ]


def test_a_finding_and_its_event_text_carry_the_memory_and_the_lines() -> None:
    spec = PolicySpec(
        selector=LabelSelector(),
        rules=(rule(MemorySource.AUTO),),
        actions=Actions(),
    )
    evaluator = PolicyEvaluator("ns/p", spec, namespace="ns")
    store = feed(leak_with_sites)
    result = evaluator.evaluate([PodView("ns", "train", {}, {})], store, T0 + SECONDS - 1)
    (started,) = result.transitions
    assert started.transition is Transition.STARTED
    assert started.finding.message.startswith("allocated memory (live tensors, not the cache) grows")
    assert "top growing lines: src/train.py:88 +50Mi (1,200 blocks)" in started.finding.message


def test_auto_reads_device_once_the_hook_is_gone_for_a_window() -> None:
    store = SeriesStore(retention_seconds=4000, max_points=4000)
    key = SeriesKey(*POD, "GPU-0")
    for i in range(2400):
        hook = HookPoint(allocated=float(GI)) if i < 300 else None
        store.add(key, Point(T0 + i, mem_used=20 * GI + 200 * MI * i / 60, mem_total=CARD, hook=hook))
    at = evaluate_growth(rule(MemorySource.AUTO), POD, store.series_of(*POD), T0 + 2399, PARAMS)
    assert at.signal == "device"
    assert at.holds


def test_local_mode_subjects_carry_their_hook() -> None:
    (sample,) = leak_with_sites(SECONDS - 1)
    ((key, point),) = points_from_processes(Snapshot(timestamp=T0, gpus=[sample]))
    assert key.pod == "pid/10"
    assert point.hook is not None
    assert point.hook.allocated == float(sample.processes[0].hook.allocated_bytes or 0)  # type: ignore[union-attr]
    assert point.hook.host == 6 * GI
    assert [s.line for s in point.hook.sites] == [88, 12, 7]
    assert point.hook.host_limit is None  # the hook sent none
    (with_limit,) = limited(leak_with_sites, 16 * GI, None)(SECONDS - 1)
    ((_, point),) = points_from_processes(Snapshot(timestamp=T0, gpus=[with_limit]))
    assert point.hook is not None
    assert point.hook.host_limit == 16 * GI


def test_on_a_shared_gpu_each_pod_gets_its_own_processes_hook_readings() -> None:
    other = PodRef(namespace="ns", name="notebook")
    hooked = HookSample(timestamp=T0, allocated_bytes=3 * GI, reserved_bytes=4 * GI, host_rss_bytes=GI)
    shared = GpuSample(
        uuid="GPU-0",
        index=0,
        memory_used_bytes=20 * GI,
        memory_total_bytes=CARD,
        pods=[REF, other],
        processes=[
            ProcessSample(pid=10, used_memory_bytes=5 * GI, pod=REF, hook=hooked),
            ProcessSample(pid=11, used_memory_bytes=GI, pod=REF, hook=hooked),
            ProcessSample(pid=20, used_memory_bytes=8 * GI, pod=other, hook=hooked),
            ProcessSample(pid=21, used_memory_bytes=6 * GI, pod=other),
        ],
    )
    report = NodeReport(
        schema_version=SCHEMA_VERSION,
        node="n1",
        agent_id="a",
        seq=0,
        snapshots=[Snapshot(timestamp=T0, gpus=[shared])],
    )
    points = {key.pod: point for key, point in points_from_report(report)}
    train, notebook = points["train"].hook, points["notebook"].hook
    assert train is not None
    assert notebook is not None
    assert (train.allocated, train.reserved, train.host) == (6 * GI, 8 * GI, 2 * GI)
    # One notebook process runs no hook: its GPU sums are unknown; its host memory is the hooked one's.
    assert (notebook.allocated, notebook.reserved, notebook.host) == (None, None, GI)

"""Schema versions 3, 5, 7 and 8: the hook's block on a process entry (5: its host memory limit; 7: GPU
lines; 8: the hooks' replies to the operator's asks, and the asks themselves), and what older versions
may not carry."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gpuwarden.wire.node import (
    SCHEMA_VERSION,
    AllocationSite,
    AsksError,
    GpuSample,
    HookAsk,
    HookReply,
    HookSample,
    NodeReport,
    PodRef,
    ProcessSample,
    ReportError,
    Snapshot,
    dump_asks,
    dump_report,
    parse_asks,
    parse_report,
)

T0 = 1_764_770_000.0
HOOK = HookSample(
    timestamp=T0,
    step=1200,
    allocated_bytes=20 * 2**30,
    reserved_bytes=24 * 2**30,
    max_allocated_bytes=22 * 2**30,
    host_rss_bytes=6 * 2**30,
    sites=[
        AllocationSite(file="train.py", line=88, size_bytes=50 * 2**20, growth_bytes=49 * 2**20, count=1200)
    ],
)


def report(version: int, hook: HookSample | None) -> bytes:
    process = ProcessSample(pid=4242, used_memory_bytes=24 * 2**30, hook=hook)
    snapshot = Snapshot(timestamp=T0, gpus=[GpuSample(uuid="GPU-0", index=0, processes=[process])])
    built = NodeReport(schema_version=version, node="n", agent_id="a", seq=0, snapshots=[snapshot])
    return dump_report(built)


def test_this_build_sends_version_8_and_the_hook_block_round_trips() -> None:
    assert SCHEMA_VERSION == 8
    body = report(3, HOOK)
    assert b'"allocatedBytes":21474836480' in body
    assert b'"growthBytes"' in body
    assert parse_report(body).snapshots[0].gpus[0].processes[0].hook == HOOK


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_version_is_accepted_without_the_block_and_refused_with_it(version: int) -> None:
    assert parse_report(report(version, None)).schema_version == version
    with pytest.raises(ReportError, match=f"hook: not part of schemaVersion {version}"):
        parse_report(report(version, HOOK))


@pytest.mark.parametrize(
    ("original", "bad", "field"),
    [
        (b'"line":88', b'"line":-1', "line"),
        (b'"count":1200', b'"count":1.5', "count"),
        (b'"file":"train.py"', b'"file":""', "file"),
        (b'"step":1200', b'"step":1200,"pid":1', "pid"),  # a hook cannot name a process
    ],
)
def test_the_block_is_parsed_strictly_naming_the_field(original: bytes, bad: bytes, field: str) -> None:
    body = report(3, HOOK)
    assert original in body
    with pytest.raises(ReportError, match=field):
        parse_report(body.replace(original, bad))


def test_at_most_sixteen_sites() -> None:
    many = HOOK.sites * 17
    with pytest.raises(ValueError, match="sites"):
        HookSample(timestamp=T0, sites=many)


def test_a_claim_is_part_of_version_4_only() -> None:
    claimed = PodRef(namespace="ns", name="p", container="c", claim="gpu")
    snapshot = Snapshot(timestamp=T0, gpus=[GpuSample(uuid="GPU-0", index=0, pods=[claimed])])
    for version in (3, 4):
        body = dump_report(
            NodeReport(schema_version=version, node="n", agent_id="a", seq=0, snapshots=[snapshot])
        )
        if version == 4:
            assert parse_report(body).snapshots[0].gpus[0].pods == [claimed]
        else:
            with pytest.raises(ReportError, match="claim: not part of schemaVersion 3"):
                parse_report(body)


def test_the_host_memory_limit_is_part_of_version_5_only() -> None:
    limited = HOOK.model_copy(update={"host_limit_bytes": 16 * 2**30})
    assert b'"hostLimitBytes":17179869184' in report(5, limited)
    assert parse_report(report(5, limited)).snapshots[0].gpus[0].processes[0].hook == limited
    assert parse_report(report(4, HOOK)).schema_version == 4  # an older agent's hook block, without it
    with pytest.raises(ReportError, match="hostLimitBytes: not part of schemaVersion 4"):
        parse_report(report(4, limited))


def test_gpu_lines_are_part_of_version_7_only() -> None:
    """GPU bytes by line (the allocator's history, docs/hook.md "Requests"): a site with ``memory``."""
    gpu = AllocationSite(
        file="train.py",
        line=35,
        size_bytes=41 * 2**30,
        growth_bytes=40 * 2**30,
        count=300,
        memory="gpu",
        growth_bytes_per_minute=37 * 2**30,
    )
    lined = HOOK.model_copy(update={"sites": [gpu, *HOOK.sites]})
    body = report(7, lined)
    assert b'"memory":"gpu","growthBytesPerMinute":39728447488' in body
    assert parse_report(body).snapshots[0].gpus[0].processes[0].hook == lined
    assert b'"memory"' not in report(6, HOOK)  # a host site is as before
    with pytest.raises(ReportError, match="GPU lines are not part of schemaVersion 6"):
        parse_report(report(6, lined))
    with pytest.raises(ReportError, match="memory"):
        parse_report(body.replace(b'"memory":"gpu"', b'"memory":"host"'))


@pytest.mark.parametrize("limit", [-1, 2**50 + 1, 1.5])
def test_the_host_memory_limit_is_a_bounded_byte_count(limit: float) -> None:
    body = report(5, HOOK).replace(
        b'"hostRssBytes"', b'"hostLimitBytes":' + str(limit).encode() + b',"hostRssBytes"'
    )
    with pytest.raises(ReportError, match="hostLimitBytes"):
        parse_report(body)


@pytest.mark.parametrize("name", ["GPU claim", "gpu\nWarning: fake", "-gpu", "Gpu"])
def test_a_claim_is_a_kubernetes_object_name(name: str) -> None:
    # it reaches Event text: nothing but a name a ResourceClaim could have
    with pytest.raises(ValidationError):
        PodRef(namespace="ns", name="p", claim=name)


REPLY = HookReply(
    id=7,
    namespace="ml",
    pod="train-0",
    pid=4242,
    op="snapshot",
    status="ok",
    file="/data/snaps/gpuwarden-snapshot-4242-1.pickle",
    size_bytes=3 * 2**20,
    sites=[
        AllocationSite(
            file="train.py", line=35, size_bytes=18 * 2**30, growth_bytes=17 * 2**30, count=90, memory="gpu"
        )
    ],
)


def replied(version: int) -> bytes:
    snapshot = Snapshot(timestamp=T0, gpus=[GpuSample(uuid="GPU-0", index=0)], hook_replies=[REPLY])
    return dump_report(
        NodeReport(schema_version=version, node="n", agent_id="a", seq=0, snapshots=[snapshot])
    )


def test_the_hooks_replies_are_part_of_version_8_only() -> None:
    body = replied(8)
    assert b'"hookReplies":[{"status":"ok"' in body
    assert parse_report(body).snapshots[0].hook_replies == [REPLY]
    with pytest.raises(ReportError, match="hookReplies: not part of schemaVersion 7"):
        parse_report(replied(7))
    with pytest.raises(ReportError, match="op"):
        parse_report(body.replace(b'"op":"snapshot"', b'"op":"format"'))


def test_the_asks_round_trip_and_a_bad_one_names_its_field() -> None:
    asks = [HookAsk(id=1, namespace="ml", pod="train-0", gpus=["GPU-0"], op="record")]
    assert parse_asks(json.loads(dump_asks(asks))) == asks
    assert parse_asks(None) == []
    with pytest.raises(AsksError, match=r"hookAsks\.0\.op"):
        parse_asks([{"id": 1, "namespace": "ml", "pod": "p", "op": "delete"}])
    with pytest.raises(AsksError, match="hookAsks"):
        parse_asks([{"id": 1, "namespace": "ml", "pod": "p", "op": "record"}] * 17)

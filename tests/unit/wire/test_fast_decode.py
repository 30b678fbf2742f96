"""The operator's fast decoder (gpuwarden/wire/fast.py) answers every body as parse_report does: what
its msgspec mirror takes, pydantic takes too, with the same values; what it refuses, parse_report
answers (its own message, or its models)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gpuwarden.wire.fast import decode_report
from gpuwarden.wire.node import (
    SCHEMA_VERSION,
    AllocationSite,
    DeviceState,
    GpuHealth,
    GpuSample,
    HookSample,
    NodeReport,
    PodRef,
    ProcessSample,
    ReportError,
    Snapshot,
    XidEvent,
    dump_report,
    parse_report,
)
from gpuwarden.wire.scrape import ServiceCounter, ServiceSample

T0 = 1_764_770_000.0
POD = PodRef(namespace="team-a", name="train-0", container="main", claim="gpu-claim-0")
FULL = NodeReport(
    schema_version=SCHEMA_VERSION,
    node="gpu-node-1",
    agent_id="agent-1",
    seq=7,
    snapshots=[
        Snapshot(
            timestamp=T0,
            gpus=[
                GpuSample(
                    uuid="GPU-0",
                    index=0,
                    model="NVIDIA H200",
                    utilization_gpu=55.5,
                    sm_active=50.0,
                    sm_occupancy=20.0,
                    tensor_active=10.0,
                    dram_active=5.0,
                    memory_used_bytes=60 * 2**30,
                    memory_total_bytes=141 * 2**30,
                    temperature_c=54.0,
                    power_watts=350.0,
                    sm_clock_mhz=1980,
                    ecc_uncorrected=0,
                    health=GpuHealth(
                        xids=[XidEvent(code=79, timestamp=T0 - 1)],
                        ecc_uncorrected_aggregate=0,
                        remapped_rows_uncorrectable=0,
                        row_remap_pending=False,
                        row_remap_failed=False,
                        clock_event_reasons=[],
                    ),
                    pods=[POD],
                    processes=[
                        ProcessSample(
                            pid=4242,
                            used_memory_bytes=24 * 2**30,
                            sm_util=40.0,
                            command="python train.py",
                            pod=POD,
                            hook=HookSample(
                                timestamp=T0,
                                step=1200,
                                allocated_bytes=20 * 2**30,
                                host_rss_bytes=6 * 2**30,
                                host_limit_bytes=64 * 2**30,
                                sites=[
                                    AllocationSite(
                                        file="train.py", line=88, size_bytes=1, growth_bytes=1, count=3
                                    ),
                                    # A GPU line (schema 7), while the allocator's history is recorded.
                                    AllocationSite(
                                        file="train.py",
                                        line=35,
                                        size_bytes=41 * 2**30,
                                        growth_bytes=2**30,
                                        count=12,
                                        memory="gpu",
                                        growth_bytes_per_minute=37 * 2**30,
                                    ),
                                ],
                            ),
                        )
                    ],
                ),
                GpuSample(uuid="GPU-1", index=1, mig_id="MIG-1", state=DeviceState.LOST),
            ],
        )
    ],
)
BODY = dump_report(FULL)


def tree(value: Any) -> Any:
    """A report's values, whichever decoder made it: fields by name, with each leaf's type."""
    if isinstance(value, BaseModel):
        return {name: tree(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, msgspec.Struct):
        return {name: tree(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list):
        return [tree(v) for v in value]
    return (type(value).__name__, value)


def mirrored(body: bytes) -> Any:
    """decode_report's answer when the mirror took ``body`` (the fast path), else None."""
    try:
        decoded = decode_report(body)
    except ReportError:
        return None
    return decoded if isinstance(decoded, msgspec.Struct) else None


def answer(decode: Any, body: bytes) -> Any:
    """What ``decode`` makes of ``body``: its values, or its refusal's message."""
    try:
        return tree(decode(body))
    except ReportError as exc:
        return ("refused", str(exc))


def same_answer(body: bytes) -> None:
    """decode_report answers as parse_report does, and the mirror takes nothing that pydantic refuses."""
    assert answer(decode_report, body) == answer(parse_report, body), body[:300]


def test_a_full_report_is_decoded_by_the_mirror_with_pydantic_s_values() -> None:
    decoded = mirrored(BODY)
    assert decoded is not None  # the fast path, not the fallback
    assert tree(decoded) == tree(parse_report(BODY))
    assert decoded.snapshots[0].gpus[1].state is FULL.snapshots[0].gpus[1].state


def test_what_the_mirror_cannot_take_pydantic_answers() -> None:
    # snake_case names: pydantic takes them (validate_by_name), the mirror does not.
    snake = BODY.replace(b'"agentId"', b'"agent_id"')
    assert mirrored(snake) is None
    assert tree(decode_report(snake)) == tree(parse_report(snake))
    # A scrape: its model checks itself (validators), so the mirror takes none.
    scraped = FULL.model_copy(
        update={
            "snapshots": [
                FULL.snapshots[0].model_copy(
                    update={
                        "services": [
                            ServiceSample(
                                namespace="team-a",
                                name="train-0",
                                uid="u",
                                at=T0,
                                counters=[ServiceCounter(name="tokens_total", value=5.0)],
                            )
                        ]
                    }
                )
            ]
        }
    )
    body = dump_report(scraped)
    decoded = mirrored(body)
    assert decoded is not None  # the fast path, the scrapes validated by pydantic
    assert tree(decoded) == tree(parse_report(body))
    assert decoded.snapshots[0].services == scraped.snapshots[0].services
    # Whatever stands there, pydantic answers it.
    # A failed scrape with a metric (its model's own check), and 257 of them (past the field's bound).
    failed = b'{"namespace":"a","name":"b","uid":"u","at":1.0,"error":"Timeout"'
    bad = b"[" + failed + b',"counters":[{"name":"c","value":1}]}]'
    many = b"[" + b",".join([failed + b"}"] * 257) + b"]"
    for services in (
        b"[]",
        b"[null]",
        b"[{}]",
        b"{}",
        b"1",
        b"null",
        bad,
        many,
    ):
        same_answer(BODY.replace(b'"podHostMemory":[]', b'"podHostMemory":[],"services":' + services, 1))


@pytest.mark.parametrize(
    "bad",
    [
        b'"claim":"gpu-claim-0\\n"',  # Python's `$` would take a final newline; pydantic's does not
        b'"claim":"Gpu-claim"',
        b'"claim":""',
        b'"claim":null,"claim":"x!"',
    ],
)
def test_the_claim_pattern_refuses_what_pydantic_refuses(bad: bytes) -> None:
    body = BODY.replace(b'"claim":"gpu-claim-0"', bad, 1)
    assert body != BODY
    same_answer(body)
    assert answer(decode_report, body)[0] == "refused"


def paths(document: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every value's path in a JSON document."""
    out = [at]
    if isinstance(document, dict):
        for key, value in document.items():
            out += paths(value, (*at, key))
    elif isinstance(document, list):
        for i, value in enumerate(document):
            out += paths(value, (*at, i))
    return out


DOCUMENT = json.loads(BODY)
PATHS = paths(DOCUMENT)[1:]
ODD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.0,
    0.5,
    -0.0,
    1e308,
    -1e308,
    10**30,
    10**4000,
    2**53,
    2**53 + 1,
    2**63,
    2**64,
    "",
    "1",
    "x" * 254,
    "ok",
    "lost",
    "gpuIdle",
    "abc\n",
    "\ud800",
    [],
    {},
]


def replaced(path: tuple[Any, ...], value: Any) -> bytes:
    document = json.loads(BODY)
    *parents, last = path
    node = document
    for step in parents:
        node = node[step]
    node[last] = value
    return json.dumps(document).encode()


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PATHS), st.sampled_from(ODD))
def test_a_value_replaced_is_answered_as_parse_report_answers(path: tuple[Any, ...], value: Any) -> None:
    same_answer(replaced(path, value))


def wire_names(model: type[BaseModel]) -> set[str]:
    """Every field name of ``model`` and the models it holds, on the wire and in Python."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names |= {name, info.alias or name}
        for held in (info.annotation, *getattr(info.annotation, "__args__", ())):
            for inner in (held, *getattr(held, "__args__", ())):
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner is not model:
                    names |= wire_names(inner)
    return names


NAMES = sorted(wire_names(NodeReport) | {"unknownField"})


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(PATHS), st.sampled_from(NAMES), st.sampled_from([*ODD, 1, 50.0, "x", [1]]))
def test_a_key_added_is_answered_as_parse_report_answers(path: tuple[Any, ...], key: str, value: Any) -> None:
    # Into the object holding ``path`` (a duplicate key when it is already there; junk in a list).
    added = b'"PLACE", %s: %s' % (json.dumps(key).encode(), json.dumps(value).encode())
    same_answer(replaced(path, "PLACE").replace(b'"PLACE"', added, 1))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"])
def test_non_finite_numbers_are_refused_alike(literal: bytes) -> None:
    body = BODY.replace(b'"utilizationGpu":55.5', b'"utilizationGpu":' + literal, 1)
    assert body != BODY
    same_answer(body)
    assert answer(decode_report, body)[0] == "refused"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"{", b"\xef\xbb\xbf{"),  # a byte order mark
        (b"{", b" \n\t{"),
        (b'"node":"gpu-node-1"', b'"node":"gpu-node-\\u0031"'),
        (b'"node":"gpu-node-1"', b'"node":"\xff"'),  # not UTF-8
        (b'"seq":7', b'"seq":7.0'),
        (b'"seq":7', b'"seq":-0'),
        (b"55.5", b"5.55e1"),
        (b"55.5", b"1E2"),
        (b"55.5", b"100.0000000000000001"),  # rounds to the bound
        (b"55.5", b"100.00000000000002"),  # the next float past it
    ],
)
def test_json_spellings_are_answered_alike(old: bytes, new: bytes) -> None:
    body = BODY.replace(old, new, 1)
    assert body != BODY
    same_answer(body)
    same_answer(body + b" x")  # trailing bytes

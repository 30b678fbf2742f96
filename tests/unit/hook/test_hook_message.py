"""The hook's line matches docs/hook.md (its example and its table) and what gpuwarden's schema takes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpuwarden.hook import DeviceMemory, Reading, Site, encode_line
from gpuwarden.hook.message import MAX_LINE_BYTES, Answer
from gpuwarden.wire.node import AllocationSite, HookSample

DOC = (Path(__file__).resolve().parents[3] / "docs" / "hook.md").read_text()

FULL = Reading(
    timestamp=1764770000.5,
    step=1200,
    devices=(DeviceMemory("GPU-5f1c", 21474836480, 25769803776, 23622320128),),
    host_rss_bytes=6442450944,
    host_limit_bytes=17179869184,
    sites=(Site("train.py", 88, 52428800, 52000000, 1200),),
    requests=1,
    answers=(Answer(7, "ok"),),
)


def doc_example() -> dict[str, Any]:
    block = re.search(r"### Messages.*?```json\n(.*?)```", DOC, re.S)
    assert block, "docs/hook.md has no JSON example under Messages"
    example: dict[str, Any] = json.loads(block.group(1))
    return example


def doc_fields() -> dict[str, str]:
    """The table's rows: field name (``devices[]`` as ``devices``) -> meaning."""
    table = DOC.split("| field | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([A-Za-z]+)(?:\[\])?` \| (.*) \|$", table, re.M)
    return dict(rows)


def emitted(reading: Reading) -> dict[str, Any]:
    line = encode_line(reading)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    message: dict[str, Any] = json.loads(line)
    return message


def test_the_full_line_has_the_doc_examples_fields_and_types() -> None:
    example, line = doc_example(), emitted(FULL)

    def shape(obj: dict[str, Any]) -> dict[str, type]:
        return {k: type(v) for k, v in obj.items()}

    assert shape(line) == shape(example)
    assert shape(line["devices"][0]) == shape(example["devices"][0])
    assert shape(line["sites"][0]) == shape(example["sites"][0])
    assert line["v"] == 1


def test_every_field_of_the_doc_table_is_sent_with_its_sub_fields() -> None:
    fields, line = doc_fields(), emitted(FULL)
    assert set(fields) == set(line)
    for parent in ("devices", "sites", "answers"):
        named = set(re.findall(r"`([A-Za-z]+)`", fields[parent]))
        sent = set(line[parent][0])
        assert sent <= named, f"{parent}: sent {sent - named} that the table does not name"
        assert sent - {"uuid", "file", "line"} <= named


def test_gpuwarden_schema_takes_the_line_strictly() -> None:
    line = emitted(FULL)
    device = line["devices"][0]
    sample = HookSample.model_validate(
        {
            "timestamp": line["timestamp"],
            "step": line["step"],
            "allocatedBytes": device["allocatedBytes"],
            "reservedBytes": device["reservedBytes"],
            "maxAllocatedBytes": device["maxAllocatedBytes"],
            "hostRssBytes": line["hostRssBytes"],
            "hostLimitBytes": line["hostLimitBytes"],
            "sites": line["sites"],
        },
        strict=True,
    )
    assert sample.sites == [AllocationSite(file="train.py", line=88, size_bytes=52428800,
                                           growth_bytes=52000000, count=1200)]  # fmt: skip
    assert sample.allocated_bytes == 21474836480
    assert sample.host_limit_bytes == 16 * 2**30


def test_what_was_not_read_is_left_out() -> None:
    line = emitted(Reading(timestamp=1764770000.0, devices=(DeviceMemory("MIG-1"),)))
    assert line == {"v": 1, "timestamp": 1764770000.0, "devices": [{"uuid": "MIG-1"}]}
    assert isinstance(line["timestamp"], float)
    assert emitted(Reading(timestamp=1.0, sites=()))["sites"] == []  # tracemalloc on, nothing grew


def test_limits_hold_whatever_the_paths() -> None:
    long_path = "/" + "d" * 5000 + "/train.py"
    sites = tuple(Site(long_path, n, 10, 10 - n % 10, 1) for n in range(40))
    devices = tuple(DeviceMemory(f"GPU-{n}", 1, 1, 1) for n in range(100))
    line = encode_line(Reading(timestamp=1.0, devices=devices, sites=sites))
    assert len(line) <= MAX_LINE_BYTES
    message = json.loads(line)
    assert len(message["devices"]) == 64
    assert len(message["sites"]) == 16
    assert all(len(s["file"]) == 1024 and s["file"].endswith("/train.py") for s in message["sites"])
    AllocationSite.model_validate(message["sites"][0], strict=True)

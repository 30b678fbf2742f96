"""Issue 19's fuzzer on the whole path, bounded for CI: generated requests through the real aiohttp
app into intake, the series store, an evaluation and the metrics exposition (see
ingest_fuzz_support for the invariants). A longer, random run: bench/fuzz_ingest.py."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from ingest_fuzz_support import START, Case, HarnessRunner, cases

from gpuwarden.operator.admission import MAX_FUTURE_SKEW, MAX_REPORT_AGE
from gpuwarden.wire.base import MAX_BYTES, MAX_COUNT, MAX_TIMESTAMP

_seqs = itertools.count(1)


@pytest.fixture(scope="module")
def operator() -> Iterator[HarnessRunner]:
    runner = HarnessRunner()
    yield runner
    runner.close()


# One operator for every example, as in production: what one request leaves behind must not hurt
# the next. Derandomized and bounded: the same 150 cases every run, in a few seconds.
@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases())
def test_no_request_breaks_ingestion_evaluation_or_metrics(operator: HarnessRunner, case: Case) -> None:
    operator.check(case)


def test_the_cases_reach_every_answer(operator: HarnessRunner) -> None:
    """The fuzzer is worth its time only if its cases get past each check (ran after the one above)."""
    harness = operator.harness
    assert set(harness.statuses) >= {200, 400, 401, 403, 404}, harness.statuses
    taken = harness.op.parts.metrics.registry.get_sample_value
    assert (taken("gpuwarden_operator_verdicts_received_total", {"result": "ok"}) or 0) > 0
    get = harness.op.parts.metrics.registry.get_sample_value
    refused = {
        reason: get("gpuwarden_operator_points_refused_total", {"reason": reason}) or 0
        for reason in ("future", "past", "foreignPod", "unknownPod")
    }
    assert sum(refused.values()) > 0, (refused, harness.statuses)
    assert (get("gpuwarden_operator_points_total") or 0) > harness.good_seq  # the cases' own, too


BASE: dict[str, Any] = {
    "schemaVersion": 3,
    "node": "node-1",
    "agentId": "extremes",
    "seq": 0,
    "snapshots": [
        {
            "timestamp": 0.0,
            "gpus": [
                {
                    "uuid": "GPU-a",
                    "index": 0,
                    "utilizationGpu": 10.0,
                    "smActive": 10.0,
                    "memoryUsedBytes": 2**30,
                    "memoryTotalBytes": 2**36,
                    "temperatureC": 40.0,
                    "powerWatts": 100.0,
                    "smClockMhz": 1000,
                    "eccUncorrected": 0,
                    "health": {
                        "xids": [{"code": 79, "timestamp": 0.0}],
                        "eccUncorrectedAggregate": 0,
                        "retiredPagesDoubleBit": 0,
                        "remappedRowsUncorrectable": 0,
                        "clockEventReasons": ["swThermalSlowdown"],
                    },
                    "pods": [{"namespace": "ns", "name": "fuzz"}],
                    "processes": [
                        {
                            "pid": 1,
                            "usedMemoryBytes": 2**30,
                            "smUtil": 10.0,
                            "pod": {"namespace": "ns", "name": "fuzz"},
                            "hook": {
                                "timestamp": START,
                                "step": 1,
                                "allocatedBytes": 1,
                                "reservedBytes": 1,
                                "maxAllocatedBytes": 1,
                                "hostRssBytes": 1,
                                "sites": [
                                    {"file": "a.py", "line": 1, "sizeBytes": 1, "growthBytes": 1, "count": 1}
                                ],
                            },
                        }
                    ],
                }
            ],
            "podHostMemory": [{"namespace": "ns", "name": "fuzz", "memoryBytes": 1}],
        }
    ],
}
GPU_PATH = ("snapshots", 0, "gpus", 0)
PROC_PATH = (*GPU_PATH, "processes", 0)
TIMES = [MAX_TIMESTAMP, 1e12, 1e-300, START + MAX_FUTURE_SKEW + 1, START - MAX_REPORT_AGE - 1]
"""Every timestamp at the schema's bounds and just past the operator's (absolute, not offsets)."""
EXTREMES: list[tuple[tuple[Any, ...], Any]] = [
    *(((*GPU_PATH, "health", "xids", 0, "timestamp"), t) for t in TIMES),
    *(((*PROC_PATH, "hook", "timestamp"), t) for t in TIMES),
    *(((*GPU_PATH, "health", "xids", 0, "code"), c) for c in (0, 2**32 - 1)),
    *(((*GPU_PATH, field), v) for field in ("utilizationGpu", "smActive") for v in (0.0, 100.0)),
    *(((*GPU_PATH, field), v) for field in ("memoryUsedBytes", "memoryTotalBytes") for v in (0, MAX_BYTES)),
    *(((*GPU_PATH, "temperatureC"), v) for v in (-273.15, 1000.0)),
    *(((*GPU_PATH, "powerWatts"), v) for v in (0.0, 100_000.0)),
    *(((*GPU_PATH, "smClockMhz"), v) for v in (0, 100_000)),
    *(((*GPU_PATH, "index"), v) for v in (0, 4096)),
    *(((*GPU_PATH, "eccUncorrected"), v) for v in (0, MAX_COUNT)),
    *(
        ((*GPU_PATH, "health", field), v)
        for field in ("eccUncorrectedAggregate", "retiredPagesDoubleBit", "remappedRowsUncorrectable")
        for v in (0, MAX_COUNT)
    ),
    *(((*PROC_PATH, field), v) for field, v in (("pid", 2**31 - 1), ("usedMemoryBytes", MAX_BYTES))),
    *(
        ((*PROC_PATH, "hook", field), v)
        for field in ("step", "allocatedBytes", "reservedBytes", "maxAllocatedBytes", "hostRssBytes")
        for v in (0, MAX_BYTES)
    ),
    (("seq",), MAX_COUNT),
]


@pytest.mark.parametrize(("path", "value"), EXTREMES, ids=lambda v: str(v)[-40:])
def test_each_fields_extremes_go_through_a_whole_round(
    operator: HarnessRunner, path: tuple[Any, ...], value: Any
) -> None:
    """Issue 27 (2): no value that parses raises in an evaluation round, on the readings' path or the
    health path (a gpuHealth and a utilization rule with throttling, the node view, the Events)."""
    # The snapshot at the clock's time; the mutated value absolute, as a forger would send it.
    report = json.loads(json.dumps(BASE))
    report["seq"] = next(_seqs)
    operator.check(Case("node-1", report, (path, value), b"", "identity"))

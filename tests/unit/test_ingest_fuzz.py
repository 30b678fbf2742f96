"""Issue 19's fuzzer on the whole path, bounded for CI: generated requests through the real aiohttp
app into intake, the series store, an evaluation and the metrics exposition (see
ingest_fuzz_support for the invariants). A longer, random run: bench/fuzz_ingest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from ingest_fuzz_support import Case, HarnessRunner, cases


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
    assert set(harness.statuses) >= {200, 400, 401, 403}, harness.statuses
    get = harness.state.metrics.registry.get_sample_value
    refused = {
        reason: get("gpuwarden_operator_points_refused_total", {"reason": reason})
        for reason in ("future", "past", "foreignPod", "unknownPod")
    }
    assert sum(refused.values()) > 0, (refused, harness.statuses)
    assert (get("gpuwarden_operator_points_total") or 0) > harness.good_seq  # the cases' own, too

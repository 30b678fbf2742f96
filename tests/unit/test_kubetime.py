"""Kubernetes' RFC 3339 times: the two forms written, and what readers accept or refuse."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpuwarden.kubetime import format_micro_time, format_time, parse_epoch, parse_time

T0 = datetime(2026, 12, 3, 8, 0, 5, 250_000, tzinfo=UTC).timestamp()


def test_time_is_utc_whole_seconds_with_z() -> None:
    assert format_time(T0) == "2026-12-03T08:00:05Z"


def test_micro_time_keeps_the_microseconds() -> None:
    assert format_micro_time(T0) == "2026-12-03T08:00:05.250000Z"


@pytest.mark.parametrize("text", [format_time(T0), format_micro_time(T0)])
def test_what_is_written_reads_back(text: str) -> None:
    assert parse_epoch(text) == pytest.approx(T0, abs=1.0)


def test_an_offset_is_honoured_and_no_offset_means_utc() -> None:
    assert parse_time("2026-12-03T09:00:00+01:00") == datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
    # An aware datetime never equals a naive one, so this also says the naive text came back aware.
    assert parse_time("2026-12-03T08:00:00") == datetime(2026, 12, 3, 8, 0, tzinfo=UTC)


@pytest.mark.parametrize("text", ["", "yesterday", "2026-13-01T00:00:00Z", None, 1_700_000_000, ["x"]])
def test_what_does_not_parse_is_none(text: object) -> None:
    assert parse_time(text) is None
    assert parse_epoch(text) is None

"""The ``--accounting-*`` flags: what they set, and the flag each refusal names."""

from __future__ import annotations

import argparse

import pytest

from gpuwarden.operator.accounting import AccountingSettings


def settings(*argv: str) -> AccountingSettings:
    parser = argparse.ArgumentParser()
    AccountingSettings.add_arguments(parser)
    return AccountingSettings.from_args(parser.parse_args(argv))


def test_the_defaults_and_every_flag_set() -> None:
    default = settings()
    assert (default.group_label, default.idle_floor, dict(default.prices), default.scrape_interval) == (
        "",
        5.0,
        {},
        60.0,
    )
    got = settings(
        "--accounting-group-label=example.com/team",
        "--accounting-idle-floor=2.5",
        "--accounting-price=NVIDIA H200=3.5",
        "--accounting-price=NVIDIA A100-SXM4-80GB=1.2",
        "--accounting-scrape-interval=15s",
    )
    assert got.group_label == "example.com/team"
    assert got.idle_floor == 2.5
    assert dict(got.prices) == {"NVIDIA H200": 3.5, "NVIDIA A100-SXM4-80GB": 1.2}
    assert got.scrape_interval == 15.0
    assert settings("--accounting-scrape-interval=0s").scrape_interval == 0.0


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--accounting-group-label=not a label", "--accounting-group-label"),
        ("--accounting-idle-floor=101", "--accounting-idle-floor"),
        ("--accounting-price=3.5", "--accounting-price"),
        ("--accounting-price=NVIDIA H200=-1", "--accounting-price"),
        ("--accounting-price=NVIDIA H200=nan", "--accounting-price"),
        ("--accounting-scrape-interval=30", "--accounting-scrape-interval"),
        ("--accounting-scrape-interval=2h", "--accounting-scrape-interval"),
    ],
)
def test_a_bad_value_is_refused_naming_its_flag(flag: str, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}: "):
        settings(flag)

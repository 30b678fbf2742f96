"""What the operator's accounting is told at start: ``--accounting-*`` flags, declared and checked here.

The operator's :class:`~gpuwarden.operator.config.OperatorConfig` holds one
:class:`AccountingSettings` and adds these flags through :meth:`AccountingSettings.add_arguments`.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwarden.accounting import DEFAULT_IDLE_FLOOR
from gpuwarden.units import parse_duration

__all__ = ["AccountingSettings"]

DEFAULT_SCRAPE_INTERVAL = 60.0
"""Prometheus' default scrape interval."""
MAX_SCRAPE_INTERVAL = 3600.0
"""A new row reads 0 for at most an hour (a scrape interval longer than that is no history)."""
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
"""A Kubernetes label key: an optional DNS-subdomain prefix and a name."""


@dataclass(frozen=True, slots=True)
class AccountingSettings:
    """How GPU time is counted and priced (docs/accounting.md)."""

    group_label: str = ""
    """The pod label whose value fills the counters' ``group`` label (``team``); empty: ``group`` is empty."""
    idle_floor: float = DEFAULT_IDLE_FLOOR
    """Percent of its allocation under which a pod's time counts as idle."""
    prices: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Price of a GPU-hour by GPU model (``NVIDIA H200``); ``gpuwarden_gpu_idle_cost_total`` is
    exported only when there is one, for the models that have one."""
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL
    """The longest interval Prometheus scrapes the operator at, seconds: a new row reads 0 this long
    before its seconds, so that Prometheus keeps a 0 first and ``increase()`` counts them all (a
    series' first value is only its baseline). 0: rows show their seconds at once."""
    follow_owners: bool = True
    """Read a pod's owners up to its top workload (ReplicaSet → Deployment, Job → CronJob, StatefulSet →
    LeaderWorkerSet; needs ``get`` on replicasets, jobs and statefulsets); off
    (``--no-accounting-owners``): a pod's time goes to its own controller, read from the pod alone."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the ``--accounting-*`` flags; :meth:`from_args` checks them."""
        parser.add_argument(
            "--accounting-group-label",
            default="",
            metavar="LABEL",
            help="the pod label that fills the accounting counters' group label (e.g. team); default none",
        )
        parser.add_argument(
            "--accounting-idle-floor",
            type=float,
            default=DEFAULT_IDLE_FLOOR,
            metavar="PERCENT",
            help="a pod's time counts as idle while its activity is under this share of its allocation "
            "(%(default)s)",
        )
        parser.add_argument(
            "--accounting-price",
            action="append",
            default=[],
            metavar="MODEL=PRICE",
            help="price of a GPU-hour of MODEL (the GPU's product name, e.g. 'NVIDIA H200=3.5'); repeatable",
        )
        parser.add_argument(
            "--accounting-owners",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="read a pod's owners up to its top workload (a Deployment, not its ReplicaSet); "
            "--no-accounting-owners: its own controller, without reading owners (no RBAC on them)",
        )
        parser.add_argument(
            "--accounting-scrape-interval",
            default="1m",
            metavar="DURATION",
            help="the longest interval Prometheus scrapes the operator at: a workload's new counters read "
            "0 this long before its seconds, so that increase() counts its first ones (%(default)s; 0s: "
            "at once)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AccountingSettings:
        """The settings of the parsed flags; ValueError names the flag at fault."""
        label = args.accounting_group_label.strip()
        if label and (len(label) > 316 or not LABEL_KEY.match(label)):
            raise ValueError(f"--accounting-group-label: {label!r} is not a label key")
        floor = args.accounting_idle_floor
        if not 0 <= floor <= 100:
            raise ValueError(f"--accounting-idle-floor: {floor:g} is not a percentage from 0 to 100")
        prices: dict[str, float] = {}
        for text in args.accounting_price:
            model, sep, price_text = text.rpartition("=")
            try:
                price = float(price_text)
            except ValueError:
                price = math.nan
            if not sep or not model.strip() or not math.isfinite(price) or price < 0:
                raise ValueError(f"--accounting-price: {text!r} is not MODEL=PRICE (e.g. 'NVIDIA H200=3.5')")
            prices[model.strip()] = price
        try:
            interval = parse_duration(args.accounting_scrape_interval)
        except ValueError as exc:
            raise ValueError(f"--accounting-scrape-interval: {exc}") from None
        if interval > MAX_SCRAPE_INTERVAL:
            raise ValueError(
                f"--accounting-scrape-interval: {args.accounting_scrape_interval} is over an hour"
            )
        return cls(
            group_label=label,
            idle_floor=floor,
            prices=MappingProxyType(prices),
            scrape_interval=interval,
            follow_owners=args.accounting_owners,
        )

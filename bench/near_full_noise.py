"""Benchmark of memoryGrowth's urgent spans near full: false pages on a flat card, and a real leak's delay.

Not a test: it prints the table in docs/benchmarks.md ("Urgent spans: significance"). Near full, an
urgent span (40s, 1m20s, 2m40s) may decide on a short ramp, and it is judged afresh at each of its
buckets: a flat card's noise has many chances an hour to look like one. Each row plays a GPU for
40 minutes (a 141Gi card, a reading a second, an evaluation every 10 s, transient +4Gi allocations
in 1% of readings, clipped at the card) and counts the runs in which a finding started; side by
side, the rule as it is and with its significance test (``URGENT_SIGNIFICANCE_Z``) left out, on the
same seeds (each run is leak_detection's ``run_engine``). The last row is the near-full leak the
urgent spans exist for (104Mi/m under 43Mi of noise, starting 0.9Gi from full at minute 10): its
delay from the onset, median and worst.

    .venv/bin/python bench/near_full_noise.py              # 1,000 runs a row (~6 minutes)
    .venv/bin/python bench/near_full_noise.py --runs 200
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Sequence
from unittest import mock

from leak_detection import CARD, GI, MI, run_engine

from gpuwarden.policy.rules import growth
from gpuwarden.policy.rules.growth import MemoryGrowth
from gpuwarden.policy.spec.model import LabelSelector, PolicySpec

SECONDS = 2400
"""Readings a run: one a second, the last at 39:59."""
ONSET = 600
FLATS = ((1.0, 256.0, 10.0), (0.5, 256.0, 10.0), (2.0, 256.0, 10.0), (1.0, 1024.0, 10.0), (0.3, 43.0, 10.0))
"""``(GiB from full, noise MiB, the rule's rate MiB/m)`` of the flat rows."""


def flat(seed: int, below: float, noise: float) -> list[float]:
    """A flat card ``below`` GiB from full, Gaussian noise and 1% transient +4Gi readings."""
    rng = random.Random(seed)
    top = CARD - below * GI
    used = []
    for _ in range(SECONDS):
        spike = 4 * GI if rng.random() < 0.01 else 0.0
        used.append(min(CARD, top + rng.gauss(0, noise * MI) + spike))
    return used


def leak(seed: int) -> list[float]:
    """104Mi/m under 43Mi of noise from 0.9Gi below full, from :data:`ONSET` on."""
    rng = random.Random(seed)
    top = CARD - 0.9 * GI
    return [
        min(CARD, top + max(0, t - ONSET) * 104 * MI / 60 + rng.gauss(0, 43 * MI)) for t in range(SECONDS)
    ]


def first_start(used: Sequence[float], rate_mi_per_min: float) -> float | None:
    """Seconds into the run at which the first finding started, or None (leak_detection's engine run)."""
    rule = MemoryGrowth("leak", rate_mi_per_min * MI / 60, 1800.0, 0.8)
    return run_engine(used, 1, PolicySpec(selector=LabelSelector(), rules=(rule,)), SECONDS - 1).first


def row(seed0: int, judge: Callable[[int], str]) -> tuple[str, str]:
    """The row's figure with the significance test, then without it."""
    with_test = judge(seed0)
    with mock.patch.object(growth, "_rising_beyond_chance", return_value=True):
        without = judge(seed0)
    return with_test, without


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=1000, help="runs (seeds) a flat row")
    parser.add_argument("--leak-runs", type=int, default=30, help="runs (seeds) of the leak row")
    args = parser.parse_args(argv)
    print(f"40-minute runs, {args.runs} seeds a flat row (seeds 3000 on), {args.leak_runs} of the leak")
    print("| run | as it is | without the significance test |")
    print("| --- | --- | --- |")
    for below, noise, rate in FLATS:

        def pages(seed0: int, below: float = below, noise: float = noise, rate: float = rate) -> str:
            hits = sum(
                first_start(flat(s, below, noise), rate) is not None for s in range(seed0, seed0 + args.runs)
            )
            return f"{hits} of {args.runs} paged"

        name = f"flat {below:g}Gi from full, noise {noise:g}Mi, rate {rate:g}Mi/m"
        print(f"| {name} | " + " | ".join(row(3000, pages)) + " |", flush=True)

    def delay(seed0: int) -> str:
        found = [first_start(leak(s), 100.0) for s in range(seed0, seed0 + args.leak_runs)]
        delays = [(t - ONSET) / 60 for t in found if t is not None]
        missed = len(found) - len(delays)
        text = f"{statistics.median(delays):.2f} (≤ {max(delays):.2f}) min" if delays else "never"
        return text + (f", {missed} never" if missed else "")

    print(
        "| leak 104Mi/m from 0.9Gi below full, noise 43Mi, rate 100Mi/m | " + " | ".join(row(0, delay)) + " |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

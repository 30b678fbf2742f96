"""What `gpuwarden demo` costs in wall time, against the README's "under a minute".

Not a test: it prints figures for docs/benchmarks.md ("Local mode: `gpuwarden demo`"). Each run
is a fresh ``python -m gpuwarden demo`` child (interpreter start and imports included), its
output discarded:

    .venv/bin/python bench/demo.py               # 3 unpaced runs
    .venv/bin/python bench/demo.py --paced       # and one default (60x, paced) run

The exit status is 1 when the median unpaced run plus the paced part (the scenario's length over
the default speed) does not fit in the README's minute, or a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from gpuwarden.local.demo import DEFAULT_SPEED
from gpuwarden.sim.scenario import load_scenario

DEMO_BUDGET_S = 60.0
"""What the README promises for `make demo`."""


def timed_run(*flags: str) -> float:
    """Seconds of wall time of one ``gpuwarden demo`` child with ``flags``."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "demo", *flags], capture_output=True, text=True, timeout=300
    )
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"gpuwarden demo {' '.join(flags)} exited {done.returncode}:\n{done.stderr}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="unpaced runs (%(default)s)")
    parser.add_argument("--paced", action="store_true", help="also time one default, paced run")
    args = parser.parse_args()

    unpaced = [timed_run("--no-pace") for _ in range(args.runs)]
    median = statistics.median(unpaced)
    print("unpaced wall: " + " / ".join(f"{w:.1f} s" for w in unpaced) + f" (median {median:.1f} s)")
    paced_part = load_scenario("demo").duration / DEFAULT_SPEED
    estimate = paced_part + median
    print(f"default run, estimated: {paced_part:.0f} s of scenario at {DEFAULT_SPEED:g}x + {median:.1f} s")
    if args.paced:
        print(f"default run, measured: {timed_run():.1f} s")
    if estimate >= DEMO_BUDGET_S:
        print(f"over the README's budget of {DEMO_BUDGET_S:.0f} s")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

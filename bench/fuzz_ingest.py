"""The whole-path ingest fuzzer of tests/unit/operator/endpoints/test_ingest_fuzz.py, as long as you like.

Not a test: CI runs the same property on 200 fixed cases; this runs ``--examples`` random ones (new
ones each run; ``--seed`` to repeat one) through the real ingest app into intake, the series store,
an evaluation and the metrics exposition, with the same invariants (see
tests/unit/operator/endpoints/ingest_fuzz_support.py), and reports the answers, the rate and the
process's RSS as it went, which must level off (the state is bounded by identities and the watched
pods). Hypothesis keeps a record of every example of a run, so the cases go in rounds of ``--round``
examples, each a run of its own, on the same operator.

    .venv/bin/python bench/fuzz_ingest.py --examples 20000
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "operator" / "endpoints"))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from ingest_fuzz_support import Case, HarnessRunner, cases  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--round", type=int, default=1000, help="examples per hypothesis run")
    parser.add_argument("--seed", type=int, default=None, help="repeat a run (default: a new one)")
    args = parser.parse_args()

    operator = HarnessRunner()
    done = [0]
    rss: list[tuple[int, float]] = [(0, rss_mib())]

    @settings(
        max_examples=min(args.round, args.examples),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def fuzz(case: Case) -> None:
        operator.check(case)
        done[0] += 1

    started = time.perf_counter()
    try:
        for number in range(max(1, args.examples // args.round)):
            (fuzz if args.seed is None else seed(args.seed + number)(fuzz))()
            rss.append((done[0], rss_mib()))
    finally:
        elapsed = time.perf_counter() - started
        harness = operator.harness
        get = harness.op.parts.metrics.registry.get_sample_value
        print(
            json.dumps(
                {
                    "examples": done[0],
                    "seconds": round(elapsed, 1),
                    "per_second": round(done[0] / elapsed, 1),
                    "statuses": harness.statuses,
                    "refused_points": {
                        r: get("gpuwarden_operator_points_refused_total", {"reason": r})
                        for r in ("future", "past", "foreignPod", "unknownPod")
                    },
                    "stored_points": get("gpuwarden_operator_points_total"),
                    "series": len(harness.op.state.store),
                    "rss_mib": [(n, round(m, 1)) for n, m in rss],
                },
                indent=2,
            )
        )
        operator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What sharded mode adds to each report: the ingest endpoint's ``acting()`` and ``route(node)``.

Not a test: a benchmark, recorded in docs/benchmarks.md ("Sharded mode, before and after").
Best of 7 runs of 10 passes over 2,000 nodes this replica owns among 3; then the owner of a node
uncached (the first report after a membership change) over 3 and 50 replicas.

    .venv/bin/python bench/shard_routing.py
"""

from __future__ import annotations

import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.sharding import Sharding
from gpuwarden.operator.sharding.membership import Member
from gpuwarden.operator.sharding.ring import Ring


def main() -> None:
    members = {f"replica-{i}": Member(f"replica-{i}", "http://x/v1/reports") for i in range(3)}
    operator = build_operator(OperatorConfig(shards=True, identity="replica-0", pod_namespace="bench"))
    shard = operator.parts.shard
    assert isinstance(shard, Sharding)
    for t in (time.monotonic() - 1, time.monotonic()):  # two listings alike: a steady view
        shard.view.update(members, t)
    ring = Ring(members)
    names = (f"gpu-node-{k:05d}" for k in range(100_000))
    nodes = [n for n in names if ring.owner(n) == "replica-0"][:2000]
    ingest = operator.ingest

    def one_pass() -> None:
        for node in nodes:
            ingest.acting()
            ingest.route(node)

    best = min(timeit.repeat(one_pass, number=10, repeat=7)) / (10 * len(nodes))
    print(f"acting() + route(node), cached: {best * 1e6:.2f} us a report")
    for count in (3, 50):
        cold = Ring(f"replica-{i}" for i in range(count))
        started = time.perf_counter()
        for node in nodes:
            cold.owner(node)
        each = (time.perf_counter() - started) / len(nodes)
        print(f"owner uncached over {count} replicas: {each * 1e6:.1f} us")


if __name__ == "__main__":
    main()

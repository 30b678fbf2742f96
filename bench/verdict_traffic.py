"""What sharded mode's verdict exchange costs on the wire: bytes a judged pod adds to a VerdictReport.

Not a test: a benchmark, recorded in docs/scaling-out.md ("Policies across shards"). The policy
of bench/ingest.py (the four rule kinds, default windows), judged by the real engine
(:meth:`~gpuwarden.policy.engine.PolicyEvaluator.judge`) on 10 minutes of 1 s readings of
``--pods`` one-GPU pods, half idle (violating ``utilizationFloor``), half busy (violating
nothing), each pod with figures of its own; each half sent as one report, as a shard sends it
once per evaluation interval, raw and gzip-compressed (level 1, what
:class:`~gpuwarden.operator.sharding.exchange.VerdictSender` sends).

    .venv/bin/python bench/verdict_traffic.py --pods 1000
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwarden.operator.sharding.board import pod_verdicts
from gpuwarden.policy.engine import PodView, PolicyEvaluator
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.store.series import Point, SeriesKey, SeriesStore
from gpuwarden.wire.verdicts import SCHEMA_VERSION, VerdictReport, dump_verdicts

T0 = 1_800_000_000.0
RULES = [
    {"name": "idle", "utilizationFloor": {"percent": 20, "for": "5m"}},
    {"name": "saturated", "utilizationCeiling": {"percent": 95, "for": "2m"}},
    {"name": "near-oom", "memoryCeiling": {"percent": 90, "for": "1m"}},
    {"name": "leak", "memoryGrowth": {"rate": "100Mi/m", "window": "10m"}},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="pods on the shard (half idle)")
    args = parser.parse_args()
    policy = {"selector": {"matchLabels": {"gpu": "yes"}}, "evaluationInterval": "10s", "rules": RULES}
    spec = parse_spec(policy)
    store = SeriesStore(retention_seconds=900, max_points=3600)
    pods = [PodView("ns", f"pod-{i:05d}", {"gpu": "yes"}) for i in range(args.pods)]
    for i, pod in enumerate(pods):
        # Every pod its own figures (messages that differ, as a fleet's do), seeded: the same each run.
        rng = random.Random(i)
        util = rng.uniform(1, 15) if i % 2 == 0 else rng.uniform(40, 85)
        mem = rng.uniform(10, 120) * 2**30
        key = SeriesKey("ns", pod.name, f"GPU-{rng.getrandbits(128):032x}")
        for t in range(600):
            point = Point(t=T0 - 600 + t, gpu_util=util + rng.uniform(-1, 1), mem_used=mem, mem_total=141e9)
            store.add(key, point)
    judged = PolicyEvaluator("ns/gpus", spec, namespace="ns").judge(pods, store, T0)
    print(f"{args.pods} pods, {len(RULES)} rules (four kinds), one report a half per interval")
    for label, parity in (("violating (idle)", 0), ("healthy (busy)", 1)):
        half = {p: o for p, o in judged.items() if int(p.name.split("-")[1]) % 2 == parity}
        holding = sum(any(o.holds for o in out) for out in half.values())
        report = VerdictReport(
            schema_version=SCHEMA_VERSION, shard="operator-7d9f8-abcde", at=T0, namespace="ns",
            policy="gpus", generation=1, pods=pod_verdicts(half),
        )  # fmt: skip
        raw = dump_verdicts(report)
        packed = gzip.compress(raw, compresslevel=1)
        print(
            f"  {label:17} {len(half)} pods ({holding} holding a rule): "
            f"{len(raw) / len(half):6.0f} B/pod raw, {len(packed) / len(half):5.0f} B/pod gzip"
        )


if __name__ == "__main__":
    main()

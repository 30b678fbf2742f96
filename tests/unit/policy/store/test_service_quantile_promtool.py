"""The ServiceStore's windowed quantile against Prometheus itself: ``promtool test rules`` evaluates
``histogram_quantile(q, sum by (le) (increase(x_bucket[w])))`` over the same scrapes (a server restart
among them) and must answer what :func:`histogram_quantile` over :meth:`ServiceStore.increase` does,
to float rounding."""

from __future__ import annotations

import math
import random
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from promtool_support import promtool

from gpuwarden.policy import Histogram, PodId, ServiceScrape, ServiceStore
from gpuwarden.policy.store.service import histogram_quantile

POD = PodId("ns", "llm")
BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf)
STEP = 10  # seconds between scrapes
SCRAPES = 40
WINDOW = 120


def scrapes(seed: int) -> list[tuple[float, ...]]:
    """Cumulative bucket counts per scrape: requests of a drifting latency, the server restarting at
    scrape 25 (its counts fall back to what it served since). They start high, as a long-running
    server's do, so that Prometheus's extrapolation never meets zero (it scales every bucket alike)."""
    rng = random.Random(seed)
    served = [1000.0 * (i + 1) for i in range(len(BOUNDS))]
    out = []
    for k in range(SCRAPES):
        if k == 25:
            served = [0.0] * len(BOUNDS)
        for _ in range(rng.randint(5, 30)):
            latency = rng.lognormvariate(math.log(0.3 + k * 0.05), 0.6)
            for i, bound in enumerate(BOUNDS):
                if latency <= bound:
                    served[i] += 1
        out.append(tuple(served))
    return out


def le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(bound)


@pytest.mark.parametrize(("seed", "q", "at"), [(1, 0.99, 39), (2, 0.5, 39), (3, 0.9, 30), (4, 0.95, 20)])
def test_the_quantile_is_prometheus_s(tmp_path: Path, seed: int, q: float, at: int) -> None:
    counts = scrapes(seed)
    store = ServiceStore(retention_seconds=3600)
    for k, c in enumerate(counts):
        store.record(POD, ServiceScrape(at=k * STEP, histograms={"lat": Histogram(BOUNDS, c, 0.0)}))
    window = store.increase(POD, ["lat"], WINDOW, now=at * STEP, stale_after=60)
    assert window is not None
    assert window.histogram is not None
    ours = histogram_quantile(q, window.histogram)
    assert ours is not None
    # Prometheus 2's range [t - 125s, t] holds the same scrapes as our [t - 120s, t].
    tests = {
        "rule_files": [],
        "evaluation_interval": f"{STEP}s",  # promtool reads the data as of its last evaluation tick
        "tests": [
            {
                "interval": f"{STEP}s",
                "input_series": [
                    {"series": f'lat_bucket{{le="{le(b)}"}}', "values": " ".join(f"{c[i]:g}" for c in counts)}
                    for i, b in enumerate(BOUNDS)
                ],
                "promql_expr_test": [
                    {
                        "expr": f"histogram_quantile({q}, sum by (le) (increase(lat_bucket[{WINDOW + 5}s])))",
                        "eval_time": f"{at * STEP}s",
                        # An answer it cannot give: promtool 2.42 compares to the bit, and prints what it got.
                        "exp_samples": [{"labels": "{}", "value": -1}],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "quantile_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    ran = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    got = re.search(r"got: \{\} (\S+)", ran.stderr)
    assert got is not None, ran.stdout + ran.stderr
    # The same figure, up to float rounding (Prometheus extrapolates every bucket alike; we do not).
    assert float(got.group(1)) == pytest.approx(ours, rel=1e-12)

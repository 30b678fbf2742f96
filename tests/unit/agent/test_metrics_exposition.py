"""``/metrics`` of the agent, the operator and the simulated server: one handler (prometheus_client's
aiohttp handler), so one behaviour. The text format unless OpenMetrics is asked for, gzip when it is
accepted; each checked with ``promtool`` or prometheus_client's OpenMetrics parser (issue 43, item 5).
"""

from __future__ import annotations

import gzip
import re
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from promtool_support import promtool
from test_agent_metrics import sample_at

from gpuwarden.agent.http import build_app as agent_app
from gpuwarden.agent.metrics import build_registry
from gpuwarden.agent.snapshots import SnapshotRing
from gpuwarden.operator.metrics import OperatorMetrics, make_metrics_app
from gpuwarden.sim.replica import ReplicaConfig
from gpuwarden.simserver.server import SimServer
from gpuwarden.simserver.server import build_app as simserver_app

TEXT = "text/plain; version=0.0.4; charset=utf-8"
# prometheus_client's OpenMetrics parser, typed (the library leaves it untyped).
openmetrics_families: Callable[[str], Iterable[Metric]] = text_string_to_metric_families
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# What Prometheus 3 sends (scrape_protocols' default order), OpenMetrics first.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
)


def _agent() -> web.Application:
    ring = SnapshotRing()
    registry, _ = build_registry(ring, backend="scripted", node="node-a")
    sample_at(ring, 30)  # with pods and processes
    return agent_app(registry, ring)


def _operator() -> web.Application:
    return make_metrics_app(OperatorMetrics(), lambda: True)


def _simserver() -> web.Application:
    return simserver_app(SimServer(ReplicaConfig(), model="tiny"))


COMPONENTS: dict[str, tuple[Callable[[], web.Application], str]] = {
    "agent": (_agent, "gpuwarden_gpu_up"),
    "operator": (_operator, "gpuwarden_operator_reports_total"),
    "simserver": (_simserver, "vllm:num_requests_running"),
}


def promtool_check(body: bytes) -> None:
    result = subprocess.run([promtool(), "check", "metrics"], input=body, capture_output=True, check=False)
    problems = (result.stdout + result.stderr).decode().splitlines()
    if body.startswith(b"# HELP vllm:"):
        # promtool parses it (exit 1 would be an error) and lints one thing only: vLLM's names have
        # colons, which Prometheus keeps for recording rules (exit 3: lint problems).
        assert result.returncode == 3, problems
        assert all(p.endswith("metric names should not contain ':'") for p in problems), problems
    else:
        assert result.returncode == 0, problems


@pytest.fixture(params=sorted(COMPONENTS))
async def served(request: pytest.FixtureRequest) -> Any:
    build, family = COMPONENTS[request.param]
    # auto_decompress off: what is checked is what goes over the wire.
    async with TestClient(TestServer(build()), auto_decompress=False) as client:
        yield client, family


async def test_the_text_format_when_nothing_is_asked_for(served: tuple[TestClient[Any, Any], str]) -> None:
    client, family = served
    response = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert response.status == 200
    assert response.headers["Content-Type"] == TEXT
    assert "Content-Encoding" not in response.headers
    body = await response.read()
    assert family.encode() in body
    promtool_check(body)


async def test_openmetrics_when_prometheus_asks_for_it(served: tuple[TestClient[Any, Any], str]) -> None:
    client, family = served
    response = await client.get(
        "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "identity"}
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith(OPENMETRICS)
    text = await response.text()
    assert text.endswith("# EOF\n")
    openmetrics_families(text)  # prometheus_client's OpenMetrics parser reads it
    # Colons (vLLM's names) come out as underscores in OpenMetrics' sample lines (prometheus/client_python
    # #1177): what vLLM's own exposition does too, and why the agent's scraper asks for the text format.
    assert re.search(rf"^{re.escape(family.replace(':', '_'))}[ {{]", text, re.MULTILINE), text[-500:]


async def test_gzip_when_accepted(served: tuple[TestClient[Any, Any], str]) -> None:
    client, family = served
    response = await client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert response.status == 200
    assert response.headers["Content-Encoding"] == "gzip"
    assert response.headers["Content-Type"] == TEXT
    body = gzip.decompress(await response.read())
    assert family.encode() in body
    promtool_check(body)

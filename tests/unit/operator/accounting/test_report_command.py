"""``gpuwarden report``'s connection flags and failures, run as the command it is (a process) against a
real HTTP server standing in for Prometheus: what it sends, and one line (no traceback) for each
failure. The real Prometheus and API server are tests/integration/test_report_login.py's."""

from __future__ import annotations

import asyncio
import base64
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tls_support import make_pki

REPO_ROOT = Path(__file__).resolve().parents[4]
# The core install (`pip install gpuwarden`): neither Kopf nor the agent's gRPC can be imported.
CORE_ONLY = (
    "import sys; sys.modules['kopf'] = sys.modules['grpc'] = None; "
    "from gpuwarden.cli import main; sys.exit(main())"
)
SERIES = {"namespace": "ml", "workload_kind": "Deployment", "workload": "web"}


@dataclass
class FakePrometheus:
    """``/api/v1/query``: ``answer`` (a status and a body) to each query, which it records."""

    status: int = 200
    body: Any = None
    empty: bool = False
    queries: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def query(self, request: web.Request) -> web.Response:
        promql = request.query["query"]
        self.queries.append(promql)
        self.headers.append(dict(request.headers))
        if self.body is not None:
            return web.Response(status=self.status, text=self.body)
        result = (
            [] if self.empty or promql.startswith("count(") else [{"metric": SERIES, "value": [0, "7200"]}]
        )
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


@pytest.fixture
async def prometheus() -> AsyncIterator[tuple[FakePrometheus, str]]:
    fake = FakePrometheus()
    app = web.Application()
    app.router.add_get("/prom/api/v1/query", fake.query)
    async with TestServer(app, host="127.0.0.1") as server:
        yield fake, str(server.make_url("/prom"))


async def report(*args: str, home: Path) -> tuple[int, str, str]:
    """Run ``gpuwarden report`` from the core install; its exit status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CORE_ONLY, "report", *args,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "HOME": str(home), "PATH": "/usr/bin:/bin"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err
    return err.strip()


async def test_credentials_headers_and_the_cluster_go_with_every_query(
    prometheus: tuple[FakePrometheus, str], tmp_path: Path
) -> None:
    fake, url = prometheus
    (tmp_path / "token").write_text("s3cret\n")
    code, out, err = await report(
        f"--prometheus={url}", "--no-findings", f"--prometheus-token-file={tmp_path / 'token'}",
        "-H", "X-Scope-OrgID: team-a", "--cluster=east", "-n", "ml",
        home=tmp_path,
    )  # fmt: skip
    assert code == 0, err
    assert "Deployment/web" in out
    assert len(fake.queries) >= 4
    assert all('{namespace="ml",cluster="east"}' in q for q in fake.queries)
    assert {h["Authorization"] for h in fake.headers} == {"Bearer s3cret"}
    assert {h["X-Scope-OrgID"] for h in fake.headers} == {"team-a"}


async def test_basic_auth_and_a_cluster_label_of_ones_own(
    prometheus: tuple[FakePrometheus, str], tmp_path: Path
) -> None:
    fake, url = prometheus
    code, _, err = await report(
        f"--prometheus={url}", "--no-findings", "--prometheus-basic-auth=alice:pa:ss",
        "--cluster=east", "--cluster-label=k8s_cluster",
        home=tmp_path,
    )  # fmt: skip
    assert code == 0, err
    assert all('{k8s_cluster="east"}' in q for q in fake.queries)
    assert {h["Authorization"] for h in fake.headers} == {
        "Basic " + base64.b64encode(b"alice:pa:ss").decode()
    }


@pytest.mark.parametrize(
    ("status", "body", "line"),
    [
        (
            401,
            "no org id\n",
            "gpuwarden report: Prometheus at {url} refused the request: 401 Unauthorized (no org id); give "
            "credentials with --prometheus-token-file, --prometheus-basic-auth or -H",
        ),
        (
            200,
            "<html>Grafana</html>",
            "gpuwarden report: Prometheus at {url}: 200 OK, not a Prometheus answer (is that its base URL?)",
        ),
    ],
)
async def test_a_refusal_or_another_server_is_one_line(
    prometheus: tuple[FakePrometheus, str], tmp_path: Path, status: int, body: str, line: str
) -> None:
    fake, url = prometheus
    fake.status, fake.body = status, body
    code, out, err = await report(f"--prometheus={url}", "--no-findings", home=tmp_path)
    assert (code, out) == (1, "")
    assert one_line(err) == line.format(url=url)


async def test_an_empty_prometheus_is_one_line(
    prometheus: tuple[FakePrometheus, str], tmp_path: Path
) -> None:
    fake, url = prometheus
    fake.empty = True
    code, out, err = await report(f"--prometheus={url}", "--no-findings", "--cluster=west", home=tmp_path)
    assert (code, out) == (1, "")
    assert one_line(err) == (
        'gpuwarden report: no gpuwarden series with {cluster="west"} in the last 1d: is the operator scraped?'
    )


async def test_an_unreachable_prometheus_is_one_line(tmp_path: Path) -> None:
    code, out, err = await report("--prometheus=http://127.0.0.1:9", "--no-findings", home=tmp_path)
    assert (code, out) == (1, "")
    assert (
        one_line(err)
        == "gpuwarden report: Prometheus at http://127.0.0.1:9: unreachable (Connection refused)"
    )


async def test_its_certificate_is_verified_against_the_ca_given(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, names=("localhost",), ip="127.0.0.1")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki.cert_file, pki.key_file)
    fake = FakePrometheus()
    app = web.Application()
    app.router.add_get("/api/v1/query", fake.query)
    server = TestServer(app, host="127.0.0.1", scheme="https")
    await server.start_server(ssl=tls)
    try:
        url = str(server.make_url("")).rstrip("/")
        code, _, err = await report(f"--prometheus={url}", "--no-findings", home=tmp_path)
        assert code == 1
        assert one_line(err) == (
            f"gpuwarden report: Prometheus at {url}: "
            "its TLS certificate is not trusted (unable to get local issuer certificate)"
        )
        assert fake.queries == []
        for trust in (f"--prometheus-ca-file={pki.ca_file}", "--prometheus-insecure"):
            code, out, err = await report(f"--prometheus={url}", "--no-findings", trust, home=tmp_path)
            assert code == 0, err
            assert "Deployment/web" in out
    finally:
        await server.close()


async def test_no_kubeconfig_is_one_line_with_the_way_around(
    prometheus: tuple[FakePrometheus, str], tmp_path: Path
) -> None:
    _, url = prometheus
    code, out, err = await report(f"--prometheus={url}", home=tmp_path)
    assert (code, out) == (1, "")
    assert one_line(err) == (
        "gpuwarden report: cannot log in to Kubernetes: no kubeconfig ($KUBECONFIG or ~/.kube/config) and "
        "not in a pod of the cluster; --no-findings skips the findings"
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["-H", "X-Scope-OrgID"], "gpuwarden report: -H 'X-Scope-OrgID' is not 'NAME: VALUE'"),
        (["--prometheus-basic-auth=alice"], "gpuwarden report: --prometheus-basic-auth is USER:PASSWORD"),
        (
            ["--prometheus-token-file=/no/such/token"],
            "gpuwarden report: --prometheus-token-file /no/such/token: No such file or directory",
        ),
        (
            ["--prometheus-token=t", "-H", "Authorization: Basic x"],
            "gpuwarden report: -H 'Authorization: ...' and a token or basic auth: give one",
        ),
    ],
)
async def test_a_bad_flag_is_one_line(
    prometheus: tuple[FakePrometheus, str], tmp_path: Path, args: list[str], line: str
) -> None:
    fake, url = prometheus
    code, _, err = await report(f"--prometheus={url}", "--no-findings", *args, home=tmp_path)
    assert code == 2
    assert one_line(err) == line
    assert fake.queries == []


async def test_prometheus_credentials_are_refused_through_the_api_servers_proxy(tmp_path: Path) -> None:
    code, _, err = await report(
        "--prometheus-service=monitoring/prometheus:9090", "--prometheus-insecure", home=tmp_path
    )
    assert code == 2
    assert one_line(err) == (
        "gpuwarden report: --prometheus-insecure: only with --prometheus (not through the API server's proxy)"
    )

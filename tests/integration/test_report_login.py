"""``gpuwarden report`` logs in as kubectl does and reads a Prometheus that wants credentials.

On the real API server: the report reads the policies' findings as a ServiceAccount allowed to read
them in one namespace, logging in through a kubeconfig ``exec`` credential plugin (a script that
prints a ``client.authentication.k8s.io/v1`` ExecCredential carrying the ServiceAccount's token,
minted by the API server) picked by ``--context``, and as the current context of ``--kubeconfig``.
Prometheus is Debian's real server, behind a real reverse proxy (tests/integration/auth_proxy.py)
over TLS that wants a bearer token the API server authenticates and a tenant header, as Mimir
behind kube-rbac-proxy would; it scrapes two clusters' accounting counters, told apart by a
``cluster`` label. (The counters are the operator's names and labels, growing at set rates from a
prometheus_client exporter of the test's: the operator's own counting is test_accounting.py's.)

Every report runs as the core install does (Kopf and gRPC cannot be imported), and each failure
(no kubeconfig, an unknown context, a failing plugin, refused credentials, a forbidden read, an
unreachable API server or Prometheus, Prometheus refusing, an empty Prometheus) is one line on
stderr, no traceback.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from auth_proxy import AuthProxy
from controlplane import REPO_ROOT, ControlPlane, free_port
from operator_support import apply, apply_crds, monitor_policy, wait_until
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_support import Prometheus, prometheus_binary

pytestmark = pytest.mark.integration

CORE_ONLY = (
    "import sys; sys.modules['kopf'] = sys.modules['grpc'] = None; "
    "from gpuwarden.cli import main; sys.exit(main())"
)
TENANT = "team-a"
READER = "reporter"
"""The ServiceAccount the report logs in as: it may read policies and pods in the test's namespace."""


class GrowingCounters:
    """The operator's accounting counters for one workload: a GPU-hour allocated each second (so that
    the table reads hours), ``used`` of it used, all of it idle when ``used`` is under the idle floor."""

    def __init__(self, namespace: str, kind: str, name: str, used: float) -> None:
        self.labels = [namespace, kind, name, "", "NVIDIA H200"]
        self.used = used
        self.start = time.time()

    def collect(self) -> Iterator[Metric]:
        seconds = 3600 * (time.time() - self.start)
        names = ["namespace", "workload_kind", "workload", "group", "gpu_model"]
        for metric, value in (
            ("allocated", seconds),
            ("used", seconds * self.used),
            ("idle", seconds if self.used < 0.1 else 0.0),
        ):
            family = CounterMetricFamily(f"gpuwarden_gpu_{metric}_seconds", "GPU-seconds", labels=names)
            family.add_metric(self.labels, value)
            yield family


@contextlib.contextmanager
def exporter(counters: GrowingCounters) -> Iterator[str]:
    """Serve ``counters`` on /metrics; the target's HOST:PORT."""
    registry = CollectorRegistry()
    registry.register(counters)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Setup:
    cp: ControlPlane
    namespace: str
    proxy: AuthProxy
    token_file: Path
    """The ServiceAccount's token, which Prometheus's proxy lets in too."""
    kubeconfig: Path
    plugin_runs: Path
    workdir: Path

    def report(self, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``gpuwarden report`` over the last 15 minutes from the core install, with the test's
        kubeconfig and the Prometheus proxy's credentials unless ``args`` say otherwise."""
        base = {
            "PYTHONPATH": str(REPO_ROOT),
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.workdir),
            "KUBECONFIG": str(self.kubeconfig),
        }
        return subprocess.run(
            [sys.executable, "-c", CORE_ONLY, "report", "--window=15m", *args],
            cwd=REPO_ROOT,
            env={**base, **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def prometheus(self, *extra: str) -> list[str]:
        """The flags that reach Prometheus through its proxy."""
        return [
            f"--prometheus={self.proxy.url}",
            f"--prometheus-token-file={self.token_file}",
            f"--prometheus-ca-file={self.cp.ca_path}",
            "-H",
            f"X-Scope-OrgID: {TENANT}",
            *extra,
        ]


def kubeconfig(path: Path, cp: ControlPlane, plugin: Path, current: str) -> Path:
    """A kubeconfig of five contexts: ``admin`` (a token), ``reporter`` (the exec plugin), ``broken``
    (a plugin that fails), ``stranger`` (a token the API server does not know), ``nowhere`` (an API
    server that is not there)."""

    def exec_user(*args: str) -> dict[str, object]:
        return {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": str(plugin),
                "args": list(args),
                "env": [{"name": "REPORT_TEST", "value": "1"}],
                "interactiveMode": "Never",
                "installHint": "the test writes it",
            }
        }

    clusters = {
        "test": {"server": cp.server, "certificate-authority": str(cp.ca_path)},
        "gone": {"server": f"https://127.0.0.1:{free_port()}", "certificate-authority": str(cp.ca_path)},
    }
    users = {
        "admin": {"token": cp.admin_token},
        "reporter": exec_user("token"),
        "broken": exec_user("fail"),
        "stranger": {"token": "not-a-token-the-api-server-knows"},
    }
    contexts = {
        "admin": ("test", "admin"),
        "reporter": ("test", "reporter"),
        "broken": ("test", "broken"),
        "stranger": ("test", "stranger"),
        "nowhere": ("gone", "admin"),
    }
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
                "users": [{"name": n, "user": u} for n, u in users.items()],
                "contexts": [
                    {"name": n, "context": {"cluster": c, "user": u}} for n, (c, u) in contexts.items()
                ],
                "current-context": current,
            }
        )
    )
    return path


def exec_plugin(path: Path, token_file: Path, runs: Path) -> Path:
    """The credential plugin: ``token`` prints an ExecCredential with the ServiceAccount's token,
    valid for an hour; ``fail`` says why on stderr and exits 1, as a cloud's plugin does when its
    session is over. Each run appends its argument to ``runs``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!{sys.executable}\n"
        "import datetime, json, os, sys\n"
        f"open({str(runs)!r}, 'a').write(sys.argv[1] + ' ' + os.environ['REPORT_TEST'] + '\\n')\n"
        "if sys.argv[1] == 'fail':\n"
        "    sys.exit('error: the SSO session has expired: log in again')\n"
        "spec = json.loads(os.environ['KUBERNETES_EXEC_INFO'])['spec']\n"
        "assert spec == {'interactive': False}, spec\n"
        "expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',\n"
        f"    'status': {{'token': open({str(token_file)!r}).read().strip(),\n"
        "               'expirationTimestamp': expiry.strftime('%Y-%m-%dT%H:%M:%SZ')}}))\n"
    )
    path.chmod(0o755)
    return path


def reader_token(cp: ControlPlane, namespace: str) -> str:
    """A token of :data:`READER`, allowed to read policies and pods in ``namespace`` only."""
    cp.kubectl("create", "serviceaccount", READER, "-n", namespace, check=True)
    cp.kubectl(
        "create", "role", READER, "-n", namespace,
        "--verb=get,list", "--resource=gpumonitorpolicies.gpuwarden.dev,pods", check=True,
    )  # fmt: skip
    cp.kubectl(
        "create", "rolebinding", READER, "-n", namespace,
        f"--role={READER}", f"--serviceaccount={namespace}:{READER}", check=True,
    )  # fmt: skip
    return cp.kubectl("create", "token", READER, "-n", namespace, "--duration=1h", check=True).stdout.strip()


def flag_the_notebook(cp: ControlPlane, namespace: str) -> None:
    """A bare pod ``notebook`` and a policy whose status names it idle (as the operator writes it)."""
    apply(
        cp,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "notebook", "namespace": namespace},
            "spec": {"containers": [{"name": "main", "image": "example.invalid/cuda:1"}]},
        },
    )
    rule = {"name": "idle", "utilizationFloor": {"percent": 20, "for": "10s"}}
    apply(cp, monitor_policy(namespace, "idle", [rule]))
    violation = {
        "pod": "notebook",
        "rule": "idle",
        "reason": "GPUUnderutilized",
        "message": "mean GPU utilization 3% over 10s, floor 20%",
        "since": "2026-12-06T08:00:00Z",
    }
    cp.kubectl(
        "patch", "gpumonitorpolicy", "idle", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"violations": [violation]}}), check=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def setup(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    binary = prometheus_binary()
    cp = control_plane
    workdir = tmp_path_factory.mktemp("report-login")
    namespace = cp.create_namespace(f"gw-report-login-{int(time.time()) % 100000}")
    apply_crds(cp)
    token_file = workdir / "reader.token"
    token_file.write_text(reader_token(cp, namespace))
    flag_the_notebook(cp, namespace)
    with contextlib.ExitStack() as stack:
        east = stack.enter_context(exporter(GrowingCounters(namespace, "Pod", "notebook", used=0.03)))
        west = stack.enter_context(exporter(GrowingCounters("west-only", "Deployment", "web", used=0.6)))
        yield from _served(cp, namespace, workdir, token_file, binary, east, west)


def _served(
    cp: ControlPlane, namespace: str, workdir: Path, token_file: Path, binary: str, east: str, west: str
) -> Iterator[Setup]:
    scrape = [
        {
            "job_name": f"operator-{cluster}",
            "static_configs": [{"targets": [target], "labels": {"cluster": cluster}}],
        }
        for cluster, target in (("east", east), ("west", west))
    ]
    prometheus = Prometheus(binary, workdir / "prometheus", scrape, [], interval="250ms")
    try:
        # Both clusters' counters, each with samples enough for increase().
        scraped = "count_over_time(gpuwarden_gpu_allocated_seconds_total[1m]) >= 3"
        wait_until(
            lambda: len(prometheus.query(scraped)) == 2,
            timeout=60,
            every=0.25,
            what="both clusters' counters scraped thrice",
        )
        proxy = AuthProxy(prometheus.url, cp, TENANT)
        try:
            runs = workdir / "plugin-runs"
            plugin = exec_plugin(workdir / "bin" / "cloud-login", token_file, runs)
            config = kubeconfig(workdir / "kubeconfig", cp, plugin, "admin")
            yield Setup(cp, namespace, proxy, token_file, config, runs, workdir)
        finally:
            proxy.stop()
    finally:
        prometheus.stop()


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    return done.stdout


def one_line(done: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one line a failed report says (no traceback, nothing on stdout)."""
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


def test_an_exec_plugin_picked_by_context_reads_the_findings(setup: Setup) -> None:
    setup.plugin_runs.unlink(missing_ok=True)
    table = ok(
        setup.report(*setup.prometheus("--cluster=east"), "--context=reporter", f"-n={setup.namespace}")
    )
    print(table)
    assert "Pod/notebook" in table
    assert "west-only" not in table
    # The finding is the policy's, read as the ServiceAccount the plugin's token names.
    assert f"    {setup.namespace}/idle: pod notebook idle GPUUnderutilized: mean GPU utilization 3%" in table
    # Once for the whole report: its credential holds for an hour.
    assert setup.plugin_runs.read_text() == "token 1\n"


def test_the_current_context_of_a_kubeconfig_flag(setup: Setup) -> None:
    plugin = setup.workdir / "bin" / "cloud-login"
    other = kubeconfig(setup.workdir / "reporter.kubeconfig", setup.cp, plugin, "reporter")
    args = [*setup.prometheus("--cluster=east"), f"--kubeconfig={other}", f"-n={setup.namespace}", "-ojson"]
    data = json.loads(ok(setup.report(*args, env={"KUBECONFIG": "/nonexistent"})))
    (offender,) = data["worstOffenders"]
    assert (offender["workload"], [f["reason"] for f in offender["findings"]]) == (
        "notebook",
        ["GPUUnderutilized"],
    )


def test_every_cluster_without_the_filter(setup: Setup) -> None:
    setup.proxy.requests.clear()
    data = json.loads(ok(setup.report(*setup.prometheus(), "--no-findings", "-o", "json")))
    assert {w["workload"] for w in data["workloads"]} == {"notebook", "web"}
    # Through the proxy only: every query it was asked carried the token and the tenant.
    assert setup.proxy.requests
    assert {status for _, status in setup.proxy.requests} == {200}


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            [],
            {"KUBECONFIG": "", "HOME": "/nonexistent"},
            "gpuwarden report: cannot log in to Kubernetes: no kubeconfig ($KUBECONFIG or ~/.kube/config) "
            "and not in a pod of the cluster; --no-findings skips the findings",
        ),
        (
            ["--context=nope"],
            {},
            'gpuwarden report: cannot log in to Kubernetes: context "nope" not found in {kubeconfig}'
            "; --no-findings skips the findings",
        ),
        (
            ["--context=broken"],
            {},
            'gpuwarden report: cannot log in to Kubernetes: context "broken" of {kubeconfig}: exec plugin '
            "{plugin} failed (exit status 1): error: the SSO session has expired: log in again"
            "; --no-findings skips the findings",
        ),
        (
            ["--context=stranger"],
            {},
            'gpuwarden report: the API server at {server} refused the credentials of context "stranger" of '
            "{kubeconfig} (401 Unauthorized); --no-findings skips the findings",
        ),
        (
            ["--context=reporter"],  # every namespace's policies: more than its Role allows
            {},
            "gpuwarden report: the API server at {server}: 403: gpumonitorpolicies.gpuwarden.dev is "
            'forbidden: User "system:serviceaccount:{namespace}:reporter" cannot list resource '
            '"gpumonitorpolicies" in API group "gpuwarden.dev" at the cluster scope'
            "; --no-findings skips the findings",
        ),
        (
            ["--context=nowhere"],
            {},
            "gpuwarden report: the API server at {nowhere}: unreachable (Connection refused)"
            "; --no-findings skips the findings",
        ),
    ],
    ids=["no-kubeconfig", "unknown-context", "plugin-fails", "unauthorized", "forbidden", "unreachable"],
)
def test_each_kubernetes_failure_is_one_line(
    setup: Setup, args: list[str], env: dict[str, str], line: str
) -> None:
    nowhere = yaml.safe_load(setup.kubeconfig.read_text())["clusters"][1]["cluster"]["server"]
    said = one_line(setup.report(*setup.prometheus("--cluster=east"), *args, env=env))
    assert said == line.format(
        kubeconfig=setup.kubeconfig,
        plugin=setup.workdir / "bin" / "cloud-login",
        server=setup.cp.server,
        namespace=setup.namespace,
        nowhere=nowhere,
    )


def test_each_prometheus_failure_is_one_line(setup: Setup) -> None:
    url = setup.proxy.url
    no_token = [a for a in setup.prometheus() if not a.startswith("--prometheus-token-file")]
    assert one_line(setup.report(*no_token, "--no-findings")) == (
        f"gpuwarden report: Prometheus at {url} refused the request: 401 Unauthorized (Unauthorized); give "
        "credentials with --prometheus-token-file, --prometheus-basic-auth or -H"
    )
    no_tenant = setup.prometheus()[:-2]
    assert one_line(setup.report(*no_tenant, "--no-findings")) == (
        f"gpuwarden report: Prometheus at {url} refused the request: 401 Unauthorized (no org id); give "
        "credentials with --prometheus-token-file, --prometheus-basic-auth or -H"
    )
    untrusted = [a for a in setup.prometheus() if not a.startswith("--prometheus-ca-file")]
    assert one_line(setup.report(*untrusted, "--no-findings")).startswith(
        f"gpuwarden report: Prometheus at {url}: its TLS certificate is not trusted ("
    )
    assert one_line(setup.report(*setup.prometheus("--cluster=north"), "--no-findings")) == (
        'gpuwarden report: no gpuwarden series with {cluster="north"} in the last 15m: '
        "is the operator scraped?"
    )
    gone = f"https://127.0.0.1:{free_port()}"
    assert one_line(setup.report(f"--prometheus={gone}", "--no-findings")) == (
        f"gpuwarden report: Prometheus at {gone}: unreachable (Connection refused)"
    )

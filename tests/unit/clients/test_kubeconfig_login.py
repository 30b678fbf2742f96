"""gpuwarden.clients.kubeconfig: kubectl's way to credentials, on real files and real plugin processes.

The exec plugins here are small Python scripts run as kubectl runs them (a process, its env and
args, ``KUBERNETES_EXEC_INFO``); each writes what it was given to a file the test reads.
"""

from __future__ import annotations

import base64
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwarden.clients import Credentials, LoginError, load_credentials

REPO_ROOT = Path(__file__).resolve().parents[3]
V1 = "client.authentication.k8s.io/v1"


def kubeconfig(
    path: Path,
    *,
    users: dict[str, dict[str, Any]],
    contexts: dict[str, tuple[str, str]] | None = None,
    clusters: dict[str, dict[str, Any]] | None = None,
    current: str | None = "main",
) -> Path:
    """A kubeconfig at ``path``: clusters by name, users by name, contexts (cluster, user) by name."""
    clusters = clusters if clusters is not None else {"c": {"server": "https://api.example:6443"}}
    contexts = contexts if contexts is not None else {"main": ("c", next(iter(users)))}
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()],
        "contexts": [{"name": n, "context": {"cluster": c, "user": u}} for n, (c, u) in contexts.items()],
    }
    if current is not None:
        doc["current-context"] = current
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def plugin(path: Path, *, status: dict[str, Any] | None = None, exit_code: int = 0, stderr: str = "") -> Path:
    """An exec plugin at ``path`` that records its argv, env and exec info in ``path.json`` (appending
    one line per run), then prints an ExecCredential with ``status`` (or says ``stderr`` and exits)."""
    answer = {"apiVersion": V1, "kind": "ExecCredential", "status": status or {"token": "from-plugin"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(path) + '.json'!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}) + '\\n')\n"
        f"sys.stderr.write({stderr!r})\n"
        f"if {exit_code}: sys.exit({exit_code})\n"
        f"print({json.dumps(answer)!r})\n"
    )
    path.chmod(0o755)
    return path


def runs(path: Path) -> list[dict[str, Any]]:
    """What each run of the plugin at ``path`` was given."""
    log = Path(str(path) + ".json")
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def exec_user(command: str, **extra: Any) -> dict[str, Any]:
    return {"exec": {"apiVersion": V1, "command": command, "interactiveMode": "Never", **extra}}


NO_ENV: dict[str, str] = {"HOME": "/nonexistent"}


def test_a_token_user_and_a_ca_relative_to_its_file(tmp_path: Path) -> None:
    config = kubeconfig(
        tmp_path / "kube" / "config",
        clusters={"c": {"server": "https://10.0.0.1:6443", "certificate-authority": "ca.crt"}},
        users={"u": {"token": "secret"}},
    )
    creds = load_credentials(str(config), environ=NO_ENV)
    assert creds.server == "https://10.0.0.1:6443"
    assert creds.ca_file == str(tmp_path / "kube" / "ca.crt")
    assert creds.headers() == {"Authorization": "Bearer secret"}
    assert creds.expires is None
    assert creds.source == f'context "main" of {config}'


def test_a_token_file_and_client_certificate_data(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    config = kubeconfig(
        tmp_path / "config",
        clusters={"c": {"server": "https://h", "certificate-authority-data": base64.b64encode(pem).decode()}},
        users={
            "u": {"tokenFile": "token", "client-certificate-data": base64.b64encode(pem).decode()},
        },
    )
    creds = load_credentials(str(config), environ=NO_ENV)
    assert creds.token == "from-file"
    assert creds.ca_data == pem
    assert creds.cert_data == pem


def test_a_basic_auth_user() -> None:
    creds = Credentials("https://h", username="alice", password="pw")
    assert creds.headers() == {"Authorization": "Basic " + base64.b64encode(b"alice:pw").decode()}


def test_kubeconfig_files_merge_as_kubectl_merges_them(tmp_path: Path) -> None:
    first = kubeconfig(
        tmp_path / "a",
        clusters={"c": {"server": "https://first"}},
        users={"u": {"token": "first"}},
        contexts={"main": ("c", "u")},
        current=None,
    )
    second = kubeconfig(
        tmp_path / "b",
        clusters={"c": {"server": "https://second"}, "d": {"server": "https://d"}},
        users={"u": {"token": "second"}},
        contexts={"main": ("c", "u"), "other": ("d", "u")},
        current="other",
    )
    env = {"KUBECONFIG": os.pathsep.join([str(tmp_path / "missing"), str(first), str(second)])}
    current = load_credentials(environ=env)
    # The current-context is the second file's (the first names none); its cluster "d" too; the user
    # "u" the first file named.
    assert (current.server, current.token) == ("https://d", "first")
    named = load_credentials(context="main", environ=env)
    assert (named.server, named.token) == ("https://first", "first")


def test_home_kubeconfig_when_kubeconfig_is_unset(tmp_path: Path) -> None:
    kubeconfig(tmp_path / ".kube" / "config", users={"u": {"token": "home"}})
    assert load_credentials(environ={"HOME": str(tmp_path)}).token == "home"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": "nope"}, 'context "nope" not found in {config}'),
        ({"kubeconfig": "/no/such/kubeconfig"}, "kubeconfig /no/such/kubeconfig: no such file"),
    ],
)
def test_an_unknown_context_or_file_is_one_line(tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    config = kubeconfig(tmp_path / "config", users={"u": {"token": "t"}})
    with pytest.raises(LoginError) as caught:
        load_credentials(kwargs.get("kubeconfig", str(config)), kwargs.get("context"), environ=NO_ENV)
    assert str(caught.value) == message.format(config=config)


def test_no_kubeconfig_and_no_pod_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(LoginError) as caught:
        load_credentials(environ={"HOME": str(tmp_path)}, in_cluster=tmp_path / "sa")
    assert (
        str(caught.value) == "no kubeconfig ($KUBECONFIG or ~/.kube/config) and not in a pod of the cluster"
    )


def test_in_a_pod_its_service_account(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("pod-token")
    (sa / "ca.crt").write_text("ca")
    env = {"HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    creds = load_credentials(environ=env, in_cluster=sa)
    assert (creds.server, creds.token, creds.ca_file) == (
        "https://[fd00::1]:443",
        "pod-token",
        str(sa / "ca.crt"),
    )
    # A kubeconfig comes first for the user (kubectl's order), the pod first for the operator.
    kubeconfig(tmp_path / ".kube" / "config", users={"u": {"token": "home"}})
    assert load_credentials(environ=env, in_cluster=sa).token == "home"
    assert load_credentials(environ=env, in_cluster=sa, in_cluster_first=True).token == "pod-token"


def test_an_exec_plugin_gets_its_env_args_and_request_and_gives_a_token(tmp_path: Path) -> None:
    script = plugin(
        tmp_path / "bin" / "get-token",
        status={"token": "exec-token", "expirationTimestamp": "2030-01-02T03:04:05Z"},
    )
    config = kubeconfig(
        tmp_path / "config",
        clusters={
            "c": {"server": "https://h:6443", "certificate-authority-data": base64.b64encode(b"CA").decode()}
        },
        users={
            "u": exec_user(
                "./bin/get-token",  # a path relative to the kubeconfig's folder
                args=["--cluster", "prod"],
                env=[{"name": "AWS_PROFILE", "value": "team"}],
                provideClusterInfo=True,
            )
        },
    )
    creds = load_credentials(str(config), environ={**NO_ENV, "PATH": os.environ["PATH"]})
    assert creds.token == "exec-token"
    assert creds.expires == 1893553445.0
    (run,) = runs(script)
    assert run["argv"] == ["--cluster", "prod"]
    assert run["env"]["AWS_PROFILE"] == "team"
    assert json.loads(run["env"]["KUBERNETES_EXEC_INFO"]) == {
        "apiVersion": V1,
        "kind": "ExecCredential",
        "spec": {
            "interactive": False,
            "cluster": {
                "server": "https://h:6443",
                "certificate-authority-data": base64.b64encode(b"CA").decode(),
            },
        },
    }


def test_an_exec_plugin_may_give_a_client_certificate(tmp_path: Path) -> None:
    plugin(tmp_path / "p", status={"clientCertificateData": "CERT PEM", "clientKeyData": "KEY PEM"})
    config = kubeconfig(tmp_path / "config", users={"u": exec_user(str(tmp_path / "p"))})
    creds = load_credentials(str(config), environ=NO_ENV)
    assert (creds.cert_data, creds.key_data, creds.token) == (b"CERT PEM", b"KEY PEM", None)


@pytest.mark.parametrize(
    ("user", "message"),
    [
        (
            {"exit_code": 1, "stderr": "loading...\nError: the SSO session has expired; run aws sso login\n"},
            "exec plugin {p} failed (exit status 1): Error: the SSO session has expired; run aws sso login",
        ),
        (
            {"status": {"expirationTimestamp": "2030-01-01T00:00:00Z"}},
            "exec plugin {p}: its ExecCredential has neither",
        ),
    ],
)
def test_a_failing_plugin_is_one_line(tmp_path: Path, user: dict[str, Any], message: str) -> None:
    script = plugin(tmp_path / "p", **user)
    config = kubeconfig(tmp_path / "config", users={"u": exec_user(str(script))})
    with pytest.raises(LoginError) as caught:
        load_credentials(str(config), environ=NO_ENV)
    assert message.format(p=script) in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("exec_spec", "message"),
    [
        (
            {"command": "gke-gcloud-auth-plugin-missing", "installHint": "Install it with gcloud components"},
            "exec plugin gke-gcloud-auth-plugin-missing: cannot run it: No such file or directory "
            "(Install it with gcloud components)",
        ),
        ({"interactiveMode": "Always"}, "it needs a terminal to talk to you (interactiveMode Always)"),
        ({"interactiveMode": None}, "interactiveMode must be one of Never, IfAvailable, Always"),
        (
            {"apiVersion": "client.authentication.k8s.io/v1alpha1"},
            "apiVersion 'client.authentication.k8s.io/v1alpha1'",
        ),
    ],
)
def test_an_exec_spec_kubectl_would_refuse_is_one_line(
    tmp_path: Path, exec_spec: dict[str, Any], message: str
) -> None:
    script = plugin(tmp_path / "p")
    spec = exec_user(str(script))["exec"] | exec_spec
    config = kubeconfig(tmp_path / "config", users={"u": {"exec": {k: v for k, v in spec.items() if v}}})
    with pytest.raises(LoginError) as caught:
        load_credentials(str(config), environ={"PATH": "/nonexistent"})
    assert message in str(caught.value)
    assert runs(script) == []


def test_an_answer_in_another_version_is_refused(tmp_path: Path) -> None:
    script = plugin(tmp_path / "p")
    beta = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(script)}}
    config = kubeconfig(tmp_path / "config", users={"u": beta})
    with pytest.raises(
        LoginError, match=r"answered in 'client.authentication.k8s.io/v1', asked in .*/v1beta1"
    ):
        load_credentials(str(config), environ=NO_ENV)


def test_an_auth_provider_is_refused_by_name(tmp_path: Path) -> None:
    config = kubeconfig(tmp_path / "config", users={"u": {"auth-provider": {"name": "gcp", "config": {}}}})
    with pytest.raises(LoginError, match='the auth-provider "gcp", which is not supported: use its exec'):
        load_credentials(str(config), environ=NO_ENV)


def test_an_interactive_plugin_talks_to_a_terminal(tmp_path: Path) -> None:
    """With stdin a terminal (a real pseudo-terminal here), ``IfAvailable`` runs the plugin
    interactively: ``spec.interactive`` true, and the terminal as its stdin."""
    script = plugin(tmp_path / "p")
    user = exec_user(str(script), interactiveMode="IfAvailable")
    config = kubeconfig(tmp_path / "config", users={"u": user})
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from gpuwarden.clients import load_credentials as load; "
                "print(load(sys.argv[1]).token)",
                str(config),
            ],
            stdin=follower,
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            timeout=60,
            check=False,
        )
    finally:
        os.close(leader)
        os.close(follower)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "from-plugin"
    (run,) = runs(script)
    assert json.loads(run["env"]["KUBERNETES_EXEC_INFO"])["spec"] == {"interactive": True}

"""Credentials for the API server as kubectl finds them: a kubeconfig's context, or the pod's ServiceAccount.

:func:`load` reads the kubeconfig given (else ``$KUBECONFIG``'s files, merged as kubectl merges them:
the first file to name a cluster, user or context wins, and the first ``current-context``; else
``~/.kube/config``), takes the context asked for (else the current one) and returns
:class:`Credentials`. Relative paths in a file are relative to that file's folder. In a pod with no
kubeconfig, the pod's ServiceAccount is used (``in_cluster_first`` tries it before any kubeconfig,
as the operator does).

A user logs in with a token (``token``, ``tokenFile``), a client certificate, a username and password,
or an ``exec`` credential plugin (``client.authentication.k8s.io/v1``, and ``v1beta1``): the plugin runs
with the user's ``env`` and ``args``, and ``KUBERNETES_EXEC_INFO`` holding the ExecCredential request
(the cluster too, with ``provideClusterInfo``); it may talk to the user (``interactiveMode``) only when
stdin is a terminal, and then its stderr is the user's. Its answer's ``expirationTimestamp`` becomes
:attr:`Credentials.expires`: the caller keeps the credentials until then (and runs :func:`load` again
on a 401), as client-go does. The legacy ``auth-provider`` and ``proxy-url`` are not read: they are
refused by name.

Every failure is a :class:`LoginError` whose text is one line for the user.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gpuwarden.kubetime import parse_epoch

__all__ = ["IN_CLUSTER", "Credentials", "LoginError", "load"]

IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod finds its ServiceAccount's token and the cluster's CA."""
EXEC_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")
EXEC_CLUSTER_CONFIG = "client.authentication.k8s.io/exec"
"""The cluster extension handed to a plugin with ``provideClusterInfo`` (its ``config``)."""


class LoginError(Exception):
    """No credentials could be had; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """One API server and how to prove who we are to it. PEM data is PEM (kubeconfig's base64 decoded)."""

    server: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    cert_file: str | None = None
    cert_data: bytes | None = None
    key_file: str | None = None
    key_data: bytes | None = None
    token: str | None = field(default=None, repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    expires: float | None = None
    """Epoch seconds after which they are to be loaded again (an exec plugin's expiry); None: never."""
    source: str = ""
    """Where they came from, for messages: ``context "prod" of ~/.kube/config``, or ``the pod's
    ServiceAccount``."""

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header, if they carry one."""
        if self.token:
            return {"Authorization": f"Bearer {self.token}"}
        if self.username is not None and self.password is not None:
            basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        return {}

    def expired(self, now: float) -> bool:
        """Whether they are past their expiry at ``now`` (epoch seconds)."""
        return self.expires is not None and now >= self.expires


def load(
    kubeconfig: str | None = None,
    context: str | None = None,
    *,
    in_cluster_first: bool = False,
    environ: Mapping[str, str] = os.environ,
    in_cluster: Path = IN_CLUSTER,
) -> Credentials:
    """The credentials of ``context`` (else the current context) in ``kubeconfig`` (else ``$KUBECONFIG``,
    else ``~/.kube/config``), or the pod's ServiceAccount where there is no kubeconfig (first, with
    ``in_cluster_first``, unless a kubeconfig or context is asked for by name)."""
    named = kubeconfig is not None or context is not None
    if in_cluster_first and not named and (found := _in_cluster(environ, in_cluster)) is not None:
        return found
    paths = _paths(kubeconfig, environ)
    if not paths:
        if context is None and (found := _in_cluster(environ, in_cluster)) is not None:
            return found
        raise LoginError("no kubeconfig ($KUBECONFIG or ~/.kube/config) and not in a pod of the cluster")
    return _Config(paths).credentials(context, environ)


def _paths(kubeconfig: str | None, environ: Mapping[str, str]) -> list[Path]:
    if kubeconfig is not None:
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            raise LoginError(f"kubeconfig {kubeconfig}: no such file")
        return [path]
    listed = environ.get("KUBECONFIG", "")
    if listed:
        # kubectl skips the files of $KUBECONFIG that do not exist.
        paths = [Path(p).expanduser() for p in listed.split(os.pathsep) if p]
        return [p for p in paths if p.is_file()]
    home = Path(environ.get("HOME") or Path.home()) / ".kube" / "config"
    return [home] if home.is_file() else []


def _in_cluster(environ: Mapping[str, str], directory: Path) -> Credentials | None:
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    token_path = directory / "token"
    if not host or not port or not token_path.is_file():
        return None
    ca = directory / "ca.crt"
    # An IPv6 service address is bracketed in a URL.
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return Credentials(
        server,
        ca_file=str(ca) if ca.is_file() else None,
        token=_read(token_path, "the pod's ServiceAccount token").strip(),
        source="the pod's ServiceAccount",
    )


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise LoginError(f"{what} {path}: {exc.strerror or exc}") from None


def _data(body: Mapping[str, Any], key: str, source: str) -> bytes | None:
    """A kubeconfig ``*-data`` field: base64 of PEM."""
    if not body.get(key):
        return None
    try:
        return base64.b64decode(str(body[key]), validate=True)
    except (binascii.Error, ValueError):
        raise LoginError(f"{source}: {key} is not base64") from None


@dataclass
class _Entry:
    """A named cluster, user or context, and the folder of the file that named it first."""

    body: Mapping[str, Any]
    folder: Path

    def path(self, key: str) -> str | None:
        value = self.body.get(key)
        if not value:
            return None
        path = Path(str(value)).expanduser()
        return str(path if path.is_absolute() else self.folder / path)


class _Config:
    """``$KUBECONFIG``'s files merged: the first file to name an entry or a current-context wins."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.files = ", ".join(str(p) for p in paths)
        self.current = ""
        self.entries: dict[str, dict[str, _Entry]] = {"cluster": {}, "user": {}, "context": {}}
        for path in paths:
            try:
                doc = yaml.safe_load(_read(path, "kubeconfig")) or {}
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f" (line {mark.line + 1})" if mark is not None else ""
                raise LoginError(f"kubeconfig {path}: not YAML{where}") from None
            if not isinstance(doc, dict):
                raise LoginError(f"kubeconfig {path}: not a kubeconfig")
            self.current = self.current or str(doc.get("current-context") or "")
            for kind, named in self.entries.items():
                for item in doc.get(kind + "s") or ():
                    if isinstance(item, dict) and item.get("name") and isinstance(item.get(kind), dict):
                        named.setdefault(str(item["name"]), _Entry(item[kind], path.parent))

    def credentials(self, context: str | None, environ: Mapping[str, str]) -> Credentials:
        name = context or self.current
        if not name:
            raise LoginError(f"no current-context in {self.files}: name one with --context")
        ctx = self.entries["context"].get(name)
        if ctx is None:
            raise LoginError(f'context "{name}" not found in {self.files}')
        source = f'context "{name}" of {self.files}'
        cluster_name = str(ctx.body.get("cluster") or "")
        cluster = self.entries["cluster"].get(cluster_name)
        if cluster is None:
            raise LoginError(f'{source}: its cluster "{cluster_name}" is not in the file')
        user_name = str(ctx.body.get("user") or "")
        user = self.entries["user"].get(user_name) if user_name else _Entry({}, cluster.folder)
        if user is None:
            raise LoginError(f'{source}: its user "{user_name}" is not in the file')
        return _credentials(cluster, user, user_name, source, environ)


def _credentials(
    cluster: _Entry, user: _Entry, user_name: str, source: str, environ: Mapping[str, str]
) -> Credentials:
    c, u = cluster.body, user.body
    server = str(c.get("server") or "")
    if not server:
        raise LoginError(f"{source}: its cluster has no server")
    if c.get("proxy-url"):
        raise LoginError(f"{source}: proxy-url is not supported")
    if u.get("auth-provider"):
        provider = u["auth-provider"].get("name", "?") if isinstance(u["auth-provider"], dict) else "?"
        raise LoginError(
            f'{source}: user "{user_name}" logs in with the auth-provider "{provider}", which is not '
            "supported: use its exec credential plugin (kubectl dropped auth-providers in 1.26)"
        )
    ca_data = _data(c, "certificate-authority-data", source)
    creds = Credentials(
        server,
        ca_file=None if ca_data else cluster.path("certificate-authority"),
        ca_data=ca_data,
        insecure=bool(c.get("insecure-skip-tls-verify")),
        tls_server_name=str(c["tls-server-name"]) if c.get("tls-server-name") else None,
        cert_file=user.path("client-certificate"),
        cert_data=_data(u, "client-certificate-data", source),
        key_file=user.path("client-key"),
        key_data=_data(u, "client-key-data", source),
        token=str(u["token"]) if u.get("token") else None,
        username=str(u["username"]) if u.get("username") else None,
        password=str(u["password"]) if u.get("password") is not None else None,
        source=source,
    )
    if token_file := user.path("tokenFile"):
        creds = replace(creds, token=_read(Path(token_file), f"{source}: tokenFile").strip())
    if isinstance(u.get("exec"), dict):
        creds = _exec(creds, u["exec"], user.folder, c, environ)
    return creds


def _exec(
    creds: Credentials,
    spec: Mapping[str, Any],
    folder: Path,
    cluster: Mapping[str, Any],
    environ: Mapping[str, str],
) -> Credentials:
    """The credentials with what the exec plugin of ``spec`` printed (a token, or a client certificate)."""
    version = str(spec.get("apiVersion") or "")
    command = str(spec.get("command") or "")
    what = f"{creds.source}: exec plugin {command or '(no command)'}"
    if version not in EXEC_VERSIONS:
        raise LoginError(f"{what}: apiVersion {version!r} is not one of {', '.join(EXEC_VERSIONS)}")
    if not command:
        raise LoginError(f"{what}: no command")
    mode = spec.get("interactiveMode") or ("IfAvailable" if version.endswith("v1beta1") else None)
    if mode not in INTERACTIVE_MODES:
        raise LoginError(f"{what}: interactiveMode must be one of {', '.join(INTERACTIVE_MODES)}")
    terminal = sys.stdin is not None and sys.stdin.isatty()
    if mode == "Always" and not terminal:
        raise LoginError(f"{what}: it needs a terminal to talk to you (interactiveMode Always)")
    interactive = mode != "Never" and terminal
    request: dict[str, Any] = {"interactive": interactive}
    if spec.get("provideClusterInfo"):
        request["cluster"] = _cluster_info(creds, cluster)
    env = dict(environ)
    for pair in spec.get("env") or ():
        if isinstance(pair, dict) and pair.get("name"):
            env[str(pair["name"])] = str(pair.get("value", ""))
    env["KUBERNETES_EXEC_INFO"] = json.dumps(
        {"apiVersion": version, "kind": "ExecCredential", "spec": request}
    )
    # A command with a slash is a path, relative to the kubeconfig's folder; a bare name is looked up in PATH.
    program = str(folder / command) if os.sep in command and not os.path.isabs(command) else command
    argv = [program, *(str(a) for a in spec.get("args") or ())]
    try:
        done = subprocess.run(
            argv,
            env=env,
            stdin=None if interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            # An interactive plugin prompts on stderr; otherwise its complaint is our message.
            stderr=None if interactive else subprocess.PIPE,
            check=False,
        )
    except OSError as exc:
        hint = str(spec.get("installHint") or "").strip().splitlines()
        more = f" ({hint[0]})" if hint else ""
        raise LoginError(f"{what}: cannot run it: {exc.strerror or exc}{more}") from None
    if done.returncode != 0:
        said = (done.stderr or b"").decode(errors="replace").strip().splitlines()
        tail = f": {said[-1]}" if said else ""
        raise LoginError(f"{what} failed (exit status {done.returncode}){tail}")
    return _exec_answer(creds, done.stdout, version, what)


def _cluster_info(creds: Credentials, cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The cluster as an ExecCredential request carries it (``provideClusterInfo``)."""
    ca = creds.ca_data
    if ca is None and creds.ca_file:
        ca = Path(creds.ca_file).read_bytes() if Path(creds.ca_file).is_file() else None
    info: dict[str, Any] = {"server": creds.server}
    if creds.tls_server_name:
        info["tls-server-name"] = creds.tls_server_name
    if creds.insecure:
        info["insecure-skip-tls-verify"] = True
    if ca:
        info["certificate-authority-data"] = base64.b64encode(ca).decode()
    for extension in cluster.get("extensions") or ():
        if isinstance(extension, dict) and extension.get("name") == EXEC_CLUSTER_CONFIG:
            info["config"] = extension.get("extension")
    return info


def _exec_answer(creds: Credentials, stdout: bytes, version: str, what: str) -> Credentials:
    try:
        answer = json.loads(stdout)
    except ValueError:
        raise LoginError(f"{what}: printed no ExecCredential (not JSON)") from None
    if not isinstance(answer, dict) or answer.get("kind") != "ExecCredential":
        raise LoginError(f"{what}: printed no ExecCredential")
    if answer.get("apiVersion") != version:
        raise LoginError(f"{what}: answered in {answer.get('apiVersion')!r}, asked in {version}")
    status = answer.get("status")
    if not isinstance(status, dict):
        raise LoginError(f"{what}: its ExecCredential has no status")
    token = status.get("token")
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if not token and not (cert and key):
        raise LoginError(f"{what}: its ExecCredential has neither a token nor a client certificate and key")
    expires = None
    if status.get("expirationTimestamp"):
        expires = parse_epoch(status["expirationTimestamp"])
        if expires is None:
            raise LoginError(f"{what}: expirationTimestamp {status['expirationTimestamp']!r} is not RFC 3339")
    if token:
        return replace(creds, token=str(token), username=None, password=None, expires=expires)
    # An ExecCredential's certificate and key are PEM as they are (a kubeconfig's are base64 of PEM).
    return replace(
        creds,
        cert_file=None,
        cert_data=str(cert).encode(),
        key_file=None,
        key_data=str(key).encode(),
        expires=expires,
    )

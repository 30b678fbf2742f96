"""A real, throwaway Kubernetes control plane (etcd + kube-apiserver) for tests.

The binaries come from ``hack/build-control-plane.sh --print-env``, which builds
kube-apiserver, kubectl, etcd, helm, the node's binaries and Kueue from their Go modules into a cache outside
the work tree (only what is missing).  :class:`ControlPlane` then

* generates a throwaway CA, a serving certificate for localhost/127.0.0.1 and a
  service-account signing key (``cryptography``),
* starts etcd on free loopback ports with a temporary data dir (``--unsafe-no-fsync``),
* starts kube-apiserver on loopback with RBAC, a static admin token in
  ``system:masters`` and a service-account issuer (TokenRequest/TokenReview work),
* waits for ``/readyz`` and the ``default`` namespace, and writes an admin kubeconfig.

There is no kube-controller-manager, scheduler or kubelet: namespaces never finish
terminating, ServiceAccounts are not auto-created, and pods are never scheduled. A
control plane made with ``with_nodes=True`` is ready for them (``node.py`` runs them,
logging in with :meth:`ControlPlane.client_kubeconfig` certificates).

Processes are started in their own process group with ``PR_SET_PDEATHSIG`` (they die
with the test process even on SIGKILL), are killed by :meth:`ControlPlane.stop`
(pytest finalizer) and by an ``atexit`` hook, and SIGTERM to pytest is turned into
KeyboardInterrupt so that pytest runs its teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import functools
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-control-plane.sh"

#: How long one control-plane component may take to become ready.
START_TIMEOUT_S = float(os.environ.get("GPUWARDEN_CONTROLPLANE_START_TIMEOUT", "120"))
#: How long the build script may take (a cold build compiles Kubernetes).
BUILD_TIMEOUT_S = float(os.environ.get("GPUWARDEN_CONTROLPLANE_BUILD_TIMEOUT", str(90 * 60)))
#: Poll interval for readiness checks.
POLL_INTERVAL_S = 0.1
#: Default timeout of one kubectl/helm invocation.
COMMAND_TIMEOUT_S = 120.0

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
API_AUDIENCES = (SERVICE_ACCOUNT_ISSUER, "gpuwarden-test")
ADMIN_USER = "gpuwarden-admin"


class ControlPlaneError(RuntimeError):
    """The control plane (or its binaries) could not be brought up."""


class BuildError(ControlPlaneError):
    """A build script (``hack/build-control-plane.sh``, ``hack/build-images.sh``) failed."""


def in_ci() -> bool:
    """True when running under CI (``CI=true``), where nothing may be skipped."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class Binaries:
    """Paths of the control-plane and node binaries, and their versions."""

    kube_apiserver: Path
    kubectl: Path
    etcd: Path
    helm: Path
    kubelet: Path
    kube_proxy: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    coredns: Path
    kueue: Path
    kueue_manifests: Path
    """Kueue's and the reclaim targets' manifests (:mod:`kueue`), copied from their Go modules."""
    versions: Mapping[str, str] = field(default_factory=dict)

    def missing(self) -> list[Path]:
        return [
            p
            for p in (
                self.kube_apiserver,
                self.kubectl,
                self.etcd,
                self.helm,
                self.kubelet,
                self.kube_proxy,
                self.kube_scheduler,
                self.kube_controller_manager,
                self.coredns,
                self.kueue,
            )
            if not (p.is_file() and os.access(p, os.X_OK))
        ] + ([] if self.kueue_manifests.is_dir() else [self.kueue_manifests])


def parse_env_lines(text: str) -> dict[str, str]:
    """Parse ``KEY=value`` lines (the ``--print-env`` output); other lines are ignored."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and key.replace("_", "").isalnum() and key.isupper():
            env[key] = value
    return env


def run_print_env(script: Path, timeout: float) -> dict[str, str]:
    """Run ``script --print-env`` (a hack/build-*.sh: it builds what is missing) and parse its lines.

    Raises :class:`BuildError` with the script's output when it fails or times out.
    """
    if not script.is_file():
        raise BuildError(f"{script} does not exist")
    try:
        proc = subprocess.run(
            ["bash", str(script), "--print-env"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{script} did not finish within {timeout:.0f}s") from exc
    if proc.returncode != 0:
        raise BuildError(
            f"{script} --print-env failed with exit status {proc.returncode}:\n"
            f"{_tail(proc.stderr)}{_tail(proc.stdout)}"
        )
    return parse_env_lines(proc.stdout)


def locate_binaries(timeout: float = BUILD_TIMEOUT_S) -> Binaries:
    """Run ``hack/build-control-plane.sh --print-env`` (builds what is missing).

    Raises :class:`BuildError` with the script's output when it fails or does not
    report every binary.
    """
    env = run_print_env(BUILD_SCRIPT, timeout)
    keys = {
        "kube_apiserver": "KUBE_APISERVER",
        "kubectl": "KUBECTL",
        "etcd": "ETCD",
        "helm": "HELM",
        "kubelet": "KUBELET",
        "kube_proxy": "KUBE_PROXY",
        "kube_scheduler": "KUBE_SCHEDULER",
        "kube_controller_manager": "KUBE_CONTROLLER_MANAGER",
        "coredns": "COREDNS",
        "kueue": "KUEUE",
        "kueue_manifests": "KUEUE_MANIFESTS",
    }
    absent = [k for k in keys.values() if not env.get(k)]
    if absent:
        raise BuildError(f"{BUILD_SCRIPT} --print-env did not report {absent}: {env}")
    binaries = Binaries(
        **{field_name: Path(env[key]) for field_name, key in keys.items()},
        versions={k: v for k, v in env.items() if k.endswith("_VERSION")},
    )
    if missing := binaries.missing():
        raise BuildError(f"{BUILD_SCRIPT} succeeded but these binaries are missing: {missing}")
    return binaries


def _tail(text: str, lines: int = 60) -> str:
    if not text:
        return ""
    out = "\n".join(text.splitlines()[-lines:])
    return out + "\n"


# ------------------------------------------------------------------------------- PKI


@dataclass(frozen=True)
class Pki:
    """File paths of the throwaway PKI."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_private_key: Path
    sa_public_key: Path


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signing for both; a CA also signs certificates and CRLs, which a serving certificate must not."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=2)


def generate_pki(directory: Path, address: str = "127.0.0.1") -> Pki:
    """A CA, a serving certificate for localhost, 127.0.0.1 and ``address``, and a service-account key."""
    directory.mkdir(parents=True, exist_ok=True)
    not_before, not_after = _validity()

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuwarden-test-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    serving_key = ec.generate_private_key(ec.SECP256R1())
    service_ip = next(ipaddress.IPv4Network(SERVICE_CLUSTER_IP_RANGE).hosts())
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
        *(x509.IPAddress(ipaddress.IPv4Address(ip)) for ip in sorted({"127.0.0.1", address})),
        x509.IPAddress(service_ip),
    ]
    serving_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(serving_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_private_key=directory / "sa.key",
        sa_public_key=directory / "sa.pub",
    )
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    nocrypt = serialization.NoEncryption()
    pki.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    _write_private(pki.ca_key, ca_key.private_bytes(pem, pkcs8, nocrypt))
    pki.serving_cert.write_bytes(serving_cert.public_bytes(pem))
    _write_private(pki.serving_key, serving_key.private_bytes(pem, pkcs8, nocrypt))
    _write_private(pki.sa_private_key, sa_key.private_bytes(pem, pkcs8, nocrypt))
    pki.sa_public_key.write_bytes(
        sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pki


def issue_client_certificate(
    pki: Pki, directory: Path, common_name: str, organizations: Sequence[str] = ()
) -> tuple[Path, Path]:
    """A client certificate signed by the CA: the API server maps CN to the user, O to its groups.

    Returns the certificate's and key's paths, named after the common name.
    """
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    not_before, not_after = _validity()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    stem = _NOT_FILENAME.sub("-", common_name)
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        key_path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
    return cert_path, key_path


_NOT_FILENAME = re.compile(r"[^A-Za-z0-9._-]+")


# ------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (sockets held open together so they differ)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


_PR_SET_PDEATHSIG = 1
_libc: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: die with SIGKILL when the process that started us dies (Linux).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so it is only
    armed for children started from the main thread (a worker thread may end early).
    """
    armed = _libc is not None and threading.current_thread() is threading.main_thread()

    def setup() -> None:
        if armed:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The parent may have died between fork and prctl.
            if os.getppid() != parent_pid:
                os._exit(1)

    return setup


class ManagedProcess:
    """A child process in its own process group, with output going to a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, cwd: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killpg reaches every child
                preexec_fn=_child_setup(os.getpid()),
                env=_child_env(),
            )
        except BaseException:
            self._log.close()
            raise
        _registry.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return _tail(text, lines)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; reap it."""
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=grace)
            # Kill whatever is left in the group (the leader may be gone already).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        finally:
            with contextlib.suppress(OSError):
                self._log.close()
            _registry.discard(self)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Never let a developer's kubeconfig or proxy settings leak into the control plane.
    for key in ("KUBECONFIG", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        env.pop(key, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


class _Registry:
    """Every live ManagedProcess, killed by atexit and on SIGTERM."""

    def __init__(self) -> None:
        self._procs: set[ManagedProcess] = set()
        self._lock = threading.Lock()
        self._installed = False

    def add(self, p: ManagedProcess) -> None:
        with self._lock:
            self._procs.add(p)
            if not self._installed:
                self._installed = True
                atexit.register(self.kill_all)
                _install_sigterm_handler()

    def discard(self, p: ManagedProcess) -> None:
        with self._lock:
            self._procs.discard(p)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            p.stop(grace=5.0)


_registry = _Registry()


def _install_sigterm_handler() -> None:
    """Turn SIGTERM into KeyboardInterrupt so pytest tears fixtures down.

    Only when nobody else handles SIGTERM and only in the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(f"received signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)


def wait_for(
    condition: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    alive: Callable[[], str | None] | None = None,
    interval: float = POLL_INTERVAL_S,
) -> None:
    """Poll ``condition`` until it is true, ``alive`` reports a failure, or the deadline.

    ``alive`` returns an error message when waiting is pointless (a process exited).
    """
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if alive is not None and (err := alive()):
            raise ControlPlaneError(f"while waiting for {what}: {err}")
        if time.monotonic() >= deadline:
            raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)  # polling interval of a condition wait, not synchronisation


# ---------------------------------------------------------------------- control plane


class ControlPlane:
    """etcd + kube-apiserver on loopback, with an admin kubeconfig.

    ``address`` is where kube-apiserver listens and what it advertises (loopback unless a
    node's pods must reach it). ``with_nodes`` configures it for kubelets and controllers
    (tests/integration/node.py): the Node authorizer and NodeRestriction, the
    ServiceAccount admission plugin (which needs kube-controller-manager to create each
    namespace's ``default`` ServiceAccount), and a client certificate for the kubelets.

    Attributes available after :meth:`start`:

    ``kubeconfig``  path of the admin kubeconfig (static token, CA-verified TLS)
    ``server``      the API server URL (``https://127.0.0.1:<port>``)
    ``ca_path``     the CA certificate that signed the serving certificate
    ``admin_token`` bearer token of a ``system:masters`` user
    ``helm``        path of the helm binary; ``kubectl_path`` likewise
    ``startup_seconds`` time from starting etcd to a ready API server
    """

    def __init__(
        self,
        binaries: Binaries,
        workdir: Path | None = None,
        *,
        address: str = "127.0.0.1",
        with_nodes: bool = False,
        apiserver_flags: Sequence[str] = (),
    ) -> None:
        self.binaries = binaries
        self.address = address
        self.with_nodes = with_nodes
        self.apiserver_flags = tuple(apiserver_flags)
        """More kube-apiserver flags (e.g. an admission configuration)."""
        self._own_workdir = workdir is None
        self.workdir = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="gpuwarden-cp-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.admin_token = secrets.token_urlsafe(32)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.ca_path = self.workdir / "pki" / "ca.crt"
        self.helm = binaries.helm
        self.kubectl_path = binaries.kubectl
        self.server = ""
        self.etcd_url = ""
        self.startup_seconds = 0.0
        self.etcd: ManagedProcess | None = None
        self.apiserver: ManagedProcess | None = None
        self.pki: Pki | None = None
        self._ssl: ssl.SSLContext | None = None
        self._etcd_paused = False

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start etcd and kube-apiserver; return once the API server is ready."""
        t0 = time.monotonic()
        try:
            pki = self.pki = generate_pki(self.workdir / "pki", self.address)
            self.ca_path = pki.ca_cert
            self._ssl = ssl.create_default_context(cafile=str(pki.ca_cert))
            self._start_etcd()
            self._start_apiserver()
            self._write_kubeconfig()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Kill kube-apiserver and etcd (idempotent)."""
        self.resume_etcd()  # a stopped process would sit out SIGTERM's grace
        for proc in (self.apiserver, self.etcd):
            if proc is not None:
                proc.stop()
        self.apiserver = self.etcd = None
        if self._own_workdir and not os.environ.get("GPUWARDEN_KEEP_CONTROLPLANE"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _start_etcd(self, attempts: int = 3) -> None:
        data_dir = self.workdir / "etcd-data"
        for attempt in range(1, attempts + 1):
            shutil.rmtree(data_dir, ignore_errors=True)
            client_port, peer_port = free_ports(2)
            client_url = f"http://127.0.0.1:{client_port}"
            peer_url = f"http://127.0.0.1:{peer_port}"
            self.etcd = ManagedProcess(
                "etcd",
                [
                    str(self.binaries.etcd),
                    "--name=gpuwarden-test",
                    f"--data-dir={data_dir}",
                    f"--listen-client-urls={client_url}",
                    f"--advertise-client-urls={client_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=gpuwarden-test={peer_url}",
                    "--initial-cluster-state=new",
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                    "--quota-backend-bytes=1073741824",
                ],
                self.workdir / "etcd.log",
                self.workdir,
            )
            try:
                wait_for(
                    functools.partial(self._etcd_healthy, client_url),
                    timeout=START_TIMEOUT_S,
                    what=f"etcd at {client_url}",
                    alive=self._exited(self.etcd),
                )
            except ControlPlaneError as exc:
                log = self.etcd.log_tail()
                self.etcd.stop()
                if attempt < attempts and "address already in use" in log:
                    continue  # lost a port race; pick new ports
                raise ControlPlaneError(f"{exc}\n--- etcd log ---\n{log}") from exc
            self.etcd_url = client_url
            return

    def _start_apiserver(self, attempts: int = 3) -> None:
        tokens = self.workdir / "tokens.csv"
        _write_private(tokens, f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'.encode())
        for attempt in range(1, attempts + 1):
            port = free_port()
            self.server = f"https://{self.address}:{port}"
            try:
                self._launch_apiserver()
            except ControlPlaneError as exc:
                if attempt < attempts and "address already in use" in str(exc):
                    continue
                raise
            return

    def _launch_apiserver(self) -> None:
        """Start kube-apiserver on ``self.server``'s port; return once it is ready."""
        assert self.pki is not None
        pki = self.pki
        port = self.server.rpartition(":")[2]
        self.apiserver = ManagedProcess(
            "kube-apiserver",
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers={self.etcd_url}",
                f"--advertise-address={self.address}",
                f"--bind-address={self.address}",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.sa_public_key}",
                f"--service-account-signing-key-file={pki.sa_private_key}",
                f"--api-audiences={','.join(API_AUDIENCES)}",
                *self._apiserver_node_flags(pki),
                # As every cluster installer sets it (kubeadm, GKE, EKS, AKS): the chart's privileged
                # fallback (agent.gpuAccess.mode=privileged) must be admitted as it is there.
                "--allow-privileged=true",
                *self.apiserver_flags,
                "--profiling=false",
                "--v=1",
            ],
            self.workdir / "kube-apiserver.log",
            self.workdir,
        )
        try:
            wait_for(
                lambda: self._get("/readyz") == 200,
                timeout=START_TIMEOUT_S,
                what=f"kube-apiserver {self.server}/readyz",
                alive=self._exited(self.apiserver),
            )
            wait_for(
                lambda: self._get("/api/v1/namespaces/default") == 200,
                timeout=START_TIMEOUT_S,
                what="the default namespace",
                alive=self._exited(self.apiserver),
            )
        except ControlPlaneError as exc:
            log = self.apiserver.log_tail()
            self.apiserver.stop()
            raise ControlPlaneError(f"{exc}\n--- kube-apiserver log ---\n{log}") from exc

    # -- faults (tests/integration/test_faults.py) -----------------------------------

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, as a rolling restart does); etcd and its data stay."""
        if self.apiserver is not None:
            self.apiserver.stop()
            self.apiserver = None

    def start_apiserver(self) -> None:
        """Start kube-apiserver again after :meth:`stop_apiserver`: the same port, certificates,
        tokens and etcd, so every client's kubeconfig and token still work. Returns once ready."""
        if self.apiserver is None:
            self._launch_apiserver()

    def pause_etcd(self) -> None:
        """SIGSTOP etcd: it keeps its connections open and answers nothing (a stalled disk or VM),
        so the API server's requests hang, until :meth:`resume_etcd`."""
        if self.etcd is not None and not self._etcd_paused:
            os.killpg(self.etcd.pid, signal.SIGSTOP)
            self._etcd_paused = True

    def resume_etcd(self) -> None:
        """SIGCONT etcd after :meth:`pause_etcd`."""
        if self.etcd is not None and self._etcd_paused:
            os.killpg(self.etcd.pid, signal.SIGCONT)
            self._etcd_paused = False

    def _apiserver_node_flags(self, pki: Pki) -> list[str]:
        """The flags that differ between an API server for kubelets and one without any."""
        flags = []
        if ipaddress.ip_address(self.address).is_loopback:
            # The endpoint reconciler refuses a loopback advertise address; otherwise it keeps
            # the `kubernetes` Service's endpoints at this server, as in any cluster.
            flags.append("--endpoint-reconciler-type=none")
        if not self.with_nodes:
            # No kube-controller-manager creates `default` ServiceAccounts for the admission plugin.
            return [*flags, "--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]
        kubelet_cert, kubelet_key = issue_client_certificate(
            pki, self.workdir / "pki", "kube-apiserver-kubelet-client", ["system:masters"]
        )
        return [
            *flags,
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={kubelet_cert}",
            f"--kubelet-client-key={kubelet_key}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    @staticmethod
    def _exited(proc: ManagedProcess | None) -> Callable[[], str | None]:
        def check() -> str | None:
            if proc is not None and not proc.running():
                return f"{proc.name} exited with status {proc.proc.returncode}"
            return None

        return check

    @staticmethod
    def _etcd_healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError):
            return False
        return str(body.get("health")) == "true"

    def _get(self, path: str) -> int:
        """HTTP status of an authenticated GET to the API server (0 when unreachable)."""
        req = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=2, context=self._ssl) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except OSError:
            return 0

    def get_json(self, path: str) -> Any:
        """An authenticated GET of an API path as the admin; None when absent or unreachable."""
        req = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5, context=self._ssl) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def _write_kubeconfig(self) -> None:
        self._write_kubeconfig_for(self.kubeconfig, ADMIN_USER, {"token": self.admin_token})

    def _write_kubeconfig_for(self, path: Path, user_name: str, user: Mapping[str, str]) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "gpuwarden-test",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_path)},
                }
            ],
            "users": [{"name": user_name, "user": dict(user)}],
            "contexts": [
                {"name": "gpuwarden-test", "context": {"cluster": "gpuwarden-test", "user": user_name}}
            ],
            "current-context": "gpuwarden-test",
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)

    def client_kubeconfig(self, common_name: str, organizations: Sequence[str] = ()) -> Path:
        """A kubeconfig authenticating as user ``common_name`` in ``organizations`` (client certificate).

        How the node's components log in: the kubelet as ``system:node:<name>`` in
        ``system:nodes``, the scheduler as ``system:kube-scheduler``, and so on, each
        authorized by the bootstrap RBAC roles (and the Node authorizer) like in any cluster.
        """
        assert self.pki is not None, "start() first"
        directory = self.workdir / "clients"
        cert, key = issue_client_certificate(self.pki, directory, common_name, organizations)
        path = directory / f"{cert.stem}.kubeconfig"
        self._write_kubeconfig_for(
            path, common_name, {"client-certificate": str(cert), "client-key": str(key)}
        )
        return path

    # -- clients ---------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """Environment for kubectl/helm/clients pointed at this control plane only."""
        env = _child_env()
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.workdir / "kube-cache")
        env["HELM_CACHE_HOME"] = str(self.workdir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.workdir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.workdir / "helm" / "data")
        return env

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = False,
        timeout: float = COMMAND_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this control plane; output is captured as text."""
        return self._run(
            [str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", *args], input, check, timeout
        )

    def run_helm(
        self,
        *args: str,
        input: str | None = None,
        check: bool = False,
        timeout: float = COMMAND_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this control plane; output is captured as text."""
        return self._run([str(self.helm), f"--kubeconfig={self.kubeconfig}", *args], input, check, timeout)

    def _run(
        self, argv: list[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO_ROOT,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def create_namespace(self, name: str) -> str:
        self.kubectl("create", "namespace", name, check=True)
        return name

    def logs(self) -> str:
        """Tails of the etcd and kube-apiserver logs (for failure messages)."""
        parts = []
        for proc in (self.etcd, self.apiserver):
            if proc is not None:
                parts.append(f"--- {proc.name} log ---\n{proc.log_tail()}")
        return "\n".join(parts)


@contextlib.contextmanager
def running_control_plane(binaries: Binaries, workdir: Path | None = None) -> Iterator[ControlPlane]:
    """Context manager form: start a control plane, always stop it."""
    cp = ControlPlane(binaries, workdir)
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()

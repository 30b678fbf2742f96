"""Kueue's real controller manager on a test control plane, installed from the manifests it is released with.

``hack/build-control-plane.sh`` builds the manager from ``sigs.k8s.io/kueue`` and copies, from the same
module versions, Kueue's CRD and webhook kustomizations and the CRDs of the workloads reclaim suspends
(RayCluster, JobSet, LeaderWorkerSet). :class:`Kueue` installs them as Kueue's release does, rendered
with ``kubectl kustomize``, with one change: the webhooks (Kueue's own API, a Job's ``suspend`` on
creation, and the conversion of its CRDs between ``v1beta1`` and ``v1beta2``) are reached through a
``url`` on loopback, where the manager serves them, instead of a Service no proxy routes here.

Certificates: Kueue's internal certificate management stays on (off, the manager reads its metrics
certificate from a fixed ``/etc/kueue`` path and will not start without it). Its rotator finds the
Secret made here valid (a CA named ``kueue-ca``, a serving certificate for the Service name) and keeps
it, then injects that CA into the webhook configurations and CRDs; the serving certificate also names
127.0.0.1, which the API server checks against the ``url``. The manager reads the certificate from its
``certDir``, written here as a pod's mounted Secret would be.

The control plane must be Kueue's alone: its webhooks fail closed (``failurePolicy: Fail``) on pods,
Deployments and Jobs, and outlive the manager.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from controlplane import START_TIMEOUT_S, ControlPlane, ManagedProcess, free_ports, wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
CA_NAME = "kueue-ca"
"""The name Kueue's rotator checks its CA for (``pkg/util/cert``): another would be replaced."""
FRAMEWORKS = ("batch/job",)
"""The integrations Kueue manages here; every other one gets Kueue's no-op webhook."""


@dataclass(frozen=True)
class WebhookPki:
    ca: bytes
    ca_key: bytes
    cert: bytes
    key: bytes


def _rsa_pem(key: rsa.RSAPrivateKey) -> bytes:
    # PKCS#1: the rotator parses the CA key with x509.ParsePKCS1PrivateKey.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def webhook_pki() -> WebhookPki:
    """A CA and a serving certificate that Kueue's rotator keeps: valid past its 90-day lookahead."""
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=365)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CA_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sans: list[x509.GeneralName] = [
        x509.DNSName(f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"),
        x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WEBHOOK_SERVICE)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return WebhookPki(ca.public_bytes(pem), _rsa_pem(ca_key), cert.public_bytes(pem), _rsa_pem(key))


def by_url(client_config: dict[str, Any], base: str, ca: bytes) -> dict[str, Any]:
    """A webhook's ``clientConfig`` naming a Service, pointed at ``base`` + the same path instead."""
    path = client_config["service"].get("path", "")
    return {"url": f"{base}{path}", "caBundle": base64.b64encode(ca).decode()}


def render(cp: ControlPlane, manifests: Path, base: str, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs and webhook configurations as its release installs them, reached at ``base``."""
    docs: list[dict[str, Any]] = []
    for component in ("crd", "webhook"):
        out = cp.kubectl("kustomize", str(manifests / "kueue" / component), check=True).stdout
        # libyaml's loader: Kueue's CRDs are 24k lines, seconds for the pure-Python one.
        docs.extend(d for d in yaml.load_all(out, Loader=yaml.CSafeLoader) if d)
    rendered = []
    for doc in docs:
        kind = doc["kind"]
        if kind == "Service":
            continue  # the url replaces it
        if kind == "CustomResourceDefinition":
            webhook = (doc["spec"].get("conversion") or {}).get("webhook")
            if webhook:
                webhook["clientConfig"] = by_url(webhook["clientConfig"], base, ca)
        else:  # Mutating/ValidatingWebhookConfiguration: named as config/default's namePrefix names them
            doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
            for hook in doc["webhooks"]:
                hook["clientConfig"] = by_url(hook["clientConfig"], base, ca)
        rendered.append(doc)
    return rendered


@dataclass
class Kueue:
    """Kueue's manager as a process, with admin credentials, on ``cp``; :meth:`start`, :meth:`stop`."""

    cp: ControlPlane
    binary: Path
    manifests: Path
    workdir: Path
    process: ManagedProcess | None = field(default=None, init=False)

    def start(self) -> None:
        webhook_port, health_port = free_ports(2)
        pki = webhook_pki()
        certs = self.workdir / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        (certs / "tls.crt").write_bytes(pki.cert)
        (certs / "tls.key").write_bytes(pki.key)
        self.cp.create_namespace(NAMESPACE)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
            "data": {
                name: base64.b64encode(data).decode()
                for name, data in (
                    ("ca.crt", pki.ca),
                    ("ca.key", pki.ca_key),
                    ("tls.crt", pki.cert),
                    ("tls.key", pki.key),
                )
            },
        }
        objects = [secret, *render(self.cp, self.manifests, f"https://127.0.0.1:{webhook_port}", pki.ca)]
        self.cp.kubectl(
            "apply",
            "--server-side",
            "-f",
            "-",
            "-f",
            str(self.manifests / "crds"),
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
            check=True,
            timeout=300,
        )
        self.cp.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s", check=True)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {
                "enable": True,
                "webhookServiceName": WEBHOOK_SERVICE,
                "webhookSecretName": WEBHOOK_SECRET,
            },
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": list(FRAMEWORKS)},
            # The on-demand visibility API is an aggregated API server of its own: not what is tested.
            "featureGates": {"VisibilityOnDemand": False},
        }
        config_path = self.workdir / "kueue-config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.process = ManagedProcess(
            "kueue",
            [str(self.binary), f"--config={config_path}", f"--kubeconfig={self.cp.kubeconfig}"],
            self.workdir / "kueue.log",
            self.workdir,
        )
        wait_for(
            lambda: _ok(f"http://127.0.0.1:{health_port}/readyz"),
            timeout=START_TIMEOUT_S,
            what=f"kueue ready (log: {self.workdir / 'kueue.log'})",
            alive=self._exited,
        )

    def _exited(self) -> str | None:
        if self.process is not None and not self.process.running():
            return f"kueue exited with status {self.process.proc.returncode}:\n{self.process.log_tail()}"
        return None

    def log_tail(self) -> str:
        return self.process.log_tail() if self.process is not None else ""

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except (OSError, urllib.error.URLError):
        return False

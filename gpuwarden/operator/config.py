"""The operator's configuration: one typed, frozen object built from the command line and the pod's env.

Every field says what it is for; the flags and their defaults are those of
``docs/deployment-contract.md``, declared once, in :meth:`OperatorConfig.add_arguments`
(the fields' defaults are checked against them by a test). :meth:`OperatorConfig.from_args`
checks them together with ``POD_NAME``, ``POD_NAMESPACE`` and ``POD_IP``; errors are
:class:`ConfigError` naming the flag or the environment variable at fault. The agent's
:class:`~gpuwarden.agent.config.AgentConfig` is built the same way.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuwarden.operator.accounting.settings import AccountingSettings
from gpuwarden.policy import CRITICAL_XIDS
from gpuwarden.units import parse_duration, parse_quantity

__all__ = [
    "Address",
    "ConfigError",
    "CordonMode",
    "OperatorConfig",
    "ServiceAccountRef",
    "derive_priority",
    "parse_address",
    "parse_service_account",
]

INGEST_ACTIVE_LABEL = "gpuwarden.dev/ingest-active"
"""The label the acting replica puts on its own pod; the ingest Service selects on it."""


class ConfigError(ValueError):
    """A flag or environment variable that cannot be used; the message names it."""


class CordonMode(enum.StrEnum):
    """``--cordon``: what the node view does to a node whose GPUs turn unhealthy."""

    OFF = "off"
    DRY_RUN = "dry-run"
    """Post the Event saying it would cordon the node, and change nothing."""
    ON = "on"


@dataclass(frozen=True, slots=True)
class Address:
    """A TCP listen address."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServiceAccountRef:
    """A ServiceAccount by namespace and name."""

    namespace: str
    name: str

    @property
    def username(self) -> str:
        """The user name the API server gives this ServiceAccount's tokens."""
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    def __str__(self) -> str:
        return f"{self.namespace}:{self.name}"


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Everything the operator is told at start; never changes while it runs."""

    namespaces: tuple[str, ...] = ()
    """Namespaces whose policies and pods are watched; empty means all (cluster-wide peering)."""
    ingest: Address = field(default_factory=lambda: Address("0.0.0.0", 8443))
    """Where agents POST their reports (/v1/reports)."""
    tls_cert_file: str | None = None
    """Serve the ingest endpoint over TLS with this certificate (and ``tls_key_file``)."""
    tls_key_file: str | None = None
    metrics: Address = field(default_factory=lambda: Address("0.0.0.0", 8080))
    """Where /metrics, /healthz and /readyz are served."""
    token_audience: str = "gpuwarden-operator"
    """The audience agents' projected tokens must carry; TokenReview is asked for exactly this one."""
    agent_service_account: ServiceAccountRef = field(
        default_factory=lambda: ServiceAccountRef("gpuwarden-system", "gpuwarden-agent")
    )
    """The only ServiceAccount whose tokens may post reports."""
    operator_service_account: ServiceAccountRef = field(
        default_factory=lambda: ServiceAccountRef("gpuwarden-system", "gpuwarden-operator")
    )
    """Sharded mode: the replicas' own ServiceAccount, the only one whose tokens may post verdicts."""
    peer_token_file: str | None = None
    """Sharded mode: the token this replica shows the other replicas (a projected ServiceAccount token
    for ``token_audience``), re-read for every send; None sends none."""
    peer_ca_file: str | None = None
    """Sharded mode: the CA bundle the other replicas' certificates must chain to (``--peer-ca-file``);
    None: the system's trust store."""
    peer_server_name: str | None = None
    """Sharded mode: the name the other replicas' certificates must carry (``--peer-server-name``);
    None: the host of their advertised URL (a pod IP, which a Service's certificate does not name)."""
    peering: str = "gpuwarden"
    """Kopf peering object name (ClusterKopfPeering cluster-wide, KopfPeering per namespace)."""
    priority: int = 0
    """Kopf peering priority: the live replica with the highest one acts."""
    identity: str = ""
    """This replica's Kopf peering identity (the pod name in a cluster)."""
    max_body_bytes: int = 2**20
    """Report bodies above this get 413: 1Mi holds about 4 minutes of 1 s snapshots of 8 GPUs, and
    bounds how long one report holds the event loop (parsing is one block; see ingest.LARGE_BODY)."""
    node_rate: float = 20.0
    """Reports per second a node may send before 429; agents report once a second and replay in batches."""
    token_review_rate: float = 500.0
    """TokenReviews a second of never-seen tokens claiming no known node (the strangers' budget,
    :data:`~gpuwarden.operator.kube.tokenreview.REVIEW_RATE`); past it such a token gets 503."""
    max_connections: int = 0
    """Connections the operator's servers hold open at once, all together (``--max-connections``);
    0: :data:`~gpuwarden.serving.DEFAULT_MAX_CONNECTIONS`. Either way kept below the process's
    file-descriptor limit (:func:`~gpuwarden.serving.connection_cap`); at the cap a new connection
    closes the one heard from least recently."""
    idle_timeout: float = 30.0
    """Seconds a connection may go without a complete request (``--connection-idle-timeout``)."""
    pod_name: str | None = None
    """This replica's pod (downward API ``POD_NAME``); labelled while it acts. None outside a cluster."""
    pod_namespace: str | None = None
    """This replica's namespace (downward API ``POD_NAMESPACE``)."""
    node_health: bool = False
    """Keep the ``GPUHealthy`` condition of each reporting node, and post GPU health Events on nodes
    and pods (``--node-health``; needs nodes get, nodes/status patch and events in ``default``)."""
    node_health_xids: tuple[int, ...] = CRITICAL_XIDS
    """The XIDs that make a node unhealthy (and get Events)."""
    node_health_hold: float = 600.0
    """Seconds an XID or a new uncorrected ECC error keeps a node unhealthy after it."""
    cordon: CordonMode = CordonMode.OFF
    """Cordon a node whose GPUs turn unhealthy: off, dry-run (say so only), on (needs nodes patch)."""
    observe_only: bool = False
    """Change nothing but policies' status and Events (``--observe-only``): no ``/scale`` read or
    written (a scaling policy's ``ScalingActive`` says ``ObserveOnly``), no node condition written,
    no cordon; the chart then grants none of these."""
    reclaim: bool = False
    """Let policies' ``actions.reclaim`` act (``--reclaim``; the chart's ``operator.reclaim.enabled``,
    which grants the writes): without it every reclaim stays in dryRun."""
    reclaim_max_per_hour: int = 20
    """Workloads reclaimed by all policies together in any hour (``--reclaim-max-per-hour``): the
    cluster-wide circuit breaker."""
    shards: bool = False
    """Sharded mode (``--shards``, docs/scaling-out.md): every live replica acts, on the nodes and
    policies the ring gives it; membership through Leases in ``pod_namespace``, no Kopf peering."""
    advertise_url: str | None = None
    """Sharded mode: where agents reach this replica directly (``--advertise-url``; default from
    ``POD_IP``), published on its Lease and in the 421 answers of the other replicas."""
    accounting: AccountingSettings = field(default_factory=AccountingSettings)
    """How GPU time is counted and priced (``--accounting-*``, docs/accounting.md)."""
    verbose: bool = False
    """Log more (Kopf's verbose mode)."""
    debug: bool = False
    """Log everything, including each API call."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the operator's flags (docs/deployment-contract.md); :meth:`from_args` checks them."""
        scope = parser.add_mutually_exclusive_group()
        scope.add_argument(
            "--namespace",
            dest="namespaces",
            action="append",
            default=[],
            metavar="NS",
            help="watch policies and pods in NS only (repeatable); default: all namespaces",
        )
        scope.add_argument(
            "--all-namespaces", action="store_true", help="watch every namespace (the default)"
        )
        parser.add_argument(
            "--ingest-address",
            default="0.0.0.0:8443",
            help="HOST:PORT for POST /v1/reports (%(default)s)",
        )
        parser.add_argument(
            "--tls-cert-file", help="serve the ingest endpoint over TLS with this certificate"
        )
        parser.add_argument("--tls-key-file", help="the key of --tls-cert-file")
        parser.add_argument(
            "--metrics-address",
            default="0.0.0.0:8080",
            help="HOST:PORT for /metrics, /healthz, /readyz",
        )
        parser.add_argument(
            "--token-audience", default="gpuwarden-operator", help="audience agents' tokens must carry"
        )
        parser.add_argument(
            "--agent-service-account",
            default="gpuwarden-system:gpuwarden-agent",
            metavar="NAMESPACE:NAME",
            help="the only ServiceAccount whose tokens may post reports (%(default)s)",
        )
        parser.add_argument("--peering", default="gpuwarden", help="Kopf peering object name (%(default)s)")
        parser.add_argument(
            "--priority", type=int, default=None, help="Kopf peering priority; default: derived from POD_NAME"
        )
        parser.add_argument(
            "--shards",
            action="store_true",
            help="sharded mode: every replica acts on its share of nodes and policies (Leases, no peering)",
        )
        parser.add_argument(
            "--advertise-url",
            default=None,
            help="with --shards: where agents reach this replica; default http(s)://$POD_IP:PORT/v1/reports",
        )
        parser.add_argument(
            "--operator-service-account",
            default="gpuwarden-system:gpuwarden-operator",
            metavar="NAMESPACE:NAME",
            help="with --shards: the replicas' ServiceAccount, the only one that may post verdicts "
            "(%(default)s)",
        )
        parser.add_argument(
            "--peer-token-file",
            default=None,
            metavar="PATH",
            help="with --shards: the token (audience --token-audience) shown to the other replicas",
        )
        parser.add_argument(
            "--peer-ca-file",
            default=None,
            metavar="PATH",
            help="with --shards: CA bundle (PEM) the other replicas' certificates must chain to "
            "(default: the system's trust store)",
        )
        parser.add_argument(
            "--peer-server-name",
            default=None,
            metavar="NAME",
            help="with --shards: the name the other replicas' certificates must carry (default: the host "
            "of their advertised URL)",
        )
        parser.add_argument(
            "--max-body-bytes",
            default="1Mi",
            help="larger report bodies get 413 (%(default)s)",
        )
        parser.add_argument(
            "--node-rate",
            type=float,
            default="20",
            help="reports a second per node before 429 (%(default)s)",
        )
        parser.add_argument(
            "--token-review-rate",
            type=float,
            default="500",
            help="TokenReviews a second of never-seen tokens that claim no node the operator knows; "
            "past it 503 (%(default)s)",
        )
        parser.add_argument(
            "--max-connections",
            type=int,
            default=0,
            metavar="N",
            help="connections the servers hold open at once, all together; at the cap a new one closes the "
            "one heard from least recently (default 0: 20000, or less where the file-descriptor limit is "
            "lower)",
        )
        parser.add_argument(
            "--connection-idle-timeout",
            default="30s",
            metavar="DURATION",
            help="close a connection that sends no complete request for this long (%(default)s)",
        )
        parser.add_argument(
            "--node-health",
            action="store_true",
            help="keep each reporting node's GPUHealthy condition and post GPU health Events on nodes "
            "and pods",
        )
        parser.add_argument(
            "--node-health-xids",
            default="",
            metavar="CODES",
            help="comma-separated XIDs that make a node unhealthy (default: "
            + ",".join(str(c) for c in CRITICAL_XIDS)
            + ")",
        )
        parser.add_argument(
            "--node-health-hold",
            default="10m",
            metavar="DURATION",
            help="how long an XID or a new uncorrected ECC error keeps a node unhealthy (%(default)s)",
        )
        parser.add_argument(
            "--cordon",
            choices=[m.value for m in CordonMode],
            default="off",
            help="cordon a node whose GPUs turn unhealthy: off (default), dry-run (an Event says it "
            "would), on",
        )
        parser.add_argument(
            "--observe-only",
            action="store_true",
            help="change nothing but policies' status and Events: no /scale, no node condition, no cordon",
        )
        parser.add_argument(
            "--reclaim",
            action="store_true",
            help="let policies' actions.reclaim scale idle workloads to zero or suspend them "
            "(without it they stay in dryRun; the chart's operator.reclaim.enabled)",
        )
        parser.add_argument(
            "--reclaim-max-per-hour",
            type=int,
            default=20,
            help="workloads reclaimed by all policies together in any hour, at most (%(default)s)",
        )
        AccountingSettings.add_arguments(parser)
        parser.add_argument("--verbose", action="store_true", help="log more (Kopf's verbose mode)")
        parser.add_argument("--debug", action="store_true", help="log everything, including each API call")

    @classmethod
    def parse(cls, argv: Sequence[str], env: Mapping[str, str] | None = None) -> OperatorConfig:
        """The config of an operator started with ``argv`` (its flags) in ``env`` (default: the process's)."""
        parser = argparse.ArgumentParser()
        cls.add_arguments(parser)
        return cls.from_args(parser.parse_args(list(argv)), env)

    @classmethod
    def defaults(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Every flag at its default, all namespaces (for ``kopf run -m gpuwarden.operator.kopfrun``)."""
        return cls.parse([], env)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Check the flags (:meth:`add_arguments`) and ``env`` (default:
        the process's) together; :class:`ConfigError` names the flag or variable at fault."""
        env = os.environ if env is None else env
        if args.all_namespaces and args.namespaces:
            raise ConfigError("--namespace and --all-namespaces exclude each other")
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            raise ConfigError("--tls-cert-file and --tls-key-file go together")
        if not args.token_audience:
            raise ConfigError("--token-audience must not be empty")
        if not args.peering:
            raise ConfigError("--peering must not be empty")
        if not args.node_rate > 0:
            raise ConfigError(f"--node-rate: {args.node_rate} must be greater than 0")
        if not args.token_review_rate >= 1:
            raise ConfigError(f"--token-review-rate: {args.token_review_rate} must be at least 1")
        if args.max_connections < 0:
            raise ConfigError(f"--max-connections: {args.max_connections} must be 0 (the default) or more")
        pod_name = env.get("POD_NAME", "").strip() or None
        pod_namespace = env.get("POD_NAMESPACE", "").strip() or None
        if pod_name and not pod_namespace:
            raise ConfigError("POD_NAME is set but POD_NAMESPACE is not (set both from the downward API)")
        try:
            cordon = CordonMode(args.cordon)
        except ValueError:
            raise ConfigError(f"--cordon: {args.cordon!r} is not one of off, dry-run, on") from None
        if cordon is not CordonMode.OFF and not args.node_health:
            raise ConfigError("--cordon needs --node-health (it acts on the GPUHealthy condition)")
        if args.observe_only and cordon is CordonMode.ON:
            raise ConfigError("--cordon=on changes nodes: not with --observe-only (dry-run is)")
        if args.reclaim and args.observe_only:
            raise ConfigError("--reclaim changes workloads: not with --observe-only")
        if args.reclaim_max_per_hour < 1:
            raise ConfigError("--reclaim-max-per-hour must be at least 1")
        if args.shards and not pod_namespace:
            raise ConfigError("--shards needs POD_NAMESPACE (the replicas' Leases live there)")
        advertise_url = args.advertise_url
        if advertise_url and not args.shards:
            raise ConfigError("--advertise-url goes with --shards")
        if args.shards and not advertise_url:
            advertise_url = default_advertise_url(env, args.ingest_address, tls=bool(args.tls_cert_file))
        if advertise_url and not advertise_url.startswith(("http://", "https://")):
            raise ConfigError(f"--advertise-url: {advertise_url!r} is not an http(s) URL")
        for flag, value in (
            ("--peer-token-file", args.peer_token_file),
            ("--peer-ca-file", args.peer_ca_file),
            ("--peer-server-name", args.peer_server_name),
        ):
            if value and not args.shards:
                raise ConfigError(f"{flag} goes with --shards")
        xids = args.node_health_xids
        try:
            accounting = AccountingSettings.from_args(args)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            namespaces=tuple(dict.fromkeys(args.namespaces)),
            ingest=parse_address(args.ingest_address, flag="--ingest-address"),
            tls_cert_file=args.tls_cert_file or None,
            tls_key_file=args.tls_key_file or None,
            metrics=parse_address(args.metrics_address, flag="--metrics-address"),
            token_audience=args.token_audience,
            agent_service_account=parse_service_account(
                args.agent_service_account, flag="--agent-service-account"
            ),
            operator_service_account=parse_service_account(
                args.operator_service_account, flag="--operator-service-account"
            ),
            peer_token_file=args.peer_token_file or None,
            peer_ca_file=args.peer_ca_file or None,
            peer_server_name=args.peer_server_name or None,
            peering=args.peering,
            priority=derive_priority(pod_name or socket.gethostname())
            if args.priority is None
            else args.priority,
            identity=default_identity(env),
            max_body_bytes=parse_size(args.max_body_bytes, flag="--max-body-bytes"),
            node_rate=args.node_rate,
            token_review_rate=args.token_review_rate,
            max_connections=args.max_connections,
            idle_timeout=parse_hold(args.connection_idle_timeout, flag="--connection-idle-timeout"),
            pod_name=pod_name,
            pod_namespace=pod_namespace,
            node_health=args.node_health,
            node_health_xids=parse_xids(xids, flag="--node-health-xids") if xids else CRITICAL_XIDS,
            node_health_hold=parse_hold(args.node_health_hold, flag="--node-health-hold"),
            cordon=cordon,
            observe_only=args.observe_only,
            reclaim=args.reclaim,
            reclaim_max_per_hour=args.reclaim_max_per_hour,
            shards=args.shards,
            advertise_url=advertise_url or None,
            accounting=accounting,
            verbose=args.verbose,
            debug=args.debug,
        )

    @property
    def clusterwide(self) -> bool:
        """Whether every namespace is watched."""
        return not self.namespaces

    @property
    def node_burst(self) -> float:
        """Bucket size per node: a second's worth of reports, at least a few, so a retry is never refused."""
        return max(self.node_rate, 5.0)


def parse_address(text: str, *, flag: str) -> Address:
    """Parse ``HOST:PORT`` (``[v6]:PORT``, ``:PORT`` for every interface); ConfigError names ``flag``."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ConfigError(f"{flag}: {text!r} is not HOST:PORT (e.g. 0.0.0.0:8443)")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} has no numeric port") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag}: port {port} is out of range")
    return Address(host, port)


def parse_service_account(text: str, *, flag: str) -> ServiceAccountRef:
    """Parse ``NAMESPACE:NAME``."""
    namespace, sep, name = text.partition(":")
    if not sep or not namespace or not name or ":" in name:
        raise ConfigError(f"{flag}: {text!r} is not NAMESPACE:NAME (e.g. gpuwarden-system:gpuwarden-agent)")
    return ServiceAccountRef(namespace, name)


def parse_size(text: str, *, flag: str) -> int:
    """Parse a byte size given as a Kubernetes quantity (``8Mi``)."""
    try:
        size = parse_quantity(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if size < 1:
        raise ConfigError(f"{flag}: must be at least 1 byte")
    return size


def parse_xids(text: str, *, flag: str) -> tuple[int, ...]:
    """A comma-separated list of XID codes (``48,79``); empty for none."""
    codes: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or not 1 <= int(part) <= 2**32 - 1:
            raise ConfigError(f"{flag}: {part!r} is not an XID code (a whole number from 1)")
        if int(part) not in codes:
            codes.append(int(part))
    return tuple(codes)


def parse_hold(text: str, *, flag: str) -> float:
    """A duration of at least a second (``10m``)."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if seconds < 1:
        raise ConfigError(f"{flag}: {text!r} must be at least 1s")
    return seconds


def derive_priority(name: str) -> int:
    """A stable peering priority from a replica's name, in ``[1, 2**31 - 1]``.

    Kopf pauses every replica when two live ones share a priority, so replicas
    must differ; hashing the pod name makes them differ without coordination and
    keeps a replica's priority across its own restarts.
    """
    digest = hashlib.sha256(name.encode()).digest()
    return 1 + int.from_bytes(digest[:8], "big") % (2**31 - 2)


def default_identity(env: Mapping[str, str]) -> str:
    """The peering identity: the pod name in a cluster, else host and pid (two local runs differ)."""
    pod = env.get("POD_NAME", "").strip()
    return pod or f"{socket.gethostname()}/{os.getpid()}"


def default_advertise_url(env: Mapping[str, str], ingest_address: str, *, tls: bool) -> str | None:
    """``http(s)://POD_IP:PORT/v1/reports`` (the ingest port), or None without ``POD_IP``."""
    ip = env.get("POD_IP", "").strip()
    if not ip:
        return None
    port = parse_address(ingest_address, flag="--ingest-address").port
    host = f"[{ip}]" if ":" in ip else ip
    return f"{'https' if tls else 'http'}://{host}:{port}/v1/reports"

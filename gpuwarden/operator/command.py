"""``gpuwarden operator``: run the Kopf operator in this process with the deployment contract's flags.

The handlers are those of :mod:`gpuwarden.operator.handlers`; Kopf runs them with
peering on (``--peering``, ``--priority``), over all namespaces or the named ones.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, cast

from gpuwarden.operator.config import ConfigError, CordonMode, OperatorConfig
from gpuwarden.policy import CRITICAL_XIDS

__all__ = ["add_arguments", "default_config", "parse_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the operator's flags (see docs/deployment-contract.md)."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="watch policies and pods in NS only (repeatable); default: all namespaces",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    parser.add_argument(
        "--ingest-address",
        default="0.0.0.0:8443",
        help="HOST:PORT for POST /v1/reports (%(default)s)",
    )
    parser.add_argument("--tls-cert-file", help="serve the ingest endpoint over TLS with this certificate")
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
        help="with --shards: the replicas' ServiceAccount, the only one that may post verdicts (%(default)s)",
    )
    parser.add_argument(
        "--peer-token-file",
        default=None,
        metavar="PATH",
        help="with --shards: the token (audience --token-audience) shown to the other replicas",
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
        "--max-connections",
        type=int,
        default=0,
        metavar="N",
        help="connections the servers hold open at once, all together; at the cap a new one closes the "
        "one heard from least recently (default 0: 20000, or less where the file-descriptor limit is lower)",
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
        help="keep each reporting node's GPUHealthy condition and post GPU health Events on nodes and pods",
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
        help="cordon a node whose GPUs turn unhealthy: off (default), dry-run (an Event says it would), on",
    )
    parser.add_argument("--verbose", action="store_true", help="log more (Kopf's verbose mode)")
    parser.add_argument("--debug", action="store_true", help="log everything, including each API call")


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> OperatorConfig:
    """The config of an operator started with ``argv`` (its flags) in ``env`` (default: the process's)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return OperatorConfig.from_args(parser.parse_args(list(argv)), env)


def default_config(env: Mapping[str, str] | None = None) -> OperatorConfig:
    """Every flag at its default, all namespaces (for ``kopf run -m gpuwarden.operator.handlers``)."""
    return parse_config([], env)


def run(args: argparse.Namespace) -> int:
    """Run the operator until SIGINT/SIGTERM; 2 for a bad flag, 1 if Kopf fails to start."""
    try:
        config = OperatorConfig.from_args(args)
    except ConfigError as exc:
        print(f"gpuwarden operator: {exc}", file=sys.stderr)
        return 2

    import kopf

    import gpuwarden.operator.handlers  # noqa: F401  (registers the handlers)
    from gpuwarden.operator.composition import build_operator

    kopf.configure(debug=config.debug, verbose=config.verbose, log_format=kopf.LogFormat.PLAIN)
    log = logging.getLogger("gpuwarden.operator")
    log.info(
        "%s %r as %r with priority %d, %s.",
        "Sharding (Leases of group)" if config.shards else "Peering",
        config.peering,
        config.identity,
        config.priority,
        "all namespaces" if config.clusterwide else "namespaces " + ", ".join(config.namespaces),
    )
    try:
        kopf.run(
            clusterwide=config.clusterwide,
            namespaces=list(config.namespaces),
            # Sharded mode runs Kopf standalone; a peering name would make peering mandatory in Kopf,
            # which then pauses every watch for want of the peering objects it does not use.
            peering_name=None if config.shards else config.peering,
            priority=config.priority,
            identity=cast(Any, config.identity),  # Kopf's Identity is a NewType of str
            # Sharded mode: every replica runs every policy's daemon; the ring says which one acts.
            standalone=config.shards,
            memo=kopf.Memo(state=build_operator(config)),
        )
    except Exception as exc:
        log.error("The operator stopped: %s", exc)
        return 1
    return 0

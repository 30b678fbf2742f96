"""``gpuwarden operator``: run the Kopf operator in this process with the deployment contract's flags.

The handlers are those of :mod:`gpuwarden.operator.handlers`; Kopf runs them with
peering on (``--peering``, ``--priority``), over all namespaces or the named ones.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, cast

from gpuwarden.operator.config import DEFAULTS, ConfigError, CordonMode, build_config
from gpuwarden.policy.xids import CRITICAL_XIDS

__all__ = ["add_arguments", "run"]


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
        default=DEFAULTS["ingest_address"],
        help="HOST:PORT for POST /v1/reports (%(default)s)",
    )
    parser.add_argument("--tls-cert-file", help="serve the ingest endpoint over TLS with this certificate")
    parser.add_argument("--tls-key-file", help="the key of --tls-cert-file")
    parser.add_argument(
        "--metrics-address",
        default=DEFAULTS["metrics_address"],
        help="HOST:PORT for /metrics, /healthz, /readyz",
    )
    parser.add_argument(
        "--token-audience", default=DEFAULTS["token_audience"], help="audience agents' tokens must carry"
    )
    parser.add_argument(
        "--agent-service-account",
        default=DEFAULTS["agent_service_account"],
        metavar="NAMESPACE:NAME",
        help="the only ServiceAccount whose tokens may post reports (%(default)s)",
    )
    parser.add_argument(
        "--peering", default=DEFAULTS["peering"], help="Kopf peering object name (%(default)s)"
    )
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
        default=DEFAULTS["operator_service_account"],
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
        default=DEFAULTS["max_body_bytes"],
        help="larger report bodies get 413 (%(default)s)",
    )
    parser.add_argument(
        "--node-rate",
        type=float,
        default=DEFAULTS["node_rate"],
        help="reports a second per node before 429 (%(default)s)",
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


def run(args: argparse.Namespace) -> int:
    """Run the operator until SIGINT/SIGTERM; 2 for a bad flag, 1 if Kopf fails to start."""
    try:
        config = build_config(
            namespaces=args.namespaces,
            all_namespaces=args.all_namespaces,
            ingest_address=args.ingest_address,
            tls_cert_file=args.tls_cert_file,
            tls_key_file=args.tls_key_file,
            metrics_address=args.metrics_address,
            token_audience=args.token_audience,
            agent_service_account=args.agent_service_account,
            peering=args.peering,
            priority=args.priority,
            max_body_bytes=args.max_body_bytes,
            node_rate=args.node_rate,
            node_health=args.node_health,
            node_health_xids=args.node_health_xids,
            node_health_hold=args.node_health_hold,
            cordon=args.cordon,
            shards=args.shards,
            advertise_url=args.advertise_url,
            operator_service_account=args.operator_service_account,
            peer_token_file=args.peer_token_file,
            verbose=args.verbose,
            debug=args.debug,
        )
    except ConfigError as exc:
        print(f"gpuwarden operator: {exc}", file=sys.stderr)
        return 2

    import kopf

    import gpuwarden.operator.handlers  # noqa: F401  (registers the handlers)
    from gpuwarden.operator.state import OperatorState

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
            memo=kopf.Memo(state=OperatorState(config)),
        )
    except Exception as exc:
        log.error("The operator stopped: %s", exc)
        return 1
    return 0

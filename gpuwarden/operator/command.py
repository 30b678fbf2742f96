"""``gpuwarden operator``: run the Kopf operator in this process with the deployment contract's flags.

The handlers are those of :mod:`gpuwarden.operator.handlers` (its registry); Kopf runs them with
peering on (``--peering``, ``--priority``), over all namespaces or the named ones.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, cast

from gpuwarden.operator.config import ConfigError, OperatorConfig

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the operator's flags (:meth:`OperatorConfig.add_arguments`); :mod:`gpuwarden.cli` asks each
    command for this."""
    OperatorConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the operator until SIGINT/SIGTERM; 2 for a bad flag, 1 if Kopf fails to start."""
    try:
        config = OperatorConfig.from_args(args)
    except ConfigError as exc:
        print(f"gpuwarden operator: {exc}", file=sys.stderr)
        return 2

    import kopf

    from gpuwarden.operator.composition import build_operator
    from gpuwarden.operator.handlers import registry
    from gpuwarden.operator.memory import pace_collector

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
    operator = build_operator(config)
    pace_collector()  # what exists now lives as long as the process
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
            memo=kopf.Memo(operator=operator),
            registry=registry,
        )
    except Exception as exc:
        log.error("The operator stopped: %s", exc)
        return 1
    return 0

"""The pod's ServiceAccount, as the agent's clients of the API server and the operator use it.

The agent talks to two servers with a token: the API server (the node's pod list, its
ResourceSlices: :mod:`gpuwarden.agent.attribution`) and the operator (reports:
:mod:`gpuwarden.agent.sender`). Each request reads its token here, whole and afresh, because the
kubelet rotates the projected token in place.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def bearer(token_path: Path) -> str:
    """The ``Authorization`` header's value for the token at ``token_path``; ``OSError`` if it cannot
    be read (each caller turns that into its own kind of failure, retried)."""
    # A small file on a tmpfs the kubelet rewrites in place: read it whole, every time.
    return f"Bearer {token_path.read_text().strip()}"


def in_cluster_api(service_account_dir: str | os.PathLike[str], without: str) -> tuple[str, Path] | None:
    """The API server's URL and the ServiceAccount directory of the pod this runs in.

    None, logged once with ``without`` (what is then done without), when there is no API
    server or no token to reach it with: a configuration, not an error.
    """
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    account = Path(service_account_dir)
    if not host or not port:
        log.info("not in a cluster (no KUBERNETES_SERVICE_HOST/PORT): %s", without)
        return None
    if not (account / "token").exists():
        log.info("no API token at %s: %s", account, without)
        return None
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{port}", account

"""``gpuwarden restore KIND/NAME``: undo a reclaim, from what it recorded on the workload.

Reads the workload (logged in as kubectl is: ``--kubeconfig``, ``--context``), and sends the merge
patch of :func:`~.marks.restore_patch`: the previous replicas, ``suspend`` or ``active`` back, the
reclaim's annotations removed, guarded by the resourceVersion read. A Job, JobSet or RayCluster that
Kueue admits was reclaimed through its Kueue Workload: that one is restored. docs/reclaim.md has the
kubectl line that does the same.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Mapping
from typing import Any

from gpuwarden.clients import LoginError, load_credentials
from gpuwarden.operator.kube import ApiError, KubeApi
from gpuwarden.operator.reclaim.api import KubeReclaimApi, Owner, ReclaimApiError, path_of
from gpuwarden.operator.reclaim.marks import KINDS, Kind, restore_patch

__all__ = ["add_arguments", "run"]

FIELD_MANAGER = "gpuwarden-restore"
_SHORT = {"deploy": "deployment", "sts": "statefulset", "lws": "leaderworkerset"}


class RestoreFailed(Exception):
    """What went wrong, in one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "workload",
        metavar="KIND/NAME",
        help="the reclaimed workload: deployment/x, statefulset/x, leaderworkerset/x, job/x, jobset/x, "
        "raycluster/x or workload/x (Kueue's)",
    )
    parser.add_argument("--namespace", "-n", default="default", help="its namespace (%(default)s)")
    parser.add_argument(
        "--kubeconfig", metavar="PATH", help="the kubeconfig (default: $KUBECONFIG, else ~/.kube/config)"
    )
    parser.add_argument(
        "--context", metavar="NAME", help="the kubeconfig's context (default: its current one)"
    )


def kind_named(word: str) -> Kind | None:
    """The kind ``word`` names as kubectl takes it: ``deployment``, ``deployments``, ``deploy``,
    ``jobsets.jobset.x-k8s.io``."""
    word = word.lower()
    name, _, group = word.partition(".")
    name = _SHORT.get(name, name)
    for kind in KINDS:
        if kind.field is not None and name in (kind.kind.lower(), kind.plural) and group in ("", kind.group):
            return kind
    return None


async def restore(api: KubeApi, namespace: str, kind: Kind, name: str) -> str:
    """Restore one workload; what was done, in words."""
    api_version = f"{kind.group}/{kind.version}" if kind.group else kind.version
    path = path_of(api_version, kind.kind, namespace, name)
    assert path is not None
    what = f"{kind.kind.lower()}/{name}"
    try:
        obj: Mapping[str, Any] = await api.get(path)
    except ApiError as exc:
        raise RestoreFailed(f"{what} in {namespace}: {exc}") from None
    reclaim = KubeReclaimApi(api)
    patch = restore_patch(obj)
    if patch is None and kind.field == "suspend":
        uid = str((obj.get("metadata") or {}).get("uid", ""))
        try:
            queued = await reclaim.kueue_workload(Owner(api_version, kind.kind, namespace, name, uid))
        except ReclaimApiError as exc:
            raise RestoreFailed(str(exc)) from None
        if queued is not None and (patch := restore_patch(queued)) is not None:
            obj, what = queued, f"{what} (its Kueue Workload {queued['metadata']['name']})"
    if patch is None:
        raise RestoreFailed(
            f"{what} in {namespace} was not reclaimed (no gpuwarden.dev/reclaimed-at annotation)"
        )
    body, words = patch
    try:
        await reclaim.patch(obj, body, FIELD_MANAGER)
    except ReclaimApiError as exc:
        raise RestoreFailed(f"{exc}; try again") from None
    return f"restored {what} in {namespace}: {words}"


def run(args: argparse.Namespace) -> int:
    """Restore the workload; 1 when it cannot be, 2 on a bad argument."""
    word, _, name = args.workload.partition("/")
    kind = kind_named(word)
    if kind is None or not name:
        print(
            f"gpuwarden restore: {args.workload!r} is not KIND/NAME of a kind reclaim acts on",
            file=sys.stderr,
        )
        return 2

    async def main() -> str:
        api = KubeApi(functools.partial(load_credentials, args.kubeconfig, args.context))
        try:
            return await restore(api, args.namespace, kind, name)
        finally:
            await api.close()

    try:
        print(asyncio.run(main()))
    except (RestoreFailed, LoginError) as exc:
        print(f"gpuwarden restore: {exc}", file=sys.stderr)
        return 1
    return 0

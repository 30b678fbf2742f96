"""Policies outlive the operator cleanly: it puts no finalizer on them, so after `helm uninstall` (no
operator left to remove one) deleting the policies and the CRD completes, on the real API server.

While it runs: a policy deleted goes at once and its evaluation daemon ends (the DELETED event, not
Kopf's finalizer, stops it); a policy that still carries the finalizer an earlier version put on every
policy loses it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from controlplane import ControlPlane
from operator_support import IDLE_RULE, apply_crds, get, monitor_policy, prepare, wait_until

from gpuwarden.operator.resources import FINALIZER

pytestmark = pytest.mark.integration

CRD = "gpumonitorpolicies.gpuwarden.dev"


def _finalizers(cp: ControlPlane, namespace: str, name: str) -> list[str] | None:
    policy = get(cp, "gpumonitorpolicy", name, "-n", namespace)
    return None if policy is None else list(policy["metadata"].get("finalizers") or [])


def test_policies_and_the_crd_delete_within_30s_once_the_operator_is_gone(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "finalizers")
    ns = setup.namespace
    older: dict[str, Any] = monitor_policy(ns, "older", [IDLE_RULE])
    older["metadata"]["finalizers"] = [FINALIZER]  # as an earlier version left every policy
    setup.apply(older)
    for name in ("idle", "gone", "kept"):
        setup.apply(monitor_policy(ns, name, [IDLE_RULE]))

    try:
        with setup.operator() as operator:
            operator.wait_ready()
            wait_until(
                lambda: operator.metric("gpuwarden_operator_policies") == 4,
                timeout=60,
                what="the four policies' daemons running",
                alive=operator.alive,
            )
            wait_until(
                lambda: _finalizers(cp, ns, "older") == [],
                timeout=30,
                what="the earlier version's finalizer removed",
                alive=operator.alive,
            )
            assert [_finalizers(cp, ns, name) for name in ("idle", "gone", "kept")] == [[], [], []]

            deleted = cp.kubectl("delete", "gpumonitorpolicy", "gone", "-n", ns, "--timeout=10s")
            assert deleted.returncode == 0, deleted.stderr
            wait_until(
                lambda: operator.metric("gpuwarden_operator_policies") == 3,
                timeout=10,
                what="the deleted policy's daemon ended",
                alive=operator.alive,
            )
        # The operator has exited, as after `helm uninstall`; the policies and the CRD stay (Helm never
        # deletes CRDs) until deleted by hand.
        assert get(cp, "gpumonitorpolicy", "kept", "-n", ns) is not None
        started = time.monotonic()
        policies = cp.kubectl("delete", "gpumonitorpolicies", "--all", "-n", ns, "--timeout=30s", timeout=40)
        assert policies.returncode == 0, policies.stderr
        crd = cp.kubectl("delete", "crd", CRD, "--timeout=30s", timeout=40)
        assert crd.returncode == 0, crd.stderr
        assert time.monotonic() - started < 30
        assert cp.kubectl("get", "crd", CRD).returncode != 0
    finally:
        apply_crds(cp)  # for the tests after this one

"""Kopf handlers: declarations only; the work is done by the modules they call.

- startup: tune Kopf (one place, a reason per value), start the ingest and metrics servers;
- ``gpu_pods`` index: GPU pods by namespace, for the policies' selectors;
- ``gpu_pod_nodes`` index: the node each GPU pod runs on, for the reports' pods;
- ``gpu_pod_grants`` index: the GPUs each scheduled GPU pod was given and its start, what accounting
  may bill it for;
- ``service_pods`` index: GPU pods by node with their IP and metrics endpoint hints, for the nodes'
  scrape plans;
- ``service_policies`` index: the policies whose rules read the pods' own metrics by namespace,
  parsed once per change, for the nodes' scrape plans;
- ``policy_claims`` index: each policy's parsed scale action by namespace, for the scaler's
  conflict check (parsed once per change, not by every policy at every round);
- pod deletion: forget the pod's series;
- one daemon per GPUMonitorPolicy: its evaluation loop (Kopf stops it while this replica is
  paused by peering, and at exit);
- policy deletion (the watch's DELETED event): end that daemon. No finalizer: see :func:`_no_finalizers`;
- spec changes: wake that daemon.

The handlers go into :data:`registry`, the operator's own, never Kopf's default one: importing this
module registers nothing in Kopf. ``gpuwarden operator`` (:mod:`.command`) runs Kopf on
:data:`registry`; ``kopf run -m gpuwarden.operator.kopfrun`` makes it Kopf's default (:mod:`.kopfrun`).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import UTC, datetime
from typing import Any

import kopf

from gpuwarden.accounting import Bound
from gpuwarden.operator.accounting import pod_grant
from gpuwarden.operator.composition import Operator, build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.kube import connection_info
from gpuwarden.operator.policies import pod_record, requests_gpu
from gpuwarden.operator.resources import FINALIZER, GROUP, PLURAL, PREFIX, VERSION, PodRecord, PolicyKey
from gpuwarden.operator.scaling import PolicyClaim, policy_claim
from gpuwarden.operator.scrape import ServicePod, ServicePolicy, service_pod, service_policy

logger = logging.getLogger(__name__)

registry = kopf.OperatorRegistry()
"""The operator's handlers, for ``kopf.run(registry=...)``."""


def _operator(memo: kopf.Memo) -> Operator:
    operator: Operator = memo.operator
    return operator


@kopf.on.login(registry=registry)
def login(**_: Any) -> kopf.ConnectionInfo:
    # A registry of our own lacks the fallback logins Kopf's default one brings. Kopf logs in as the
    # operator's own API client does (the pod's ServiceAccount, else the kubeconfig, exec credential
    # plugins included, which Kopf's own kubeconfig reader ignores); past an exec credential's expiry,
    # or on a 401, Kopf calls this again.
    creds = connection_info()
    return kopf.ConnectionInfo(
        server=creds.server,
        ca_path=creds.ca_file,
        ca_data=creds.ca_data,
        insecure=creds.insecure,
        username=creds.username,
        password=creds.password,
        scheme="Bearer" if creds.token else None,
        token=creds.token,
        certificate_path=creds.cert_file,
        certificate_data=creds.cert_data,
        private_key_path=creds.key_file,
        private_key_data=creds.key_data,
        expiration=None if creds.expires is None else datetime.fromtimestamp(creds.expires, UTC),
    )


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "operator" not in memo:  # run as `kopf run -m gpuwarden.operator.kopfrun`: the contract's defaults
        memo.operator = build_operator(OperatorConfig.defaults())
    # Events are ours (kube/events.py: never twice); Kopf's own handler logs stay in the log, not in
    # `kubectl describe`.
    settings.posting.enabled = False
    # The finalizer Kopf removes (from policies an earlier version left it on: _no_finalizers) and its
    # bookkeeping annotations carry our domain, not Kopf's.
    settings.persistence.finalizer = FINALIZER
    # Our CRD's status schema prunes unknown fields, so Kopf must keep its progress in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    # Keep-alives every ~50 s would fill the log; pauses and resumes are still logged.
    settings.peering.stealth = True
    # Re-open watches every 10 min so a connection silently dropped by a load balancer is noticed.
    settings.watching.server_timeout = 600
    settings.watching.client_timeout = 660
    # A hung API call must not hold a handler forever; Kopf retries with its backoffs.
    settings.networking.request_timeout = 30


@kopf.on.startup(registry=registry)
async def start_lifecycle(memo: kopf.Memo, **kwargs: Any) -> None:
    # The indexes by their names (empty this early, filled live by Kopf): which node each GPU pod runs
    # on, for the reports' pods; the pods' uids, for the node view.
    state = _operator(memo).state
    state.pod_nodes = kwargs["gpu_pod_nodes"]
    state.pod_grants = kwargs["gpu_pod_grants"]
    state.pods = kwargs["gpu_pods"]
    state.service_pods = kwargs["service_pods"]
    state.service_policies = kwargs["service_policies"]
    await _operator(memo).lifecycle.start()


@kopf.on.cleanup(registry=registry)
async def stop_lifecycle(memo: kopf.Memo, **_: Any) -> None:
    await _operator(memo).lifecycle.stop()


def _has_gpu(spec: kopf.Spec, **_: Any) -> bool:
    return requests_gpu(spec)


@kopf.index("pods", when=_has_gpu, registry=registry)
def gpu_pods(
    namespace: str | None, name: str, uid: str, labels: kopf.Labels, annotations: kopf.Annotations, **_: Any
) -> dict[str, PodRecord]:
    assert namespace is not None  # pods are namespaced
    record = pod_record(namespace=namespace, name=name, uid=uid, labels=labels, annotations=annotations)
    return {namespace: record}


def _scheduled_gpu_pod(spec: kopf.Spec, **_: Any) -> bool:
    return bool(spec.get("nodeName")) and requests_gpu(spec)


@kopf.index("pods", when=_scheduled_gpu_pod, registry=registry)
def gpu_pod_nodes(namespace: str | None, name: str, spec: kopf.Spec, **_: Any) -> dict[tuple[str, str], str]:
    assert namespace is not None
    return {(namespace, name): str(spec["nodeName"])}


@kopf.index("pods", when=_scheduled_gpu_pod, registry=registry)
def gpu_pod_grants(
    namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, **_: Any
) -> dict[tuple[str, str], Bound]:
    assert namespace is not None
    return {(namespace, name): pod_grant(spec, status, meta)}


@kopf.index("pods", when=_scheduled_gpu_pod, registry=registry)
def service_pods(
    namespace: str | None,
    name: str,
    uid: str,
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    spec: kopf.Spec,
    status: kopf.Status,
    **_: Any,
) -> dict[str, ServicePod]:
    assert namespace is not None
    pod = service_pod(
        namespace=namespace,
        name=name,
        uid=uid,
        labels=labels,
        annotations=annotations,
        spec=spec,
        status=status,
    )
    return {str(spec["nodeName"]): pod}


@kopf.index(GROUP, VERSION, PLURAL, registry=registry)
def service_policies(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, ServicePolicy]:
    assert namespace is not None
    record = service_policy(body)
    # {} rather than None: Kopf keeps an entry a None leaves alone, and drops the ones {} does not name
    # (and a namespace left with none), so "is any policy reading pods?" stays a len() at every report.
    return {} if record is None else {namespace: record}


@kopf.index(GROUP, VERSION, PLURAL, registry=registry)
def policy_claims(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, PolicyClaim]:
    assert namespace is not None  # policies are namespaced
    return {namespace: policy_claim(body)}


def _gpu_pod_gone(type: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> bool:
    # Kopf calls a non-index handler's filter only once every index has been filled from the
    # initial listing: from the first pod event on, the pod indexes hold every pod.
    _operator(memo).state.pods_synced = True
    # Filtered here, not in the handler: Kopf logs every handler call, and pods change often.
    return type == "DELETED" and requests_gpu(spec)


# Async handlers run in Kopf's event loop, with ingestion and the daemons; Kopf runs a sync one in a
# thread, where the store would change under an evaluation and a daemon's wake-up has no loop.
@kopf.on.event("pods", when=_gpu_pod_gone, registry=registry)
async def pod_deleted(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    if namespace is not None:
        _operator(memo).forget_pod(namespace, name)


# Cancelled at once when stopped (peering pause, exit): a round holds nothing worth finishing.
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0, registry=registry)
async def evaluate(namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    assert namespace is not None  # policies are namespaced
    # The indexes above, passed by their names.
    pods: kopf.Index[str, PodRecord] = kwargs["gpu_pods"]
    policies: kopf.Index[str, PolicyClaim] = kwargs["policy_claims"]
    runner = _operator(memo).runner(PolicyKey(namespace, name))
    await runner.run(body=body, pods=pods, policies=policies)


def _deleted(type: str, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event(GROUP, VERSION, PLURAL, when=_deleted, registry=registry)
async def policy_deleted(uid: str, memo: kopf.Memo, **_: Any) -> None:
    _operator(memo).state.end_policy(uid)


def _no_finalizers() -> None:
    """Register the evaluation daemon without Kopf's finalizer.

    Kopf puts a finalizer on every object a daemon runs for, to stop the daemon before the object
    goes. On our policies nothing needs it: a round holds nothing worth finishing, and the DELETED
    event (:func:`policy_deleted`) ends the daemon as well; should that event be missed, a 404 on the
    status write or the runner's check every five minutes that the object still exists does. With the
    finalizer, every policy outlived the operator: after `helm uninstall`, deleting a policy, its
    namespace or the CRD hung on a finalizer that nothing would remove. Kopf removes the finalizer from
    policies that still carry it (an earlier version's) at their next event, since no handler requires
    it. ``kopf.daemon`` has no ``optional=`` as ``kopf.on.delete`` has, so the flag is cleared on the
    registered handler (tests/unit/operator/policies/test_policy_deletion.py checks that no handler
    requires a finalizer; tests/integration/test_policy_finalizers.py, the API server's side).
    """
    spawning = registry._spawning
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) for h in spawning._handlers]


_no_finalizers()


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
async def spec_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    if namespace is not None:
        _operator(memo).state.nudge_policy(PolicyKey(namespace, name))

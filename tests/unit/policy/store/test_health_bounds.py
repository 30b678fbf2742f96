"""The health store under a hostile node (issue 27): records owned by the reporting node, pods admitted
by the caller, XIDs held to the caller's time bounds, and every table bounded."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwarden.policy.findings import Finding
from gpuwarden.policy.rules import utilization
from gpuwarden.policy.rules.throttling import throttling_note
from gpuwarden.policy.store import health as healthstore
from gpuwarden.policy.store.health import (
    MAX_DEVICES_PER_GPU,
    MAX_GPUS_PER_NODE,
    MAX_PODS_PER_GPU,
    Admission,
    HealthStore,
    IncidentKind,
)
from gpuwarden.policy.store.series import PodId
from gpuwarden.wire.node import (
    ClockEventReason,
    GpuHealth,
    GpuSample,
    PodRef,
    ProcessSample,
    Snapshot,
    XidEvent,
)

T0 = 1_800_000_000.0
GPU = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
VICTIM = PodId("ml", "victim-0")


def sample(uuid: str = GPU, pods: tuple[str, ...] = (), **kw: Any) -> GpuSample:
    return GpuSample(uuid=uuid, index=0, pods=[PodRef(namespace="ml", name=p) for p in pods], **kw)


def xids(*stamps: float, code: int = 79) -> GpuHealth:
    return GpuHealth(xids=[XidEvent(code=code, timestamp=t) for t in stamps])


def test_two_nodes_naming_one_uuid_keep_two_records() -> None:
    """Issue 27 (1): node B naming A's GPU UUID (no pods, an XID) changed A's record, its node and pods."""
    store = HealthStore(retention_seconds=600)
    store.observe(Snapshot(timestamp=T0, gpus=[sample(pods=("victim-0",))]), node="node-a")
    store.observe(Snapshot(timestamp=T0 + 1, gpus=[sample(health=xids(T0 + 1))]), node="node-b")
    a, b = store.gpu(GPU, node="node-a"), store.gpu(GPU, node="node-b")
    assert a is not None
    assert b is not None
    assert a is not b
    assert (a.node, list(a.xids), a.current) == ("node-a", [], (VICTIM,))
    assert (b.node, [code for _, code in b.xids], b.current) == ("node-b", [79], ())
    assert [r.node for r in store.gpus_of("ml", "victim-0", since=0)] == ["node-a"]
    (incident,) = [i for i in store.incidents() if i.kind is IncidentKind.XID]
    assert (incident.node, incident.pods) == ("node-b", ())
    assert store.nodes() == {"node-a", "node-b"}
    assert len(store) == 2


def test_a_pod_the_caller_does_not_admit_is_put_on_no_gpu() -> None:
    """Issue 27 (1): node B listing A's pod on its own GPU with an XID put Events on A's pod."""
    store = HealthStore(retention_seconds=600)
    admission = Admission(admit=lambda pod: pod.name != "victim-0")
    gpu = sample("GPU-b", ("victim-0", "own-0"), health=xids(T0, code=48))
    store.observe(Snapshot(timestamp=T0, gpus=[gpu]), node="node-b", admission=admission)
    assert store.gpus_of("ml", "victim-0", since=0) == []
    (incident,) = list(store.incidents())
    assert incident.pods == (PodId("ml", "own-0"),)


def test_throttling_is_read_from_the_pods_own_nodes_record() -> None:
    """Issue 27 (1): node B reporting A's GPU throttled resolved A's pod's idle finding."""
    store = HealthStore(retention_seconds=600)
    hot = GpuHealth(clock_event_reasons=[ClockEventReason.SW_THERMAL_SLOWDOWN])
    for i in range(20):
        store.observe(Snapshot(timestamp=T0 + i, gpus=[sample(pods=("victim-0",))]), node="node-a")
        store.observe(Snapshot(timestamp=T0 + i, gpus=[sample(health=hot)]), node="node-b")
    assert throttling_note(store, VICTIM, [GPU], T0 + 5, T0 + 19) == ("", False)
    # The same GPU throttled by its own node's word is throttled.
    store.observe(Snapshot(timestamp=T0 + 20, gpus=[sample(pods=("victim-0",), health=hot)]), node="node-a")
    for i in range(21, 40):
        store.observe(
            Snapshot(timestamp=T0 + i, gpus=[sample(pods=("victim-0",), health=hot)]), node="node-a"
        )
    assert throttling_note(store, VICTIM, [GPU], T0 + 25, T0 + 39)[1]


@pytest.mark.parametrize(("at", "reason"), [(T0 + 31, "future"), (1e12, "future"), (T0 - 7200, "past")])
def test_an_xid_outside_the_bounds_is_refused_and_counted(at: float, reason: str) -> None:
    """Issue 27 (2): an XID stamped 1e12 broke every round; one a year ahead held the GPU for a year."""
    store = HealthStore(retention_seconds=600)
    admission = Admission(earliest=T0 - 3600, latest=T0 + 30)
    store.observe(Snapshot(timestamp=T0, gpus=[sample(health=xids(at, T0))]), node="n", admission=admission)
    record = store.gpu(GPU, node="n")
    assert record is not None
    assert list(record.xids) == [(T0, 79)]
    assert admission.refused == {reason: 1}


def test_a_node_has_room_for_so_many_gpus_and_the_rest_is_refused() -> None:
    """Issue 27 (3): reports of ever new GPU UUIDs grew the store without bound."""
    store = HealthStore(retention_seconds=600)
    admission = Admission()
    for k in range(3):
        gpus = [sample(f"GPU-{k}-{i}") for i in range(MAX_GPUS_PER_NODE)]
        store.observe(Snapshot(timestamp=T0 + k, gpus=gpus), node="n", admission=admission)
    assert len(store.gpus_on("n")) == MAX_GPUS_PER_NODE
    assert admission.refused == {"tooManyGpus": 2 * MAX_GPUS_PER_NODE}
    assert admission.devices == {f"GPU-{k}-{i}" for k in (1, 2) for i in range(MAX_GPUS_PER_NODE)}
    # Another node is not held back by this one.
    store.observe(Snapshot(timestamp=T0, gpus=[sample("GPU-other")]), node="m")
    assert store.gpu("GPU-other", node="m") is not None
    # Once the node's old GPUs age out, new ones have room again.
    store.prune(T0 + 601)
    store.observe(Snapshot(timestamp=T0 + 602, gpus=[sample("GPU-new")]), node="n")
    assert [r.uuid for r in store.gpus_on("n")] == ["GPU-new"]


def test_the_store_holds_so_many_gpus_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(healthstore, "MAX_GPUS", 3)
    store = HealthStore(retention_seconds=600)
    admission = Admission()
    for node in "abcd":
        store.observe(Snapshot(timestamp=T0, gpus=[sample()]), node=node, admission=admission)
    assert (len(store), store.nodes(), admission.refused) == (3, {"a", "b", "c"}, {"tooManyGpus": 1})


def test_a_gpu_has_room_for_so_many_mig_devices() -> None:
    store = HealthStore(retention_seconds=600)
    admission = Admission()
    migs = [
        GpuSample(uuid=GPU, index=0, mig_id=f"MIG-{i}", pods=[PodRef(namespace="ml", name=f"p-{i}")])
        for i in range(MAX_DEVICES_PER_GPU + 2)
    ]
    store.observe(Snapshot(timestamp=T0, gpus=migs), node="n", admission=admission)
    record = store.gpu(GPU, node="n")
    assert record is not None
    assert len(record.devices) == MAX_DEVICES_PER_GPU
    assert admission.devices == {f"MIG-{MAX_DEVICES_PER_GPU}", f"MIG-{MAX_DEVICES_PER_GPU + 1}"}
    assert len(record.current) == MAX_DEVICES_PER_GPU  # the refused devices' pods are not on it


def test_a_gpu_remembers_so_many_pods() -> None:
    """Issue 27 (3): every pod a GPU ever listed was remembered (until the retention)."""
    store = HealthStore(retention_seconds=600)
    for i in range(MAX_PODS_PER_GPU + 10):
        store.observe(Snapshot(timestamp=T0 + i, gpus=[sample(pods=(f"p-{i}",))]), node="n")
    record = store.gpu(GPU, node="n")
    assert record is not None
    assert len(record.pods) == MAX_PODS_PER_GPU
    assert store.gpus_of("ml", "p-0", since=0) == []  # the oldest went, from the pod's side too
    assert store.gpus_of("ml", f"p-{MAX_PODS_PER_GPU + 9}", since=0) == [record]


def test_so_many_pods_at_once_on_a_gpu() -> None:
    store = HealthStore(retention_seconds=600)
    admission = Admission()
    many = tuple(f"p-{i}" for i in range(MAX_PODS_PER_GPU + 5))
    # 64 allocated (what a report may list), and more running a process on it.
    full = GpuSample(
        uuid=GPU,
        index=0,
        pods=[PodRef(namespace="ml", name=p) for p in many[:64]],
        processes=[
            ProcessSample(pid=i + 1, pod=PodRef(namespace="ml", name=p)) for i, p in enumerate(many[64:])
        ],
    )
    store.observe(Snapshot(timestamp=T0, gpus=[full]), node="n", admission=admission)
    record = store.gpu(GPU, node="n")
    assert record is not None
    assert len(record.current) == MAX_PODS_PER_GPU
    assert admission.refused == {"tooManyPods": 5}


def test_a_gpu_keeps_the_claims_of_its_admitted_pods_only() -> None:
    """The claim a report names rides into the Events of the pod's findings: only for pods the
    caller admitted (a node cannot label another node's pod), and only while the pod is on the GPU."""
    store = HealthStore(retention_seconds=600)
    admission = Admission(admit=lambda pod: pod.name != "victim-0")
    refs = [PodRef(namespace="ml", name=p, claim=f"{p}-gpu") for p in ("own-0", "victim-0")]
    gpu = GpuSample(uuid=GPU, index=0, pods=refs)
    store.observe(Snapshot(timestamp=T0, gpus=[gpu]), node="node-b", admission=admission)
    record = store.gpu(GPU, node="node-b")
    assert record is not None
    assert record.claims == {PodId("ml", "own-0"): "own-0-gpu"}

    def found(pod: str) -> Finding:
        return Finding(
            policy="ml/p", rule="idle", kind=utilization.FLOOR_KIND, reason="GPUUnderutilized",
            namespace="ml", pod=pod, gpus=(GPU,), value=3.0, threshold=20.0, unit="percent",
            started_at=T0, message="",
        )  # fmt: skip

    assert store.claim_of(found("own-0")) == "own-0-gpu"
    assert store.claim_of(found("victim-0")) is None
    # the pod left the GPU: its claim goes with it
    store.observe(Snapshot(timestamp=T0 + 1, gpus=[sample()]), node="node-b", admission=admission)
    assert store.claim_of(found("own-0")) is None

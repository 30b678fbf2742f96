"""Issue 45's accounting attacks, on the real API server with real ServiceAccount tokens and TokenReview:
what one node's token can make the operator bill.

One operator (its counters shown at once, ``--accounting-scrape-interval=0s``) watches a namespace; each
attack comes from a node of its own, its token bound to an agent pod there, posting as a compromised
agent would, for a pod of its own that asks for one GPU:

- **32 GPUs, six hours back.** The node reports its pod on 32 GPU UUIDs, a snapshot every 4.5 s from
  the 6 h the ingest accepts; the pod was made seconds before. Billed GPU-seconds never exceed one GPU
  times the pod's age (on cee149e: 32 GPUs for every interval, hours of them).
- **Model names without bound.** The node reports its pod on one GPU with a new model name in every
  snapshot. The pod has one row, under the GPU's model first reported, and the operator's memory stays within
  twice what it was (on cee149e: a row each, 80,001 rows in 8 s).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from controlplane import ControlPlane
from operator_support import Operator, Setup, agent_token, create_gpu_pod, get, http, prepare, wait_until

from gpuwarden.kubetime import parse_epoch
from gpuwarden.wire.node import GpuSample, NodeReport, PodRef, Snapshot, dump_report

pytestmark = pytest.mark.integration

TIMEOUT = 60.0
ALLOCATED = "gpuwarden_gpu_allocated_seconds_total"


@dataclass
class Node:
    """An attacker's node: its token, and its pod (one GPU asked for)."""

    setup: Setup
    operator: Operator
    name: str
    token: str
    pod: str

    def post(self, snapshots: list[Snapshot]) -> dict[str, object]:
        report = NodeReport(
            schema_version=3, node=self.name, agent_id=secrets.token_hex(4), seq=0, snapshots=snapshots
        )
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        status, payload = http("POST", self.operator.url, dump_report(report), headers)
        assert status == 200, payload
        assert isinstance(payload, dict)
        return payload

    def sample(self, uuid: str, model: str = "NVIDIA H200") -> GpuSample:
        pods = [PodRef(namespace=self.setup.namespace, name=self.pod)]
        return GpuSample(uuid=uuid, index=0, model=model, utilization_gpu=90.0, pods=pods)

    def rows(self) -> dict[str, float]:
        """This pod's allocated GPU-seconds on /metrics, by GPU model."""
        found = {}
        for series, value in self.operator.metrics().items():
            if series.startswith(ALLOCATED) and f'workload="{self.pod}"' in series:
                model = re.search(r'gpu_model="([^"]*)"', series)
                assert model is not None, series
                found[model.group(1)] = value
        return found


@pytest.fixture(scope="module")
def world(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Setup, Operator]]:
    setup = prepare(control_plane, tmp_path_factory, "attacks-accounting")
    args = ["--accounting-scrape-interval=0s", "--node-rate=50"]
    with setup.operator(extra_args=args) as operator:
        operator.wait_ready()
        yield setup, operator


def rss(operator: Operator) -> float:
    """The operator process's resident memory, bytes."""
    status = Path(f"/proc/{operator.proc.pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None, status
    return float(match.group(1)) * 1024


def attacker(world: tuple[Setup, Operator], role: str, uuid: str) -> Node:
    """A node of its own with a pod asking for one GPU, once the operator knows the pod (readings of it
    on GPU ``uuid`` taken)."""
    setup, operator = world
    name = f"gw-atk-{role}-{secrets.token_hex(3)}"
    node = Node(setup, operator, name, agent_token(setup.cp, setup.namespace, name), f"{role}-0")
    create_gpu_pod(setup.cp, setup.namespace, node.pod, {}, name)

    def known() -> bool:
        return not node.post([Snapshot(timestamp=time.time(), gpus=[node.sample(uuid)])])["refused"]

    wait_until(known, timeout=TIMEOUT, what=f"the operator knowing pod {node.pod}", alive=operator.alive)
    return node


def test_a_node_cannot_bill_its_one_gpu_pod_for_32_gpus_six_hours_back(world: tuple[Setup, Operator]) -> None:
    node = attacker(world, "billing", "GPU-b1110000-0000-4000-8000-000000000000")
    setup, operator = world
    created = parse_epoch(
        get(setup.cp, "pod", node.pod, "-n", setup.namespace)["metadata"]["creationTimestamp"]
    )
    assert created is not None
    now = time.time()
    gpus = [node.sample(f"GPU-b1110000-0000-4000-8000-{i:012d}") for i in range(32)]
    # The first and the last 10 minutes of the 6 h, a snapshot every 4.5 s (all of it: the same bound),
    # and on to the 30 s ahead the ingest allows for clock skew.
    times = [now - 6 * 3600 + 4.5 * i for i in range(134)] + [now - 600 + 4.5 * i for i in range(140)]
    for start in range(0, len(times), 40):
        node.post([Snapshot(timestamp=t, gpus=gpus) for t in times[start : start + 40]])
    billed = wait_until(
        lambda: sum(node.rows().values()), timeout=TIMEOUT, what="the pod's row", alive=operator.alive
    )
    age = time.time() - created
    print(f"billed {billed:.1f} GPU-s to a one-GPU pod {age:.1f} s old")
    assert 0 < billed <= 1 * age


def test_model_names_without_bound_make_one_row_and_keep_memory_within_twice(
    world: tuple[Setup, Operator],
) -> None:
    uuid = "GPU-b2220000-0000-4000-8000-000000000000"
    node = attacker(world, "models", uuid)
    _, operator = world
    before = rss(operator)
    # Since the pod's known reading (billed from its start), 0.1 ms apart: all of them timely.
    start = time.time()
    sent = 0
    for _ in range(20):
        snapshots = [
            Snapshot(timestamp=start + 1e-4 * (sent + i), gpus=[node.sample(uuid, f"H200 flood {sent + i}")])
            for i in range(1000)
        ]
        node.post(snapshots)
        sent += len(snapshots)
    rows = wait_until(node.rows, timeout=TIMEOUT, what="the pod's row", alive=operator.alive)
    after = rss(operator)
    print(f"{sent} model names: rows {rows}; RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    assert list(rows) == ["NVIDIA H200"]  # the model the GPU was first reported with
    assert after <= 2 * before

"""End to end: three operator replicas in sharded mode (``--shards``) on a real API server, scripted
agents on several nodes posting to one replica's endpoint (standing for the ingest Service), one
replica SIGKILLed mid-run.

What is asserted: every replica holds a Lease; each node's readings land on the node's owner by the
ring (the others answered 421 and the agent followed); the policy's Events come from its owner only,
once; after the kill, the dead replica's nodes are taken by their next owners and its policy by its
next owner, which resumes the violation without announcing it again; no agent dropped a snapshot.
(The policy here selects one pod whose node the policy's owner also owns, before and after the kill:
the exchange of per-pod verdicts between shards is not built yet, docs/scaling-out.md.)
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
from controlplane import ControlPlane, free_ports
from operator_support import (
    IDLE_RULE,
    Agent,
    Operator,
    create_gpu_pod,
    create_plain_pod,
    get,
    gpu,
    monitor_policy,
    pod,
    prepare,
    wait_until,
    write_scenario,
)

from gpuwarden.operator.membership import GROUP_LABEL
from gpuwarden.operator.shards import Ring, policy_key

pytestmark = pytest.mark.integration

REPLICAS = ("op-a", "op-b", "op-c")
LABEL = "gpuwarden.dev/ingest-active"


def holds_pod(operator: Operator, name: str) -> bool:
    """Whether the replica has readings of pod ``name`` (its per-pod gauge)."""
    return any(
        k.startswith("gpuwarden_pod_gpu_utilization_percent{") and f'pod="{name}"' in k
        for k in operator.metrics()
    )


def test_three_sharded_replicas_share_the_nodes_and_survive_one_killed(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "shards")
    namespace = setup.namespace
    for name in REPLICAS:
        create_plain_pod(cp, namespace, name)

    # Who owns what, as the replicas will compute it: the policy's owner is the one killed; the agents
    # post to another replica.
    ring3 = Ring(REPLICAS)
    killed = ring3.owner(policy_key(namespace, "idle"))
    assert killed is not None
    entry = next(r for r in REPLICAS if r != killed)
    ring2 = Ring(r for r in REPLICAS if r != killed)
    heir = ring2.owner(policy_key(namespace, "idle"))
    candidates = [f"gpu-node-{i}" for i in range(2, 200)]
    # The policy's pod: on a node that its owner owns too, before and after the kill.
    watched = next(n for n in candidates if ring3.owner(n) == killed and ring2.owner(n) == heir)
    # One more node for each replica.
    others = [next(n for n in candidates if ring3.owner(n) == r and n != watched) for r in REPLICAS]
    nodes = [watched, *others]

    setup.apply(monitor_policy(namespace, "idle", [IDLE_RULE], selector={"matchLabels": {"app": "x"}}))
    scenarios = {}
    for i, node in enumerate(nodes):
        name, labels = f"pod-{i}", {"app": "x" if node == watched else "y"}
        uuid = f"GPU-5a000000-0000-4000-8000-{i:012d}"
        create_gpu_pod(cp, namespace, name, labels, node=node)
        card = gpu(uuid, 0, [{"kind": "idle", "level": 3, "noise": 1}], [{"kind": "idle", "level": "8Gi"}])
        scenarios[node] = write_scenario(
            setup.workdir / f"scenario-{node}.yaml",
            f"shards-{i}",
            [card],
            [pod(namespace, name, uuid, labels, 100 + i)],
        )
    pod_of = {node: f"pod-{i}" for i, node in enumerate(nodes)}

    def warnings() -> list[Any]:
        return setup.events("Pod", pod_of[watched], "GPUUnderutilized")

    with ExitStack() as running:
        operators: dict[str, Operator] = {}
        for name in REPLICAS:
            ports = free_ports(2)
            url = f"http://127.0.0.1:{ports[0]}/v1/reports"
            operators[name] = running.enter_context(
                setup.operator(
                    name, ports=(ports[0], ports[1]), extra_args=["--shards", f"--advertise-url={url}"]
                )
            )
        for operator in operators.values():
            operator.wait_ready(active=True, timeout=120)
        leases = get(cp, "leases", "-n", namespace, "-l", f"{GROUP_LABEL}=gpuwarden")["items"]
        assert {le["spec"]["holderIdentity"] for le in leases} == set(REPLICAS)
        labelled = {
            p["metadata"]["name"] for p in get(cp, "pods", "-n", namespace, "-l", f"{LABEL}=true")["items"]
        }
        assert labelled == set(REPLICAS)

        agents: dict[str, Agent] = {}
        for node in nodes:
            agent = setup.agent(scenarios[node], operators[entry], node=node)
            agents[node] = running.enter_context(agent)

        def alive() -> str | None:
            return next((why for p in [*operators.values(), *agents.values()] if (why := p.alive())), None)

        # Each node's readings on its owner only.
        for node in nodes:
            owner = operators[ring3.owner(node) or ""]
            wait_until(
                lambda o=owner, p=pod_of[node]: holds_pod(o, p),
                timeout=90,
                what=f"{node} on {owner.name}",
                alive=alive,
            )

        # And on no other replica, once the views have settled: a report that reached a replica
        # whose first view lacked a peer's Lease was stored there; its per-pod gauge goes 60 s after
        # that last reading (seen in a CI run: gpu-node-4's pod, owned by op-b, also on op-a).
        def exclusive() -> list[tuple[str, str]]:
            return [
                (node, name)
                for node in nodes
                for name, operator in operators.items()
                if holds_pod(operator, pod_of[node]) != (name == ring3.owner(node))
            ]

        wait_until(
            lambda: not exclusive(), timeout=120, what="each node's readings on its owner only", alive=alive
        )
        (warning,) = wait_until(warnings, timeout=60, what="the Warning", alive=alive)
        assert warning["reportingInstance"] == killed
        wait_until(lambda: setup.violations("idle"), timeout=30, what="the violation in status", alive=alive)
        redirected = sum(
            a.metrics().get('gpuwarden_agent_report_errors_total{reason="misdirected"}', 0.0)
            for a in agents.values()
        )
        assert redirected >= len([n for n in nodes if ring3.owner(n) != entry])

        # The policy's owner (and owner of two nodes) dies without a word.
        operators[killed].kill()
        survivors = {n: o for n, o in operators.items() if n != killed}

        def alive_after() -> str | None:
            return next((why for p in [*survivors.values(), *agents.values()] if (why := p.alive())), None)

        for node in nodes:
            if ring3.owner(node) == killed:
                heir_op = survivors[ring2.owner(node) or ""]
                wait_until(
                    lambda o=heir_op, p=pod_of[node]: holds_pod(o, p),
                    timeout=120,
                    what=f"{node} taken over by {heir_op.name}",
                    alive=alive_after,
                )
        new_owner = survivors[heir or ""]
        wait_until(
            lambda: new_owner.findings("idle", "idle") == 1,
            timeout=90,
            what=f"{new_owner.name} judging the policy",
            alive=alive_after,
        )
        assert len(warnings()) == 1  # resumed from status, not announced again
        assert {e["reportingInstance"] for e in setup.events("GPUMonitorPolicy", "idle")} == {killed}
        other = next(n for n in survivors if n != heir)
        assert survivors[other].metric("gpuwarden_operator_status_writes_total") == 0
        for node, agent in agents.items():
            metrics = agent.metrics()
            for reason in ("buffer_full", "rejected"):
                assert (
                    metrics.get(f'gpuwarden_agent_report_dropped_snapshots_total{{reason="{reason}"}}') == 0
                ), node

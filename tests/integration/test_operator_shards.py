"""End to end: three operator replicas in sharded mode (``--shards``) on a real API server, scripted
agents on several nodes posting to one replica's endpoint (standing for the ingest Service).

The first test SIGKILLs one replica mid-run. What is asserted: every replica holds a Lease; each
node's readings land on the node's owner by the ring, and on no other (the others answered 421
and the agent followed; a view acts only once two listings agree); the policy's Events come from
its owner only, once; after the kill, the dead replica's nodes are taken by their next owners and
its policy by its next owner, which resumes the violation without announcing it again; no agent
dropped a snapshot.

The second: a policy whose pods run on the three replicas' nodes is judged by its owner on all of
them (the others send it their verdicts, ``POST /v1/verdicts`` with the operator's own
ServiceAccount token): every pod's finding in its status, each Event posted once, by the owner,
and one scale-up that needs every pod saturated, taken once.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any

import pytest
from controlplane import ControlPlane, free_ports
from operator_support import (
    IDLE_RULE,
    Agent,
    Operator,
    Setup,
    create_gpu_pod,
    create_plain_pod,
    get,
    gpu,
    monitor_policy,
    pod,
    prepare,
    service_account_token,
    wait_until,
    write_scenario,
)

from gpuwarden.operator.sharding.membership import GROUP_LABEL
from gpuwarden.operator.sharding.ring import Ring, ring_key

pytestmark = pytest.mark.integration

REPLICAS = ("op-a", "op-b", "op-c")
LABEL = "gpuwarden.dev/ingest-active"


OPERATOR_SA = "gpuwarden-operator"


def start_replicas(setup: Setup, running: ExitStack) -> dict[str, Operator]:
    """The three replicas, each with its own advertised URL and the operator's ServiceAccount token
    (what it shows the others with its verdicts), acting and seeing each other."""
    cp, namespace = setup.cp, setup.namespace
    token = service_account_token(cp, namespace, OPERATOR_SA)
    token_file = setup.workdir / "operator-token"
    token_file.write_text(token)
    operators: dict[str, Operator] = {}
    for name in REPLICAS:
        ports = free_ports(2)
        url = f"http://127.0.0.1:{ports[0]}/v1/reports"
        args = [
            "--shards",
            f"--advertise-url={url}",
            f"--operator-service-account={namespace}:{OPERATOR_SA}",
            f"--peer-token-file={token_file}",
        ]
        operators[name] = running.enter_context(
            setup.operator(name, ports=(ports[0], ports[1]), extra_args=args)
        )
    for operator in operators.values():
        operator.wait_ready(active=True, timeout=120)

    # Agents start once every view counts all three: a view that lags a poll behind a joiner's Lease
    # would take the joiner's nodes for that poll (a joiner, not a start-up, matter).
    def sees_all(o: Operator) -> bool:
        return o.metric("gpuwarden_operator_shard_members") == len(REPLICAS)

    for operator in operators.values():
        wait_until(
            partial(sees_all, operator),
            timeout=30,
            what=f"{operator.name} seeing {len(REPLICAS)} replicas",
            alive=operator.alive,
        )
    return operators


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
    killed = ring3.owner(ring_key(namespace, "idle"))
    assert killed is not None
    entry = next(r for r in REPLICAS if r != killed)
    ring2 = Ring(r for r in REPLICAS if r != killed)
    heir = ring2.owner(ring_key(namespace, "idle"))
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
        operators = start_replicas(setup, running)
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
                partial(holds_pod, owner, pod_of[node]),
                timeout=90,
                what=f"{node} on {owner.name}",
                alive=alive,
            )

        # And on no other replica: no view acted before two listings agreed (the start-up gap).
        strays = [
            (node, name)
            for node in nodes
            for name, operator in operators.items()
            if holds_pod(operator, pod_of[node]) != (name == ring3.owner(node))
        ]
        assert not strays
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
                    partial(holds_pod, heir_op, pod_of[node]),
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


SATURATED_RULE: dict[str, Any] = {
    "name": "saturated",
    "utilizationCeiling": {"percent": 90, "for": "5s", "signal": "gpuUtil"},
}


def spanning_policy(namespace: str) -> dict[str, Any]:
    """Saturated pods call for one more replica of ``llm``, once every selected pod is saturated."""
    policy = monitor_policy(namespace, "span", [SATURATED_RULE], selector={"matchLabels": {"app": "span"}})
    policy["spec"]["evaluationInterval"] = "2s"
    policy["spec"]["actions"] = {
        "scale": {
            "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"},
            "minReplicas": 1,
            "maxReplicas": 3,
            "scaleUpOn": ["saturated"],
            "scaleUpMinPods": "100%",
            "behavior": {"scaleUp": {"stabilizationWindow": "0s", "step": 1, "cooldown": "10m"}},
        }
    }
    return policy


def deployment(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "llm"}},
            "template": {
                "metadata": {"labels": {"app": "llm"}},
                "spec": {"containers": [{"name": "server", "image": "example.invalid/llm:1"}]},
            },
        },
    }


def test_a_policy_whose_pods_span_shards_is_judged_whole_and_acted_on_once(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    setup = prepare(cp, tmp_path_factory, "spanning")
    namespace = setup.namespace
    for name in REPLICAS:
        create_plain_pod(cp, namespace, name)
    ring = Ring(REPLICAS)
    owner = ring.owner(ring_key(namespace, "span"))
    # One saturated pod on a node of each replica: the owner judges one, the other two send verdicts.
    candidates = [f"gpu-node-{i}" for i in range(2, 200)]
    nodes = [next(n for n in candidates if ring.owner(n) == r) for r in REPLICAS]
    setup.apply(deployment(namespace))
    setup.apply(spanning_policy(namespace))
    scenarios = {}
    pod_of = {}
    for i, node in enumerate(nodes):
        name, labels = f"span-{i}", {"app": "span"}
        uuid = f"GPU-5b000000-0000-4000-8000-{i:012d}"
        create_gpu_pod(cp, namespace, name, labels, node=node)
        card = gpu(uuid, 0, [{"kind": "saturated", "level": 98}], [{"kind": "idle", "level": "60Gi"}])
        scenarios[node] = write_scenario(
            setup.workdir / f"scenario-{node}.yaml",
            f"span-{i}",
            [card],
            [pod(namespace, name, uuid, labels, 200 + i)],
        )
        pod_of[node] = name

    with ExitStack() as running:
        operators = start_replicas(setup, running)
        entry = operators[next(r for r in REPLICAS if r != owner)]
        agents = [running.enter_context(setup.agent(scenarios[n], entry, node=n)) for n in nodes]

        def alive() -> str | None:
            return next((why for p in [*operators.values(), *agents] if (why := p.alive())), None)

        def violating() -> set[str]:
            return {v["pod"] for v in setup.violations("span")}

        wait_until(
            lambda: violating() == set(pod_of.values()), timeout=90, what="every pod in status", alive=alive
        )

        def replicas() -> int:
            return int(get(cp, "deployment", "llm", "-n", namespace)["spec"]["replicas"])

        wait_until(lambda: replicas() == 2, timeout=60, what="one scale-up", alive=alive)
        # A few more rounds of the owner's: nothing is announced or scaled again.
        rounds = "gpuwarden_operator_evaluation_duration_seconds_count"
        later = operators[owner or ""].metric(rounds) + 5
        wait_until(
            lambda: operators[owner or ""].metric(rounds) >= later,
            timeout=30,
            what="5 more rounds",
            alive=alive,
        )

        for name in pod_of.values():
            (warning,) = setup.events("Pod", name, "GPUSaturated")
            assert warning["reportingInstance"] == owner
        on_policy = setup.events("GPUMonitorPolicy", "span", "GPUSaturated")
        assert sorted(e["message"].split(":")[0] for e in on_policy) == sorted(
            f"pod {p}" for p in pod_of.values()
        )
        assert {e["reportingInstance"] for e in on_policy} == {owner}
        (scaled,) = setup.events("Deployment", "llm", "ScaledUp")
        assert scaled["reportingInstance"] == owner
        assert replicas() == 2
        for name, operator in operators.items():
            writes = operator.metric("gpuwarden_operator_status_writes_total")
            assert (writes > 0) == (name == owner), name
            sent = operator.metric('gpuwarden_operator_verdicts_sent_total{result="ok"}')
            assert (sent > 0) == (name != owner), name

"""Sharded mode in the operator (docs/scaling-out.md): the Lease loop against an in-memory API, ingest
answering 421 for nodes another replica owns, and a policy evaluated by its owner only."""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from operator_fakes import PODS, POLICY, T0, Clock, ReviewApi, StatusApi, feed, report
from tls_support import SERVICE_NAME, make_pki

from gpuwarden.kubetime import format_micro_time
from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import ConfigError, OperatorConfig
from gpuwarden.operator.endpoints.reports import make_ingest_app
from gpuwarden.operator.metrics import OperatorMetrics
from gpuwarden.operator.policies.runner import PolicyRunner, RunnerParts
from gpuwarden.operator.resources import ObjectRef, PodRecord, PolicyKey
from gpuwarden.operator.sharding.exchange import VerdictSender
from gpuwarden.operator.sharding.membership import (
    LEASE_SECONDS,
    RENEW_SECONDS,
    URL_ANNOTATION,
    Member,
    ShardView,
    lease_name,
)
from gpuwarden.operator.sharding.ring import ring_key
from gpuwarden.operator.sharding.shard import Sharding
from gpuwarden.policy.engine import PodView
from gpuwarden.policy.store.series import Point, SeriesKey
from gpuwarden.wire.node import dump_report
from gpuwarden.wire.verdicts import SCHEMA_VERSION, VerdictReport

URL_B = "http://10.0.0.2:8443/v1/reports"


def sharded(identity: str = "op-a") -> OperatorConfig:
    return OperatorConfig(
        shards=True,
        identity=identity,
        pod_name=identity,
        pod_namespace="gw",
        advertise_url=f"http://{identity}:8443/v1/reports",
    )


def view(identity: str, *members: Member, settle: float = 0.0) -> ShardView:
    v = ShardView(identity, settle_seconds=settle)
    now = time.monotonic()
    for t in (now - 1, now):  # two listings alike: a steady view
        v.update({m.identity: m for m in members}, t)
    return v


class LeaseApi:
    """Leases in memory, as the API server keeps them; also takes pod label patches."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.labels: dict[str, str | None] = {}
        self.down = False

    async def renew_lease(self, namespace: str, lease: Mapping[str, Any], *, manager: str) -> Any:
        if self.down:
            from gpuwarden.operator.kube.client import ApiError

            raise ApiError(0, "away")
        self.leases[lease["metadata"]["name"]] = dict(lease)
        return lease

    async def list_leases(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        if self.down:
            from gpuwarden.operator.kube.client import ApiError

            raise ApiError(0, "away")
        key, _, value = selector.partition("=")
        return [le for le in self.leases.values() if le["metadata"]["labels"].get(key) == value]

    async def delete_lease(self, namespace: str, name: str) -> None:
        self.leases.pop(name, None)

    async def patch_pod_labels(self, namespace: str, name: str, labels: Any, *, manager: str) -> Any:
        self.labels.update(labels)
        return {}


def test_the_flags_build_a_sharded_config() -> None:
    env = {"POD_NAME": "op-a", "POD_NAMESPACE": "gw", "POD_IP": "10.0.0.1"}
    base = OperatorConfig.defaults(env)
    assert not base.shards
    flags = ("--token-audience", "a", "--agent-service-account", "gw:agent")
    config = OperatorConfig.parse([*flags, "--shards"], env)
    assert (config.shards, config.advertise_url) == (True, "http://10.0.0.1:8443/v1/reports")
    with pytest.raises(ConfigError, match="POD_NAMESPACE"):
        OperatorConfig.parse([*flags, "--shards"], {})
    with pytest.raises(ConfigError, match="goes with --shards"):
        OperatorConfig.parse([*flags, "--advertise-url", "http://x/v1/reports"], env)


class Clocks:
    """The operator's two clocks, driven by the test: wall time (the Leases') and monotonic (the view's)."""

    def __init__(self) -> None:
        self.wall = T0
        self.mono = 1000.0

    def build(self, identity: str, api: LeaseApi) -> Sharding:
        config = sharded(identity)
        operator = build_operator(config, api=api, clock=lambda: self.wall, monotonic=lambda: self.mono)  # type: ignore[arg-type]
        return sharding(operator.parts)


def sharding(parts: RunnerParts) -> Sharding:
    """The shard the composition root gave the runners: in sharded mode, a :class:`Sharding`."""
    assert isinstance(parts.shard, Sharding)
    return parts.shard


async def test_the_loop_renews_its_lease_sees_the_others_and_hands_over_on_exit() -> None:
    api = LeaseApi()
    clocks = Clocks()
    a = clocks.build("op-a", api)
    b = clocks.build("op-b", api)
    await a._follow()
    assert not a.active  # one listing: not yet steady
    await a._follow()
    assert a.active
    assert set(a.view.members) == {"op-a"}
    lease = api.leases[lease_name("gpuwarden", "op-a")]
    assert lease["metadata"]["annotations"] == {URL_ANNOTATION: "http://op-a:8443/v1/reports"}
    assert lease["spec"]["renewTime"] == format_micro_time(T0)  # the operator's clock
    await b._follow()
    await a._follow()
    assert set(a.view.members) == {"op-a", "op-b"}
    assert a.view.members["op-b"].url == "http://op-b:8443/v1/reports"

    await b.step_down()
    assert lease_name("gpuwarden", "op-b") not in api.leases
    await a._follow()
    assert set(a.view.members) == {"op-a"}

    # The API away: the view goes stale and the replica stops acting, though it was active.
    api.down = True
    clocks.mono += 10
    with pytest.raises(Exception, match="away"):
        await a._follow()
    assert not a.active
    assert not a.acting()


async def test_a_lease_not_renewed_dies_by_the_operators_clock() -> None:
    api = LeaseApi()
    clocks = Clocks()
    a = clocks.build("op-a", api)
    b = clocks.build("op-b", api)
    await b._follow()
    await a._follow()
    await a._follow()
    assert set(a.view.members) == {"op-a", "op-b"}
    # b stops renewing (killed); a renews its own every RENEW_SECONDS of its monotonic clock.
    clocks.wall += LEASE_SECONDS - 1
    clocks.mono += RENEW_SECONDS
    await a._follow()
    assert set(a.view.members) == {"op-a", "op-b"}  # b's Lease lives a second more
    clocks.wall += 1
    clocks.mono += RENEW_SECONDS
    await a._follow()
    assert set(a.view.members) == {"op-a"}
    assert api.leases[lease_name("gpuwarden", "op-a")]["spec"]["renewTime"] == format_micro_time(clocks.wall)
    assert a.active


@pytest.fixture
async def client() -> AsyncIterator[tuple[TestClient[Any, Any], RunnerParts]]:
    operator = build_operator(sharded("op-a"), api=ReviewApi(), clock=Clock())  # type: ignore[arg-type]
    operator.state.pod_nodes = {("ns", "pod-a"): ["node-1"], ("ns", "pod-b"): ["node-2"]}
    operator.state.pods_synced = True
    c = TestClient(TestServer(make_ingest_app(operator.ingest)))
    await c.start_server()
    try:
        yield c, operator.parts
    finally:
        await c.close()


async def post(c: TestClient[Any, Any], node: str, token: str) -> tuple[int, dict[str, Any]]:
    rsp = await c.post(
        "/v1/reports", data=dump_report(report(node=node)), headers={"Authorization": f"Bearer {token}"}
    )
    return rsp.status, await rsp.json()


async def test_ingest_answers_421_with_the_owner_for_nodes_it_does_not_own(client: Any) -> None:
    c, parts = client
    assert (await post(c, "node-1", "good"))[0] == 503  # no listing yet: acts on nothing
    members = [Member("op-a", "http://op-a:8443/v1/reports"), Member("op-b", URL_B)]
    sharding(parts).view = view("op-a", *members)
    ring = sharding(parts).view.ring
    assert {ring.owner("node-1"), ring.owner("node-2")} == {"op-a", "op-b"}  # (the names were picked so)
    ours, theirs = ("good", "node-1"), ("good-2", "node-2")
    if ring.owner("node-1") == "op-b":
        ours, theirs = theirs, ours
    status, payload = await post(c, theirs[1], theirs[0])
    assert (status, payload["reason"], payload["owner"], payload["url"]) == (421, "NotOwner", "op-b", URL_B)
    status, payload = await post(c, ours[1], ours[0])
    assert (status, payload["duplicate"]) == (200, False)
    rejected = parts.metrics.registry.get_sample_value(
        "gpuwarden_operator_reports_rejected_total", {"reason": "not_owner"}
    )
    assert rejected == 1


@pytest.fixture
def world() -> tuple[RunnerParts, StatusApi, list[str], list[float]]:
    api = StatusApi()
    clock = [T0]
    posted: list[str] = []

    class Sink:
        async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
            posted.append(f"{regarding.kind} {reason}")

    return runner_parts(sharded("op-a"), api, lambda: clock[0], Sink()), api, posted, clock


def runner_parts(config: OperatorConfig, api: Any, clock: Callable[[], float], events: Any) -> RunnerParts:
    """A runner's parts as the composition root builds them, with the Events going to ``events`` and
    neither scaling nor reclaiming."""
    parts = build_operator(config, api=api, clock=clock).parts
    return replace(parts, events=events, scaler=None, reclaimer=None)


def owner_of_pol(*identities: str) -> str:
    return view(identities[0], *(Member(i) for i in identities)).ring.owner(ring_key("ns", "pol")) or ""


async def test_only_the_policys_owner_evaluates_and_a_new_owner_does_not_announce_again(world: Any) -> None:
    parts, api, posted, clock = world
    other = next(o for o in (f"op-{c}" for c in "bcdefgh") if owner_of_pol("op-a", o) == o)
    sharding(parts).view = view("op-a", Member("op-a"), Member(other))
    runner = PolicyRunner(parts, PolicyKey("ns", "pol"))
    pacing = parts.records.open_policy(runner.key)
    feed(parts.records, T0 - 20, T0, util=3)
    await runner.round(body=dict(POLICY, status={}), pods=PODS["ns"], pacing=pacing)
    assert (posted, api.patches) == ([], [])  # the other replica's policy

    # The owner announced it and wrote the status; then it left, and op-a takes the policy over.
    owner = runner_parts(sharded(other), api, parts.clock, parts.events)
    sharding(owner).view = view(other, Member("op-a"), Member(other))
    feed(owner.records, T0 - 20, T0, util=3)
    theirs = PolicyRunner(owner, PolicyKey("ns", "pol"))
    await theirs.round(
        body=dict(POLICY, status={}), pods=PODS["ns"], pacing=owner.records.open_policy(theirs.key)
    )
    assert len(posted) == 2
    written = api.patches[-1]

    sharding(parts).view = view("op-a", Member("op-a"), settle=6.0)
    clock[0] += 1
    feed(parts.records, T0, clock[0], util=3)
    await runner.round(body=dict(POLICY, status=written), pods=PODS["ns"], pacing=pacing)
    assert len(api.patches) == 1  # not yet settled: nothing written
    sharding(parts).view = view("op-a", Member("op-a"))
    await runner.round(body=dict(POLICY, status=written), pods=PODS["ns"], pacing=pacing)
    assert len(posted) == 2  # resumed from status, not announced again
    assert runner.evaluation is not None
    assert len(runner.evaluation.active) == 1

    # And it stands aside again when the ring gives the policy back.
    sharding(parts).view = view("op-a", Member("op-a"), Member(other))
    await runner.round(body=dict(POLICY, status=written), pods=PODS["ns"], pacing=pacing)
    assert runner.evaluator is None


OPERATOR_SA = "system:serviceaccount:gpuwarden-system:gpuwarden-operator"


class PeerApi(StatusApi):
    """Status patches, and TokenReviews: "peer" is the operator's own ServiceAccount (no pod binding)."""

    async def create_token_review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        users = {"peer": OPERATOR_SA, "agent": "system:serviceaccount:gpuwarden-system:gpuwarden-agent"}
        if token not in users:
            return {"authenticated": False, "error": "invalid bearer token"}
        return {"authenticated": True, "audiences": audiences, "user": {"username": users[token]}}


async def test_a_policy_spanning_shards_is_judged_on_all_its_pods_and_announced_by_its_owner_once(
    tmp_path: Any,
) -> None:
    """op-a owns the policy and the node of pod p; another replica owns q's node: it judges q and
    sends op-a its verdicts, POST /v1/verdicts with its token; op-a announces and writes both."""
    other = next(o for o in (f"op-{c}" for c in "bcdefgh") if owner_of_pol("op-a", o) == "op-a")
    ring = view("op-a", Member("op-a"), Member(other)).ring
    node_a = next(n for n in (f"node-{i}" for i in range(100)) if ring.owner(n) == "op-a")
    node_b = next(n for n in (f"node-{i}" for i in range(100)) if ring.owner(n) == other)
    clock = [T0]
    api = PeerApi()
    owner_operator = build_operator(sharded("op-a"), api=api, clock=lambda: clock[0])  # type: ignore[arg-type]
    posted: list[str] = []

    class Sink:
        async def post(self, regarding: ObjectRef, type_: str, reason: str, message: str) -> None:
            posted.append(f"{regarding.kind} {regarding.name} {reason}")

    sink = Sink()
    owner = replace(owner_operator.parts, events=sink, scaler=None, reclaimer=None)
    shard = runner_parts(sharded(other), api, lambda: clock[0], sink)
    token = tmp_path / "token"
    token.write_text("peer\n")
    shard = replace(shard, sender=VerdictSender(str(token), shard.metrics))
    pods = [
        PodRecord(PodView("ns", "p", {"app": "x"}), "uid-p"),
        PodRecord(PodView("ns", "q", {"app": "x"}), "uid-q"),
    ]
    for parts in (owner, shard):
        parts.records.pod_nodes = {("ns", "p"): [node_a], ("ns", "q"): [node_b]}
    server = TestServer(owner_operator.lifecycle.ingest_app)  # /v1/reports and /v1/verdicts, as wired
    c = TestClient(server)
    await c.start_server()
    try:
        url = str(server.make_url("/v1/reports"))
        members = [Member("op-a", url), Member(other, "http://unused/v1/reports")]
        sharding(owner).view = view("op-a", *members)
        sharding(shard).view = view(other, *members)
        add_readings(owner.records.store, "p", T0 - 20, T0, util=50)  # busy on op-a's node
        add_readings(shard.records.store, "q", T0 - 20, T0, util=3)  # idle on the other's

        # Every replica runs every policy's daemon: the owner takes verdicts only on a policy it runs.
        ours = PolicyRunner(owner, PolicyKey("ns", "pol"))
        our_pacing = owner.records.open_policy(ours.key)
        theirs = PolicyRunner(shard, PolicyKey("ns", "pol"))
        await theirs.round(
            body=dict(POLICY, status={}), pods=pods, pacing=shard.records.open_policy(theirs.key)
        )
        assert (posted, api.patches) == ([], [])  # only the owner announces and writes
        sent = shard.metrics.registry.get_sample_value(
            "gpuwarden_operator_verdicts_sent_total", {"result": "ok"}
        )
        assert sent == 1
        assert len(owner.board) == 1  # q's verdict

        await ours.round(body=dict(POLICY, status={}), pods=pods, pacing=our_pacing)
        assert posted == ["Pod q GPUUnderutilized", "GPUMonitorPolicy pol GPUUnderutilized"]
        (written,) = api.patches
        assert [v["pod"] for v in written["violations"]] == ["q"]
        assert written["matchedPods"] == 2

        # q recovers on its shard: the owner resolves it (once), from the next verdict.
        clock[0] = T0 + 30
        add_readings(shard.records.store, "q", T0 + 1, T0 + 30, util=60)
        add_readings(owner.records.store, "p", T0 + 1, T0 + 30, util=50)
        await theirs.round(
            body=dict(POLICY, status={}), pods=pods, pacing=shard.records.open_policy(theirs.key)
        )
        await ours.round(
            body=dict(POLICY, status=written), pods=pods, pacing=owner.records.open_policy(ours.key)
        )
        assert posted[2:] == [
            "Pod q GPUUnderutilizedResolved",
            "GPUMonitorPolicy pol GPUUnderutilizedResolved",
        ]

        # Only the operator's own ServiceAccount may post verdicts.
        for bearer, status in (("agent", 403), ("nobody", 401)):
            rsp = await c.post("/v1/verdicts", data=b"{}", headers={"Authorization": f"Bearer {bearer}"})
            assert rsp.status == status
        rsp = await c.post("/v1/verdicts", data=b"{}", headers={"Authorization": "Bearer peer"})
        assert (rsp.status, (await rsp.json())["reason"]) == (400, "InvalidVerdicts")
    finally:
        await shard.sender.close()
        await c.close()


def add_readings(store: Any, pod: str, start: float, end: float, util: float) -> None:
    t = start
    while t <= end:
        store.add(SeriesKey("ns", pod, "GPU-1"), Point(t=t, gpu_util=util, mem_used=1e9, mem_total=8e10))
        t += 1


async def test_a_send_to_an_owner_that_does_not_answer_is_counted_and_not_retried(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = OperatorMetrics()
    sender = VerdictSender(None, metrics)
    report = VerdictReport(schema_version=SCHEMA_VERSION, shard="op-b", at=T0, namespace="ns", policy="pol")
    try:
        for _ in range(2):
            assert not await sender.send("http://127.0.0.1:9/v1/verdicts", report)  # discard port: refused
    finally:
        await sender.close()
    failed = metrics.registry.get_sample_value("gpuwarden_operator_verdicts_sent_total", {"result": "failed"})
    assert failed == 2
    assert len([r for r in caplog.records if "Cannot send verdicts" in r.message]) == 1  # logged once


@pytest.mark.parametrize("trusted", [True, False], ids=["the chart's CA", "another CA"])
async def test_verdicts_go_over_tls_to_a_replica_at_its_pod_ip_named_as_the_service(
    tmp_path: Path, trusted: bool
) -> None:
    """A peer is reached at its pod IP, which its certificate (the ingest Service's) does not name:
    --peer-server-name is what is checked; another CA's certificate gets nothing, the token included."""
    pki = make_pki(tmp_path / "operator")
    seen: list[str | None] = []

    async def take(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"taken": 0, "refused": 0})

    app = web.Application()
    app.router.add_post("/v1/verdicts", take)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(pki.cert_file, pki.key_file)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=serving).start()
    port = runner.addresses[0][1]
    token = tmp_path / "token"
    token.write_text("peer-token")
    ca = pki.ca_file if trusted else make_pki(tmp_path / "other").ca_file
    metrics = OperatorMetrics()
    sender = VerdictSender(
        str(token), metrics, tls=ssl.create_default_context(cafile=ca), server_name=SERVICE_NAME
    )
    report = VerdictReport(schema_version=SCHEMA_VERSION, shard="op-b", at=T0, namespace="ns", policy="pol")
    try:
        delivered = await sender.send(f"https://127.0.0.1:{port}/v1/verdicts", report)
    finally:
        await sender.close()
        await runner.cleanup()
    assert delivered is trusted
    assert seen == (["Bearer peer-token"] if trusted else [])

"""The whole-path fuzzer's parts, shared by tests/unit/operator/endpoints/test_ingest_fuzz.py (bounded,
for CI) and bench/fuzz_ingest.py (long runs): generated requests, the real operator behind its real aiohttp
apps, and the invariants every request must keep.

A :class:`Case` is one request to ``/v1/reports`` or ``/v1/verdicts``: a token (the agent of
node-1 or node-2, an unbound one, a stranger, a peer replica, none), a body (a valid node or
verdict report, one with a value replaced by something nasty, or junk) and an encoding (none,
deflate, gzip, or a corrupt deflate stream). Its timestamps are offsets from the operator's
clock, so that the bounds are hit exactly.

After each case, :meth:`Harness.check` asserts: no 500 and no internal error counted, a 200's
answer well formed; a good report from node-1's agent right after is stored (its readings are
newer than anything the case could store) and evaluated (the memoryCeiling rule judges it from
its value); ``/metrics`` answers 200 with text the Prometheus parser reads, carrying the good
reading, and ``/readyz`` is 200; a whole round of the health path runs without an error (a
gpuHealth and a utilization rule with throttling over every pod, the node verdict of every node,
the Event of every incident); state is bounded by identities, not by what the requests claim:
a node's GPU records hold only pods the index places on that node, no XID is later than the
clock's bound, and verdicts are kept only for the policy that runs.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.operator.admission import MAX_FUTURE_SKEW, MAX_REPORT_AGE
from gpuwarden.operator.composition import build_operator
from gpuwarden.operator.config import OperatorConfig
from gpuwarden.operator.endpoints.reports import make_ingest_app
from gpuwarden.operator.kube.tokenreview import TokenAuthenticator
from gpuwarden.operator.metrics import make_metrics_app
from gpuwarden.operator.nodehealth import NodeSettings, incident_event, node_verdict
from gpuwarden.operator.resources import PolicyKey
from gpuwarden.operator.sharding.exchange import VerdictIngest
from gpuwarden.policy.engine import PodView, PolicyEvaluator
from gpuwarden.policy.parse import parse_spec
from gpuwarden.policy.store.series import SeriesKey
from gpuwarden.policy.xids import CRITICAL_XIDS
from gpuwarden.wire.base import MAX_BYTES, MAX_COUNT, MAX_TIMESTAMP
from gpuwarden.wire.verdicts import MAX_PODS

AGENT = "system:serviceaccount:gpuwarden-system:gpuwarden-agent"
OPERATOR = "system:serviceaccount:gpuwarden-system:gpuwarden-operator"
NAMESPACE = "ns"
START = 1_800_000_000.0
GOOD_POD = "good"
GOOD_GPU = "GPU-good"
CARD = 80 * 2**30
GOOD_USED = int(CARD * 0.95)
"""The good report's memory: 95% of the card, over the rule's 90%."""

TOKENS: dict[str, tuple[str, str | None]] = {
    "node-1": (AGENT, "node-1"),
    "node-2": (AGENT, "node-2"),
    "unbound": (AGENT, None),
    "stranger": ("system:serviceaccount:default:intruder", "node-1"),
    "peer": (OPERATOR, None),
}
POD_NODES = {
    (NAMESPACE, "fuzz"): ["node-1"],
    (NAMESPACE, "other"): ["node-2"],
    (NAMESPACE, GOOD_POD): ["node-1"],
}
"""The pod index: fuzz and good run on node-1, other on node-2."""
PODS = [(NAMESPACE, "fuzz"), (NAMESPACE, "other"), (NAMESPACE, "ghost"), ("elsewhere", "fuzz")]
"""What generated reports name: a pod of node-1, of node-2, none, one of an unwatched namespace."""
GPUS = ["GPU-a", "GPU-b", "MIG-c"]
STATUSES = {200, 400, 401, 403, 404, 413}
POLICY = "fuzz"
"""The policy whose daemon runs: verdicts on it are kept, on any other refused."""

SPEC = parse_spec(
    {
        "selector": {},
        "evaluationInterval": "1s",
        "rules": [{"name": "near-oom", "memoryCeiling": {"percent": 90, "for": "1s"}}],
    }
)
HEALTH_SPEC = parse_spec(
    {
        "selector": {},
        "evaluationInterval": "1s",
        "rules": [
            {"name": "health", "gpuHealth": {"clearAfter": "60s", "throttling": ["thermal", "power"]}},
            {"name": "idle", "utilizationFloor": {"percent": 20, "for": "5s"}},
        ],
    }
)
"""The health path's round: gpuHealth, and throttling beside a utilization rule."""
NODE_SETTINGS = NodeSettings(xids=CRITICAL_XIDS, hold=60.0)


class FuzzApi:
    """TokenReviews from :data:`TOKENS`; anything else is not a token."""

    async def create_token_review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        if token not in TOKENS:
            return {"authenticated": False, "error": "invalid bearer token"}
        username, node = TOKENS[token]
        user: dict[str, Any] = {"username": username}
        if node is not None:
            user["extra"] = {"authentication.kubernetes.io/node-name": [node]}
        return {"authenticated": True, "audiences": audiences, "user": user}

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


# -- generated requests ------------------------------------------------------------------------------

NASTY: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    1e308,
    -1e308,
    10**30,
    10**4000,
    -1,
    MAX_COUNT + 1,
    MAX_BYTES + 1,
    1.5,
    1.0,
    "1",
    True,
    None,
    [],
    {},
    "x" * 300,
]
"""Values that were accepted, or crashed something, before issue 19; put anywhere in a report."""

OFFSETS = st.one_of(
    st.floats(-600, MAX_FUTURE_SKEW),
    st.floats(-600, MAX_FUTURE_SKEW),
    st.sampled_from([0.0, -MAX_REPORT_AGE - 1, -MAX_REPORT_AGE + 1, -START, 1e12]),
    st.sampled_from([MAX_FUTURE_SKEW - 0.5, MAX_FUTURE_SKEW, MAX_FUTURE_SKEW + 1]),
    st.floats(-2 * MAX_REPORT_AGE, 2 * MAX_FUTURE_SKEW),
)
"""Timestamps relative to the operator's clock: at its bounds, far off, or anywhere near."""

percent = st.one_of(st.none(), st.floats(0, 100))
size = st.one_of(st.none(), st.integers(0, MAX_BYTES), st.sampled_from([0, MAX_BYTES]))


@st.composite
def healths(draw: st.DrawFn) -> dict[str, Any]:
    """Schema version 2's GPU health; XID timestamps are offsets from the clock, as snapshots' are."""
    health: dict[str, Any] = {
        "xids": [
            {"code": draw(st.integers(0, 2**32 - 1)), "timestamp": draw(OFFSETS)}
            for _ in range(draw(st.integers(0, 2)))
        ],
        "eccUncorrectedAggregate": draw(st.one_of(st.none(), st.integers(0, MAX_COUNT))),
        "rowRemapFailed": draw(st.one_of(st.none(), st.booleans())),
        "clockEventReasons": draw(
            st.one_of(
                st.none(), st.lists(st.sampled_from(["hwSlowdown", "swPowerCap", "gpuIdle"]), max_size=3)
            )
        ),
    }
    return {k: v for k, v in health.items() if v is not None}


@st.composite
def gpu_samples(draw: st.DrawFn) -> dict[str, Any]:
    pods = draw(st.lists(st.sampled_from(PODS), min_size=1, max_size=3))
    gpu: dict[str, Any] = {
        "uuid": draw(st.sampled_from(GPUS)),
        "index": draw(st.integers(0, 8)),
        "state": draw(st.sampled_from(["ok", "ok", "ok", "lost", "unknown"])),
        "utilizationGpu": draw(percent),
        "smActive": draw(percent),
        "memoryUsedBytes": draw(size),
        "memoryTotalBytes": draw(size),
        "temperatureC": draw(st.one_of(st.none(), st.floats(-273.15, 1000))),
        "powerWatts": draw(st.one_of(st.none(), st.floats(0, 100_000))),
        "pods": [{"namespace": ns, "name": name} for ns, name in pods],
        "health": draw(st.one_of(st.none(), healths())),
        "processes": [
            {
                "pid": draw(st.integers(0, 2**31 - 1)),
                "usedMemoryBytes": draw(size),
                "smUtil": draw(percent),
                **({"pod": {"namespace": ns, "name": name}} if draw(st.booleans()) else {}),
            }
            for ns, name in draw(st.lists(st.sampled_from(PODS), max_size=2))
        ],
    }
    return {k: v for k, v in gpu.items() if v is not None}


@st.composite
def reports(draw: st.DrawFn) -> dict[str, Any]:
    """A valid report but for its timestamps, which are offsets (see :meth:`Case.body`)."""
    return {
        "schemaVersion": draw(st.sampled_from([1, 2, 2])),  # a version 1 report with health is a 400
        "node": draw(st.sampled_from(["node-1"] * 6 + ["node-2", "claimed"])),
        "agentId": draw(st.sampled_from(["fuzz-a", "fuzz-b"])),
        "seq": draw(st.one_of(st.integers(0, 5), st.just(MAX_COUNT))),
        "snapshots": [
            {"timestamp": offset, "gpus": draw(st.lists(gpu_samples(), min_size=1, max_size=3))}
            for offset in draw(st.lists(OFFSETS, min_size=1, max_size=4))
        ],
    }


@st.composite
def verdict_reports(draw: st.DrawFn) -> dict[str, Any]:
    """A valid verdict report but for ``at``, an offset (see :meth:`Case.body`)."""
    figure = st.floats(-(2.0**60), 2.0**60)
    return {
        "schemaVersion": 1,
        "shard": draw(st.sampled_from(["op-b", "op-c"])),
        "at": draw(OFFSETS),
        "namespace": draw(st.sampled_from([NAMESPACE] * 4 + ["invented"])),
        "policy": draw(st.sampled_from([POLICY] * 4 + ["nope"])),
        "generation": draw(st.one_of(st.none(), st.integers(0, 2**53))),
        "pods": [
            {
                "pod": name,
                "rules": [
                    {
                        "rule": "near-oom",
                        "kind": draw(st.sampled_from(["memoryCeiling", "gpuHealth"])),
                        "holds": draw(st.booleans()),
                        "clears": draw(st.booleans()),
                        "value": draw(figure),
                        "threshold": draw(figure),
                        "unit": "%",
                        "message": draw(st.text(max_size=20)),
                    }
                    for _ in range(draw(st.integers(0, 2)))
                ],
            }
            for name in draw(st.lists(st.sampled_from(["fuzz", "other", "ghost", GOOD_POD]), max_size=3))
        ],
    }


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out.extend(_paths(item, (*prefix, key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.extend(_paths(item, (*prefix, i)))
    return out


@dataclass(frozen=True)
class Case:
    """One request: which token, what body (built at the operator's time), which encoding."""

    token: str | None
    report: dict[str, Any] | None
    """A report whose timestamps are offsets from the clock; None: ``junk`` is the body."""
    mutation: tuple[tuple[Any, ...], Any] | None
    """A path into the report and what to put there (an unknown key is added)."""
    junk: bytes
    encoding: str
    path: str = "/v1/reports"
    """Where it goes: ``/v1/reports`` (a node report) or ``/v1/verdicts`` (a verdict report)."""

    def body(self, now: float) -> bytes:
        if self.report is None:
            raw = self.junk
        else:
            report = json.loads(json.dumps(self.report))
            timed = [*report.get("snapshots", [])] + ([report] if "at" in report else [])
            for snapshot in report.get("snapshots", []):
                for gpu in snapshot["gpus"]:
                    timed.extend(gpu.get("health", {}).get("xids", []))
            for item in timed:
                key = "at" if "at" in item else "timestamp"
                if isinstance(item[key], float):
                    t = now + item[key]
                    item[key] = t if 0 < t <= MAX_TIMESTAMP else now
            if self.mutation is not None:
                path, value = self.mutation
                target = report
                for step in path[:-1]:
                    target = target[step]
                target[path[-1]] = value
            raw = json.dumps(report, allow_nan=True).encode()
        if self.encoding == "deflate":
            return zlib.compress(raw)
        if self.encoding == "gzip":
            return gzip.compress(raw)
        if self.encoding == "corrupt":
            packed = zlib.compress(raw)
            return packed[:8] + bytes(b ^ 0x5A for b in packed[8:])
        return raw

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.encoding != "identity":
            headers["Content-Encoding"] = "deflate" if self.encoding == "corrupt" else self.encoding
        return headers


@st.composite
def cases(draw: st.DrawFn) -> Case:
    verdicts = draw(st.integers(0, 4)) == 0
    if verdicts:
        token = draw(st.sampled_from([*TOKENS, *["peer"] * 8, "garbage", None]))
    else:
        token = draw(st.sampled_from([*TOKENS, *["node-1"] * 8, "garbage", None]))
    kind = draw(st.sampled_from(["valid", "valid", "valid", "mutated", "mutated", "junk"]))
    report = (draw(verdict_reports()) if verdicts else draw(reports())) if kind != "junk" else None
    mutation = None
    if kind == "mutated":
        assert report is not None
        paths = _paths(report)
        path = draw(st.sampled_from(paths))
        if draw(st.booleans()) and isinstance(path[-1], str):
            path = (*path[:-1], "unknownField")
        mutation = (path, draw(st.sampled_from(NASTY)))
    junk = draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{}", b"[]", b"null", b"{" * 500])))
    encoding = draw(st.sampled_from(["identity", "identity", "identity", "deflate", "gzip", "corrupt"]))
    return Case(token, report, mutation, junk, encoding, "/v1/verdicts" if verdicts else "/v1/reports")


# -- the operator and the invariants -----------------------------------------------------------------


class Harness:
    """One operator (state, ingest and metrics apps on loopback) for a whole run of cases."""

    def __init__(self) -> None:
        self.clock = Clock()
        # Rate limits are exercised elsewhere; here they would only turn cases into 429s.
        config = OperatorConfig(namespaces=(NAMESPACE,), node_rate=1e9, max_body_bytes=256 * 1024)
        self.op = build_operator(config, api=FuzzApi(), clock=self.clock)  # type: ignore[arg-type]
        self.op.parts.shard.active = True
        self.op.state.pod_nodes = POD_NODES
        self.op.state.pods_synced = True
        self.op.state.open_policy(PolicyKey(NAMESPACE, POLICY))
        api = FuzzApi()
        schedule = self.op.state.schedule

        async def review(token: str) -> dict[str, Any]:
            return await api.create_token_review(token, [config.token_audience])

        self.verdicts = VerdictIngest(
            authenticator=TokenAuthenticator(
                review, audience=config.token_audience, username=OPERATOR, pod_bound=False
            ),
            board=self.op.parts.board,
            metrics=self.op.parts.metrics,
            acting=lambda: True,
            received=lambda report: schedule.nudge_policy_data(report.namespace, report.policy),
            max_body_bytes=config.max_body_bytes,
            clock=self.clock,
            known=self.op.state.runs_policy,
        )
        self.evaluator = PolicyEvaluator("ns/fuzz", SPEC, namespace=NAMESPACE)
        self.health_evaluator = PolicyEvaluator("ns/health", HEALTH_SPEC, namespace=NAMESPACE)
        self.incidents = 0
        self.good_seq = 0
        self.statuses: dict[int, int] = {}

    async def start(self) -> None:
        # Plain sessions rather than aiohttp's TestClient, which keeps every response until closed:
        # a long run (bench/fuzz_ingest.py) measures the operator's memory, not the client's.
        self._servers = [
            TestServer(make_ingest_app(self.op.ingest, self.verdicts.handle)),
            TestServer(make_metrics_app(self.op.parts.metrics, lambda: True)),
        ]
        for server in self._servers:
            await server.start_server()
        self.ingest = aiohttp.ClientSession(str(self._servers[0].make_url("")))
        self.metrics = aiohttp.ClientSession(str(self._servers[1].make_url("")))

    async def close(self) -> None:
        for session in (self.ingest, self.metrics):
            await session.close()
        for server in self._servers:
            await server.close()

    async def check(self, case: Case) -> None:
        """Post ``case``, then prove that the operator still works (see the module doc)."""
        self.clock.now += 1.0
        now = self.clock.now
        rsp = await self.ingest.post(case.path, data=case.body(now), headers=case.headers())
        answer = await rsp.json()
        self.statuses[rsp.status] = self.statuses.get(rsp.status, 0) + 1
        assert rsp.status in STATUSES, (rsp.status, answer)
        if rsp.status == 200 and case.path == "/v1/verdicts":
            assert set(answer) == {"taken", "refused"}, answer
        elif rsp.status == 200:
            assert set(answer) == {"accepted", "duplicate", "refused"}, answer
            assert answer["accepted"] >= 0
            assert all(count > 0 for count in answer["refused"].values()), answer
        else:
            assert set(answer) == {"reason", "message"}, answer
        get = self.op.parts.metrics.registry.get_sample_value
        assert get("gpuwarden_operator_reports_rejected_total", {"reason": "internal"}) == 0

        await self._good_report_is_stored_and_evaluated(now)
        await self._metrics_parse_and_readiness_holds()
        self._health_round_runs(now + MAX_FUTURE_SKEW)
        self._state_is_bounded()

    async def _good_report_is_stored_and_evaluated(self, now: float) -> None:
        # The newest a case could store is now + MAX_FUTURE_SKEW; a second later the clock is further.
        t = now + MAX_FUTURE_SKEW
        self.good_seq += 1
        report = {
            "schemaVersion": 1,
            "node": "node-1",
            "agentId": "good-agent",
            "seq": self.good_seq,
            "snapshots": [
                {
                    "timestamp": t,
                    "gpus": [
                        {
                            "uuid": GOOD_GPU,
                            "index": 0,
                            "utilizationGpu": 50.0,
                            "memoryUsedBytes": GOOD_USED,
                            "memoryTotalBytes": CARD,
                            "pods": [{"namespace": NAMESPACE, "name": GOOD_POD}],
                        }
                    ],
                }
            ],
        }
        rsp = await self.ingest.post("/v1/reports", json=report, headers={"Authorization": "Bearer node-1"})
        assert (rsp.status, await rsp.json()) == (200, {"accepted": 1, "duplicate": False, "refused": {}})
        window = self.op.state.store.window(SeriesKey(NAMESPACE, GOOD_POD, GOOD_GPU))
        assert window is not None
        assert window.last_time == t
        evaluation = self.evaluator.evaluate([PodView(NAMESPACE, GOOD_POD)], self.op.state.store, t)
        (outcome,) = evaluation.outcomes
        # Judged from the good reading (95% of the card), whatever the cases stored before it.
        assert outcome.value is not None, outcome
        assert math.isclose(outcome.value, 95.0, rel_tol=1e-6), outcome

    async def _metrics_parse_and_readiness_holds(self) -> None:
        rsp = await self.metrics.get("/metrics")
        text = await rsp.text()
        assert rsp.status == 200, text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        used = [
            s.value
            for s in families["gpuwarden_pod_gpu_memory_used_bytes"].samples
            if s.labels.get("pod") == GOOD_POD
        ]
        assert used == [GOOD_USED], used
        assert (await self.metrics.get("/readyz")).status == 200

    def _health_round_runs(self, now: float) -> None:
        """A whole round of the health path on what the cases left: nothing raises (issue 27, 2)."""
        health = self.op.state.health
        pods = [PodView(ns, name) for ns, name in {*POD_NODES, *PODS}]
        evaluation = self.health_evaluator.evaluate(pods, self.op.state.store, now, health)
        for outcome in evaluation.outcomes:
            assert outcome.value is None or math.isfinite(outcome.value), outcome
            assert outcome.message  # the words of every outcome can be made
        for node in health.nodes():
            node_verdict(health.gpus_on(node), now, NODE_SETTINGS)
        for incident in health.incidents(after=self.incidents):
            incident_event(incident, NODE_SETTINGS)
            self.incidents = incident.seq

    def _state_is_bounded(self) -> None:
        # Per-identity state is as large as the identities, whatever names the requests claim.
        identities = sum(1 for _, node in TOKENS.values() if node is not None)
        assert len(self.op.ingest.limiter) <= identities
        assert len(self.op.ingest.book) <= identities
        assert len(self.op.ingest.authenticator) <= len(TOKENS) + 1
        # Series only for the watched pods the index places on the token's node, on the GPUs named.
        placed = [pod for pod in self.op.state.store.pods() if (pod.namespace, pod.name) in POD_NODES]
        assert placed == list(self.op.state.store.pods())
        assert len(self.op.state.store) <= len(POD_NODES) * (len(GPUS) + 1)
        assert len(self.op.parts.metrics.latest) <= len(self.op.state.store) + len(POD_NODES)
        # Health only from the identities' nodes, for the GPUs named.
        health = self.op.state.health
        assert health.nodes() <= {"node-1", "node-2"}, health.nodes()
        assert sum(len(health.gpus_on(node)) for node in health.nodes()) <= 2 * (len(GPUS) + 1)
        # A node's GPUs hold only pods the index places on it (issue 27, 1), and no XID from the future.
        latest = self.clock.now + MAX_FUTURE_SKEW
        for node in health.nodes():
            for record in health.gpus_on(node):
                for pod in (*record.current, *record.pods):
                    assert node in POD_NODES.get((pod.namespace, pod.name), ()), (node, pod)
                assert all(t <= latest for t, _ in record.xids), record.xids
        # Verdicts only for the policy that runs, and bounded (issue 27, 7).
        assert self.op.parts.board.policies() <= 1
        assert len(self.op.parts.board) <= MAX_PODS


class HarnessRunner:
    """A :class:`Harness` on an event loop of its own, driven from synchronous (hypothesis) code."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.harness = Harness()
        self.runner.run(self.harness.start())

    def check(self, case: Case) -> None:
        self.runner.run(self.harness.check(case))

    def close(self) -> None:
        self.runner.run(self.harness.close())
        self.runner.close()


__all__ = ["Case", "Harness", "HarnessRunner", "cases"]

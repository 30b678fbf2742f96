"""TokenReview verdicts and their cache (looptime: the TTLs pass without real waiting)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any

import pytest

from gpuwarden.operator.kube.tokenreview import (
    Review,
    ReviewLimited,
    TokenAuthenticator,
    Verdict,
    claimed_node,
    review_from,
)

AUDIENCE = "gpuwarden-operator"
AGENT = "system:serviceaccount:gpuwarden-system:gpuwarden-agent"


def status(
    username: str = AGENT, audiences: list[str] | None = None, node: str | None = "node-7"
) -> dict[str, Any]:
    """What the API server says of a token; a pod-bound one names its pod's node in ``extra``."""
    user: dict[str, Any] = {"username": username}
    if node is not None:
        user["extra"] = {"authentication.kubernetes.io/node-name": [node]}
    return {"authenticated": True, "audiences": [AUDIENCE] if audiences is None else audiences, "user": user}


def test_accepts_the_agent_for_our_audience_as_its_pods_node() -> None:
    review = review_from(status(), audience=AUDIENCE, username=AGENT)
    assert review.verdict is Verdict.ACCEPTED
    assert review.node == "node-7"


@pytest.mark.parametrize(
    ("review", "verdict", "says"),
    [
        ({"authenticated": False, "error": "token expired"}, Verdict.UNAUTHENTICATED, "token expired"),
        ({}, Verdict.UNAUTHENTICATED, "invalid token"),
        (status(audiences=["https://kubernetes.default.svc"]), Verdict.UNAUTHENTICATED, "audience"),
        (status(audiences=[]), Verdict.UNAUTHENTICATED, "audience"),
        (status(username="system:serviceaccount:default:intruder"), Verdict.FORBIDDEN, "default:intruder"),
        (status(username="admin"), Verdict.FORBIDDEN, "only " + AGENT),
        # Not bound to a pod (kubectl create token): it could claim to be any node.
        (status(node=None), Verdict.FORBIDDEN, "bound to no pod"),
        (status(node=""), Verdict.FORBIDDEN, "bound to no pod"),
    ],
)
def test_refusals(review: dict[str, Any], verdict: Verdict, says: str) -> None:
    result = review_from(review, audience=AUDIENCE, username=AGENT)
    assert result.verdict is verdict
    assert says in result.message


class FakeApi:
    def __init__(self, answers: dict[str, dict[str, Any]], delay: float = 0.0) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.delay = delay
        self.fail = False

    async def __call__(self, token: str) -> dict[str, Any]:
        self.calls.append(token)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("api down")
        return self.answers.get(token, {"authenticated": False})


def authenticator(api: FakeApi) -> TokenAuthenticator:
    return TokenAuthenticator(api, audience=AUDIENCE, username=AGENT, ttl=60, negative_ttl=5)


@pytest.mark.looptime
async def test_accepted_tokens_are_cached_for_the_ttl() -> None:
    api = FakeApi({"good": status()})
    auth = authenticator(api)
    for _ in range(100):
        assert (await auth.authenticate("good")).verdict is Verdict.ACCEPTED
    assert api.calls == ["good"]
    await asyncio.sleep(61)
    await auth.authenticate("good")
    assert api.calls == ["good", "good"]


@pytest.mark.looptime
async def test_refusals_are_cached_briefly() -> None:
    api = FakeApi({})
    auth = authenticator(api)
    assert (await auth.authenticate("bad")).verdict is Verdict.UNAUTHENTICATED
    assert (await auth.authenticate("bad")).verdict is Verdict.UNAUTHENTICATED
    assert api.calls == ["bad"]
    await asyncio.sleep(5)
    await auth.authenticate("bad")
    assert api.calls == ["bad", "bad"]


@pytest.mark.looptime
async def test_concurrent_requests_share_one_review() -> None:
    api = FakeApi({"good": status()}, delay=0.5)
    auth = authenticator(api)
    reviews = await asyncio.gather(*(auth.authenticate("good") for _ in range(50)))
    assert {r.verdict for r in reviews} == {Verdict.ACCEPTED}
    assert api.calls == ["good"]
    assert auth.reviews == 1


@pytest.mark.looptime
async def test_failures_are_not_cached_and_reach_every_sharer() -> None:
    api = FakeApi({"good": status()}, delay=0.1)
    api.fail = True
    auth = authenticator(api)
    results = await asyncio.gather(*(auth.authenticate("good") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    api.fail = False
    assert (await auth.authenticate("good")).verdict is Verdict.ACCEPTED
    assert len(api.calls) == 2


@pytest.mark.looptime
async def test_cache_is_bounded_and_keeps_no_tokens() -> None:
    api = FakeApi({f"t{i}": status() for i in range(10)})
    auth = TokenAuthenticator(api, audience=AUDIENCE, username=AGENT, max_entries=4)
    for i in range(10):
        await auth.authenticate(f"t{i}")
    assert len(auth) == 4
    assert not any(isinstance(k, str) for k in auth._cache)


async def _flood(auth: TokenAuthenticator, count: int, prefix: str = "forged") -> tuple[int, int]:
    """``count`` requests with as many never-seen bad tokens at once: (answered, refused as limited)."""
    results = await asyncio.gather(
        *(auth.authenticate(f"{prefix}-{i}") for i in range(count)), return_exceptions=True
    )
    limited = sum(isinstance(r, ReviewLimited) for r in results)
    assert all(isinstance(r, Review | ReviewLimited) for r in results)
    return count - limited, limited


@pytest.mark.looptime
async def test_a_flood_of_new_bad_tokens_costs_at_most_the_review_budget() -> None:
    api = FakeApi({})
    auth = TokenAuthenticator(api, audience=AUDIENCE, username=AGENT, review_rate=50)
    assert await _flood(auth, 1000) == (50, 950)
    assert (auth.reviews, auth.limited) == (50, 950)
    await asyncio.sleep(0.5)  # half a second refills half the budget
    assert await _flood(auth, 1000, "again") == (25, 975)
    assert len(api.calls) == 75


@pytest.mark.looptime
async def test_an_admitted_agent_is_reviewed_again_whatever_the_flood() -> None:
    api = FakeApi({"good": status()})
    auth = TokenAuthenticator(api, audience=AUDIENCE, username=AGENT, ttl=60, review_rate=50)
    assert (await auth.authenticate("good")).verdict is Verdict.ACCEPTED
    await asyncio.sleep(61)  # its verdict expired
    await _flood(auth, 1000)  # the budget is spent
    assert (await auth.authenticate("good")).verdict is Verdict.ACCEPTED
    assert api.calls.count("good") == 2  # reviewed again, outside the budget


@pytest.mark.looptime
async def test_a_new_agent_during_a_flood_waits_only_until_the_budget_allows() -> None:
    api = FakeApi({"new": status()})
    auth = TokenAuthenticator(api, audience=AUDIENCE, username=AGENT, review_rate=50)
    await _flood(auth, 1000)
    with pytest.raises(ReviewLimited):
        await auth.authenticate("new")
    await asyncio.sleep(1 / 50)  # one review's worth of budget
    assert (await auth.authenticate("new")).verdict is Verdict.ACCEPTED


def jwt(node: str | None, salt: str = "") -> str:
    """A token shaped as a ServiceAccount token's (the signature is never checked here)."""
    claims: dict[str, Any] = {"sub": salt or "x"}
    if node is not None:
        claims["kubernetes.io"] = {"node": {"name": node}, "pod": {"name": "agent-" + salt}}

    def part(obj: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.{salt or 'sig'}"


def test_the_claimed_node_is_read_from_the_payload_or_is_none() -> None:
    assert claimed_node(jwt("node-7")) == "node-7"
    for token in (jwt(None), "node-7", "a.b.c", "a.!!!.c", jwt("node-7") + ".x", "a." + "A" * 5000 + ".c"):
        assert claimed_node(token) is None


@pytest.mark.looptime
async def test_a_new_token_of_a_known_node_is_reviewed_at_once_whatever_the_strangers_flood() -> None:
    """Issue 45: during a flood of invalid tokens a never-seen or rotated agent token got 503 on its first
    reports and got through on the third try (+12 s); a larger flood, a longer wait."""
    new, rotated = jwt("node-7", "new"), jwt("node-8", "rotated")
    api = FakeApi({new: status(node="node-7"), rotated: status(node="node-8")})
    known = {"node-7", "node-8", "node-9"}
    auth = TokenAuthenticator(
        api, audience=AUDIENCE, username=AGENT, review_rate=50, known_node=known.__contains__
    )
    # Garbage of every shape: not a JWT, claiming no node, claiming nodes nobody knows, claiming node-9.
    flood = [f"junk-{i}" for i in range(300)] + [jwt(None, f"n{i}") for i in range(300)]
    flood += [jwt(f"ghost-{i}", f"g{i}") for i in range(300)] + [jwt("node-9", f"k{i}") for i in range(300)]
    for token in flood:
        with contextlib.suppress(ReviewLimited):
            await auth.authenticate(token)
    assert auth.limited == 1200 - 50 - 2  # the strangers' budget, and node-9's own
    assert (await auth.authenticate(new)).verdict is Verdict.ACCEPTED
    assert (await auth.authenticate(rotated)).verdict is Verdict.ACCEPTED
    # Forging the node's own name shares that node's budget: the rest still get through.
    for i in range(10):
        with contextlib.suppress(ReviewLimited):
            await auth.authenticate(jwt("node-7", f"forged{i}"))
    with pytest.raises(ReviewLimited):
        await auth.authenticate(jwt("node-7", "late"))
    assert (await auth.authenticate(jwt("node-8", "again"))).verdict is Verdict.UNAUTHENTICATED

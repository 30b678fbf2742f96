"""Agent authentication: a bearer token checked with a TokenReview, verdicts cached by the token's hash.

At 2,000 reports a second the API server must not see 2,000 TokenReviews a
second: a verdict is kept for ``ttl`` seconds (a projected token lives at least
10 minutes, and a revoked ServiceAccount is noticed within ``ttl``), refusals
for ``negative_ttl`` (so a flood of bad tokens costs one review per token per
few seconds), and concurrent requests carrying the same unknown token share a
single review. Tokens are never stored, only their SHA-256.

A flood of tokens never seen before (each new, so no cache helps) must not become a flood of
TokenReviews: reviews of unknown tokens draw on a budget; past it a request gets
:class:`ReviewLimited` (the ingest answers 503 with ``Retry-After: 1``) and is counted in
``limited``. A token accepted before, whose verdict expired, is reviewed again outside any budget:
an attacker cannot make such tokens, so agents already admitted are never held up by a flood.

An unknown token that claims a node the operator knows (``known_node``: a GPU pod runs there, or
its agent reported lately) draws on that node's own budget of :data:`NODE_REVIEW_RATE` a second;
any other (a stranger) on the shared budget of ``review_rate`` a second. The claim is the token's
own (:func:`claimed_node`, its payload read without checking the signature): it only picks the
budget, the review still decides. So a new or kubelet-rotated agent token of a known node is
reviewed on its first report whatever the flood of garbage, unless the flood forges claims of that
very node, which then shares that node's budget with it (its other nodes unaffected); a token of a
node not known yet waits, as a stranger, until the shared budget allows.

Only pod-bound tokens are accepted (what a projected ServiceAccount token volume
mounts): the API server names the node their pod runs on, and that node is the
only one the token may report for. A token without a pod binding (``kubectl
create token`` without ``--bound-object-kind Pod``) could claim any node: 403. The one exception
is sharded mode's ``/v1/verdicts`` (``pod_bound=False``): the replicas' own ServiceAccount speaks
for no node.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import enum
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "NODE_REVIEW_RATE",
    "REVIEW_RATE",
    "Review",
    "ReviewAbandoned",
    "ReviewCollector",
    "ReviewLimited",
    "TokenAuthenticator",
    "Verdict",
    "claimed_node",
    "review_from",
]

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
"""TokenReview ``user.extra`` key naming the node a pod-bound token's pod runs on (Kubernetes >= 1.30)."""

ReviewFn = Callable[[str], Awaitable[Mapping[str, Any]]]
"""Sends a TokenReview for a token and returns its ``status``; raises when the API cannot answer."""


REVIEW_RATE = 500.0
"""TokenReviews of unknown tokens a second, at most (as many at once): a restarted operator admits
a fleet of 10,000 agents in 20 s (each retries after a second), and renews their verdicts
(~170 a second) outside this budget; an attack of new tokens costs the API server no more."""


NODE_REVIEW_RATE = 2.0
"""TokenReviews a second (as many at once) of unknown tokens claiming one known node: its agent's new
token, and a retry a second later, are reviewed at once."""
MAX_CLAIM = 4096
"""Characters of a token's payload read for its claim; a ServiceAccount token's is under 1,000."""


def claimed_node(token: str) -> str | None:
    """The node a ServiceAccount token says its pod runs on (the JWT payload's
    ``kubernetes.io.node.name``), unverified; None when the token has no such claim to read."""
    parts = token.split(".")
    if len(parts) != 3 or len(parts[1]) > MAX_CLAIM:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        node = payload["kubernetes.io"]["node"]["name"]
    except (ValueError, binascii.Error, KeyError, TypeError):
        return None
    return node if isinstance(node, str) and node else None


class ReviewLimited(RuntimeError):
    """The budget of TokenReviews for unknown tokens is spent for now; retry in a second."""


class ReviewAbandoned(RuntimeError):
    """The request running a shared TokenReview was cancelled before the answer came."""


class Verdict(enum.Enum):
    """What the review says about a token."""

    ACCEPTED = "accepted"
    UNAUTHENTICATED = "unauthenticated"
    """Not a valid token, or not one for our audience: 401."""
    FORBIDDEN = "forbidden"
    """A valid token of some other identity: 403."""


@dataclass(frozen=True, slots=True)
class Review:
    """A verdict and, when accepted, the user and the node the token's pod runs on (its identity)."""

    verdict: Verdict
    message: str
    username: str = ""
    node: str = ""


def review_from(status: Mapping[str, Any], *, audience: str, username: str, pod_bound: bool = True) -> Review:
    """Read a TokenReview ``status``: authenticated, for ``audience``, as exactly ``username``,
    bound to a pod on a node unless ``pod_bound`` is off (the operator's replicas, which need no node)."""
    if status.get("authenticated") is not True:
        error = status.get("error") or "the API server did not authenticate it"
        return Review(Verdict.UNAUTHENTICATED, f"invalid token: {error}")
    audiences = status.get("audiences") or []
    if audience not in audiences:
        return Review(Verdict.UNAUTHENTICATED, f"the token is not meant for audience {audience!r}")
    user = status.get("user") or {}
    name = str(user.get("username", ""))
    if name != username:
        return Review(Verdict.FORBIDDEN, f"{name or 'this user'} may not post reports; only {username} may")
    nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
    if not pod_bound:
        return Review(Verdict.ACCEPTED, "ok", username=name, node=str(nodes[0]) if nodes else "")
    if not nodes or not nodes[0]:
        return Review(
            Verdict.FORBIDDEN,
            "the token is bound to no pod on a node; agents must show a projected ServiceAccount token",
        )
    return Review(Verdict.ACCEPTED, "ok", username=name, node=str(nodes[0]))


class TokenAuthenticator:
    """Authenticates bearer tokens through ``review``, with a bounded verdict cache and single flight."""

    def __init__(
        self,
        review: ReviewFn,
        *,
        audience: str,
        username: str,
        pod_bound: bool = True,
        ttl: float = 60.0,
        negative_ttl: float = 5.0,
        max_entries: int = 20_000,
        review_rate: float = REVIEW_RATE,
        node_review_rate: float = NODE_REVIEW_RATE,
        known_node: Callable[[str], bool] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._review = review
        self.audience = audience
        self.username = username
        self.pod_bound = pod_bound
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self.max_entries = max_entries
        self._clock = clock
        self._cache: OrderedDict[bytes, tuple[float, Review]] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[Review]] = {}
        self.reviews = 0
        """TokenReviews sent (the rest were answered from the cache or a shared review)."""
        self.review_rate = review_rate
        self._budget = review_rate
        self._budget_at: float | None = None
        self.node_review_rate = node_review_rate
        self.known_node = known_node
        """Whether the operator knows a node (see the module doc); None: every token is a stranger."""
        self._node_budgets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # node → (left, at)
        self.limited = 0
        """Requests refused (:class:`ReviewLimited`) because the budget for unknown tokens was spent."""

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def authenticate(self, token: str) -> Review:
        """The verdict for ``token``; raises whatever ``review`` raises when the API cannot answer."""
        key = hashlib.sha256(token.encode()).digest()
        now = self._now()
        hit = self._cache.get(key)
        known = False
        if hit is not None:
            if hit[0] > now:
                return hit[1]
            # An expired acceptance stays (bounded by max_entries) to mark the token as known.
            known = hit[1].verdict is Verdict.ACCEPTED
            if not known:
                del self._cache[key]
        shared = self._inflight.get(key)
        if shared is not None:
            return await asyncio.shield(shared)
        if not known and not self._spend(now, token):
            self.limited += 1
            raise ReviewLimited("too many new tokens to review at once; retry")
        future: asyncio.Future[Review] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            self.reviews += 1
            status = await self._review(token)
            review = review_from(
                status, audience=self.audience, username=self.username, pod_bound=self.pod_bound
            )
        except asyncio.CancelledError:
            # The request that ran the review went away; those sharing it get an error, not a cancel.
            future.set_exception(ReviewAbandoned("the shared TokenReview was abandoned; retry"))
            future.exception()  # retrieved, so a review nobody shared does not warn when collected
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()
            raise
        finally:
            del self._inflight[key]
        ttl = self.ttl if review.verdict is Verdict.ACCEPTED else self.negative_ttl
        self._remember(key, review, self._now() + ttl)
        future.set_result(review)
        return review

    def _spend(self, now: float, token: str) -> bool:
        """Take one review from the budget for an unknown token, if there is one: its known node's, or
        the strangers'."""
        if (
            self.known_node is not None
            and (node := claimed_node(token)) is not None
            and self.known_node(node)
        ):
            left, at = self._node_budgets.pop(node, (self.node_review_rate, now))
            left = min(self.node_review_rate, left + max(0.0, now - at) * self.node_review_rate)
            taken = left >= 1.0
            self._node_budgets[node] = (left - 1.0 if taken else left, now)
            if len(self._node_budgets) > self.max_entries:
                self._node_budgets.popitem(last=False)
            return taken
        if self._budget_at is not None:
            elapsed = max(0.0, now - self._budget_at)
            self._budget = min(self.review_rate, self._budget + elapsed * self.review_rate)
        self._budget_at = now
        if self._budget < 1.0:
            return False
        self._budget -= 1.0
        return True

    def _remember(self, key: bytes, review: Review, expires: float) -> None:
        self._cache[key] = (expires, review)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)

    def __len__(self) -> int:
        return len(self._cache)


class ReviewCollector(Collector):
    """``<prefix>_tokenreviews_limited_total`` of a :class:`TokenAuthenticator`, read at scrape time."""

    def __init__(self, authenticator: TokenAuthenticator, prefix: str) -> None:
        self._authenticator = authenticator
        self._prefix = prefix

    def collect(self) -> Iterable[Metric]:
        """The one series."""
        yield CounterMetricFamily(
            f"{self._prefix}_tokenreviews_limited",
            "Requests with a token never reviewed before, refused (503) because the TokenReview budget "
            "for such tokens was spent.",
            value=self._authenticator.limited,
        )

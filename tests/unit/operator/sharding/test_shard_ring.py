"""The ring and the membership of sharded mode (docs/scaling-out.md): balance, movement, expiry, settling."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from gpuwarden.operator.sharding.membership import (
    LEASE_SECONDS,
    URL_ANNOTATION,
    Member,
    ShardView,
    lease_body,
    lease_name,
    live_members,
)
from gpuwarden.operator.sharding.ring import Ring, ring_key

NODES = [f"gpu-node-{i:05d}.pool-{i % 7}" for i in range(10_000)]


def replicas(n: int) -> list[str]:
    return [f"gpuwarden-operator-7d9f8c-{i:05x}" for i in range(n)]


@pytest.mark.parametrize("count", [3, 5, 10, 20, 50])
def test_shares_stay_within_a_quarter_of_fair(count: int) -> None:
    ring = Ring(replicas(count))
    shares = Counter(ring.owner(node) for node in NODES)
    fair = len(NODES) / count
    assert set(shares) == set(replicas(count))
    assert max(shares.values()) <= 1.25 * fair
    assert min(shares.values()) >= 0.75 * fair


@pytest.mark.parametrize("count", [3, 10, 50])
def test_only_the_leavers_nodes_move(count: int) -> None:
    members = replicas(count)
    before = Ring(members)
    gone = members[count // 2]
    after = Ring([m for m in members if m != gone])
    for node in NODES:
        if before.owner(node) == gone:
            assert after.owner(node) != gone
        else:
            assert after.owner(node) == before.owner(node)


@pytest.mark.parametrize("count", [3, 10, 49])
def test_a_joiner_takes_about_its_share_and_only_moves_nodes_to_itself(count: int) -> None:
    members = replicas(count)
    before = Ring(members)
    joiner = "gpuwarden-operator-new"
    after = Ring([*members, joiner])
    moved = [n for n in NODES if after.owner(n) != before.owner(n)]
    assert all(after.owner(n) == joiner for n in moved)
    assert len(moved) <= 1.25 * len(NODES) / (count + 1)


def test_every_replica_computes_the_same_owner_whatever_the_order() -> None:
    members = replicas(7)
    assert all(Ring(members).owner(n) == Ring(reversed(members)).owner(n) for n in NODES[:500])
    assert Ring(()).owner("any") is None
    assert Ring(members).owner(ring_key("team-a", "idle")) in members


NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def test_leases_are_live_until_their_duration_runs_out() -> None:
    a = lease_body("gpuwarden", Member("op-a", "http://10.0.0.1:8443/v1/reports"), NOW)
    b = lease_body("gpuwarden", Member("op-b"), NOW - timedelta(seconds=10))
    assert a["metadata"]["annotations"] == {URL_ANNOTATION: "http://10.0.0.1:8443/v1/reports"}
    assert live_members([a, b], NOW) == {
        "op-a": Member("op-a", "http://10.0.0.1:8443/v1/reports"),
        "op-b": Member("op-b"),
    }
    later = NOW + timedelta(seconds=LEASE_SECONDS - 10)
    assert set(live_members([a, b], later)) == {"op-a"}  # b expired at 5 s
    assert live_members([a, b], NOW + timedelta(seconds=LEASE_SECONDS)) == {}
    renewed = lease_body("gpuwarden", Member("op-b"), later)
    assert set(live_members([a, renewed], later)) == {"op-a", "op-b"}


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"holderIdentity": "", "leaseDurationSeconds": 15, "renewTime": "2026-12-03T12:00:00.000000Z"},
        {"holderIdentity": "x", "leaseDurationSeconds": 15},
        {"holderIdentity": "x", "leaseDurationSeconds": 0, "renewTime": "2026-12-03T12:00:00.000000Z"},
        {"holderIdentity": "x", "leaseDurationSeconds": True, "renewTime": "2026-12-03T12:00:00Z"},
        {"holderIdentity": "x", "leaseDurationSeconds": 15, "renewTime": "yesterday"},
    ],
)
def test_malformed_leases_count_as_dead(spec: dict[str, object]) -> None:
    assert live_members([{"spec": spec}], NOW) == {}


def test_lease_names_are_dns_labels_and_distinct() -> None:
    names = {lease_name("gpuwarden", i) for i in ("op-a", "OP-A", "host/123", "host_123")}
    assert len(names) == 4
    for name in names:
        assert len(name) <= 253
        assert name == name.lower()
        assert "/" not in name
        assert "_" not in name


def members(*ids: str) -> dict[str, Member]:
    return {i: Member(i) for i in ids}


def test_a_replica_acts_only_on_a_fresh_view_that_counts_it_in() -> None:
    view = ShardView("op-a", stale_seconds=4, settle_seconds=6)
    assert not view.acting(0.0)
    view.update(members("op-a", "op-b"), 0.0)
    view.update(members("op-a", "op-b"), 2.0)
    assert view.acting(6.0)
    assert not view.acting(6.1)
    view.update(members("op-b"), 7.0)  # its own Lease did not renew
    assert not view.acting(7.0)
    assert not any(view.owns(n, 7.0) for n in NODES[:100])


def test_a_first_view_acts_once_two_listings_in_a_row_agree() -> None:
    """The start-up gap: a first listing that misses a peer (its Lease renewed just after) would
    take the peer's nodes for a poll; a view acts only once a second listing found the same ring."""
    view = ShardView("op-a", stale_seconds=4, settle_seconds=6)
    view.update(members("op-a"), 0.0)  # op-b's Lease not there yet
    assert not view.acting(0.0)
    assert not any(view.owns(n, 0.0) for n in NODES[:100])
    view.update(members("op-a", "op-b"), 2.0)  # there now: a change, not yet two alike
    assert not view.acting(2.0)
    view.update(members("op-a", "op-b"), 4.0)
    assert view.acting(4.0)
    theirs = next(n for n in NODES if view.ring.owner(n) == "op-b")
    assert not view.owns(theirs, 4.0)
    # Steady once: a later change (a peer leaving) is acted on at once, not waited out.
    view.update(members("op-a"), 6.0)
    assert view.acting(6.0)
    assert view.owns(theirs, 6.0)
    # Slow polls (the API server loaded: 5 s between listings, the view stale in between) keep it.
    for t in (11.0, 16.0, 21.0):
        view.update(members("op-a"), t)
        assert view.acting(t)
    # Longer than a Lease lives without a listing: peers may have come and gone; two alike again.
    view.update(members("op-a"), 40.0)
    assert not view.acting(40.0)
    view.update(members("op-a"), 42.0)
    assert view.acting(42.0)


def test_a_first_view_polled_slowly_still_becomes_steady() -> None:
    """A loaded API server: 5 s between listings, each view stale by the next; two alike suffice."""
    view = ShardView("op-a", stale_seconds=4, settle_seconds=6)
    view.update(members("op-a", "op-b"), 0.0)
    assert not view.acting(0.0)
    view.update(members("op-a", "op-b"), 5.0)
    assert view.acting(5.0)


def test_nodes_are_owned_at_once_policies_after_settling() -> None:
    view = ShardView("op-a", stale_seconds=4, settle_seconds=6)
    view.update(members("op-a", "op-b"), -2.0)
    view.update(members("op-a", "op-b"), 0.0)
    mine = next(n for n in NODES if view.ring.owner(n) == "op-a")
    theirs = next(n for n in NODES if view.ring.owner(n) == "op-b")
    assert view.owns(mine, 0.0)
    assert not view.owns(theirs, 0.0)
    assert view.owner(theirs) == Member("op-b")
    assert not view.settled_owner(mine, 5.9)
    for t in (2.0, 4.0, 6.0):
        view.update(members("op-a", "op-b"), t)
    assert view.settled_owner(mine, 6.0)
    # op-b leaves: its keys are op-a's for nodes at once, for policies 6 s later.
    assert view.update(members("op-a"), 8.0)
    assert view.owns(theirs, 8.0)
    assert not view.settled_owner(theirs, 8.0)
    assert view.settled_owner(mine, 8.0)  # owned all along: no pause
    for t in (10.0, 12.0, 14.0):
        view.update(members("op-a"), t)
    assert view.settled_owner(theirs, 14.0)


def test_a_replica_back_from_a_stale_view_settles_again() -> None:
    view = ShardView("op-a", stale_seconds=4, settle_seconds=6)
    for t in (0.0, 2.0, 4.0, 6.0):
        view.update(members("op-a"), t)
    assert view.settled_owner("ns/p", 6.0)
    view.update(members("op-a"), 20.0)  # 14 s without a listing: others may have acted meanwhile
    assert not view.settled_owner("ns/p", 20.0)
    for t in (22.0, 24.0, 26.0):
        view.update(members("op-a"), t)
    assert view.settled_owner("ns/p", 26.0)

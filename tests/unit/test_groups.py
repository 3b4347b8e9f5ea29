"""Bounded averaging groups: group formation (every peer in exactly one group, groups change between
rounds, sizes near G) and grouped DiLoCo rounds over a real-frame in-memory transport (each group
ends at the mean of its members' stepped weights, bit-identical inside a group; the swarm's mean moves
as one DiLoCo step; a member sends about twice the payload)."""

from __future__ import annotations

import asyncio
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gossip.group_rendezvous as diloco_module  # the rendezvous steps of a DiLoCo round live there
from gossip.exchange import Contribution
from gossip.groups import group_count, group_of, near_a_grouping_boundary, split_into_groups
from gossip.partition import Partition
from protocol.records import RoundEntry, round_key
from tests.helpers.diloco_members import diloco_members, run_round_together
from tests.helpers.memory_transport import Network

SHAPES = [(96, 64), (64,), (120, 32), (5,)]
PART_NUMEL = 256


def test_group_count_keeps_groups_at_or_below_the_bound_on_average():
    assert group_count(1, 32) == group_count(32, 32) == 1
    assert group_count(33, 32) == 2 and group_count(64, 32) == 2 and group_count(65, 32) == 4
    assert group_count(1000, 32) == 32 and group_count(4000, 32) == 128
    for n in (33, 100, 257, 1000, 4000):
        count = group_count(n, 32)
        assert n / count <= 32 < 2 * n / count
    with pytest.raises(ValueError):
        group_count(10, 1)


@given(st.sets(st.text("abcdef0123456789", min_size=4, max_size=10), min_size=1, max_size=300), st.integers(0, 10_000),
       st.sampled_from([1, 2, 4, 8, 16]))
@settings(max_examples=100, deadline=None)
def test_every_peer_is_in_exactly_one_group(members, round_no, count):
    groups = split_into_groups("run", round_no, members, count)
    assert len(groups) == count
    assert sorted(p for g in groups for p in g) == sorted(members)
    for k, group in enumerate(groups):
        assert group == sorted(group) and all(group_of("run", round_no, p, count) == k for p in group)


def test_groups_change_between_rounds_and_stay_near_their_expected_size():
    members = [f"peer{i:04d}" for i in range(1000)]
    count = group_count(len(members), 32)
    rounds = [split_into_groups("run", r, members, count) for r in range(4)]
    sizes = [len(g) for groups in rounds for g in groups]
    assert statistics.mean(sizes) == 1000 / 32 and max(sizes) <= 55 and min(sizes) >= 12  # binomial(1000, 1/32): sd 5.5
    together = [{frozenset((a, b)) for g in groups for a in g for b in g if a < b} for groups in rounds]
    # a pair meets again in the next round with probability 1/32: most groups are new
    assert len(together[0] & together[1]) < 0.1 * len(together[0])
    assert round_key("run", 3, "g1of4") != round_key("run", 3) == "locomesh.run.round.3"


def _run_grouped_round(members, monkeypatch, round_no: int = 0):
    everyone = {m["peer"] for m in members}
    samples = {m["peer"]: m["samples"] for m in members}

    async def live(*args, **kwargs):
        return set(everyone)

    async def group_view(dht, validator, run_id, round_no, entry, expected, timeout, **kwargs):
        peers = sorted(await expected() | {entry.peer_id})
        return [RoundEntry(peer_id=p, samples=samples[p], codec=entry.codec) for p in peers], True

    monkeypatch.setattr(diloco_module, "round_members", live)
    monkeypatch.setattr(diloco_module, "gather_group", group_view)

    return asyncio.run(run_round_together(members, round_no))


def _assert_group_holds_the_mean_of_stepped_weights(group, by_peer) -> None:
    """Every member of ``group`` holds the sample-weighted mean of the group's stepped weights (lr 1, no
    momentum: a member's stepped weights are its θ)."""
    weights = [by_peer[p]["samples"] for p in group]
    for i in range(len(SHAPES)):
        expected = sum(w * by_peer[p]["theta"][i] for p, w in zip(group, weights)) / sum(weights)
        for p in group:
            assert torch.allclose(by_peer[p]["phi"][i], expected, atol=1e-5)


@pytest.mark.parametrize("n, bound", [(8, 3), (12, 4)])
def test_each_group_ends_bit_identical_at_the_weighted_mean_of_its_stepped_weights(n, bound, monkeypatch):
    network = Network()
    # nothing fails here, so the deadlines only matter on a starved machine: the in-process round of 12
    # members missed the 3 s ones once under a load average of ~19 (a failure or an unsynced member)
    _, members = diloco_members(n, network, SHAPES, "none", PART_NUMEL, max_group_size=bound, fetch_timeout=60,
                                serve_timeout=60, gather_timeout=60)
    results = _run_grouped_round(members, monkeypatch)
    count = group_count(n, bound)
    assert all(r.groups == count and r.in_sync and not r.failures for r in results), [(r.groups, r.in_sync, r.failures) for r in results]
    by_peer = {m["peer"]: m for m in members}
    groups = {tuple(r.group) for r in results}
    assert sorted(p for g in groups for p in g) == sorted(by_peer), "every member in exactly one group"
    assert len(groups) > 1
    for group in groups:
        _assert_group_holds_the_mean_of_stepped_weights(group, by_peer)
        for i in range(len(SHAPES)):
            for p in group:
                assert torch.equal(by_peer[p]["phi"][i], by_peer[group[0]]["phi"][i]), "a group's replicas differ"
    payload = sum(torch.Size(s).numel() * 4 for s in SHAPES)
    for m, r in zip(members, results):
        assert network.sent[m["peer"]] <= 2.5 * payload, (network.sent[m["peer"]], payload, r.reduce_scatter)


def test_the_swarm_mean_moves_as_one_outer_step_on_the_mean_update(monkeypatch):
    network = Network()
    phi, members = diloco_members(9, network, SHAPES, "none", PART_NUMEL, seed=4, lr=0.7, max_group_size=3, samples=[16] * 9)
    mean_delta = [torch.stack([p - m["theta"][i] for m in members]).mean(0) for i, p in enumerate(phi)]
    _run_grouped_round(members, monkeypatch, round_no=5)
    for i, p in enumerate(phi):
        swarm_mean = torch.stack([m["phi"][i] for m in members]).mean(0)
        assert torch.allclose(swarm_mean, p - 0.7 * mean_delta[i], atol=1e-5)
    spread = max(float((m["phi"][0] - members[0]["phi"][0]).norm()) for m in members)
    assert spread > 0, "groups average apart: replicas in different groups differ"


def test_members_that_count_a_different_number_of_groups_do_not_mix(monkeypatch):
    network = Network()
    _, members = diloco_members(2, network, SHAPES, "none", PART_NUMEL, max_group_size=4)
    a, b = members
    a["exchange"].regroup(0, a["exchange"].specs(0), "g0of2")
    b["exchange"].regroup(0, b["exchange"].specs(0), "g0of4")

    async def go():
        await a["exchange"].start()
        await b["exchange"].start()
        blobs, decoded = b["exchange"].encode(0, Partition(PART_NUMEL).split(b["theta"]))
        b["exchange"].publish(Contribution(0, 8, "fp", b["exchange"].wire_of(0), blobs, b["peer"], decoded))
        return await a["exchange"].gather([b["peer"]], 0, timeout=3)

    got, failed = asyncio.run(go())
    assert not got and failed == {b["peer"]: "remote"}  # refused by the peer: "wire mismatch"


def test_a_peer_that_came_into_the_round_after_the_grouping_was_decided_is_not_waited_for(monkeypatch):
    """Three joiners counted themselves only (one group); the first node, which had raced a round ahead,
    came back into their round and counted four (two groups): it registers under a group's key and never
    in theirs. Their rendezvous must not wait for it (it once waited its whole 60 s deadline)."""
    network = Network()
    _, members = diloco_members(3, network, SHAPES, "none", PART_NUMEL, max_group_size=2)
    joiner = members[0]["averager"]
    snapshot = {m["peer"] for m in members}
    later = snapshot | {"peer-ahead"}

    async def fresh_read(round_no):
        return set(later)

    monkeypatch.setattr(joiner, "expected_members", fresh_read)

    async def views():
        view = joiner._rendezvous_view(5, snapshot, None)
        return await view(), await view()

    first, second = asyncio.run(views())
    assert first == second == snapshot
    # a newcomer that leaves the group count as it was (far below the bound) is waited for, as before
    joiner.max_group_size = 32
    first, second = asyncio.run(views())
    assert first == snapshot and second == later
    assert not near_a_grouping_boundary(4, 1, 32) and near_a_grouping_boundary(20, 1, 32)
    # without bounded groups nothing is decided from a snapshot: the fresh read counts
    members[0]["averager"].max_group_size = None
    assert asyncio.run(joiner._rendezvous_view(5, None, None)()) == later


def test_a_member_that_registered_under_another_grouping_is_not_waited_for(monkeypatch):
    """Two members counted 2 (one group: the round's plain key); a third counted 4 and registered under its
    group of two. Once it is seen there, the rendezvous stops waiting for it instead of waiting out its
    deadline (a joiner's first round once waited 60 s so)."""
    import time

    import gossip.rendezvous as rendezvous_module
    from gossip.groups import group_tag, other_groupings

    network = Network()
    _, members = diloco_members(3, network, SHAPES, "none", PART_NUMEL, max_group_size=2)
    averager = members[0]["averager"]
    a, b, c = (m["peer"] for m in members)
    c_tag = group_tag(group_of("run", 5, c, 2), 2)
    assert c in other_groupings("run", 5, {b, c}, 1, 2)[c_tag]
    assert set(other_groupings("run", 5, {c}, 2, 2)) == {"", group_tag(group_of("run", 5, c, 4), 4)}

    async def entries(dht, run_id, round_no, tag="", timeout=3.0):
        if tag == c_tag:
            return {c: (RoundEntry(peer_id=c, samples=8, codec="none"), 0.0)}
        return {b: (RoundEntry(peer_id=b, samples=8, codec="none"), 0.0)} if tag == "" else {}

    async def registered(*args, **kwargs):
        return True

    async def everyone(round_no):
        return {a, b, c}

    for module in (diloco_module, rendezvous_module):
        monkeypatch.setattr(module, "read_round_entries", entries)
    monkeypatch.setattr(rendezvous_module, "register_round", registered)
    monkeypatch.setattr(rendezvous_module, "ELSEWHERE_CHECK_S", 0.0)
    monkeypatch.setattr(averager, "expected_members", everyone)

    async def elsewhere(peers):
        return await averager._registered_elsewhere(5, peers, None)

    async def gather(with_check):
        view = averager._rendezvous_view(5, {a, b, c}, None)
        entry = RoundEntry(peer_id=a, samples=8, codec="none")
        started = time.monotonic()
        group, complete = await rendezvous_module.gather_group(None, None, "run", 5, entry, view, 2.0, poll_interval=0.05,
                                                               elsewhere=elsewhere if with_check else None)
        return [e.peer_id for e in group], complete, time.monotonic() - started

    group, complete, took = asyncio.run(gather(True))
    assert group == sorted([a, b]) and complete and took < 1.0
    group, complete, took = asyncio.run(gather(False))
    assert not complete and took >= 2.0, "without the check it waits out the deadline"


def test_a_robust_run_averages_a_grouped_round_of_two_as_the_mean_of_weights(monkeypatch):
    """Grouped rounds average weights: a robust aggregation must not clip weights by their norm per sample
    (a round of two clips to the smaller norm per sample, which would shrink a member's weights)."""
    network = Network()
    _, members = diloco_members(8, network, SHAPES, "none", PART_NUMEL, max_group_size=2)
    for m in members:
        m["averager"].aggregation = "centered-clip"
    results = _run_grouped_round(members, monkeypatch)
    by_peer = {m["peer"]: m for m in members}
    pairs = {tuple(r.group) for r in results if len(r.group) == 2}
    assert pairs, "the seeded split has groups of two"
    for group in pairs:
        _assert_group_holds_the_mean_of_stepped_weights(group, by_peer)

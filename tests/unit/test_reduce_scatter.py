"""Reduce-scatter rounds: who owns which parts, and whole DiLoCo rounds among in-process members over an
in-memory transport (the DHT rendezvous is replaced by a fixed group): every member ends with
bit-identical weights equal to the sample-weighted mean, each sends about 2x the payload, and a member
that dies after sending its parts leaves a round that still completes."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gossip.group_rendezvous as diloco_module  # the rendezvous steps of a DiLoCo round live there
from gossip.outer import weighted_mean
from gossip.reduce_scatter import assign_owners, fine_part_numel, is_dense, round_bytes, use_reduce_scatter
from protocol.records import RoundEntry
from tests.helpers.diloco_members import diloco_members, run_round_together
from tests.helpers.memory_transport import Network

SHAPES = [(96, 64), (64,), (120, 32), (256, 16), (5,)]
PART_NUMEL = 256


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=80), st.sets(st.text("abcdef0123", min_size=3, max_size=6), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_every_part_has_one_owner_and_shares_are_even(numels, members):
    owners = assign_owners(numels, list(members))
    assert owners == assign_owners(numels, sorted(members, reverse=True)), "the assignment ignores the order members are listed in"
    dealt = sorted(i for parts in owners.values() for i in parts)
    assert dealt == list(range(len(numels)))
    fair, biggest = sum(numels) / len(members), max(numels)
    for parts in owners.values():
        assert parts == list(range(parts[0], parts[-1] + 1)) if parts else True, "each owner holds a contiguous run"
        assert sum(numels[i] for i in parts) <= fair + biggest


def test_dense_codecs_reduce_scatter_from_three_members():
    assert all(is_dense(c) for c in ("none", "fp16", "bf16", "q8", "q2", "rot2", "int8-block", "int8-block:1024"))
    assert not any(is_dense(c) for c in ("topk:64/4096+q2", "dct:8/64", "seed:r=8"))
    assert use_reduce_scatter(True, 3, "mean", False) and not use_reduce_scatter(True, 2, "mean", False)
    assert not use_reduce_scatter(True, 8, "median-clip", False) and not use_reduce_scatter(True, 8, "mean", True)
    assert not use_reduce_scatter(False, 8, "mean", False)
    for g in (3, 8, 32, 256):
        assert round_bytes(1000, g, True) <= 2000 and round_bytes(1000, g, True) < round_bytes(1000, g, False)
    assert fine_part_numel(842_496) == 16384 and fine_part_numel(1 << 30) == 1 << 20


def _run_round(members, monkeypatch):
    entries = sorted((RoundEntry(peer_id=m["peer"], samples=m["samples"], codec="none") for m in members), key=lambda e: e.peer_id)

    async def fixed_group(*args, **kwargs):
        return entries, True

    monkeypatch.setattr(diloco_module, "gather_group", fixed_group)
    return asyncio.run(run_round_together(members))


def test_a_member_out_of_sync_earns_no_tenure(monkeypatch):
    """Tenure (whose fingerprint votes count) follows the contributions a round used: a member whose φ is
    not the majority's takes part but earns nothing (it used to: three rounds of garbage made a voter)."""
    network = Network()
    _, members = diloco_members(3, network, SHAPES, "none", PART_NUMEL)
    members[2]["phi"] = [p + 1 for p in members[2]["phi"]]
    results = _run_round(members, monkeypatch)
    assert [r.in_sync for r in results] == [True, True, False]
    tenure = members[0]["averager"].tenure
    assert tenure.rounds("peer01") == 1 and tenure.rounds("peer02") == 0


@pytest.mark.parametrize("n", [3, 4, 8])
def test_members_end_bit_identical_at_the_weighted_mean_sending_about_twice_the_payload(n, monkeypatch):
    network = Network()
    phi, members = diloco_members(n, network, SHAPES, "none", PART_NUMEL)
    results = _run_round(members, monkeypatch)
    assert all(r.reduce_scatter and r.in_sync and not r.failures for r in results)
    expected = weighted_mean([m["delta"] for m in members], [m["samples"] for m in members])
    for m in members:
        for got, p, d in zip(m["phi"], phi, expected):
            assert torch.allclose(got, p - d, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], members[0]["phi"])), "replicas differ"
    payload = sum(torch.Size(s).numel() * 4 for s in SHAPES)
    for m in members:
        assert network.sent[m["peer"]] <= 2.5 * payload, (network.sent[m["peer"]], payload)


def test_lossy_codec_rounds_agree_bit_for_bit(monkeypatch):
    network = Network()
    _, members = diloco_members(5, network, SHAPES, "q8", PART_NUMEL, seed=3)
    results = _run_round(members, monkeypatch)
    assert all(r.reduce_scatter and r.in_sync for r in results)
    for m in members[1:]:
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], members[0]["phi"]))


@pytest.mark.parametrize("n, dying", [(4, [1]), (6, [1, 4])])
def test_owners_that_die_after_sending_their_parts_leave_a_complete_round(n, dying, monkeypatch):
    network = Network()
    _, members = diloco_members(n, network, SHAPES, "none", PART_NUMEL, seed=5)
    dead = [members[i] for i in dying]
    for member in dead:
        # the member serves its contribution, then is gone before it can serve what it reduced
        def die(round_no, share, member=member, original=member["exchange"].publish_reduced):
            network.down.add(member["peer"])
            original(round_no, None)

        member["exchange"].publish_reduced = die
    results = _run_round(members, monkeypatch)
    alive = [m for m in members if m not in dead]
    for m, r in zip(members, results):
        if m not in dead:
            assert r.in_sync and all(r.failures.get(d["peer"], "").startswith("reduce_") for d in dead), r.failures
    for m in alive[1:]:
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], alive[0]["phi"])), "the survivors agree"


def test_a_late_member_that_counts_more_members_than_the_others_is_refused_at_once(monkeypatch):
    """Two members gathered without the third (an all-gather round of two); the third saw all three and
    reduce-scatters. The owners it asks refuse at once, well before the 60 s timeouts (it waited that long
    in a NAT swarm, round after round), and so do their contributions: their rounds closed without it, so
    it is late (gossip.late_round): it steps nothing and hands its own update back to keep (it used to
    average their updates while they averaged without its, and every member named other contributors;
    then it averaged alone and drifted from their φ)."""
    network = Network()
    phi, members = diloco_members(3, network, SHAPES, "none", PART_NUMEL, seed=7, fetch_timeout=60, serve_timeout=60)
    entries = sorted((RoundEntry(peer_id=m["peer"], samples=m["samples"], codec="none") for m in members), key=lambda e: e.peer_id)
    late = members[2]["peer"]

    async def views(dht, validator, run_id, round_no, entry, *args, **kwargs):
        return (entries if entry.peer_id == late else [e for e in entries if e.peer_id != late]), True

    monkeypatch.setattr(diloco_module, "gather_group", views)

    early0, early1, third = asyncio.run(asyncio.wait_for(run_round_together(members), timeout=30))
    assert not early0.reduce_scatter and not early1.reduce_scatter and early0.contributors == early1.contributors == sorted(
        m["peer"] for m in members[:2])
    early = sorted(m["peer"] for m in members[:2])
    assert all(third.failures.get(p) == "late" for p in early), third.failures
    assert third.late_for == early and third.contributors == [] and not third.in_sync and third.sync_peer in early
    assert all(torch.equal(a, b) for a, b in zip(members[2]["phi"], phi)), "a late member does not step φ"
    own = [p - t for p, t in zip(phi, members[2]["theta"])]  # its Δ = φ − θ, sent dense ("none"): exactly
    assert third.samples == members[2]["samples"] and all(torch.equal(u, d) for u, d in zip(third.late_update, own))


def test_wire_partition_per_codec():
    from gossip.partition import Partition
    from gossip.reduce_scatter import FINE_PARTS, wire_partition
    shapes = [(256, 128), (128,), (64, 64)]
    assert not wire_partition("q2", shapes).flat and wire_partition("q2", shapes).max_numel == 16384
    # a small model under an elementwise codec: flat runs across tensors (its norms are no parts of their own)
    for codec in ("none", "fp16", "bf16"):
        assert wire_partition(codec, shapes) == Partition(16384, flat=True)
    many = [(4096, 256)] * 64 + [(256,)] * 64  # 67 M values
    assert wire_partition("none", many).flat is False, "a large model keeps row blocks: views, no joined copy"
    small = [(1024, 1024)] * 15 + [(1024,)] * 15  # 15.7 M values: FINE_PARTS equal runs (the last one shorter)
    runs = wire_partition("none", small).shapes(small)
    assert len(runs) == FINE_PARTS and len({r for r in runs[:-1]}) == 1
    assert wire_partition("none", shapes, noloco=True).flat is False
    # top-k with values scaled per chunk runs across tensors: one payload header for the whole model
    for codec in ("topk:64/4096+q2", "topk:64/4096"):
        partition = wire_partition(codec, shapes)
        assert partition.flat and partition.shapes(shapes) == [(256 * 128 + 128 + 64 * 64,)]
    # one quantizer table per payload (+q4/+q8), rotation blocks and DCT tiles keep tensors apart
    for codec in ("topk:64/4096+q4", "topk:64/4096+rot2", "dct:32/4096", "seed:r=8"):
        assert not wire_partition(codec, shapes).flat


def _serve_scaled_reductions(owner: dict) -> None:
    """``owner`` reduces honestly but serves 50x its result."""
    from compression import get_codec
    from gossip.exchange import ReducedShare

    def scaled(round_no, share, original=owner["exchange"].publish_reduced):
        if share is not None:
            blobs = {i: get_codec("none").encode(50 * t).to_bytes() for i, t in share.decoded.items()}
            share = ReducedShare(share.round, share.samples, share.contributors, share.fingerprint, blobs, share.decoded)
        original(round_no, share)

    owner["exchange"].publish_reduced = scaled


@pytest.mark.parametrize("samples", [None, [0, 16, 24, 32]])
def test_an_owner_that_serves_a_scaled_reduction_is_not_applied(samples, monkeypatch):
    """A hostile owner reduces honestly but serves 50x its result: the others find its share implausible
    against their own update on those parts, reduce those parts themselves and end at the honest mean.
    A member of no samples (``samples[0] == 0``: no update of its own) judges shares by its own reduced parts."""
    network = Network()
    phi, members = diloco_members(4, network, SHAPES, "none", PART_NUMEL, seed=11, samples=samples)
    liar = members[1]
    _serve_scaled_reductions(liar)
    results = _run_round(members, monkeypatch)
    trainers = [m for m in members if m["samples"]]
    expected = weighted_mean([m["delta"] for m in trainers], [m["samples"] for m in trainers])
    honest = [m for m in members if m is not liar]
    for m, r in zip(members, results):
        if m is liar:
            continue
        assert r.failures.get(liar["peer"]) == "reduce_implausible", r.failures
        for got, p, d in zip(m["phi"], phi, expected):
            assert torch.allclose(got, p - d, atol=1e-5)
    for m in honest[1:]:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(m["phi"], honest[0]["phi"]))


def test_a_lying_claim_does_not_widen_the_bound_on_a_hostile_owners_share(monkeypatch):
    """The owner that serves 50x its reduction also claims 10⁹ samples (no run cap here). The bound on an
    owner's share grows with the members' claims (``steps_scale``); taken as claimed, the lie widened it
    ~10⁸-fold and the scaled share was applied. Claims now count as they weighed on this member's own
    parts (at most twice the samples each update's norm stands for), and the share is refused."""
    network = Network()
    _, members = diloco_members(4, network, SHAPES, "none", PART_NUMEL, seed=11, samples=[8, 10**9, 8, 8])
    liar = members[1]
    for m in members:
        m["averager"].aggregation = "centered-clip"
    _serve_scaled_reductions(liar)
    results = _run_round(members, monkeypatch)
    honest = [(m, r) for m, r in zip(members, results) if m is not liar]
    for m, r in honest:
        assert r.failures.get(liar["peer"]) == "reduce_implausible", r.failures
        assert r.capped.get(liar["peer"]) == 10**9, r.capped  # cut where this member reduced parts
    for m, _ in honest[1:]:
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], honest[0][0]["phi"]))


def test_an_honest_share_is_plausible_and_a_scaled_one_is_not():
    from gossip.exchange import ReducedShare
    from gossip.reduce_scatter import OWNER_NORM_BOUND, implausible_share

    own = [torch.ones(4), torch.ones(3)]
    share = lambda k: ReducedShare(0, 8, ["a"], "fp", {}, {0: k * torch.ones(4), 1: k * torch.ones(3)})  # noqa: E731
    assert implausible_share(share(1.0), [0, 1], own) is None
    assert implausible_share(share(OWNER_NORM_BOUND * 0.99), [0, 1], own) is None
    assert "norm" in implausible_share(share(OWNER_NORM_BOUND * 1.01), [0, 1], own)
    assert implausible_share(share(1.0), [0], [torch.zeros(4), torch.ones(3)]) is not None  # own part zero: reduce here


def test_a_member_that_took_fewer_steps_allows_for_the_longer_updates_of_faster_members() -> None:
    """Under --inner-steps auto a slow member's own update is short: the aggregate of fast members' longer
    ones is not a scaled share (a member 6x slower saw 4-5x its own norm in a live swarm), while the
    widening stays bounded by the capped sample claims."""
    from gossip.exchange import ReducedShare
    from gossip.reduce_scatter import OWNER_NORM_BOUND, implausible_share, steps_scale

    assert steps_scale([50, 50, 50], 50) == 1.0  # equal steps: the plain bound
    assert steps_scale([50, 50, 50], 100) == 1.0  # never tighter than it
    slow = steps_scale([400, 400, 64], 64)  # two fast members (50 steps of 8) and this one (8 steps)
    assert 5.5 < slow < 6.0
    own = [torch.ones(4)]
    share = ReducedShare(0, 864, ["a"], "fp", {}, {0: 5 * torch.ones(4)})
    assert implausible_share(share, [0], own) is not None  # the old bound refused it
    assert implausible_share(share, [0], own, slow) is None
    scaled = ReducedShare(0, 864, ["a"], "fp", {}, {0: OWNER_NORM_BOUND * slow * 1.01 * torch.ones(4)})
    assert implausible_share(scaled, [0], own, slow) is not None
    cap = 20 * 64
    assert steps_scale([cap, cap, 64], 64) <= cap / 64  # a liar's claims are capped before they get here


def test_a_member_that_reduced_no_parts_bounds_the_claims_it_never_saw_by_their_median() -> None:
    """A member that owns no parts saw no other update, so no norm bounds a claim there: taken as claimed
    (up to the run's cap), a liar's 10⁹ widened ``steps_scale`` ~18-fold and a share scaled that much passed.
    Claims are now bounded at 4x the lower-median claim: honest members up to 4x the median's speed keep
    their claims, and the liar widens the bound as a member 4x faster would."""
    from gossip.reduce_scatter import UNSEEN_CLAIM_FACTOR, bounded_unseen, steps_scale

    cap = 20 * 64  # what the run's cap left of the lie
    lied = {"me": 64, "honest": 64, "liar": cap}
    assert steps_scale(list(lied.values()), 64) > 18
    bounded = bounded_unseen(lied)
    assert bounded == {"me": 64, "honest": 64, "liar": int(UNSEEN_CLAIM_FACTOR * 64)}
    assert steps_scale(list(bounded.values()), 64) <= 3.0
    fast = {"me": 64, "a": 400, "b": 400}  # two members 6x faster than this one: their median is theirs
    assert bounded_unseen(fast) == fast
    assert bounded_unseen({}) == {} and bounded_unseen({"a": 0, "b": 0}) == {"a": 0, "b": 0}


def test_a_member_that_owns_no_parts_refuses_a_liars_scaled_share(monkeypatch):
    """Two parts among four members: two members reduce nothing and only see the owners' shares. The owner
    that serves 50x its reduction claims 10⁹ samples; taken as claimed, that lie let the scaled share pass
    at the members that own no parts (their bound grew with the claims), and their φ left the others'."""
    network = Network()
    shapes = [(256,), (256,)]
    _, members = diloco_members(4, network, shapes, "none", PART_NUMEL, seed=12, samples=[8, 8, 8, 8])
    owners = assign_owners([256, 256], sorted(m["peer"] for m in members))
    liar = next(m for m in members if owners[m["peer"]])
    liar["samples"] = 10**9
    bystanders = [m for m in members if not owners[m["peer"]]]
    assert len(bystanders) == 2
    for m in members:
        m["averager"].aggregation = "centered-clip"
    _serve_scaled_reductions(liar)
    results = dict(zip((m["peer"] for m in members), _run_round(members, monkeypatch)))
    for m in bystanders:
        assert results[m["peer"]].failures.get(liar["peer"]) == "reduce_implausible", results[m["peer"]].failures
    honest = [m for m in members if m is not liar]
    for m in honest[1:]:
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], honest[0]["phi"]))


def test_an_owner_that_averaged_alone_on_its_own_phi_does_not_stand_in_for_the_round(monkeypatch):
    """A member whose φ drifted and whose fetches are all refused (the serve budget refuses a client that
    asks for rounds ahead) sees only its own update: it votes alone, counts itself in sync and serves its
    own update as its parts' reduction. The other two count it out of sync, yet applied that share for a
    third of the model, every round (the honest pair of a ``future`` attack ended 4-8 % worse than alone).
    A share reduced on another φ is now refused, and those parts are reduced from the two in-sync updates."""
    network = Network()
    phi, members = diloco_members(3, network, SHAPES, "none", PART_NUMEL, seed=13)
    drifted = members[2]
    drifted["phi"] = [p + 0.01 for p in drifted["phi"]]
    original = drifted["exchange"].gather

    async def refused(peers, round_no, timeout, parts=None, reduced=None, **kwargs):
        if reduced is None:  # its requests for the others' contributions are refused
            return {}, {p: "refused" for p in peers}
        return await original(peers, round_no, timeout, parts=parts, reduced=reduced, **kwargs)

    drifted["exchange"].gather = refused
    results = _run_round(members, monkeypatch)
    assert results[2].contributors == [drifted["peer"]] and results[2].in_sync, "it averaged alone, in sync by its own count"
    honest = members[:2]
    expected = weighted_mean([m["delta"] for m in honest], [m["samples"] for m in honest])
    for m, r in zip(honest, results):
        assert r.reduce_scatter and r.contributors == sorted(h["peer"] for h in honest), r.contributors
        assert r.failures.get(drifted["peer"]) == "out_of_sync", r.failures
        for got, p, d in zip(m["phi"], phi, expected):
            assert torch.allclose(got, p - d, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(honest[0]["phi"], honest[1]["phi"]))

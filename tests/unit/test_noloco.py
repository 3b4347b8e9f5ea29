"""NoLoCo's outer step and group matching, streaming fragments and the adaptive deadline (pure parts).

Identities from shared/design/ALGORITHMS.md: NoLoCo with the whole swarm as its group is DiLoCo with
heavy-ball momentum; replicas on identical data stay identical; distinct replicas contract toward
each other; streaming with P = 1 is DiLoCo.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.deadline import AdaptiveDeadline
from gossip.fragments import assign_fragments, fragment_of_round, merge_fragment, sync_interval
from gossip.noloco import choose_group
from gossip.outer import NesterovOuter, NoLoCoOuter, pseudo_gradient, weighted_mean


def _regression(seed: int, n: int = 64, d: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, x @ torch.arange(1.0, d + 1, dtype=torch.float64) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)


def _inner(w: torch.Tensor, data: tuple[torch.Tensor, torch.Tensor], steps: int, lr: float = 0.02) -> torch.Tensor:
    """Plain SGD on a least-squares problem: deterministic local training for the identities."""
    x, y = data
    w = w.clone()
    for _ in range(steps):
        w -= lr * 2 * x.T @ (x @ w - y) / len(y)
    return w


def _noloco_round(phis, datas, groups, outers, steps=5):
    thetas = [_inner(p, d, steps) for p, d in zip(phis, datas)]
    new = [p.clone() for p in phis]
    for i, group in enumerate(groups):
        mean_phi = torch.stack([phis[j] for j in group]).mean(0)
        mean_u = torch.stack([thetas[j] - phis[j] for j in group]).mean(0)
        outers[i].step([new[i]], [mean_phi], [mean_u])
    return new


def test_noloco_with_everyone_in_the_group_is_heavy_ball_diloco():
    k, rounds = 4, 6
    datas = [_regression(s) for s in range(k)]
    phi0 = torch.zeros(5, dtype=torch.float64)
    phis = [phi0.clone() for _ in range(k)]
    outers = [NoLoCoOuter(lr=0.7, momentum=0.5) for _ in range(k)]
    everyone = [list(range(k))] * k
    ref, ref_outer = phi0.clone(), NesterovOuter(lr=0.7, momentum=0.5, nesterov=False)
    for _ in range(rounds):
        phis = _noloco_round(phis, datas, everyone, outers)
        deltas = [pseudo_gradient([ref], [_inner(ref, d, 5)]) for d in datas]
        ref_outer.step([ref], weighted_mean(deltas, [1.0] * k))
        for p in phis:
            torch.testing.assert_close(p, ref.to(p.dtype), rtol=1e-6, atol=1e-7)


def test_replicas_on_identical_data_stay_identical():
    data = _regression(7)
    phis = [torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    outers = [NoLoCoOuter(), NoLoCoOuter()]
    for _ in range(5):
        phis = _noloco_round(phis, [data, data], [[0, 1], [0, 1]], outers)
        assert torch.equal(phis[0], phis[1])
    assert not torch.equal(phis[0], torch.zeros(5, dtype=torch.float64))  # and they did train


def test_distinct_replicas_contract_over_random_pair_rounds():
    """Weights that start apart (and train on different data) move together under pairwise gossip."""
    k = 8
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    phis = [torch.randn(5, generator=gen, dtype=torch.float64) * 10 for _ in range(k)]
    datas = [_regression(s) for s in range(k)]
    outers = [NoLoCoOuter() for _ in range(k)]

    def spread(ps):
        mean = torch.stack(ps).mean(0)
        return max(float((p - mean).norm()) for p in ps)

    spreads = [spread(phis)]
    for _ in range(12):
        order = list(range(k))
        rng.shuffle(order)
        groups = [None] * k
        for a, b in zip(order[::2], order[1::2]):
            groups[a] = groups[b] = [a, b]
        phis = _noloco_round(phis, datas, groups, outers, steps=2)
        spreads.append(spread(phis))
    assert spreads[-1] < 0.1 * spreads[0], spreads
    assert spreads[6] < spreads[0]


def test_noloco_alone_is_a_local_momentum_step():
    phi = [torch.tensor([1.0, 2.0])]
    outer = NoLoCoOuter(lr=0.5, momentum=0.5)
    outer.step(phi, [phi[0].clone()], [torch.tensor([2.0, -2.0])])  # group of one: no pull
    torch.testing.assert_close(phi[0], torch.tensor([2.0, 1.0]))
    outer.step(phi, [phi[0].clone()], [torch.tensor([0.0, 0.0])])  # momentum carries on
    torch.testing.assert_close(phi[0], torch.tensor([2.5, 0.5]))


def test_noloco_state_round_trips_for_joiners():
    like = [torch.zeros(3), torch.zeros(2)]
    a = NoLoCoOuter()
    a.step(like, [torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)])
    b = NoLoCoOuter()
    b.load_state_tensors(a.state_tensors(like))
    x, y = [torch.zeros(3), torch.zeros(2)], [torch.zeros(3), torch.zeros(2)]
    a.step(x, [torch.ones(3), torch.ones(2)], [torch.zeros(3), torch.zeros(2)])
    b.step(y, [torch.ones(3), torch.ones(2)], [torch.zeros(3), torch.zeros(2)])
    assert all(torch.equal(p, q) for p, q in zip(x, y))


def test_noloco_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="α in"):
        NoLoCoOuter(momentum=1.0)
    with pytest.raises(ValueError, match="mean weights"):
        NoLoCoOuter().step([torch.zeros(1)], [], [torch.zeros(1)])


# ---- matching ---------------------------------------------------------------------------------
def test_groups_form_by_order_of_arrival():
    arrivals = [(1.0, "a"), (2.0, "b"), (3.0, "c"), (4.0, "d")]
    assert choose_group(arrivals, "a", 2, final=False, seed=0) == ["a", "b"]
    assert choose_group(arrivals, "d", 2, final=False, seed=0) == ["c", "d"]
    assert choose_group(arrivals, "c", 3, final=False, seed=0) == ["a", "b", "c"]
    assert choose_group(arrivals, "d", 3, final=False, seed=0) is None  # waits for two more members
    assert choose_group(arrivals[:1], "a", 2, final=False, seed=0) is None
    assert choose_group(arrivals[:1], "a", 2, final=True, seed=0) == ["a"]  # nobody came: local step


def test_a_left_over_member_pulls_from_an_earlier_one():
    arrivals = [(1.0, "a"), (2.0, "b"), (3.0, "c")]
    group = choose_group(arrivals, "c", 2, final=True, seed=5)
    assert group[0] == "c" and group[1] in ("a", "b") and len(group) == 2
    assert choose_group(arrivals, "c", 2, final=True, seed=5) == group  # seeded
    picks = {choose_group(arrivals, "c", 2, final=True, seed=s)[1] for s in range(20)}
    assert picks == {"a", "b"}  # and random across rounds


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=12, unique=True), st.integers(2, 4))
def test_every_member_lands_in_a_group_no_larger_than_n(times, size):
    arrivals = [(t, f"p{i:02d}") for i, t in enumerate(times)]
    groups = {peer: choose_group(arrivals, peer, size, final=True, seed=1) for _, peer in arrivals}
    for peer, group in groups.items():
        assert peer in group and 1 <= len(group) <= size and len(set(group)) == len(group)
    # the first ⌊n/size⌋·size arrivals are in symmetric groups
    order = [p for _, p in sorted(arrivals)]
    for k in range(len(order) // size * size):
        assert all(sorted(groups[q]) == sorted(groups[order[k]]) for q in groups[order[k]])


# ---- streaming --------------------------------------------------------------------------------
NAMES = ["tok_emb.weight", "pos_emb.weight"] + [f"blocks.{b}.{p}" for b in range(4) for p in ("w", "b")] + ["ln_f.weight"]


def test_fragments_interleave_blocks_and_fragment_zero_owns_the_rest():
    frags = assign_fragments(NAMES, 2)
    assert sorted(i for f in frags for i in f) == list(range(len(NAMES)))
    named = [[NAMES[i] for i in f] for f in frags]
    assert "tok_emb.weight" in named[0] and "ln_f.weight" in named[0] and "blocks.1.w" in named[1] and "blocks.2.w" in named[0]
    assert assign_fragments(NAMES, 1) == [list(range(len(NAMES)))]
    with pytest.raises(ValueError, match="empty"):
        assign_fragments(NAMES, 5)


def test_schedule_rotates_fragments_every_h_over_p_steps():
    assert sync_interval(30, 3) == 10 and sync_interval(2, 4) == 1
    assert [fragment_of_round(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def _streaming_run(fragments: int, rounds: int, h: int = 6) -> list[torch.Tensor]:
    """Two replicas of a 4-tensor model, streaming DiLoCo with the daemon's schedule and merge."""
    datas = [_regression(1, d=4), _regression(2, d=4)]
    names = [f"blocks.{b}.w" for b in range(4)]
    frags = assign_fragments(names, fragments)
    phi = [torch.zeros(1, dtype=torch.float64) for _ in names]
    thetas = [[t.clone() for t in phi] for _ in datas]
    outer = NesterovOuter(0.7, 0.9)
    for r in range(rounds):
        for rep, data in enumerate(datas):  # inner steps on the flattened model
            w = _inner(torch.cat(thetas[rep]), data, sync_interval(h, fragments))
            thetas[rep] = list(w.split(1))
        f = fragment_of_round(r, fragments)
        deltas = [pseudo_gradient([phi[i] for i in frags[f]], [th[i] for i in frags[f]]) for th in thetas]
        phi_f = [phi[i] for i in frags[f]]
        outer.step(phi_f, weighted_mean(deltas, [1.0, 1.0]), frags[f])
        for th in thetas:
            merge_fragment([th[i] for i in frags[f]], phi_f, 0.0)
    return phi


def test_streaming_with_one_fragment_is_diloco():
    datas = [_regression(1, d=4), _regression(2, d=4)]
    ref, outer = [torch.zeros(4, dtype=torch.float64)], NesterovOuter(0.7, 0.9)
    for _ in range(5):
        deltas = [pseudo_gradient(ref, [_inner(ref[0], d, 6)]) for d in datas]
        outer.step(ref, weighted_mean(deltas, [1.0, 1.0]))
    torch.testing.assert_close(torch.cat(_streaming_run(1, 5)), ref[0])


def test_streaming_with_fragments_still_trains():
    x, y = _regression(1, d=4)
    loss = lambda w: float(((x @ w - y) ** 2).mean())  # noqa: E731
    assert loss(torch.cat(_streaming_run(2, 40))) < 0.1 * loss(torch.zeros(4, dtype=torch.float64))


def test_merge_fragment_alpha():
    local, synced = [torch.tensor([4.0])], [torch.tensor([0.0])]
    merge_fragment(local, synced, 0.25)
    assert local[0].item() == 1.0
    merge_fragment(local, synced, 0.0)
    assert local[0].item() == 0.0
    with pytest.raises(ValueError):
        merge_fragment(local, synced, 2.0)


# ---- deadline ---------------------------------------------------------------------------------
def test_deadline_adapts_to_recent_complete_rounds():
    d = AdaptiveDeadline(ceiling=30.0, floor=1.0, multiplier=3.0, window=4, back_off=True)
    assert d.value == 30.0  # nothing observed: the ceiling
    for w in (0.5, 0.6, 0.7):
        d.observe(w, complete=True)
    assert d.value == pytest.approx(1.8)
    d.observe(25.0, complete=False)  # a round that hit the deadline says nothing about normal waits,
    assert d.value == pytest.approx(3.6)  # but the next round waits twice as long for the late member
    d.observe(25.0, complete=False)
    assert d.value == pytest.approx(7.2)
    d.observe(0.6, complete=True)  # it came: back to the normal deadline
    assert d.value == pytest.approx(1.8)
    for w in (20.0, 20.0, 20.0, 20.0):
        d.observe(w, complete=True)
    assert d.value == 30.0  # capped
    for w in (0.01,) * 4:
        d.observe(w, complete=True)
    assert d.value == 1.0  # floored
    with pytest.raises(ValueError):
        AdaptiveDeadline(ceiling=1.0, floor=2.0)
    pairs = AdaptiveDeadline(ceiling=30.0, floor=1.0, window=4)  # NoLoCo: a member left alone is normal
    pairs.observe(0.6, complete=True)
    pairs.observe(5.0, complete=False)
    assert pairs.value == pytest.approx(1.8)


# ---- a partner's φ is bounded around ours ------------------------------------------------------
def test_a_far_partner_phi_moves_the_mean_by_at_most_the_radius_over_the_group():
    from gossip.noloco import bounded_mean_weights

    own = [torch.zeros(3), torch.zeros(2)]
    near = [torch.tensor([0.3, 0.0, 0.0]), torch.tensor([0.0, 0.4])]  # distance 0.5: kept as is
    far = [torch.full((3,), 1e6), torch.full((2,), -1e6)]
    mean, factors = bounded_mean_weights(own, [near], radius=1.0)
    assert factors == [1.0] and torch.equal(mean[0], near[0] / 2) and torch.equal(mean[1], near[1] / 2)
    mean, factors = bounded_mean_weights(own, [far], radius=1.0)
    shift = sum(float(t.pow(2).sum()) for t in mean) ** 0.5
    assert shift == pytest.approx(0.5, rel=1e-6) and factors[0] == pytest.approx(1.0 / (5 ** 0.5 * 1e6), rel=1e-6)
    mean, factors = bounded_mean_weights(own, [near, far], radius=1.0)  # a group of three: (0 + near + cut far) / 3
    cut = [t * factors[1] for t in far]
    for m, a, b in zip(mean, near, cut):
        torch.testing.assert_close(m, (a + b) / 3)
    mean, factors = bounded_mean_weights(own, [own], radius=0.0)  # a partner at the same φ, even with no radius
    assert factors == [1.0] and all(torch.equal(m, o) for m, o in zip(mean, own))

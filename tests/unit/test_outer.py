"""Outer optimizer math: the identities of shared/design/ALGORITHMS.md §1, pinned numbers, partitioning."""

import copy

import pytest
import torch

from gossip.fingerprint import fingerprint
from gossip.outer import NesterovOuter, pseudo_gradient, weighted_mean
from gossip.partition import Partition, join, part_shapes, split
from swarm.models.presets import GPT, preset


def _batch(seed, n=4, ctx=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, ctx), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_diloco_h1_inner_sgd_outer_sgd_lr1_equals_data_parallel_sgd():
    """H=1 + inner SGD + outer SGD(lr=1, μ=0) ≡ synchronous data-parallel SGD on the union batch."""
    torch.manual_seed(0)
    model = GPT(preset("nano"))
    inner_lr, k = 0.1, 3
    batches = [_batch(i) for i in range(k)]

    # DiLoCo: k replicas each take one SGD step from φ on their batch, then the outer step
    phi = [p.detach().clone() for p in model.parameters()]
    deltas = []
    for x, y in batches:
        replica = copy.deepcopy(model)
        opt = torch.optim.SGD(replica.parameters(), lr=inner_lr)
        replica(x, y)[1].backward()
        opt.step()
        deltas.append(pseudo_gradient(phi, list(replica.parameters())))
    NesterovOuter(lr=1.0, momentum=0.0).step(phi, weighted_mean(deltas, [1.0] * k))

    # data parallel: one SGD step on the mean loss of the union batch
    dp = copy.deepcopy(model)
    opt = torch.optim.SGD(dp.parameters(), lr=inner_lr)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    dp(x, y)[1].backward()
    opt.step()
    for a, b in zip(phi, dp.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_nesterov_matches_torch_sgd_nesterov():
    """The outer step is torch's SGD(momentum, nesterov=True) applied to Δ as the gradient."""
    g = torch.Generator().manual_seed(1)
    phi = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    ref = [p.clone().requires_grad_(True) for p in phi]
    ref_opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    for _ in range(5):
        delta = [torch.randn(p.shape, generator=g) for p in phi]
        outer.step(phi, delta)
        for r, d in zip(ref, delta):
            r.grad = d.clone()
        ref_opt.step()
    for a, b in zip(phi, ref):
        torch.testing.assert_close(a, b.detach())


def test_outer_golden_numbers():
    """Pinned: two Nesterov steps on a scalar (v1=1, φ1=1-0.7·1.9; v2=0.9+0.5, φ2=φ1-0.7·(0.5+0.9·1.4))."""
    phi = [torch.tensor([1.0])]
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    outer.step(phi, [torch.tensor([1.0])])
    assert phi[0].item() == pytest.approx(1 - 0.7 * 1.9)
    outer.step(phi, [torch.tensor([0.5])])
    assert phi[0].item() == pytest.approx(1 - 0.7 * 1.9 - 0.7 * (0.5 + 0.9 * 1.4))
    assert outer.buffers[0].item() == pytest.approx(1.4)


def test_outer_state_round_trip_and_validation():
    phi = [torch.ones(3)]
    outer = NesterovOuter()
    assert torch.equal(outer.state_tensors(phi)[0], torch.zeros(3))
    outer.step(phi, [torch.ones(3)])
    other = NesterovOuter()
    other.load_state_tensors(outer.state_tensors(phi))
    a, b = [phi[0].clone()], [phi[0].clone()]
    outer.step(a, [torch.ones(3)])
    other.step(b, [torch.ones(3)])
    assert torch.equal(a[0], b[0])
    with pytest.raises(ValueError):
        NesterovOuter(lr=0)
    with pytest.raises(ValueError):
        outer.step(phi, [])


def test_weighted_mean_weights_by_samples():
    a, b = [torch.tensor([0.0, 2.0])], [torch.tensor([3.0, 5.0])]
    torch.testing.assert_close(weighted_mean([a, b], [1, 2])[0], torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError):
        weighted_mean([a], [0])


@pytest.mark.parametrize("max_numel", [1, 5, 64, 1 << 20])
def test_partition_round_trip(max_numel):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(10, 7), (13,), (), (0, 3), (3, 2, 2)]]
    parts = split(tensors, max_numel)
    assert [tuple(p.shape) for p in parts] == part_shapes([t.shape for t in tensors], max_numel)
    assert all(p.numel() <= max(max_numel, 7 if p.dim() > 1 else 1) for p in parts)
    for a, b in zip(join(parts, [t.shape for t in tensors], max_numel), tensors):
        assert torch.equal(a, b)
    flat = Partition(max_numel, flat=True)
    parts = flat.split(tensors)
    assert [tuple(p.shape) for p in parts] == flat.shapes([t.shape for t in tensors])
    assert all(p.dim() == 1 and p.numel() <= max_numel for p in parts) and sum(p.numel() for p in parts) == 70 + 13 + 1 + 12
    for a, b in zip(flat.join(parts, [t.shape for t in tensors]), tensors):
        assert torch.equal(a, b) and a.shape == b.shape


def test_fingerprint_sensitive_to_any_change():
    t = [torch.zeros(100), torch.ones(3)]
    fp = fingerprint(t)
    assert fingerprint([x.clone() for x in t]) == fp
    t[0][57] = 1e-30
    assert fingerprint(t) != fp


@pytest.mark.parametrize(
    "mine, others, expected",
    [
        (5, [5, 5], None),  # in step with everyone
        (6, [5, 5], None),  # one round ahead: records lag a heartbeat
        (3, [7, 7], 7),  # finished a round alone after joining: move forward
        (20, [8, 8, 8], 8),  # raced ahead alone in a partition: back to the majority
        (8, [20, 8, 8], None),  # the majority does not follow one isolated node
        (4, [6, 6, 4], 6),  # behind the majority
        (5, [7], 7),  # a tie goes to the higher round
        (7, [5], None),
        (9, [], None),  # alone
    ],
)
def test_rejoin_target(mine, others, expected):
    from gossip.rendezvous import rejoin_target

    assert rejoin_target(mine, others) == expected


def test_preview_is_the_step_without_side_effects():
    phi = [torch.tensor([1.0, -2.0]), torch.tensor([0.5])]
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    outer.step([p.clone() for p in phi], [torch.tensor([0.3, 0.1]), torch.tensor([0.2])])  # some momentum first
    delta = [torch.tensor([0.1, -0.4]), torch.tensor([1.0])]
    before = [b.clone() for b in outer.buffers.values()]
    guess = outer.preview(phi, delta)
    assert all(torch.equal(a, b) for a, b in zip(before, outer.buffers.values())), "momentum untouched"
    assert torch.equal(phi[0], torch.tensor([1.0, -2.0])), "phi untouched"
    outer.step(phi, delta)
    assert all(torch.allclose(g, p) for g, p in zip(guess, phi))


def test_outer_lr_warms_up_over_the_first_rounds_of_the_run():
    """Round r steps at η·min(1, (r+1)/W): the same round number gives the same step on every member,
    a member that joins late steps at the full η, and the momentum is unaffected."""
    outer = NesterovOuter(lr=1.0, momentum=0.5, warmup_rounds=4)
    assert [outer.lr_at(r) for r in (0, 1, 2, 3, 4, 100)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert outer.lr_at(None) == 1.0 and NesterovOuter(lr=0.7).lr_at(0) == 0.7
    phi = [torch.tensor([1.0])]
    outer.step(phi, [torch.tensor([1.0])], round_no=0)
    assert phi[0].item() == pytest.approx(1 - 0.25 * 1.5)
    guess = outer.preview(phi, [torch.tensor([1.0])], round_no=1)
    outer.step(phi, [torch.tensor([1.0])], round_no=1)
    assert phi[0].item() == pytest.approx(1 - 0.25 * 1.5 - 0.5 * (1 + 0.5 * 1.5)) == guess[0].item()
    assert outer.buffers[0].item() == pytest.approx(1.5)
    with pytest.raises(ValueError):
        NesterovOuter(warmup_rounds=-1)


@pytest.mark.parametrize("flags, warmup", [({}, 0), ({"compression": "q2"}, 5), ({"compression": "rot2"}, 5),
                                            ({"compression": "seed:r=8"}, 0), ({"algorithm": "sparseloco"}, 0),
                                            ({"compression": "q2", "outer_warmup_rounds": 0}, 0)])
def test_lossy_diloco_warms_its_outer_lr_up_by_default(flags, warmup):
    from node.config import NodeConfig

    assert NodeConfig(**flags).outer_warmup == warmup


def test_a_lone_fresh_peer_far_ahead_is_not_followed():
    from gossip.rendezvous import plausible_rounds, rejoin_target

    claims = {"forger": 1005}
    assert plausible_rounds(5, claims, lambda p: False) == {}, "one fresh peer announcing round 1005"
    assert rejoin_target(5, list(plausible_rounds(5, claims, lambda p: False).values())) is None
    assert plausible_rounds(5, claims, lambda p: p == "forger") == claims, "an established peer is followed"
    assert plausible_rounds(5, {"a": 9, "b": 9}, lambda p: False) == {"a": 9, "b": 9}, "a majority is followed"
    assert plausible_rounds(5, {"a": 7}, lambda p: False) == {"a": 7}, "two rounds ahead is within reach"


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_step_through_part_views_equals_the_step_on_joined_parameters(nesterov):
    """The averager steps φ part by part (views of φ and of the momentum) instead of joining the parts into a
    copy of the model: bit for bit the same φ and momentum, round after round, with the indices of a fragment."""
    g = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (7,), (), (2, 4, 2), (0, 3)]
    max_numel = 4
    phi_joined = [torch.randn(s, generator=g) for s in shapes]
    phi_parts = [p.clone() for p in phi_joined]
    joined, parted = NesterovOuter(lr=0.7, momentum=0.9, nesterov=nesterov), NesterovOuter(lr=0.7, momentum=0.9, nesterov=nesterov)
    indices = [4, 1, 7, 2, 9]
    for round_no in range(3):
        delta = [torch.randn(s, generator=g) for s in shapes]
        parts = split(delta, max_numel)
        assert len(parts) > len(shapes)
        joined.step(phi_joined, join(parts, shapes, max_numel), indices, round_no)
        parted.step(phi_parts, parts, indices, round_no, split=lambda ts: split(ts, max_numel))
        for a, b in zip(phi_joined, phi_parts):
            assert torch.equal(a, b)
        assert joined.buffers.keys() == parted.buffers.keys()
        for i in indices:
            assert torch.equal(joined.buffers[i], parted.buffers[i])
    with pytest.raises(ValueError, match="parts"):
        parted.step(phi_parts, parts[:-1], indices, 3, split=lambda ts: split(ts, max_numel))

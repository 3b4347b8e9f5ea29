"""A member of no samples in a DiLoCo round (a stage replica no microbatch reached since the last round):
it takes part, its Δ is not averaged, and it ends on the same φ as the members that trained, bit for bit,
in an all-gather (two members) and a reduce-scatter (three or more). Before, such a replica sat the round
out, its φ fell one round behind, and at the next round one of the two replicas found itself out of sync
and downloaded the other's weights while trainers were routing microbatches through it. (A member of no
samples facing a hostile owner: ``tests/unit/test_reduce_scatter.py``.)"""

import pytest
import torch

from gossip.exchange import ReducedShare
from gossip.outer import weighted_mean
from gossip.reduce_scatter_round import implausible_for_listener
from tests.helpers.diloco_members import diloco_members
from tests.helpers.memory_transport import Network
from tests.unit.test_reduce_scatter import _run_round

SHAPES = [(96, 64), (64,), (120, 32), (256, 16), (5,)]
PART_NUMEL = 256


@pytest.mark.parametrize("n,idle", [(2, 0), (2, 1), (3, 0), (3, 2), (5, 1)])
def test_a_member_of_no_samples_ends_on_the_trainers_phi_bit_for_bit(n, idle, monkeypatch):
    samples = [0 if k == idle else 8 * (k + 1) for k in range(n)]
    phi, members = diloco_members(n, Network(), SHAPES, "none", PART_NUMEL, seed=5, samples=samples)
    results = _run_round(members, monkeypatch)
    trainers = [m for m in members if m["samples"]]
    expected = weighted_mean([m["delta"] for m in trainers], [m["samples"] for m in trainers])
    for m, r in zip(members, results):
        assert r.in_sync and r.contributors == sorted(t["peer"] for t in trainers), (r.contributors, r.failures)
        assert r.reduce_scatter == (n >= 3) and not r.failures, r.failures
        for got, p, d in zip(m["phi"], phi, expected):
            assert torch.allclose(got, p - d, atol=1e-5)
    for m in members[1:]:
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], members[0]["phi"])), "every member holds one φ"


@pytest.mark.parametrize("n", [2, 3])
def test_a_round_in_which_nobody_took_a_step_leaves_phi_where_it_was(n, monkeypatch):
    phi, members = diloco_members(n, Network(), SHAPES, "none", PART_NUMEL, seed=6, samples=[0] * n)
    results = _run_round(members, monkeypatch)
    for m, r in zip(members, results):
        assert r.in_sync and r.contributors == [] and not r.failures, r.failures
        assert all(torch.equal(a, b) for a, b in zip(m["phi"], phi))


def test_a_listener_judges_a_share_by_its_own_reduced_parts():
    g = torch.Generator().manual_seed(0)
    own = [torch.randn(300, generator=g) * 0.01]
    honest = {0: torch.randn(500, generator=g) * 0.02, 1: torch.randn(40, generator=g) * 0.001}
    share = ReducedShare(0, 8, ["a"], "fp", {}, honest)
    assert implausible_for_listener(share, [0, 1], own) is None
    assert "root mean square" in implausible_for_listener(ReducedShare(0, 8, ["a"], "fp", {}, {0: 100 * honest[0], 1: honest[1]}), [0, 1], own)
    broken = {0: honest[0].clone(), 1: honest[1]}
    broken[0][3] = float("nan")
    assert "not finite" in implausible_for_listener(ReducedShare(0, 8, ["a"], "fp", {}, broken), [0, 1], own)
    assert implausible_for_listener(share, [0, 1], []) is None, "owning no parts, it checks finiteness only"

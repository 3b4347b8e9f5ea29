"""Robust aggregation: honest groups are unaffected, poisoned updates move the model no more than an honest one."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gossip.aggregate import aggregate, supported_claims
from gossip.outer import weighted_mean


def _updates(n, seed=0, shape=(50,)):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=g) * 0.01, torch.randn(3, generator=g) * 0.01] for _ in range(n)]


@pytest.mark.parametrize("method", ["mean", "median-clip"])
def test_honest_groups_of_equal_norm_are_averaged_unchanged(method):
    base = _updates(1)[0]
    ups = [[t * s for t in base] for s in (1.0, 1.0, 1.0)]  # equal norms: clipping changes nothing
    agg = aggregate(["a", "b", "c"], ups, [8, 8, 8], method)
    ref = weighted_mean(ups, [8, 8, 8])
    for x, y in zip(agg.update, ref):
        torch.testing.assert_close(x, y)
    assert agg.used == ["a", "b", "c"] and not agg.dropped


def test_mean_is_sample_weighted():
    ups = _updates(2)
    agg = aggregate(["a", "b"], ups, [1, 3])
    for x, y in zip(agg.update, weighted_mean(ups, [1, 3])):
        torch.testing.assert_close(x, y)


def _norm(u):
    return sum(float(t.pow(2).sum()) for t in u) ** 0.5


@pytest.mark.parametrize("method", ["median-clip", "trimmed-mean"])
@pytest.mark.parametrize("n_honest", [1, 2, 4])
def test_a_1000x_update_moves_the_model_no_more_than_an_honest_peer(method, n_honest):
    honest = _updates(n_honest, seed=n_honest)
    attacker = [[t * 1000 for t in _updates(1, seed=99)[0]]]
    peers = [f"h{i}" for i in range(n_honest)] + ["z"]
    agg = aggregate(peers, honest + attacker, [8] * (n_honest + 1), method, reject_ratio=1e9)  # clipping alone
    assert _norm(agg.update) <= max(_norm(u) for u in honest) * (1 + 1e-5)


def test_absurd_norms_are_dropped_in_every_mode():
    honest = _updates(2)
    poisoned = [[t * 1e6 for t in honest[0]]]
    for method in ("mean", "median-clip", "trimmed-mean"):
        agg = aggregate(["a", "b", "z"], honest + poisoned, [8, 8, 8], method)
        assert agg.dropped == {"z": "norm_outlier"} and agg.used == ["a", "b"]


@pytest.mark.parametrize("method", ["mean", "median-clip", "sparse-clip", "centered-clip", "trimmed-mean"])
@pytest.mark.parametrize("n_honest", [2, 4])  # an even count: the dropped update would move the lower median
def test_a_dropped_update_changes_nothing_a_member_computes(method, n_honest):
    # an attacker may send its absurd update to some members only: who received it and who did not
    # must still compute bit-identical aggregates, or the group drifts apart (out of sync next round)
    honest = _updates(n_honest, seed=7)
    honest = [[t * (1 + 0.7 * i) for t in u] for i, u in enumerate(honest)]  # unequal norms: the reference matters
    peers = [f"h{i}" for i in range(n_honest)]
    poisoned = [[t * 1e6 for t in honest[0]]]
    saw = aggregate(peers + ["z"], honest + poisoned, [8] * (n_honest + 1), method)
    missed = aggregate(peers, honest, [8] * n_honest, method)
    assert saw.dropped == {"z": "norm_outlier"} and saw.used == missed.used == peers
    for x, y in zip(saw.update, missed.update):
        assert torch.equal(x, y)
    assert saw.clipped == missed.clipped


def test_norms_compare_per_sample_so_short_rounds_are_not_outliers():
    one_step = [[t * 0.02 for t in _updates(1, seed=3)[0]]]
    many_steps = [[t * 100 for t in one_step[0]]]  # 100 steps, 100× the norm
    agg = aggregate(["a", "b"], one_step + many_steps, [1, 100], "mean", reject_ratio=10)
    assert not agg.dropped


def test_claimed_samples_are_capped_in_median_clip():
    u, v = _updates(2, seed=5)
    agg = aggregate(["a", "b", "z"], [u, u, v], [8, 8, 10**9], "median-clip")
    # z claims a billion samples but weighs at most 4 × the lower median (32), and at most twice the
    # samples its norm stands for at the others' norm per sample (‖v‖ / (‖u‖ / 8))
    w = min(32, math.ceil(2 * _norm(v) / (_norm(u) / 8)))
    assert agg.capped == {"z": 10**9} and w < 32
    for got, x, y in zip(agg.update, u, v):
        torch.testing.assert_close(got, (16 * x + w * y) / (16 + w))


@given(st.lists(st.tuples(st.floats(0, 1e3), st.integers(0, 10**9)), min_size=1, max_size=9))
def test_a_supported_claim_is_never_cut_below_the_lower_median_claim(rows):
    norms, claims = [n for n, _ in rows], [c for _, c in rows]
    m = sorted(claims)[(len(claims) - 1) // 2]
    for claim, got in zip(claims, supported_claims(norms, claims)):
        assert min(claim, m) <= got <= claim


@given(base=st.integers(1, 500), speedups=st.lists(st.floats(1.0, 4.0), min_size=1, max_size=7), norm=st.floats(1e-4, 10.0))
def test_honest_claims_up_to_4x_the_slowest_stand_whole(base, speedups, norm):
    """Honest peers whose updates grow at least as √steps (independent steps) keep their whole claims
    while the fastest took at most 4 × the slowest's steps."""
    claims = [base] + [max(1, int(base * k)) for k in speedups]
    norms = [norm * math.sqrt(c / base) for c in claims]
    assert supported_claims(norms, claims) == claims


@given(base=st.integers(8, 500), speeds=st.lists(st.floats(1 / 16, 4.0), min_size=2, max_size=8), norm=st.floats(1e-3, 10.0))
def test_honest_claims_up_to_4x_the_median_stand_whole_beside_slower_peers(base, speeds, norm):
    """Peers of any speeds whose updates grow as √steps: every claim up to 4 × the lower-median claim stands
    whole, however much slower the others are (a slow peer's short update once raised the reference: with
    speeds 1, 1, ½ and ¼ the fast peers' claims were cut by 8 %)."""
    claims = [base] + [max(1, round(base * k)) for k in speeds]
    norms = [norm * math.sqrt(c / base) for c in claims]
    m = sorted(claims)[(len(claims) - 1) // 2]
    for claim, got in zip(claims, supported_claims(norms, claims)):
        assert got == claim or claim > 4 * m * (1 - 1e-9), (claim, got, m)


def test_the_measured_round_of_four_speeds_keeps_the_fast_claims_whole():
    """A round seen live (tiny, 4 peers, --slowdown 2/2/4/8): claims 134, 130, 60 and 28 samples, norms 1.9,
    1.87, 1.28 and 0.88 (√-like growth): nothing is cut now; the fast claims were cut to 123 and 121."""
    assert supported_claims([1.9, 1.87, 1.28, 0.88], [134, 130, 60, 28]) == [134, 130, 60, 28]


@given(honest=st.integers(2, 8), claim=st.integers(1, 10**4), lie=st.integers(1, 10**12))
def test_a_claim_with_an_honest_norm_weighs_at_most_twice_an_honest_peer(honest, claim, lie):
    norms, claims = [1.0] * (honest + 1), [claim] * honest + [lie]
    assert supported_claims(norms, claims)[-1] <= max(lie if lie <= claim else 0, 2 * claim + 1)  # (+1: rounding up)
    assert supported_claims(norms, claims)[:-1] == [claim] * honest


def test_unknown_method():
    with pytest.raises(ValueError, match="median-clip"):
        aggregate(["a"], _updates(1), [1], "krum")


def test_sparse_mean_averages_each_coordinate_over_the_senders_that_carried_it():
    a = [torch.tensor([1.0, 0.0, 2.0, 0.0])]
    b = [torch.tensor([3.0, 4.0, 0.0, 0.0])]
    agg = aggregate(["a", "b"], [a, b], [1, 3], "sparse-mean")
    # both: weighted mean; one sender: its own value, undiluted; none: 0
    torch.testing.assert_close(agg.update[0], torch.tensor([(1 + 9) / 4, 4.0, 2.0, 0.0]))
    dense = _updates(3)
    for x, y in zip(aggregate(["a", "b", "c"], dense, [1, 2, 3], "sparse-mean").update, weighted_mean(dense, [1, 2, 3])):
        torch.testing.assert_close(x, y), "equal to the mean on dense updates"


def test_sparse_mean_is_bit_identical_whatever_member_computes_it():
    g = torch.Generator().manual_seed(7)
    ups = [[torch.randn(4096, generator=g) * (torch.rand(4096, generator=g) < 0.02)] for _ in range(5)]
    first = aggregate(list("abcde"), ups, [3, 1, 4, 1, 5], "sparse-mean").update[0]
    again = aggregate(list("abcde"), [[t.clone() for t in u] for u in ups], [3, 1, 4, 1, 5], "sparse-mean").update[0]
    assert torch.equal(first, again)

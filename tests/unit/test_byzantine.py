"""Byzantine peers: each attack of gossip.byzantine against each aggregator, the sample-count cap and
the robust defaults of an open swarm."""

from __future__ import annotations

import math

import pytest
import torch

from gossip.aggregate import METHODS, aggregate
from gossip.byzantine import ATTACKS, LYING_SAMPLES, PROTOCOL_ATTACKS, Attacker, parse_attacks
from gossip.outer import weighted_mean
from node.config import NodeConfig

SAMPLES = 16


def _honest(n: int, seed: int = 0, sparse: bool = False) -> list[list[torch.Tensor]]:
    """n honest updates: a shared direction plus each peer's own noise (non-identical data)."""
    g = torch.Generator().manual_seed(seed)
    common = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g)]
    out = []
    for _ in range(n):
        u = [c + 0.5 * torch.randn(c.shape, generator=g) for c in common]
        if sparse:  # top-k-like: about 5 % of each tensor carried
            u = [t * (torch.rand(t.shape, generator=g) < 0.05) for t in u]
        out.append([t * 0.01 for t in u])
    return out


def _dist(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)))


def _norm(a: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(x.pow(2).sum()) for x in a))


def _attacked(attack: str, n_honest: int, sparse: bool = False) -> tuple[list[list[torch.Tensor]], list, list[int], list[str]]:
    """The honest updates and the round's contributions when one more peer attacks."""
    honest = _honest(n_honest + 1, seed=len(attack), sparse=sparse)
    attacker = Attacker(parse_attacks(attack), seed=1)
    for _ in range(6):  # a history, for stale
        attacker.contribution([t * 0.5 for t in honest[-1]], SAMPLES, honest=honest[:-1])
    bad, claimed = attacker.contribution(honest[-1], SAMPLES, honest=honest[:-1])
    peers = [f"p{i}" for i in range(n_honest + 1)]
    return honest[:-1], honest[:-1] + [bad], [SAMPLES] * n_honest + [claimed], peers


ROBUST_DENSE = ("centered-clip", "trimmed-mean")  # median-clip bounds norms only: a sign flip passes it


@pytest.mark.parametrize("attack", [a if a not in ("scale",) else "scale:50" for a in ATTACKS if a not in ("concentrate", *PROTOCOL_ATTACKS)])
@pytest.mark.parametrize("method", ROBUST_DENSE)
def test_one_attacker_of_four_moves_a_robust_aggregate_no_further_than_an_honest_peer(attack: str, method: str) -> None:
    honest, sent, samples, peers = _attacked(attack, 3)
    reference = weighted_mean(honest, [SAMPLES] * 3)
    spread = max(_dist(u, reference) for u in honest)
    agg = aggregate(peers, sent, samples, method, max_samples=SAMPLES)
    assert _dist(agg.update, reference) <= spread, f"{attack} moved {method}'s aggregate beyond the honest spread"


@pytest.mark.parametrize("attack", ["scale:50", "samples", "noise", "alie", "concentrate", "sign"])
def test_one_attacker_of_four_moves_sparse_clip_no_further_than_an_honest_peer(attack: str) -> None:
    honest, sent, samples, peers = _attacked(attack, 3, sparse=True)
    reference = aggregate(peers[:3], honest, [SAMPLES] * 3, "sparse-mean").update
    spread = max(_dist(u, reference) for u in honest)
    agg = aggregate(peers, sent, samples, "sparse-clip", max_samples=SAMPLES)
    assert _dist(agg.update, reference) <= spread


def test_the_plain_mean_is_taken_over_by_a_scaled_update_so_the_check_above_can_fail() -> None:
    honest, sent, samples, peers = _attacked("scale:50", 3)
    reference = weighted_mean(honest, [SAMPLES] * 3)
    spread = max(_dist(u, reference) for u in honest)
    assert _dist(aggregate(peers, sent, samples, "mean", max_samples=SAMPLES).update, reference) > 5 * spread


@pytest.mark.parametrize("method", METHODS)
def test_a_claimed_sample_count_is_capped_in_every_aggregator(method: str) -> None:
    """A peer claiming 10⁹ samples weighs as much as an honest full round, whatever the method."""
    honest = _honest(4)
    lying = aggregate(list("abcd"), honest, [SAMPLES, SAMPLES, SAMPLES, LYING_SAMPLES], method, max_samples=SAMPLES)
    fair = aggregate(list("abcd"), honest, [SAMPLES] * 4, method, max_samples=SAMPLES)
    for x, y in zip(lying.update, fair.update):
        assert torch.equal(x, y)
    assert lying.capped == {"d": LYING_SAMPLES} and not fair.capped


def test_a_count_lie_cannot_hide_a_large_update_from_the_norm_screen() -> None:
    """Norms are compared per capped sample: 10⁹ claimed samples do not make a 1000× update look small."""
    honest = _honest(3)
    huge = [[t * 1000 for t in honest[0]]]
    agg = aggregate(list("abcz"), honest + huge, [SAMPLES] * 3 + [LYING_SAMPLES], "mean", max_samples=SAMPLES)
    assert agg.dropped == {"z": "norm_outlier"}


def test_centered_clip_leaves_honest_updates_close_to_their_mean_and_is_bit_identical() -> None:
    honest = _honest(6, seed=3)
    mean = weighted_mean(honest, [SAMPLES] * 6)
    first = aggregate([f"p{i}" for i in range(6)], honest, [SAMPLES] * 6, "centered-clip")
    again = aggregate([f"p{i}" for i in range(6)], [[t.clone() for t in u] for u in honest], [SAMPLES] * 6, "centered-clip")
    assert all(torch.equal(x, y) for x, y in zip(first.update, again.update))
    assert _dist(first.update, mean) < 0.1 * _norm(mean)


@pytest.mark.parametrize("attack", ["scale:50", "samples", "noise"])
def test_centered_clip_of_two_clips_each_to_the_smaller_norm(attack: str) -> None:
    """No majority exists between two peers: neither moves the model more than the other would."""
    honest, sent, samples, peers = _attacked(attack, 1)
    agg = aggregate(peers, sent, samples, "centered-clip", max_samples=SAMPLES)
    assert _norm(agg.update) <= _norm(honest[0]) * (1 + 1e-5)


def test_attacks_rewrite_as_documented() -> None:
    delta = _honest(1)[0]
    assert Attacker(parse_attacks("samples")).contribution(delta, 8)[1] == LYING_SAMPLES
    scaled, n = Attacker(parse_attacks("scale:3")).contribution(delta, 8)
    assert n == 8 and all(torch.equal(s, d * 3) for s, d in zip(scaled, delta))
    assert all(torch.equal(s, -d) for s, d in zip(Attacker(parse_attacks("sign")).contribution(delta, 8)[0], delta))
    noise = Attacker(parse_attacks("noise"), seed=4).contribution(delta, 8)[0]
    assert abs(_norm(noise) - _norm(delta)) < 1e-4 * _norm(delta) and _dist(noise, delta) > 0.5 * _norm(delta)
    concentrated = Attacker(parse_attacks("concentrate")).contribution(delta, 8)[0]
    assert abs(_norm(concentrated) - _norm(delta)) < 1e-3 * _norm(delta)
    assert all(int((t != 0).sum()) == max(1, t.numel() // 100) for t in concentrated)
    honest = _honest(3, seed=9)
    ipm = Attacker(parse_attacks("ipm:0.5")).contribution(delta, 8, honest=honest)[0]
    mean = [torch.stack([u[i] for u in honest]).mean(0) for i in range(2)]
    assert all(torch.allclose(x, -0.5 * m) for x, m in zip(ipm, mean))
    alie = Attacker(parse_attacks("alie:1")).contribution(delta, 8, honest=honest)[0]
    std = [torch.stack([u[i] for u in honest]).std(0, unbiased=False) for i in range(2)]
    assert all(torch.allclose(a, m - s) for a, m, s in zip(alie, mean, std))


def test_stale_replays_an_old_update() -> None:
    attacker = Attacker(parse_attacks("stale:2"))
    rounds = [_honest(1, seed=s)[0] for s in range(4)]
    sent = [attacker.contribution(r, 8)[0] for r in rounds]
    assert all(torch.equal(x, -y) for x, y in zip(sent[0], rounds[0]))  # no history yet: the opposite
    assert all(torch.equal(x, y) for x, y in zip(sent[3], rounds[1]))  # two rounds back


@pytest.mark.parametrize("spec, message", [("krum", "unknown attack"), ("sign:2", "takes no parameter"),
                                           ("scale:x", "not a number"), ("", "no attack"), ("scale:inf", "finite"),
                                           ("stale:16", "from 1 to 15"), ("stale:0", "from 1 to 15"), ("stale:2.5", "whole number")])
def test_attack_specs_are_checked(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_attacks(spec)


def test_an_open_swarm_aggregates_robustly_by_default(tmp_path) -> None:
    key = tmp_path / "swarm.key"
    key.write_text("ab" * 32)
    assert NodeConfig().aggregation == "centered-clip"
    assert NodeConfig(algorithm="sparseloco").aggregation == "sparse-clip"
    assert NodeConfig(algorithm="noloco").aggregation == "centered-clip"
    assert NodeConfig(swarm_key=key).aggregation == "mean"
    assert NodeConfig(swarm_key=key, algorithm="sparseloco").aggregation == "sparse-mean"
    assert NodeConfig(aggregate="trimmed-mean").aggregation == "trimmed-mean"


def test_round_sample_cap_follows_the_run() -> None:
    assert NodeConfig(batch_size=8, inner_steps=25).max_round_samples == 200
    assert NodeConfig(batch_size=8, inner_steps="auto", round_steps=10).max_round_samples == 8 * 10 * 20


def test_attacks_are_for_replicas_stage_replicas_and_pipeline_trainers() -> None:
    with pytest.raises(ValueError, match="--attack in a pipeline rewrites a stage replica's round"):
        NodeConfig(attack="sign", stages=2, model="micro")
    with pytest.raises(ValueError, match="--attack"):
        NodeConfig(attack="sign", algorithm="zo")
    assert NodeConfig(attack="samples", stages=2, role="stage", stage=1, model="micro").attack == "samples"
    assert NodeConfig(attack="activations:1000", stages=2, role="trainer", model="micro").attack == "activations:1000"
    for wrong in ({"stages": 1}, {"stages": 2, "role": "stage", "stage": 0}, {"stages": 2, "role": "auto"}):
        with pytest.raises(ValueError, match="a pipeline trainer's"):
            NodeConfig(attack="activations", model="micro", **wrong)
    with pytest.raises(ValueError, match="a pipeline trainer's"):
        NodeConfig(attack="activations,sign", stages=2, role="trainer", model="micro")


def test_protocol_attacks_leave_the_update_alone_and_lie_around_it() -> None:
    from gossip.byzantine import LYING_UP_MBIT, announced_up_mbit

    attacker = Attacker(parse_attacks("cap,future"))
    delta = [torch.ones(3)]
    sent, samples = attacker.contribution(delta, 7)
    assert torch.equal(sent[0], delta[0]) and samples == 7
    assert attacker.does("cap") and attacker.does("future") and not attacker.does("sign")
    assert announced_up_mbit("cap", 5.0) == LYING_UP_MBIT and announced_up_mbit("sign", 5.0) == 5.0
    assert announced_up_mbit(None, 0.0) == 0.0


def test_the_state_attack_serves_a_sign_flipped_copy_and_an_honest_node_serves_phi_as_it_is() -> None:
    from gossip.byzantine import served_params

    phi = [torch.randn(4, 3), torch.randn(2)]
    honest = served_params(phi, None)
    poisoned = served_params(phi, Attacker(parse_attacks("state,relayed")))
    assert all(torch.equal(h, p) and h.data_ptr() != p.data_ptr() for h, p in zip(honest, phi))
    assert all(torch.equal(x, -p) for x, p in zip(poisoned, phi))
    assert served_params(phi, Attacker(parse_attacks("relayed")))[0].equal(phi[0])
    sent, samples = Attacker(parse_attacks("state,relayed")).contribution(phi, 7)
    assert all(torch.equal(s, p) for s, p in zip(sent, phi)) and samples == 7  # the update itself stays honest

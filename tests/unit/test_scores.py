"""Contribution scores (gossip.scores) and the node's model scorer (node.replica.scoring)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.scores import ContributionScorer, PeerScores, Screen, screen
from gossip.state_transfer import DownloadedState, StateSnapshot
from node.config import NodeConfig
from node.replica.scoring import SCORE_SEED, ModelLoss, StateJudge, far_worse, score_rows, scoring_batches
from node.data.byte_corpus import load_embedded_corpus
from node.data.bytes import ByteBatches
from swarm.models.presets import PRESETS

TARGET = torch.tensor([1.0, -2.0, 0.5, 3.0])


def quadratic(phi: list[torch.Tensor]):
    """The loss ‖φ − Δ − target‖²: an update that moves φ toward the target lowers it."""

    def loss_at(update):
        point = phi[0] if update is None else phi[0] - update[0]
        return float((point - TARGET).pow(2).sum())

    return loss_at


def honest(phi: torch.Tensor, step: float, seed: int) -> list[torch.Tensor]:
    noise = torch.randn(4, generator=torch.Generator().manual_seed(seed)) * 0.05
    return [step * (phi - TARGET) + noise]  # Δ = φ − θ, θ a step toward the target


def test_a_sign_flipped_update_is_dropped_and_honest_ones_kept() -> None:
    phi = [torch.zeros(4)]
    updates = [honest(phi[0], 0.3, s) for s in range(3)] + [[-u for u in honest(phi[0], 0.3, 9)]]
    shown = screen(["a", "b", "c", "evil"], updates, quadratic(phi))
    assert shown.dropped == {"evil": "harmful_update"}
    assert shown.kept == ["a", "b", "c"]
    assert all(shown.gains[p] > 0 for p in "abc") and shown.gains["evil"] < 0


def test_honest_updates_are_all_kept() -> None:
    phi = [torch.zeros(4)]
    shown = screen(list("abcd"), [honest(phi[0], 0.2 + 0.1 * s, s) for s in range(4)], quadratic(phi))
    assert shown.dropped == {}


def test_a_non_finite_loss_drops_the_update() -> None:
    phi = [torch.zeros(4)]
    shown = screen(["a", "b", "nan"], [honest(phi[0], 0.3, 0), honest(phi[0], 0.3, 1), [torch.full((4,), math.nan)]], quadratic(phi))
    assert shown.dropped == {"nan": "harmful_update"}


def test_rounds_of_one_or_two_are_not_screened() -> None:
    phi = [torch.zeros(4)]
    alone = screen(["me"], [[-u for u in honest(phi[0], 0.3, 0)]], quadratic(phi))
    assert alone.dropped == {} and alone.gains == {} and alone.kept == ["me"]
    pair = screen(["me", "evil"], [honest(phi[0], 0.3, 0), [-u for u in honest(phi[0], 0.3, 1)]], quadratic(phi))
    assert pair.dropped == {} and pair.kept == ["me", "evil"]  # no majority to tell which one lies
    scorer = ContributionScorer(lambda round_no, phi: quadratic(phi))
    assert scorer(0, phi, {"me": [-u for u in honest(phi[0], 0.3, 0)]}).kept == ["me"]
    assert scorer.peers.snapshot() == {}


def test_no_change_in_the_loss_drops_nothing() -> None:
    shown = screen(["a", "b", "c"], [[torch.zeros(4)]] * 3, lambda update: 1.0)
    assert shown.scale == 0.0 and shown.dropped == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=3, max_size=8))
def test_the_screen_never_drops_an_update_that_lowers_the_loss_and_is_deterministic(gains: list[float]) -> None:
    updates = [[torch.tensor([g])] for g in gains]
    loss_at = lambda update: 10.0 if update is None else 10.0 - float(update[0])  # noqa: E731
    peers = [f"p{i}" for i in range(len(gains))]
    first, second = screen(peers, updates, loss_at), screen(peers, updates, loss_at)
    assert first.dropped == second.dropped
    assert all(first.gains[p] < 0 for p in first.dropped)
    scale = first.scale
    assert all(p in first.dropped for p, g in first.gains.items() if g < -0.5 * scale)


def test_peer_scores_decay_count_harm_and_stay_bounded() -> None:
    scores = PeerScores(decay=0.5, limit=3)
    scores.record(Screen(["a", "b"], {"a": 1.0, "b": -1.0}, 1.0, {"b": "harmful_update"}))
    scores.record(Screen(["a", "b"], {"a": 1.0, "b": -1.0}, 1.0, {"b": "harmful_update"}))
    snap = scores.snapshot()
    assert snap["a"]["score"] == 0.75 and snap["b"]["score"] == -0.75
    assert snap["b"]["harmful_rounds"] == 2 and snap["a"]["harmful_rounds"] == 0
    scores.record(Screen(["c", "d"], {"c": float("nan"), "d": 100.0}, 1.0, {"c": "harmful_update"}))
    assert len(scores.snapshot()) == 3 and "a" not in scores.snapshot()
    assert scores.snapshot()["d"]["score"] == 1.5  # a round adds at most ±3 units


def test_model_loss_evaluates_phi_and_phi_minus_an_update() -> None:
    cfg = PRESETS["nano"]
    corpus = load_embedded_corpus()
    batches = scoring_batches(ByteBatches(data=corpus.train, batch_size=score_rows(cfg.context), context=cfg.context, seed=SCORE_SEED))
    again = scoring_batches(ByteBatches(data=corpus.train, batch_size=score_rows(cfg.context), context=cfg.context, seed=SCORE_SEED))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))  # every member draws the same batches
    loss = ModelLoss(cfg, batches, torch.device("cpu"))
    torch.manual_seed(0)
    phi = [p.detach().clone() for p in loss.model.parameters()]
    loss_at = loss.loss_for(3, phi)
    base = loss_at(None)
    assert math.isfinite(base) and loss_at(None) == base
    zero = [torch.zeros_like(p) for p in phi]
    assert loss_at(zero) == base
    uphill = [p * 0 + 0.5 for p in phi]
    assert loss_at(uphill) != base
    scorer = ContributionScorer(loss.loss_for)
    shown = scorer(3, phi, {"zero": zero, "zero2": zero, "wild": [torch.randn_like(p) * 10 for p in phi]})
    assert "wild" in shown.dropped and "zero" not in shown.dropped
    assert scorer.peers.snapshot()["wild"]["harmful_rounds"] == 1


def test_a_state_judge_refuses_a_state_far_worse_than_its_own_and_takes_an_honest_neighbour() -> None:
    cfg = PRESETS["nano"]
    batches = scoring_batches(ByteBatches(data=load_embedded_corpus().train, batch_size=score_rows(cfg.context),
                                          context=cfg.context, seed=SCORE_SEED))
    loss = ModelLoss(cfg, batches, torch.device("cpu"))
    torch.manual_seed(0)
    own = [p.detach().clone() for p in loss.model.parameters()]
    judge = StateJudge(lambda: loss, lambda: own)

    def state(params: list[torch.Tensor]) -> DownloadedState:
        return DownloadedState(StateSnapshot(round=4, tensors={"params": params}, fingerprint="fp"), 0, "peer", 0)

    assert judge(state([p + 1e-4 * torch.randn_like(p) for p in own])) is None  # a neighbour's φ: a round's difference
    scaled = judge(state([p + 50 * 0.02 * torch.randn_like(p) for p in own]))  # φ + 50·Δ: a scaling attacker's own φ
    assert scaled is not None and "scoring batch" in scaled
    assert judge(state([p * float("nan") for p in own])) is not None


@given(own=st.floats(0, 20), theirs=st.floats(0, 20))
def test_far_worse_allows_a_margin_of_half_a_nat_or_a_tenth(own: float, theirs: float) -> None:
    refused = far_worse(own, theirs) is not None
    assert refused == (theirs > own + max(0.5, 0.1 * own))
    assert far_worse(own, math.nan) is not None and far_worse(own, math.inf) is not None


def test_scores_are_on_by_default_in_open_swarms_whose_rounds_gather_whole_updates() -> None:
    assert NodeConfig(algorithm="sparseloco").scores_contributions
    assert not NodeConfig(algorithm="diloco").scores_contributions  # dense centered-clip rounds reduce-scatter
    assert NodeConfig(algorithm="diloco", aggregate="median-clip").scores_contributions
    assert NodeConfig(algorithm="diloco", compression="topk:64/4096+q2").scores_contributions
    assert NodeConfig(algorithm="diloco").judges_states and NodeConfig(algorithm="sparseloco").judges_states
    assert not NodeConfig(algorithm="noloco").judges_states  # sparse: all-gather
    assert not NodeConfig(algorithm="noloco").scores_contributions
    with pytest.raises(ValueError, match="--contribution-scores on screens whole-model updates"):
        NodeConfig(algorithm="noloco", contribution_scores="on")
    assert not NodeConfig(algorithm="sparseloco", contribution_scores="off").scores_contributions
    assert NodeConfig(algorithm="diloco", contribution_scores="on").scores_contributions


def test_node_status_shows_the_median_of_the_other_peers_scores() -> None:
    from rich.console import Console

    from node.ops.status import _add_scores, status_table

    rows = [{"peer_id": p, "role": "trainer", "device": "cpu", "reachability": "public", "tokens_per_s": 1.0, "round": 1,
             "inner_step": 0, "loss": 2.0, "record_age_s": 1.0, "stage": -1, "version": "0.2.0", "protocol": 1} for p in "abcz"]
    live = [{"peer_id": "a", "peer_scores": {"b": {"score": 0.5}, "z": {"score": -1.0}}},
            {"peer_id": "b", "peer_scores": {"a": {"score": 0.25}, "z": {"score": -0.75}}},
            {"peer_id": "c", "peer_scores": {"a": {"score": 0.5}, "z": {"score": -0.5}, "b": {"score": float("nan")}}},
            {"peer_id": "z", "peer_scores": {"a": {"score": -9.0}, "z": {"score": 9.0}}}]  # a liar, about others and itself
    _add_scores(rows, live)
    scores = {r["peer_id"]: r["score"] for r in rows}
    assert scores == {"a": 0.25, "b": 0.5, "c": None, "z": -0.75}
    console = Console(width=200, record=True)
    console.print(status_table({"run_id": "r", "stages": [], "peers": rows}))
    text = console.export_text()
    assert "score" in text and "-0.75" in text and "+0.25" in text


def test_peer_scores_forget_the_least_recently_scored_and_show_the_most_recent() -> None:
    scores = PeerScores(limit=3)
    for peers in (("a", "b"), ("a",), ("c",), ("d",)):
        scores.record(Screen(list(peers), {p: 1.0 for p in peers}, 1.0))
    assert list(scores.snapshot()) == ["a", "c", "d"]  # b, scored least recently, went first
    many = PeerScores()
    many.record(Screen([], {f"p{i}": 1.0 for i in range(PeerScores.SHOWN + 10)}, 1.0))
    shown = many.snapshot()
    assert len(shown) == PeerScores.SHOWN and "p0" not in shown and f"p{PeerScores.SHOWN + 9}" in shown

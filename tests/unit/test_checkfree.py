"""CheckFree / CheckFree+ (pure parts): neighbour weighting, rebuilding, out-of-order execution,
loss detection and the chaos specs of ``node swarm``."""

import pytest
import torch

from node.ops.chaos import parse_chaos
from swarm.models.presets import preset
from swarm.checkfree import (lost_stages, neighbour_weights, rebuild_stage, recoverable, restore_from_replica,
                             swap_order)
from swarm.rebalance import plan_move
from swarm.stages import Stage

CFG = preset("micro")


def _stages(count: int, plus: bool = False) -> list[Stage]:
    stages = [Stage(CFG, i, count, seed=i + 10, plus=plus) for i in range(count)]  # distinct weights per stage
    return stages


def _block_params(stage: Stage) -> list[torch.Tensor]:
    return [p for n, p in stage.named_parameters() if n.startswith("blocks.")]


def test_equal_neighbour_norms_give_the_uniform_average():
    prev, _, nxt = _stages(3)
    a = rebuild_stage(CFG, 1, 3, 0, "checkfree", prev, nxt, norms=(2.0, 2.0))
    b = rebuild_stage(CFG, 1, 3, 0, "uniform", prev, nxt, norms=(5.0, 0.1))
    for x, y, p, q in zip(_block_params(a), _block_params(b), _block_params(prev), _block_params(nxt)):
        torch.testing.assert_close(x, y)
        torch.testing.assert_close(x, (p + q) / 2)


def test_weights_are_proportional_to_gradient_norms():
    assert neighbour_weights(3.0, 1.0) == pytest.approx((0.75, 0.25), rel=1e-4)
    assert neighbour_weights(0.0, 0.0) == pytest.approx((0.5, 0.5))  # + 1e-4 each: never divides by zero
    prev, _, nxt = _stages(3)
    rebuilt = rebuild_stage(CFG, 1, 3, 0, "checkfree", prev, nxt, norms=(3.0, 1.0))
    w_prev, w_next = neighbour_weights(3.0, 1.0)
    for x, p, q in zip(_block_params(rebuilt), _block_params(prev), _block_params(nxt)):
        torch.testing.assert_close(x, w_prev * p + w_next * q)


def test_copy_and_random_baselines():
    prev, middle, nxt = _stages(3)
    copied = rebuild_stage(CFG, 1, 3, 0, "copy", prev, nxt)
    assert all(torch.equal(x, p) for x, p in zip(_block_params(copied), _block_params(prev)))
    fresh = rebuild_stage(CFG, 1, 3, 0, "random")
    assert not any(torch.equal(x, p) for x, p in zip(_block_params(fresh), _block_params(prev)) if x.dim() == 2)
    with pytest.raises(ValueError, match="both neighbours"):
        rebuild_stage(CFG, 1, 3, 0, "checkfree", prev, None)


def test_checkfree_plus_restores_first_and_last_stage_from_replicas():
    stages = _stages(4, plus=True)
    assert stages[1].can_embed and stages[2].can_head and not stages[1].can_head
    first = restore_from_replica(CFG, 0, 4, 0, stages[1])
    assert torch.equal(first.tok_emb.weight, stages[1].tok_emb.weight)
    assert all(torch.equal(x, p) for x, p in zip(_block_params(first), _block_params(stages[1])))
    last = restore_from_replica(CFG, 3, 4, 0, stages[2])
    assert torch.equal(last.head.weight, stages[2].head.weight) and torch.equal(last.ln_f.weight, stages[2].ln_f.weight)
    with pytest.raises(ValueError, match="checkfree-plus"):
        restore_from_replica(CFG, 3, 4, 0, _stages(4)[2])
    tokens = torch.randint(0, 256, (2, 8))
    loss = first(tokens, embed=True, head=False)
    assert stages[2](stages[1](loss, embed=False), tokens, head=True).ndim == 0  # the replicas act as first/last stage


def test_a_rebuilt_stage_of_a_two_stage_pipeline_takes_both_its_parts_from_the_neighbour():
    """With two stages each holds the other's replica: the rebuilt stage's own replica (the head on stage
    0, the embeddings on stage 1) is the neighbour's trained original, not the run's initialisation."""
    stage0, stage1 = _stages(2, plus=True)
    with torch.no_grad():  # "trained": every parameter moved away from the shared initialisation
        for p in [*stage0.parameters(), *stage1.parameters()]:
            p.add_(torch.randn_like(p))
    first = restore_from_replica(CFG, 0, 2, 0, stage1)
    assert torch.equal(first.tok_emb.weight, stage1.tok_emb.weight)
    assert torch.equal(first.head.weight, stage1.head.weight) and torch.equal(first.ln_f.weight, stage1.ln_f.weight)
    last = restore_from_replica(CFG, 1, 2, 0, stage0)
    assert torch.equal(last.head.weight, stage0.head.weight) and torch.equal(last.tok_emb.weight, stage0.tok_emb.weight)
    fresh = Stage(CFG, 0, 2, seed=0, plus=True)
    assert not torch.equal(first.head.weight, fresh.head.weight), "the head replica is not the initialisation's"


def test_out_of_order_execution():
    assert swap_order(5, 0) == [0, 1, 2, 3, 4]
    assert swap_order(5, 1) == [1, 0, 2, 4, 3]
    assert swap_order(2, 1) == [1, 0]
    assert {tuple(swap_order(3, k)) for k in (1, 3)} == {(1, 0, 2), (0, 2, 1)}  # the two swaps take turns
    for s in range(1, 7):
        for k in range(6):
            assert sorted(swap_order(s, k)) == list(range(s))


def test_loss_detection_and_what_can_be_rebuilt():
    assert lost_stages([100.0, 80.0, None, 99.0], now=100.0, grace=10.0) == [1]
    assert recoverable([1], 4, plus=False) == {1: "checkfree"}
    assert recoverable([1, 2], 4, plus=False) == {1: "unrecoverable", 2: "unrecoverable"}  # adjacent
    assert recoverable([3], 4, plus=False) == {3: "unrecoverable"}
    assert recoverable([3], 4, plus=True) == {3: "copy-plus"}
    assert recoverable([0, 2], 4, plus=True) == {0: "copy-plus", 2: "checkfree"}


def test_chaos_specs():
    a = parse_chaos("kill:stage=1:at=60s")
    assert (a.target, a.value, a.at, a.next_t) == ("stage", 1, 60.0, 60.0)
    b = parse_chaos("kill:random:every=45")
    assert (b.target, b.every, b.next_t) == ("random", 45.0, 45.0)
    c = parse_chaos("pause:node=2:every=30s:for=8s")
    assert (c.kind, c.target, c.value, c.every, c.pause_s) == ("pause", "node", 2, 30.0, 8.0)
    assert parse_chaos("kill:node=1:at=3").kind == "kill"
    for bad in ("kill:stage=x:at=1", "kill:stage=1", "stop:node=1:at=3", "kill:node=1:at=3:every=4", "kill:node=1:at=-1s",
                "pause:node=1:every=10", "pause:node=1:every=10:for=10", "kill:node=1:at=3:for=2", "pause:node=1:for=2"):
        with pytest.raises(ValueError, match="--chaos"):
            parse_chaos(bad)


def test_nobody_moves_on_unmeasured_throughput():
    stages = [{"a": 10.0, "b": 10.0, "c": 10.0}, {"d": 0.0}]
    assert all(plan_move(stages, p) is None for p in "abcd")

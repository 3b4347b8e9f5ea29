"""The replica simulation behind the recipe benchmarks: one replica with η = 1 and no momentum is one
process (an exact identity), the one-process baseline sees the replicas' tokens, and gaps are taken
within a seed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.replica_gap import SINGLE, gaps, parse_outer, sparseloco_recipe
from benchmarks.replica_sim import Recipe, combine, replica_batches, simulate_diloco, simulate_single
from node.config import NodeConfig, steps_for_replicas
from node.data.byte_corpus import load_embedded_corpus
from node.data.bytes import validation_batches


@pytest.fixture(scope="module")
def corpus():
    return load_embedded_corpus()


def test_one_replica_with_a_plain_unit_outer_step_is_one_process(corpus) -> None:
    val = validation_batches(corpus.val, 16, 64, max_batches=2)
    recipe = Recipe(nodes=1, rounds=3, inner_steps=2, warmup_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    diloco = simulate_diloco(recipe, 0, corpus.train, val)
    single = simulate_single(recipe, 0, corpus.train, val)
    assert diloco["val_loss"] == single["val_loss"]
    moved = simulate_diloco(Recipe(nodes=1, rounds=3, inner_steps=2, warmup_steps=2, outer_lr=0.5, outer_momentum=0.0,
                                   nesterov=False), 0, corpus.train, val)
    assert moved["val_loss"] != single["val_loss"]  # the identity is not a constant


def test_the_one_process_batch_is_every_replicas_batch(corpus) -> None:
    recipe = Recipe(nodes=3)
    a, b = replica_batches(recipe, 2, corpus.train), replica_batches(recipe, 2, corpus.train)
    assert [s.seed for s in a] == [200, 201, 202]
    assert all(torch.equal(x.next()[0], y.next()[0]) for x, y in zip(a, b))
    assert not torch.equal(a[0].next()[0], a[1].next()[0])


def test_gaps_are_ratios_within_a_seed() -> None:
    rows = [{"nodes": 2, "config": SINGLE, "seed": 0, "val_loss": 2.0}, {"nodes": 2, "config": SINGLE, "seed": 1, "val_loss": 3.0},
            {"nodes": 2, "config": "x", "seed": 0, "val_loss": 2.2}, {"nodes": 2, "config": "x", "seed": 1, "val_loss": 3.0}]
    row = next(r for r in gaps(rows) if r["config"] == "x")
    assert (row["gap_mean"], row["gap_min"], row["gap_max"]) == (0.05, 0.0, 0.1)
    assert row["val_loss_mean"] == 2.6


def test_outer_specs_parse_or_say_what_is_wrong() -> None:
    assert parse_outer("0.7:0.9") == (0.7, 0.9, True, 0)
    assert parse_outer("1:0:plain") == (1.0, 0.0, False, 0)
    assert parse_outer("0.7:0.9:w5") == (0.7, 0.9, True, 5)
    for bad in ("1", "1:0:nesterov", "1:0:w"):
        with pytest.raises(ValueError, match="η:μ"):
            parse_outer(bad)


def test_the_simulation_combines_updates_as_a_node_does() -> None:
    torch.manual_seed(0)
    updates = [[torch.randn(6, 4), torch.randn(3)] for _ in range(5)]
    plain = combine(Recipe(aggregate="mean"), updates)
    clipped = combine(Recipe(aggregate="centered-clip"), updates)
    assert all(torch.allclose(a, b) for a, b in zip(combine(Recipe(aggregate="mean"), [updates[0]] * 5), updates[0]))
    assert not all(torch.allclose(a, b) for a, b in zip(plain, clipped))  # the robust method really runs
    liar = updates[:4] + [[t * 1e3 for t in updates[4]]]
    assert max(float(t.abs().max()) for t in combine(Recipe(aggregate="centered-clip"), liar)) < 10


def test_sparseloco_runs_at_a_nodes_defaults() -> None:
    cfg = NodeConfig(algorithm="sparseloco")
    for nodes in (2, 8):
        recipe = sparseloco_recipe(Recipe(rounds=20, inner_steps=30), nodes)
        h = steps_for_replicas(nodes, "sparseloco")
        assert (recipe.nodes, recipe.inner_steps, recipe.rounds) == (nodes, h, 600 // h)
        assert (recipe.codec, recipe.aggregate) == (cfg.codec, cfg.aggregation)
        assert (recipe.outer_lr, recipe.outer_momentum, recipe.feedback_decay) == (*cfg.outer_hyper, cfg.feedback_decay())


def test_the_plot_draws_every_recipe_from_a_summary(tmp_path) -> None:
    from benchmarks.replica_gap import plot

    summary = [{"nodes": n, "config": c, "gap_mean": g, "gap_min": g - 0.01, "gap_max": g + 0.01}
               for n in (2, 8) for c, g in ((SINGLE, 0.0), ("H50 η1 μ0.7", 0.02 * n))]
    plot(summary, tmp_path / "gap.png")
    assert (tmp_path / "gap.png").stat().st_size > 1000

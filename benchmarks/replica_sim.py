"""In-process simulation of N DiLoCo replicas, and of one process trained on the same tokens.

Used by the benchmarks that compare training recipes without a network (``benchmarks.inner_optimizer``,
``benchmarks.replica_gap``): the averaging is exact, so what differs between two runs is the recipe
(inner optimizer, lr schedule, codec, outer η and μ, H), never a straggler or a lost round.

A run is built from the pieces a node uses: ``LocalTrainer`` (inner optimizer and lr schedule as a node
builds them), the embedded corpus (replica i draws ``ByteBatches`` seeded ``100·seed + i``, every
replica starts from the same initialisation), the codec with the node's error feedback, the mean (or the node's robust
aggregation, ``gossip.aggregate``) of the decoded pseudo-gradients and ``NesterovOuter``. ``simulate_single`` trains one model on the
concatenation of the N replicas' batches, step for step: the same tokens in the same order, N× the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from compression import get_codec
from compression.feedback import ErrorFeedback
from gossip.aggregate import aggregate
from gossip.outer import NesterovOuter
from node.data.bytes import ByteBatches
from node.runtime.local_training import LocalTrainer
from swarm.lr_schedule import LrSchedule
from swarm.models.presets import PRESETS

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Recipe:
    """What one simulated run trains with. ``rounds * inner_steps`` inner steps per replica."""

    model: str = "nano"
    nodes: int = 2
    rounds: int = 15
    inner_steps: int = 20
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 30
    schedule: str = "constant"
    lr_floor: float = 0.1
    optimizer: str = "adamw"
    codec: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outer_warmup_rounds: int = 0
    feedback_decay: float = 0.0
    aggregate: str = "mean"  # gossip.aggregate's method; a node's default is centered-clip (sparse-clip for top-k)

    @property
    def total_steps(self) -> int:
        return self.rounds * self.inner_steps

    def lr_schedule(self) -> LrSchedule:
        return LrSchedule(self.schedule, self.warmup_steps, self.total_steps, self.lr_floor)  # type: ignore[arg-type]


def replica_batches(recipe: Recipe, seed: int, train: torch.Tensor) -> list[ByteBatches]:
    """Replica i's batch stream in run ``seed``: the same for DiLoCo and for the one-process baseline."""
    context = PRESETS[recipe.model].context
    return [ByteBatches(data=train, batch_size=recipe.batch_size, context=context, seed=seed * 100 + i)
            for i in range(recipe.nodes)]


def _trainer(recipe: Recipe, seed: int, optimizer: str) -> LocalTrainer:
    return LocalTrainer(cfg=PRESETS[recipe.model], device=torch.device("cpu"), lr=recipe.lr, schedule=recipe.lr_schedule(),
                        inner_optimizer=optimizer, seed=1000 + seed)


def combine(recipe: Recipe, decoded: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The round's update from every replica's decoded pseudo-gradient: the plain mean, or the node's
    ``gossip.aggregate`` method (each replica claiming the round's full samples, as an honest node does)."""
    if recipe.aggregate == "mean":
        return [torch.stack(ts).mean(0) for ts in zip(*decoded)]
    samples = recipe.batch_size * recipe.inner_steps
    return aggregate([f"replica-{i}" for i in range(len(decoded))], decoded, [samples] * len(decoded), recipe.aggregate,
                     max_samples=samples).update


def simulate_diloco(recipe: Recipe, seed: int, train: torch.Tensor, val: Batches, eval_every: int = 5) -> dict[str, Any]:
    """One DiLoCo run of ``recipe.nodes`` replicas; returns φ's held-out loss after the last round, a curve
    (held-out loss on the first 4 batches every ``eval_every`` rounds) and the bytes one node sends a round."""
    trainers = [_trainer(recipe, seed, recipe.optimizer) for _ in range(recipe.nodes)]
    data = replica_batches(recipe, seed, train)
    phi = [p.detach().clone() for p in trainers[0].parameters()]
    outer = NesterovOuter(recipe.outer_lr, recipe.outer_momentum, nesterov=recipe.nesterov,
                          warmup_rounds=recipe.outer_warmup_rounds)
    codec = get_codec(recipe.codec)
    feedback = [[ErrorFeedback(recipe.feedback_decay) for _ in phi] for _ in range(recipe.nodes)]
    sent_bytes, curve, t0 = 0, [], time.time()
    for r in range(recipe.rounds):
        decoded = []
        for i, (trainer, batches) in enumerate(zip(trainers, data)):
            trainer.load_weights(phi)
            for _ in range(recipe.inner_steps):
                trainer.step(*batches.next())
            delta = [p.detach() - t.detach() for p, t in zip(phi, trainer.parameters())]
            if recipe.codec == "none":
                sent_bytes += sum(d.numel() * 4 for d in delta)
                decoded.append(delta)
                continue
            mine = []
            for d, ef in zip(delta, feedback[i]):
                payload = codec.encode(d, state=ef if recipe.feedback_decay > 0 else None)
                sent_bytes += len(payload.to_bytes())
                mine.append(codec.decode(payload))
            decoded.append(mine)
        outer.step(phi, combine(recipe, decoded), round_no=r)
        if (r + 1) % eval_every == 0 and r + 1 < recipe.rounds:
            trainers[0].load_weights(phi)
            curve.append(round(trainers[0].evaluate(val[:4]), 4))
    trainers[0].load_weights(phi)
    return {"val_loss": trainers[0].evaluate(val), "val_curve_4_batches": curve,
            "bytes_per_node_round": sent_bytes / (recipe.nodes * recipe.rounds), "inner_steps_per_node": recipe.total_steps,
            "seconds": round(time.time() - t0, 1)}


def simulate_single(recipe: Recipe, seed: int, train: torch.Tensor, val: Batches, eval_every: int = 5) -> dict[str, Any]:
    """One process on the same tokens as ``simulate_diloco(recipe, seed, …)``: step s trains on the
    concatenation of every replica's batch s (N× the batch), with the recipe's inner optimizer, lr and
    schedule, for ``recipe.total_steps`` steps. The curve is sampled at the same token counts as DiLoCo's."""
    trainer = _trainer(recipe, seed, recipe.optimizer)
    data = replica_batches(recipe, seed, train)
    curve, t0 = [], time.time()
    for step in range(recipe.total_steps):
        pairs = [b.next() for b in data]
        trainer.step(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))
        done = step + 1
        if done % (eval_every * recipe.inner_steps) == 0 and done < recipe.total_steps:
            curve.append(round(trainer.evaluate(val[:4]), 4))
    return {"val_loss": trainer.evaluate(val), "val_curve_4_batches": curve, "bytes_per_node_round": 0,
            "inner_steps_per_node": recipe.total_steps, "seconds": round(time.time() - t0, 1)}

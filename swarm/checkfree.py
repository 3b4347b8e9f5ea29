"""Rebuilding a pipeline stage that lost every replica, without a checkpoint (Blagoev et al. 2025,
CheckFree and CheckFree+, https://arxiv.org/abs/2506.15461).

- ``checkfree``: intermediate stage i ← (ω_{i−1}·W_{i−1} + ω_{i+1}·W_{i+1}) / (ω_{i−1} + ω_{i+1}), ω_j the
  neighbour's last gradient norm + 1e-4 (from its DHT announcement), block by block.
- ``uniform``: the same with ω = 1 (the paper's ablation), ``copy``: the previous neighbour's blocks,
  ``random``: a fresh initialisation (the baselines CheckFree is measured against).
- ``copy-plus`` (CheckFree+): a lost first or last stage is restored from its neighbour, which holds a
  replica of the embeddings (stage 1) or of the final norm and head (stage S−2) and has learned to act
  as first/last stage through out-of-order microbatches (``swap_order``).

Block j of the rebuilt stage is made from block min(j, n−1) of each neighbour, so stages of unequal
block counts work. Two adjacent lost stages cannot be rebuilt this way.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from swarm.models.presets import ModelConfig
from swarm.stages import Stage

METHODS = ("checkfree", "uniform", "copy", "random")
EPS = 1e-4
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def neighbour_weights(norm_prev: float, norm_next: float, gradient_weighted: bool = True) -> tuple[float, float]:
    """Normalised (w_prev, w_next)."""
    if not gradient_weighted:
        return 0.5, 0.5
    a, b = max(norm_prev, 0.0) + EPS, max(norm_next, 0.0) + EPS
    return a / (a + b), b / (a + b)


def _blocks(stage: Stage) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in stage.blocks]
    for name, p in stage.named_parameters():
        m = _BLOCK.match(name)
        if m:
            out[int(m.group(1))][m.group(2)] = p.detach()
    return out


@torch.no_grad()
def rebuild_stage(
    cfg: ModelConfig, index: int, count: int, seed: int, method: str,
    prev: Stage | None = None, next_: Stage | None = None, norms: tuple[float, float] = (1.0, 1.0), plus: bool = False,
) -> Stage:
    """A new stage ``index`` built from its neighbours (``prev`` = stage index−1, ``next_`` = index+1)."""
    if method not in METHODS:
        raise ValueError(f"unknown recovery method {method!r}; choose one of {', '.join(METHODS)}")
    stage = Stage(cfg, index, count, seed, plus=plus)
    if method == "random":
        return stage
    if method == "copy":
        sources, weights = [prev if prev is not None else next_], [1.0]
    else:
        if prev is None or next_ is None:
            raise ValueError(f"{method} rebuilds an intermediate stage from both neighbours; stage {index} lacks one")
        sources, weights = [prev, next_], list(neighbour_weights(*norms, gradient_weighted=method == "checkfree"))
    if sources[0] is None:
        raise ValueError(f"stage {index} has no neighbour to copy")
    neighbour_blocks = [_blocks(s) for s in sources]  # type: ignore[arg-type]
    for j, block in enumerate(_blocks(stage)):
        for name, target in block.items():
            mixed = sum(w * nb[min(j, len(nb) - 1)][name].float() for w, nb in zip(weights, neighbour_blocks))
            target.copy_(mixed)
    return stage


@torch.no_grad()
def restore_from_replica(cfg: ModelConfig, index: int, count: int, seed: int, neighbour: Stage, plus: bool = True) -> Stage:
    """CheckFree+: a lost first (last) stage ← its neighbour's blocks and its replica of the
    embeddings (final norm and head). In a two-stage pipeline the rebuilt stage also holds a replica of
    its neighbour's own head (embeddings), used on out-of-order microbatches: that is copied from the
    neighbour too, never left at the run's initialisation (a random head's gradients on every other
    microbatch pull the rebuilt blocks away from the model they were copied from)."""
    stage = rebuild_stage(cfg, index, count, seed, "copy", prev=neighbour, plus=plus)
    required = ("tok_emb", "pos_emb") if stage.first else ("ln_f", "head")
    for name in required:
        if hasattr(stage, name) and not hasattr(neighbour, name):
            raise ValueError(f"stage {neighbour.index} holds no replica of {name}: was the swarm run with --checkfree-plus?")
    for name in ("tok_emb", "pos_emb", "ln_f", "head"):
        if hasattr(stage, name) and hasattr(neighbour, name):
            for target, source in zip(getattr(stage, name).parameters(), getattr(neighbour, name).parameters()):
                target.copy_(source)
    return stage


def swap_order(stages: int, microbatch: int) -> list[int]:
    """CheckFree+ execution order of stages for a microbatch: odd microbatches run stage 1 before 0
    and S−1 before S−2 (with three stages the two swaps take turns, as they share stage 1)."""
    order = list(range(stages))
    if microbatch % 2 == 0 or stages < 2:
        return order
    if stages == 2:
        return [1, 0]
    swap_first = stages >= 4 or (microbatch // 2) % 2 == 0
    swap_last = stages >= 4 or not swap_first
    if swap_first:
        order[0], order[1] = order[1], order[0]
    if swap_last:
        order[-1], order[-2] = order[-2], order[-1]
    return order


def lost_stages(seen: Sequence[float | None], now: float, grace: float) -> list[int]:
    """Stages that had a server once but none for ``grace`` seconds (``seen``: last time each was served)."""
    return [s for s, t in enumerate(seen) if t is not None and now - t > grace]


def recoverable(lost: Sequence[int], stages: int, plus: bool) -> dict[int, str]:
    """How each lost stage can come back: ``checkfree`` (intermediate, both neighbours alive),
    ``copy-plus`` (first/last stage with CheckFree+, its neighbour alive), or ``unrecoverable``."""
    gone = set(lost)
    out = {}
    for s in lost:
        if 0 < s < stages - 1 and s - 1 not in gone and s + 1 not in gone:
            out[s] = "checkfree"
        elif plus and s == 0 and stages > 1 and 1 not in gone:
            out[s] = "copy-plus"
        elif plus and s == stages - 1 and stages > 1 and stages - 2 not in gone:
            out[s] = "copy-plus"
        else:
            out[s] = "unrecoverable"
    return out

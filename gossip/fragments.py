"""Streaming DiLoCo (Douillard et al. 2025, https://arxiv.org/abs/2501.18512): the parameters are cut
into P fragments that synchronise in rotation, so each exchange carries 1/P of the model.

Fragments interleave transformer blocks (block b belongs to fragment b mod P) and fragment 0 also
owns everything outside the blocks (embeddings, final norm, head). Outer round r synchronises
fragment r mod P and comes every H/P inner steps, so each fragment still syncs every H steps; with
P = 1 this is plain DiLoCo. When a round's result arrives after τ more local steps (overlap), the
fragment is merged as θ_f ← (1 − α)·φ_f + α·θ_f (α = 0 replaces the local weights).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from gossip.placement import settle

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")


def assign_fragments(names: Sequence[str], fragments: int) -> list[list[int]]:
    """Parameter indices of each fragment; every index appears in exactly one fragment."""
    if fragments < 1:
        raise ValueError(f"need at least 1 fragment, got {fragments}")
    out: list[list[int]] = [[] for _ in range(fragments)]
    for i, name in enumerate(names):
        match = _BLOCK.search(name)
        out[int(match.group(1)) % fragments if match else 0].append(i)
    empty = [f for f, members in enumerate(out) if not members]
    if empty:
        blocks = len({m.group(1) for m in map(_BLOCK.search, names) if m})
        raise ValueError(f"--fragments {fragments} leaves fragments {empty} empty: the model has {blocks} blocks")
    return out


def fragment_of_round(round_no: int, fragments: int) -> int:
    return round_no % fragments


def sync_interval(inner_steps: int, fragments: int) -> int:
    """Inner steps between two outer rounds (H/P, at least 1)."""
    return max(1, inner_steps // fragments)


@torch.no_grad()
def merge_fragment(local: Sequence[torch.Tensor], synced: Sequence[torch.Tensor], alpha: float,
                   start: Sequence[torch.Tensor] | None = None) -> None:
    """θ_f ← (1 − α)·φ_f + α·θ_f in place on ``local``. Copies from (pinned) host memory to a CUDA model
    are issued without blocking and waited for once, so ``synced`` may be stepped again afterwards.

    ``start``: θ_f when the round began, for a round that ran beside training (``--overlap``). Then
    θ_f ← θ_f + (1 − α)·(φ_f − θ_f,start): the inner steps taken meanwhile stay on top of the agreed φ
    (a one-step-delayed outer update) and enter the next round's Δ; with no step in between it is the
    merge above, up to rounding."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"fragment merge α must lie in [0, 1], got {alpha}")
    if start is not None:
        for t, p, s in zip(local, synced, start):
            t.add_((p.float() - s.float()).to(t.device, t.dtype), alpha=1 - alpha)
        return
    for t, p in zip(local, synced):
        if alpha == 0:
            t.copy_(p, non_blocking=True)
        else:
            t.mul_(alpha).add_(p.to(t.device, t.dtype, non_blocking=True), alpha=1 - alpha)
    settle(local)

"""Outer optimizers of DiLoCo-style training (Douillard et al. 2023, https://arxiv.org/abs/2311.08105).

Notation (shared/design/ALGORITHMS.md): φ = the slow weights the group last agreed on, θ = the
fast weights after the inner steps, Δ = φ − θ (the pseudo-gradient). The DiLoCo outer step is SGD
with Nesterov momentum on Δ, torch form::

    v ← μ·v + Δ
    φ ← φ − η·(Δ + μ·v)      (nesterov)     or     φ ← φ − η·v     (heavy ball)

Pure tensor math with explicit state: callers own the lists of tensors, tests can drive it step by step.
"""

from __future__ import annotations

from typing import Sequence

import torch


class NesterovOuter:
    """SGD with (Nesterov) momentum over a list of parameter tensors.

    :param lr: outer learning rate η (DiLoCo default 0.7)
    :param momentum: μ (default 0.9); 0 gives plain outer SGD
    :param nesterov: Nesterov (default, as in DiLoCo) or heavy-ball momentum
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got lr={lr}, momentum={momentum}")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buffers: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]) -> None:
        """Update ``phi`` in place from the (averaged) pseudo-gradient ``delta``."""
        if len(phi) != len(delta):
            raise ValueError(f"{len(phi)} parameters but {len(delta)} pseudo-gradients")
        if self.buffers is None:
            self.buffers = [torch.zeros_like(p, dtype=torch.float32) for p in phi]
        for p, d, v in zip(phi, delta, self.buffers):
            d = d.to(v.dtype)
            v.mul_(self.momentum).add_(d)
            update = d.add(v, alpha=self.momentum) if self.nesterov else v
            p.sub_(update.to(p.dtype), alpha=self.lr)

    def state_tensors(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Momentum buffers (zeros before the first step), for checkpoints and state transfer."""
        if self.buffers is None:
            return [torch.zeros_like(p, dtype=torch.float32) for p in like]
        return [b.clone() for b in self.buffers]

    def load_state_tensors(self, buffers: Sequence[torch.Tensor]) -> None:
        self.buffers = [b.detach().to(torch.float32).clone() for b in buffers]


@torch.no_grad()
def weighted_mean(updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Σ_i w_i·Δ_i / Σ_i w_i, summed in the given order (callers fix a canonical order so that every
    member of a group obtains bit-identical results)."""
    if not updates or len(updates) != len(weights):
        raise ValueError("need one weight per update and at least one update")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    out = [torch.zeros_like(t, dtype=torch.float32) for t in updates[0]]
    for update, w in zip(updates, weights):
        for acc, t in zip(out, update):
            acc.add_(t.to(torch.float32), alpha=w / total)
    return out


def pseudo_gradient(phi: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = φ − θ in fp32."""
    return [p.detach().float() - t.detach().float() for p, t in zip(phi, theta)]

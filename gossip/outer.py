"""Outer optimizers of DiLoCo-style training (Douillard et al. 2023, https://arxiv.org/abs/2311.08105)
and NoLoCo (Kolehmainen et al. 2025, https://arxiv.org/abs/2506.10911).

Notation (shared/design/ALGORITHMS.md): φ = the slow weights the group last agreed on, θ = the
fast weights after the inner steps, Δ = φ − θ (the pseudo-gradient). The DiLoCo outer step is SGD
with Nesterov momentum on Δ, torch form::

    v ← μ·v + Δ
    φ ← φ − η·(Δ + μ·v)      (nesterov)     or     φ ← φ − η·v     (heavy ball)

NoLoCo averages in small groups G and pulls each member toward the group's mean weights, with
u_j = θ_j − φ_j = −Δ_j::

    δ ← α·δ + β·ū + γ·(φ̄ − φ)      φ ← φ + δ

Optimizer state lives per parameter index, so streaming DiLoCo can step one fragment (a subset of
the parameters) at a time: ``step(..., indices=[...])`` names the parameters the lists hold.
Pure tensor math with explicit state: callers own the tensors, tests can drive it step by step.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


class _IndexedState:
    """One fp32 buffer per parameter index, created (as zeros) on first use. ``before_change``, when set, is
    called before a step or a load changes φ or the buffers (a replica withdraws the state it offers joiners:
    ``gossip.state_server``)."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.before_change: Callable[[], None] | None = None

    def _changing(self) -> None:
        if self.before_change is not None:
            self.before_change()

    def _buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer of parameter ``index``, on ``like``'s device: the state follows φ (``gossip.placement``)."""
        buf = self.buffers.get(index)
        if buf is None or buf.shape != like.shape:
            buf = self.buffers[index] = torch.zeros_like(like, dtype=torch.float32)
        elif buf.device != like.device:
            buf = self.buffers[index] = buf.to(like.device)
        return buf

    def state_tensors(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of the buffers of every parameter (zeros where none was stepped yet), for
        checkpoints and state transfer."""
        return [self.buffers[i].to("cpu", copy=True) if i in self.buffers else torch.zeros(tuple(p.shape), dtype=torch.float32)
                for i, p in enumerate(like)]

    def load_state_tensors(self, buffers: Sequence[torch.Tensor]) -> None:
        self._changing()
        self.buffers = {i: b.detach().to(torch.float32).clone() for i, b in enumerate(buffers)}


def _indices(indices: Sequence[int] | None, n: int) -> Sequence[int]:
    if indices is None:
        return range(n)
    if len(indices) != n:
        raise ValueError(f"{n} tensors but {len(indices)} parameter indices")
    return indices


class NesterovOuter(_IndexedState):
    """SGD with (Nesterov) momentum over a list of parameter tensors.

    :param lr: outer learning rate η (DiLoCo default 0.7)
    :param momentum: μ (default 0.9); 0 gives plain outer SGD (SparseLoCo's EF-SGD step)
    :param nesterov: Nesterov (default, as in DiLoCo) or heavy-ball momentum
    :param warmup_rounds: W: round r (counted from the run's start, the same on every member) steps at
        η·min(1, (r + 1)/W); 0 steps at η from the first round
    :param first_round: the number of the run's first round (pipeline stages number their rounds by
        wall-clock epoch, so their warm-up counts from the epoch the stage first averaged in)
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, warmup_rounds: int = 0,
                 first_round: int = 0) -> None:
        super().__init__()
        if lr <= 0 or not 0 <= momentum < 1 or warmup_rounds < 0:
            raise ValueError(f"outer lr must be > 0, momentum in [0, 1) and warm-up rounds ≥ 0, got lr={lr}, "
                             f"momentum={momentum}, warmup_rounds={warmup_rounds}")
        self.lr, self.momentum, self.nesterov, self.warmup_rounds = lr, momentum, nesterov, warmup_rounds
        self.first_round = first_round

    def lr_at(self, round_no: int | None) -> float:
        """η in force in round ``round_no`` (None: after the warm-up)."""
        if round_no is None or not self.warmup_rounds:
            return self.lr
        return self.lr * min(1.0, (max(round_no - self.first_round, 0) + 1) / self.warmup_rounds)

    @torch.no_grad()
    def step(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], indices: Sequence[int] | None = None,
             round_no: int | None = None, split: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None = None) -> None:
        """Update ``phi`` in place from the (averaged) pseudo-gradient ``delta`` of round ``round_no``.

        :param split: ``delta`` comes in wire parts, and ``split`` cuts a list of tensors shaped like ``phi`` into
            *views* of the same parts: φ and the momentum are stepped part by part, so the parts need not be
            joined into a copy of the model first
        """
        if split is None and len(phi) != len(delta):
            raise ValueError(f"{len(phi)} parameters but {len(delta)} pseudo-gradients")
        self._changing()
        buffers = [self._buffer(i, p) for i, p in zip(_indices(indices, len(phi)), phi)]
        if split is not None:
            phi, buffers = split(phi), split(buffers)
            if len(phi) != len(delta):
                raise ValueError(f"{len(phi)} parts of the parameters but {len(delta)} of the pseudo-gradient")
        lr = self.lr_at(round_no)
        for p, v, d in zip(phi, buffers, delta):
            d = d.to(v.device, v.dtype)
            v.mul_(self.momentum).add_(d)
            if not self.nesterov:
                p.sub_(v.to(p.dtype), alpha=lr)
            elif p.dtype == v.dtype:  # φ − lr·(d + μv) in two passes, without a temporary the size of the model
                p.sub_(d, alpha=lr).sub_(v, alpha=lr * self.momentum)
            else:
                p.sub_(d.add(v, alpha=self.momentum).to(p.dtype), alpha=lr)


    @torch.no_grad()
    def preview(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], indices: Sequence[int] | None = None,
                round_no: int | None = None) -> list[torch.Tensor]:
        """What :meth:`step` would make of ``phi``, leaving ``phi`` and the momentum untouched (eager updates)."""
        lr = self.lr_at(round_no)
        out = []
        for i, p, d in zip(_indices(indices, len(phi)), phi, delta):
            v = self.buffers[i].to(p.device, copy=True) if i in self.buffers else torch.zeros_like(p, dtype=torch.float32)
            d = d.to(p.device, torch.float32)
            v.mul_(self.momentum).add_(d)
            update = d.add(v, alpha=self.momentum) if self.nesterov else v
            out.append(p.detach().float() - lr * update)
        return out


class NoLoCoOuter(_IndexedState):
    """NoLoCo's outer step for one member (reference code's form; the paper's Eq. 2 has a sign typo).

    :param lr: β, weight of the group's mean progress (default 0.7)
    :param pull: γ, pull toward the group's mean weights (default 0.7, = β as in the reference code)
    :param momentum: α (default 0.5). Stable for n = 2 when α < γ < sqrt(2 + α²) and β > α.
    """

    def __init__(self, lr: float = 0.7, pull: float | None = None, momentum: float = 0.5) -> None:
        super().__init__()
        pull = lr if pull is None else pull
        if lr <= 0 or pull < 0 or not 0 <= momentum < 1:
            raise ValueError(f"NoLoCo needs β > 0, γ ≥ 0 and α in [0, 1), got β={lr}, γ={pull}, α={momentum}")
        self.lr, self.pull, self.momentum = lr, pull, momentum

    @torch.no_grad()
    def step(
        self,
        phi: Sequence[torch.Tensor],
        group_phi: Sequence[torch.Tensor],
        group_progress: Sequence[torch.Tensor],
        indices: Sequence[int] | None = None,
    ) -> None:
        """δ ← α·δ + β·ū + γ·(φ̄ − φ); φ ← φ + δ, in place.

        :param group_phi: φ̄, the group's mean slow weights (this member included)
        :param group_progress: ū, the group's mean progress θ − φ (= −mean Δ)
        """
        if not len(phi) == len(group_phi) == len(group_progress):
            raise ValueError(f"{len(phi)} parameters, {len(group_phi)} mean weights, {len(group_progress)} mean updates")
        self._changing()
        for i, p, mean_p, u in zip(_indices(indices, len(phi)), phi, group_phi, group_progress):
            d = self._buffer(i, p)
            pull = mean_p.to(p.device, torch.float32) - p.to(torch.float32)
            d.mul_(self.momentum).add_(u.to(p.device, torch.float32), alpha=self.lr).add_(pull, alpha=self.pull)
            p.add_(d.to(p.dtype))


@torch.no_grad()
def weighted_mean(updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Σ_i w_i·Δ_i / Σ_i w_i, summed in the given order (callers fix a canonical order so that every
    member of a group obtains bit-identical results)."""
    if not updates or len(updates) != len(weights):
        raise ValueError("need one weight per update and at least one update")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    # the first term is w·t (one pass, exactly 0 + w·t), then the others are added in order
    out = [torch.mul(t.to(torch.float32), weights[0] / total) for t in updates[0]]
    for update, w in zip(updates[1:], weights[1:]):
        for acc, t in zip(out, update):
            acc.add_(t.to(torch.float32), alpha=w / total)
    return out


def l2_norm(tensors: Sequence[torch.Tensor]) -> float:
    """‖(t₁, t₂, …)‖₂ in one pass per tensor, without the temporary that ``t.pow(2).sum()`` allocates."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t if t.dtype == torch.float32 else t.float())) ** 2 for t in tensors))


def pseudo_gradient(phi: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = φ − θ in fp32."""
    return [p.detach().float() - t.detach().float() for p, t in zip(phi, theta)]

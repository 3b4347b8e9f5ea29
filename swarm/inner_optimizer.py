"""The inner optimizer of a replica or a pipeline stage: AdamW, or Muon for the hidden weight matrices.

``adamw``: AdamW (betas 0.9, 0.95), weight decay on tensors of two or more dimensions only.

``muon`` (MuLoCo, Thérien et al. 2025): ``torch.optim.Muon`` for the 2-D weight matrices inside the
transformer blocks, AdamW as above for everything else (embeddings, the head, norms, biases): the usual
split, since Muon orthogonalises a matrix's update and means nothing for a vector or a lookup table.
Muon runs with ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's scaling, 0.2·√max(A, B)), which makes
its update's RMS match AdamW's, so one ``--lr`` (and its schedule) serves both halves.

Both kinds expose what the trainers use: ``param_groups`` (whose ``lr`` they set each step), ``step``,
``zero_grad``, ``state_dict`` and ``load_state_dict``. AdamW's state dict is torch's own (checkpoints
written before Muon existed load unchanged); Muon's is ``{"muon": ..., "adamw": ...}``.
"""

from __future__ import annotations

from typing import Any, Iterable, Literal

import torch

InnerOptimizerKind = Literal["adamw", "muon"]
INNER_OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")
BETAS = (0.9, 0.95)


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps this parameter: a 2-D weight matrix of a transformer block (hidden layers only)."""
    return param.dim() == 2 and (name.startswith("blocks.") or ".blocks." in name)


def _adamw(named: list[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=BETAS, fused=fused)


class MuonAdamW:
    """Muon for the hidden matrices and AdamW for the rest, stepped together as one optimizer."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float, fused: bool = False) -> None:
        named = list(named)
        hidden = [p for n, p in named if is_muon_param(n, p)]
        if not hidden:
            raise ValueError("--inner-optimizer muon found no 2-D weight matrix inside transformer blocks to step; use adamw")
        self.muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = _adamw([(n, p) for n, p in named if not is_muon_param(n, p)], lr, weight_decay, fused)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.adamw.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError("this inner optimizer state was not written by --inner-optimizer muon (it holds "
                             f"{', '.join(sorted(state))}); resume with the optimizer it was written with")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_inner_optimizer(named: Iterable[tuple[str, torch.nn.Parameter]], kind: str, lr: float, weight_decay: float,
                          fused: bool = False) -> torch.optim.AdamW | MuonAdamW:
    """The inner optimizer ``kind`` (``adamw`` or ``muon``) over ``named`` parameters."""
    if kind == "adamw":
        return _adamw(list(named), lr, weight_decay, fused)
    if kind == "muon":
        return MuonAdamW(named, lr, weight_decay, fused)
    raise ValueError(f"unknown inner optimizer {kind!r}; choose one of {', '.join(INNER_OPTIMIZERS)}")

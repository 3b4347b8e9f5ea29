"""The inner optimizer of a replica or a pipeline stage: AdamW, or Muon for the hidden weight matrices.

``adamw``: AdamW (betas 0.9, 0.95), weight decay on tensors of two or more dimensions only.

``muon`` (MuLoCo, Thérien et al. 2025): ``torch.optim.Muon`` for the 2-D weight matrices inside the
transformer blocks, AdamW as above for everything else (embeddings, the head, norms, biases): the usual
split, since Muon orthogonalises a matrix's update and means nothing for a vector or a lookup table.
Muon runs with ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's scaling, 0.2·√max(A, B)), which makes
its update's RMS match AdamW's, so one ``--lr`` (and its schedule) serves both halves.

AdamW runs torch's fused kernel wherever it has one (float parameters on the CPU or CUDA): on one CPU
thread it steps an 85 M-parameter model 4–5× faster than the default per-tensor loop, which at small
batches is most of a CPU volunteer's inner step, and it equals that loop up to float rounding. A
checkpoint written by either form loads into the other.

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


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel can step all of ``params`` (floating point, on the CPU or CUDA)."""
    params = list(params)
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


class _AdamW(torch.optim.AdamW):
    """torch's AdamW that keeps the kernel it was built with when a state dict is loaded (torch's
    ``load_state_dict`` restores the saved groups' ``fused`` flag, so a checkpoint written by the
    per-tensor loop would turn the fused kernel off)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kernels = [(g.get("fused"), g.get("foreach")) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, (fused, foreach) in zip(self.param_groups, kernels):
            group["fused"], group["foreach"] = fused, foreach


def _adamw(named: list[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float, fused: bool | None) -> torch.optim.AdamW:
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    if fused is None:
        fused = fused_supported(p for _, p in named)
    return _AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                  lr=lr, betas=BETAS, fused=fused)


class MuonAdamW:
    """Muon for the hidden matrices and AdamW for the rest, stepped together as one optimizer."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float, fused: bool | None = None) -> None:
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
                          fused: bool | None = None) -> torch.optim.AdamW | MuonAdamW:
    """The inner optimizer ``kind`` (``adamw`` or ``muon``) over ``named`` parameters; ``fused``: AdamW's fused
    kernel (None: wherever torch has one for the parameters)."""
    if kind == "adamw":
        return _adamw(list(named), lr, weight_decay, fused)
    if kind == "muon":
        return MuonAdamW(named, lr, weight_decay, fused)
    raise ValueError(f"unknown inner optimizer {kind!r}; choose one of {', '.join(INNER_OPTIMIZERS)}")

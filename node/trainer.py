"""Local training: the model on its device, the inner AdamW optimizer, bf16 autocast on CUDA, evaluation."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Sequence

import torch

from swarm.model import GPT, GPTConfig


def pick_device(requested: str) -> torch.device:
    """``auto`` takes CUDA when present; asking for ``cuda`` without one is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch sees no CUDA device; use --device auto or cpu")
    return torch.device(requested)


class LocalTrainer:
    """A model plus its inner optimizer (AdamW, betas (0.9, 0.95), linear warmup then constant lr).

    The inner optimizer state is local and never synchronised (DiLoCo).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        device: torch.device,
        lr: float,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.model = GPT(cfg).to(device)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
            fused=device.type == "cuda",
        )
        self.base_lr, self.warmup_steps = lr, warmup_steps
        self.lr_scale = 1.0
        self.steps = 0
        self.autocast = (
            torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        )

    def parameters(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters()]

    def current_lr(self) -> float:
        warm = min(1.0, (self.steps + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.base_lr * warm * self.lr_scale

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step on a batch; returns the loss (nats per byte). Non-finite losses raise."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self.autocast:
            _, loss = self.model(x, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss.item()} at step {self.steps}; lower --lr")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        return float(loss.item())

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` (nats per byte)."""
        self.model.eval()
        total, count = 0.0, 0
        for x, y in batches:
            with self.autocast:
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += float(loss.item()) * x.numel()
            count += x.numel()
        return total / count if count else math.nan

    @torch.no_grad()
    def load_weights(self, tensors: Sequence[torch.Tensor]) -> None:
        """θ ← given tensors (e.g. the agreed φ after an outer step)."""
        for p, t in zip(self.parameters(), tensors):
            p.copy_(t.to(p.device, p.dtype))

"""The compute side of a stage server: one stage's weights, its optimizer and the three requests.

Requests are stateless: a backward request carries the stage's input again and the worker recomputes
the forward pass under autograd (activation recomputation), so any replica of a stage can take any
microbatch's backward pass and a trainer can retry a failed call on another replica. Every backward
(or loss) request is one optimizer step of this stage, and one step of its lr schedule (``steps`` is the
schedule position; a replica that joins the stage takes it from the state it downloads); the gradient
norm of that step is kept for gradient-weighted stage recovery.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Sequence

import torch

from swarm.inner_optimizer import build_inner_optimizer
from swarm.lr_schedule import LrSchedule
from swarm.stages import Stage


class StageWorker:
    """Runs one stage's requests (call from one thread at a time; a lock guards weight swaps)."""

    def __init__(self, stage: Stage, device: torch.device, lr: float = 1e-3, weight_decay: float = 0.1, warmup_steps: int = 50,
                 clip: float = 1.0, slowdown: float = 1.0, schedule: LrSchedule | None = None, inner_optimizer: str = "adamw",
                 steps: int = 0) -> None:
        self.stage = stage.to(device)
        self.device = device
        self.base_lr, self.clip = lr, clip
        self.schedule = schedule if schedule is not None else LrSchedule("constant", warmup_steps)
        self.slowdown = slowdown  # experiments: emulate slower hardware
        self.optimizer = build_inner_optimizer(self.stage.named_parameters(), inner_optimizer, lr, weight_decay)
        self.lock = threading.Lock()
        self.steps = steps
        self.samples = 0
        self.last_grad_norm = 0.0
        self.last_loss = float("nan")
        self.autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def parameters(self) -> list[torch.Tensor]:
        return list(self.stage.parameters())

    def _input(self, x: torch.Tensor, grad: bool) -> torch.Tensor:
        x = x.to(self.device)
        if not torch.is_floating_point(x):
            return x.long()
        return x.float().requires_grad_(grad)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, embed: bool | None = None) -> torch.Tensor:
        with self.lock, self.autocast:
            self.stage.eval()
            return self.stage(self._input(x, grad=False), embed=embed, head=False).float().cpu()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, embed: bool | None = None) -> float:
        """Loss without learning (held-out evaluation through the pipeline); needs the head."""
        with self.lock, self.autocast:
            self.stage.eval()
            return float(self.stage(self._input(x, grad=False), y.to(self.device), embed=embed, head=True))

    def backward(self, x: torch.Tensor, grad_out: torch.Tensor, embed: bool | None = None) -> torch.Tensor | None:
        """Recompute the forward pass, backpropagate ``grad_out``, step; returns ∂loss/∂x (None for token input)."""
        with self.lock:
            inp = self._input(x, grad=True)
            self.stage.train()
            with self.autocast:
                out = self.stage(inp, embed=embed, head=False)
            out.float().backward(grad_out.to(self.device, torch.float32))
            return self._step(inp, len(x))

    def loss_step(self, x: torch.Tensor, y: torch.Tensor, embed: bool | None = None) -> tuple[float, torch.Tensor | None]:
        """Loss on ``y`` through this stage and the head, backward and step; returns (loss, ∂loss/∂x)."""
        with self.lock:
            inp = self._input(x, grad=True)
            self.stage.train()
            with self.autocast:
                loss = self.stage(inp, y.to(self.device), embed=embed, head=True)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"stage {self.stage.index}: loss became {loss.item()}")
            loss.backward()
            self.last_loss = float(loss.detach())
            return self.last_loss, self._step(inp, len(x))

    def _step(self, inp: torch.Tensor, samples: int) -> torch.Tensor | None:
        lr = self.base_lr * self.schedule.factor(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.stage.parameters(), self.clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.samples += samples
        return None if inp.grad is None else inp.grad.detach().float().cpu()

    @torch.no_grad()
    def load_weights(self, tensors: Sequence[torch.Tensor], keep: float = 0.0) -> None:
        """θ ← (1 − keep)·tensors + keep·θ (``--fragment-alpha``; 0 replaces the weights)."""
        with self.lock:
            for p, t in zip(self.parameters(), tensors):
                if keep:
                    p.mul_(keep).add_(t.to(p.device, p.dtype), alpha=1 - keep)
                else:
                    p.copy_(t.to(p.device, p.dtype))

    @torch.no_grad()
    def snapshot(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """fp32 copies of the weights on ``device`` (where the stage's φ lives: ``--outer-device``)."""
        with self.lock:
            return [p.detach().to(device, torch.float32, copy=True) for p in self.parameters()]

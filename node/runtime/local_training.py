"""Local training: the model on its device, the inner optimizer (AdamW or Muon + AdamW, ``swarm.inner_optimizer``)
stepped on an lr schedule (``swarm.lr_schedule``), bf16 autocast on CUDA, evaluation.

Memory and speed for real workloads, all optional and none changing the update:

- micro-batches (``micro_batch_size``): a batch of B sequences runs as ceil(B/m) forward/backward passes
  of at most m sequences, each loss scaled by its share of the batch, so the accumulated gradient is
  the full batch's and the token batch (what DiLoCo's hyper-parameters are tuned for) stays
  independent of the device's memory;
- activation checkpointing (``activation_checkpointing``): every transformer block of ``model.blocks``
  keeps only its input and recomputes its activations in the backward pass (about one more forward);
- ``torch.compile`` (``compile``; on by default on CUDA, where it fuses the norms, rotary embeddings, SwiGLU and
  the loss's fp32 upcast that eager runs as separate memory-bound kernels), falling back to eager with one
  warning line when compilation fails. Compiled kernels are cached on disk (``compile_cache_dir``) so that
  a restarted daemon does not compile again.

Per step the host waits for the device once (the loss, which is also the finiteness check).
"""

from __future__ import annotations

import logging
import math
import os
import types
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from swarm.inner_optimizer import build_inner_optimizer
from swarm.lr_schedule import LrSchedule
from swarm.models.presets import GPTConfig, build_model

logger = logging.getLogger("locomesh.node")


def compile_cache_dir() -> Path:
    """Where Inductor keeps compiled kernels between runs: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/locomesh/inductor`` (``~/.cache`` by default) instead of torch's per-boot ``/tmp``."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "locomesh" / "inductor"


def pick_device(requested: str) -> torch.device:
    """``auto`` takes CUDA when present; asking for ``cuda`` without one is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch sees no CUDA device; use --device auto or cpu")
    return torch.device(requested)


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's own forward, through ``torch.utils.checkpoint`` while gradients are recorded."""
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Recompute the activations of every block of ``model.blocks`` in the backward pass instead of
    keeping them; returns the number of blocks. Parameter names and the state dict are unchanged."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"activation checkpointing needs the transformer blocks in model.blocks (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    for block in blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)  # bound per instance: deepcopy rebinds it
    return len(blocks)


class LocalTrainer:
    """A model plus its inner optimizer (``inner_optimizer``: adamw or muon) on the lr ``schedule`` (default:
    linear warmup over ``warmup_steps``, then constant). ``steps`` is the schedule position: a joiner or a
    resumed node sets it to the swarm's (its checkpoint's) so the schedule continues.

    The inner optimizer state is local and never synchronised (DiLoCo). ``self.model`` is always the
    plain module (parameter names, state dict, checkpoints); training runs through ``self.train_model``,
    which is its compiled form under ``compile``.

    :param micro_batch_size: at most this many sequences per forward/backward pass (gradient accumulation;
        the last micro-batch may be smaller); None = the whole batch at once
    :param activation_checkpointing: recompute each block's activations in the backward pass
    :param compile: ``torch.compile`` the model (``compile_backend``, ``compile_mode``: None or "default" is torch's
        default); eager with one warning if that fails; None = on CUDA devices only
    :param accelerated: the CUDA recipe (bf16 autocast); None = on CUDA devices only. True on the CPU runs the
        same code path there (torch has CPU bf16 autocast), which is how the tests cover it on machines without
        a GPU. AdamW's fused kernel runs on both (``swarm.inner_optimizer``)
    """

    def __init__(
        self,
        *,
        cfg: GPTConfig,
        device: torch.device,
        lr: float,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        schedule: LrSchedule | None = None,
        inner_optimizer: str = "adamw",
        seed: int = 0,
        micro_batch_size: int | None = None,
        activation_checkpointing: bool = False,
        compile: bool | None = None,
        compile_backend: str | Callable[..., Any] = "inductor",
        compile_mode: str | None = None,
        accelerated: bool | None = None,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        torch.manual_seed(seed)
        self.device = device
        self.model = build_model(cfg).to(device)
        self.accelerated = device.type == "cuda" if accelerated is None else accelerated
        self.optimizer = build_inner_optimizer(self.model.named_parameters(), inner_optimizer, lr, weight_decay)
        self.base_lr = lr
        self.schedule = schedule if schedule is not None else LrSchedule("constant", warmup_steps)
        self.lr_scale = 1.0
        self.steps = 0
        self.autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if self.accelerated else nullcontext()
        self.micro_batch_size = micro_batch_size
        if activation_checkpointing:
            checkpoint_blocks(self.model)
        if compile is None:
            compile = device.type == "cuda"
        if compile and compile_backend == "inductor":
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (none in bf16 training)
            torch.backends.cudnn.allow_tf32 = True
        self.train_model: Callable[..., Any] = (
            torch.compile(self.model, backend=compile_backend, mode=None if compile_mode == "default" else compile_mode)
            if compile else self.model  # type: ignore[assignment]
        )

    def parameters(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters()]

    def current_lr(self) -> float:
        return self.base_lr * self.schedule.factor(self.steps) * self.lr_scale

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step on a batch; returns the loss (nats per byte). Non-finite losses raise."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._compiled_or_eager(lambda: self._accumulate(x, y))
        value = float(loss.item())  # the step's one wait for the device
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss became {value} at step {self.steps}; lower --lr")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        return value

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the batch's micro-batches; returns the batch's mean loss (detached).

        Micro-batch i of b_i sequences contributes (b_i / B)·loss_i, so the gradients sum to the
        full batch's mean-loss gradient (every sequence has the same number of targets)."""
        rows = x.shape[0]
        size = self.micro_batch_size or rows
        if size >= rows:
            with self.autocast:
                _, loss = self.train_model(x, y)
            loss.backward()
            return loss.detach()
        total = torch.zeros((), device=x.device)
        for xs, ys in zip(x.split(size), y.split(size)):
            with self.autocast:
                _, loss = self.train_model(xs, ys)
            scaled = loss * (xs.shape[0] / rows)
            scaled.backward()
            total += scaled.detach()
        return total

    def _compiled_or_eager(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()``; if the compiled model fails there, warn once and run it again on the eager model."""
        if self.train_model is self.model:
            return run()
        try:
            return run()
        except (FloatingPointError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # torch.compile raises many kinds (backend, C++ toolchain, tracing)
            root: BaseException = e
            while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
                root = inner  # the backend's own error, not Dynamo's wrapper
            reason = (str(root).strip().splitlines() or [""])[0][:200]
            logger.warning("torch.compile failed (%s: %s); training without compilation", type(root).__name__, reason)
            self.train_model = self.model
            self.optimizer.zero_grad(set_to_none=True)
            return run()

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The model's loss on a batch under autocast, through the compiled model if any (no backward)."""
        x, y = x.to(self.device), y.to(self.device)

        def run() -> torch.Tensor:
            with self.autocast:
                return self.train_model(x, y)[1]

        return self._compiled_or_eager(run)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` (nats per byte), on the eager model (rare: not worth a compiled eval graph)."""
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

"""A trainer's side of a SWARM pipeline: push one microbatch through one peer per stage and back.

Forward: stage 0 … S−2 return activations, the last stage computes the loss, backpropagates and
returns ∂loss/∂input; backward then walks the same path in reverse (each stage recomputes its
forward pass, so if the peer that ran a microbatch's forward is gone another replica takes the
backward). A failed call (error, refusal, timeout) bans that peer and is retried on another replica
of the stage; when a stage has no replica left the step is reported failed (never silently dropped)
and the caller retries the microbatch.

With CheckFree+ (``plus``) odd microbatches run in the out-of-order sequence of
``swarm.checkfree.swap_order``: the stage that comes first embeds (stage 1 with its replica of the
embeddings), the one that comes last applies the head (stage S−2 with its replica).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import torch

from protocol.hivemind_transport import Transport
from swarm.checkfree import swap_order
from swarm.plausible import ScaleCheck
from swarm.router import NoPeerAvailable, Router
from swarm.service import StageCallError, call_stage


MAX_BUSY_RETRIES = 200  # with backoff capped at 0.5 s: up to ~100 s waiting for a loaded stage


class PipelineStepFailed(Exception):
    """No replica of some stage could take the microbatch (``stage``: which one, when known)."""

    def __init__(self, message: str, stage: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass
class StepResult:
    loss: float
    path: list[str]
    retries: int = 0
    errors: list[str] = field(default_factory=list)


class PipelineClient:
    """Runs pipeline steps for one trainer.

    :param stages: number of stages S
    :param codec: activation codec of the run
    :param timeout: longest wait for one stage call
    :param max_retries: replicas tried per call after the first
    :param d_model: the model's width, to check the shape of activations stages answer with (None: unchecked)
    """

    def __init__(self, transport: Transport, run_id: str, stages: int, router: Router, codec: str = "none",
                 timeout: float = 30.0, max_retries: int = 3, plus: bool = False, d_model: int | None = None) -> None:
        self.transport, self.run_id, self.stages, self.router = transport, run_id, stages, router
        self.codec, self.timeout, self.max_retries, self.plus = codec, timeout, max_retries, plus
        self.d_model = d_model
        self.microbatches = 0
        self.scales: dict[str, ScaleCheck] = {}  # per stage, request and answer tensor: the recent scales
        self.implausible = 0  # answers refused for their shape, scale or loss (the peer is banned, the call retried)
        self.sent_scale = 1.0  # experiments only (--attack activations:K): activations sent to stages 1 … S−1 are multiplied by it
        self.sent_scale_after = 0  # ... from this many microbatches on

    def _answer_problem(self, stage: int, kind: str, x: torch.Tensor, out: dict, flags: dict) -> str | None:
        """Why a stage's answer cannot be used (wrong shape, activations far off the scale of its recent
        answers, a non-finite training loss), or None. Gradients are bounded where they are stepped on
        (the stage server, ``swarm.service``)."""
        y, g = out.get("y"), out.get("g")
        if y is not None:
            expected = (*x.shape[:2], self.d_model) if self.d_model is not None else None
            if y.dim() != 3 or tuple(y.shape[:2]) != tuple(x.shape[:2]) or (expected is not None and tuple(y.shape) != expected):
                return f"stage {stage} answered {kind} with activations of shape {list(y.shape)} for an input of shape {list(x.shape)}"
            what = f"stage {stage}'s activations{''.join(f' ({k})' for k, v in flags.items() if v)}"
            why = self.scales.setdefault(what, ScaleCheck(what)).check(y)
            if why is not None:
                return why
        if g is not None and torch.is_floating_point(x) and tuple(g.shape) != tuple(x.shape):
            return f"stage {stage} answered {kind} with a gradient of shape {list(g.shape)} for an input of shape {list(x.shape)}"
        if kind == "loss" and "loss" in out and not math.isfinite(out["loss"]):
            return f"stage {stage} answered a loss of {out['loss']}"
        return None

    async def _call(self, result: StepResult, stage: int, kind: str, x: torch.Tensor, prefer: str | None = None, **kw):
        tried: list[str] = []
        refused: set[str] = set()  # answered busy on this call: another replica first, if there is one
        busy = 0
        attempt = 0
        size = float(len(x))
        while attempt <= self.max_retries:
            charged = False
            try:
                if prefer is not None and attempt == 0 and busy == 0 and prefer in self.router.available(stage):
                    peer = prefer
                else:
                    if refused and not set(self.router.available(stage, tried)) - refused:
                        refused.clear()  # every replica was busy: wait for any of them
                    peer = self.router.choose(stage, size, exclude=[*tried, *refused])
                    charged = True
            except NoPeerAvailable as e:
                raise PipelineStepFailed(str(e), stage) from None
            try:
                started = time.monotonic()
                scaled = self.sent_scale != 1.0 and self.microbatches > self.sent_scale_after and torch.is_floating_point(x)
                sent = x * self.sent_scale if scaled else x
                out = await call_stage(self.transport, peer, self.run_id, stage, kind, sent, codec=self.codec, timeout=self.timeout, **kw)
                problem = self._answer_problem(stage, kind, x, out, {k: kw[k] for k in ("embed", "head") if k in kw})
                if problem is None:
                    tokens = x.shape[0] * x.shape[1] if x.dim() >= 2 else x.numel()  # [B, T] ids or [B, T, D] activations
                    self.router.observe(peer, float(tokens), time.monotonic() - started)
                    return out, peer
                self.implausible += 1
                raise StageCallError(f"stage {stage} peer {peer[-8:]}: {problem}")
            except StageCallError as e:
                if e.busy and busy < MAX_BUSY_RETRIES:
                    # alive but loaded: it did none of the work it was charged for; back off and try
                    # another replica if the router has one
                    if charged:
                        self.router.refund(stage, peer, size)
                    refused.add(peer)
                    busy += 1
                    await asyncio.sleep(min(0.5, 0.01 * 2 ** min(busy, 6)))
                    continue
                self.router.ban(peer)
                tried.append(peer)
                result.retries += 1
                result.errors.append(str(e))
                attempt += 1
        raise PipelineStepFailed(f"stage {stage}: {self.max_retries + 1} replicas failed: {result.errors[-1]}", stage)

    async def step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """One training microbatch through the pipeline; raises :class:`PipelineStepFailed`."""
        result = StepResult(loss=float("nan"), path=[])
        order = swap_order(self.stages, self.microbatches) if self.plus else list(range(self.stages))
        self.microbatches += 1

        def flags(position: int, head: bool) -> dict:
            return {"embed": position == 0, "head": head} if self.plus else {}

        inputs = [x]
        for position, stage in enumerate(order[:-1]):
            out, peer = await self._call(result, stage, "forward", inputs[-1], **flags(position, False))
            result.path.append(peer)
            inputs.append(out["y"])
        out, peer = await self._call(result, order[-1], "loss", inputs[-1], y=y, **flags(len(order) - 1, True))
        result.path.append(peer)
        result.loss = out["loss"]
        grad = out.get("g")
        for position in range(len(order) - 2, -1, -1):
            if grad is None:
                raise PipelineStepFailed(f"stage {order[position + 1]} returned no input gradient")
            out, _ = await self._call(result, order[position], "backward", inputs[position], prefer=result.path[position],
                                      grad=grad, **flags(position, False))
            grad = out.get("g")
        return result

    async def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Held-out loss of one batch through the pipeline (no learning)."""
        result = StepResult(loss=float("nan"), path=[])
        h = x
        for stage in range(self.stages - 1):
            out, _ = await self._call(result, stage, "forward", h)
            h = out["y"]
        out, _ = await self._call(result, self.stages - 1, "evaluate", h, y=y)
        return out["loss"]

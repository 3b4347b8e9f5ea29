"""A trainer's side of a SWARM pipeline: push one microbatch through one peer per stage and back.

Forward: stage 0 … S−2 return activations, the last stage computes the loss, backpropagates and
returns ∂loss/∂input; backward then walks the same path in reverse (each stage recomputes its
forward pass, so if the peer that ran a microbatch's forward is gone another replica takes the
backward). A failed call (error, refusal, timeout) bans that peer and is retried on another replica
of the stage; when a stage has no replica left the step is reported failed (never silently dropped)
and the caller retries the microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from protocol.hivemind_transport import Transport
from swarm.router import NoPeerAvailable, Router
from swarm.service import StageCallError, call_stage


class PipelineStepFailed(Exception):
    """No replica of some stage could take the microbatch."""


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
    """

    def __init__(self, transport: Transport, run_id: str, stages: int, router: Router, codec: str = "none",
                 timeout: float = 30.0, max_retries: int = 3) -> None:
        self.transport, self.run_id, self.stages, self.router = transport, run_id, stages, router
        self.codec, self.timeout, self.max_retries = codec, timeout, max_retries

    async def _call(self, result: StepResult, stage: int, kind: str, x: torch.Tensor, prefer: str | None = None, **kw):
        tried: list[str] = []
        for attempt in range(self.max_retries + 1):
            try:
                if prefer is not None and attempt == 0 and prefer in self.router.available(stage):
                    peer = prefer
                else:
                    peer = self.router.choose(stage, float(len(x)), exclude=tried)
            except NoPeerAvailable as e:
                raise PipelineStepFailed(str(e)) from None
            try:
                return await call_stage(self.transport, peer, self.run_id, stage, kind, x, codec=self.codec, timeout=self.timeout, **kw), peer
            except StageCallError as e:
                self.router.ban(peer)
                tried.append(peer)
                result.retries += 1
                result.errors.append(str(e))
        raise PipelineStepFailed(f"stage {stage}: {self.max_retries + 1} replicas failed: {result.errors[-1]}")

    async def step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """One training microbatch through the pipeline; raises :class:`PipelineStepFailed`."""
        result = StepResult(loss=float("nan"), path=[])
        inputs = [x]
        for stage in range(self.stages - 1):
            out, peer = await self._call(result, stage, "forward", inputs[-1])
            result.path.append(peer)
            inputs.append(out["y"])
        out, peer = await self._call(result, self.stages - 1, "loss", inputs[-1], y=y)
        result.path.append(peer)
        result.loss = out["loss"]
        grad = out.get("g")
        for stage in range(self.stages - 2, -1, -1):
            if grad is None:
                raise PipelineStepFailed(f"stage {stage + 1} returned no input gradient")
            out, _ = await self._call(result, stage, "backward", inputs[stage], prefer=result.path[stage], grad=grad)
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

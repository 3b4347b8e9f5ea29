"""``/locomesh/stage/1.0``: stage servers serve forward and backward passes; trainers call them.

Requests (one per stream): ``forward {run_id, stage, x}`` → ``activation {y}``;
``backward {run_id, stage, x, grad}`` → ``grad {g}``; ``loss {run_id, stage, x, y}`` (last stage:
loss, backward and step) → ``loss {loss, g}``; ``evaluate {run_id, stage, x, y}`` → ``loss {loss}``.
Optional ``embed``/``head`` booleans ask a CheckFree+ neighbour to act as first/last stage with its
replica of the embeddings/head (out-of-order microbatches).
Token ids travel as raw tensors; activations and gradients as payloads of the run's activation codec
(``none``, ``fp16``, ``bf16``, ``int8-block``...). Everything is validated before it is computed on.

Requests wait in a bounded queue; a full queue answers ``busy`` at once so the trainer tries another
replica. Queued forward (and backward) requests of the same shape are run as one batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compression import CodecError, Payload, get_codec
from protocol import ids
from protocol.errors import RemoteError, SchemaError
from protocol.frames import FramedStream, require
from protocol.hivemind_transport import Transport
from protocol.tensors import tensor_from_wire, tensor_to_wire
from swarm.plausible import ScaleCheck
from swarm.stage_worker import StageWorker

logger = logging.getLogger(__name__)
KINDS = ("forward", "backward", "loss", "evaluate")
MAX_BATCH = 1024


def encode_activation(t: torch.Tensor, codec: str) -> bytes:
    return get_codec(codec).encode(t.float().contiguous()).to_bytes()


def decode_activation(blob: Any, codec: str, shape: tuple[int, ...] | None, max_numel: int) -> torch.Tensor:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise SchemaError("activation must be a codec payload (bytes)")
    try:
        payload = Payload.from_bytes(blob, max_bytes=max_numel * 8 + 65536, max_numel=max_numel, expected_shape=shape)
    except CodecError as e:
        raise SchemaError(f"bad activation payload: {e}") from None
    if payload.codec != get_codec(codec).spec:
        raise SchemaError(f"activation encoded with {payload.codec!r}, this run uses {codec!r}")
    value = get_codec(codec).decode(payload)
    if not torch.isfinite(value).all():
        raise SchemaError("activation holds NaN or Inf")
    return value


@dataclass
class _Job:
    kind: str
    x: torch.Tensor
    extra: torch.Tensor | None
    future: asyncio.Future = field(repr=False)
    embed: bool | None = None


class StageService:
    """Serves one stage (the worker may be swapped when the node moves to another stage).

    :param worker: returns the current worker (None while the node is switching stages)
    :param codec: activation codec of the run
    :param queue_limit: requests that may wait; more are answered ``busy``
    """

    def __init__(self, transport: Transport, run_id: str, worker: Callable[[], StageWorker | None], codec: str = "none",
                 queue_limit: int = 8, max_batch: int = 4) -> None:
        self.transport, self.run_id, self.worker, self.codec = transport, run_id, worker, get_codec(codec).spec
        self.queue_limit, self.max_batch = queue_limit, max_batch
        self.queue: asyncio.Queue[_Job] | None = None
        self.throughput = 0.0  # microbatch samples per second of compute (EMAs of samples and of seconds)
        self._samples, self._seconds = 0.0, 0.0
        self.microbatches = 0  # microbatches whose last request here (backward or loss) is done
        self.refused_busy = 0  # requests answered busy (a full queue)
        self.refused_implausible = 0  # training requests whose input activations were far off scale
        self.clipped_gradients = 0  # backward requests whose gradient was scaled down to the bound
        self.scales: dict[str, ScaleCheck] = {}  # per stage and tensor: the recent scales (swarm.plausible)

    @property
    def queue_length(self) -> int:
        return self.queue.qsize() if self.queue is not None else 0

    async def start(self) -> None:
        self.queue = asyncio.Queue(self.queue_limit)
        asyncio.get_running_loop().create_task(self._consume())
        await self.transport.serve(ids.STAGE, self._handle)

    def _limits(self, worker: StageWorker) -> tuple[int, int]:
        cfg = worker.stage.cfg
        return cfg.context, MAX_BATCH * cfg.context * max(cfg.d_model, cfg.vocab_size)

    async def _handle(self, stream: FramedStream) -> None:
        msg = await stream.recv(expect=KINDS)
        worker = self.worker()
        if require(msg.body, "run_id", str) != self.run_id:
            raise SchemaError(f"this node trains run {self.run_id!r}")
        stage = require(msg.body, "stage", int)
        if worker is None or stage != worker.stage.index:
            raise SchemaError(f"this peer serves stage {worker.stage.index if worker else 'none'} now, not stage {stage}")
        context, max_numel = self._limits(worker)
        flags = {k: msg.body.get(k) for k in ("embed", "head")}
        if any(v is not None and not isinstance(v, bool) for v in flags.values()):
            raise SchemaError("embed and head must be booleans")
        embed = worker.stage.first if flags["embed"] is None else flags["embed"]
        head = msg.kind in ("loss", "evaluate") if flags["head"] is None else flags["head"]
        if embed and not worker.stage.can_embed:
            raise SchemaError(f"stage {stage} holds no embeddings (CheckFree+ gives stage 1 a replica)")
        if head and not worker.stage.can_head:
            raise SchemaError(f"loss and evaluate requests go to the last stage (or a CheckFree+ head replica); this is stage {stage}")
        if head != (msg.kind in ("loss", "evaluate")):
            raise SchemaError(f"a {msg.kind} request cannot {'use' if head else 'skip'} the head")
        if embed:
            x = tensor_from_wire(msg.body.get("x"), max_numel=MAX_BATCH * context)
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2 or not 0 < x.shape[1] <= context:
                raise SchemaError(f"stage {stage} embeds int token ids (batch, ≤{context}), got {x.dtype} {list(x.shape)}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= worker.stage.cfg.vocab_size):
                raise SchemaError("token id out of the vocabulary")
        else:
            x = decode_activation(msg.body.get("x"), self.codec, None, max_numel)
            d = worker.stage.cfg.d_model
            if x.dim() != 3 or x.shape[2] != d or not 0 < x.shape[1] <= context or x.shape[0] > MAX_BATCH:
                raise SchemaError(f"stage {stage} takes activations (batch, ≤{context}, {d}), got {list(x.shape)}")
        extra = None
        if msg.kind in ("loss", "evaluate"):
            extra = tensor_from_wire(msg.body.get("y"), expected_shape=tuple(x.shape[:2]))
            if extra.dtype not in (torch.int64, torch.int32) or (extra.numel() and (int(extra.min()) < 0 or int(extra.max()) >= worker.stage.cfg.vocab_size)):
                raise SchemaError("targets must be token ids of the vocabulary")
        elif msg.kind == "backward":
            out_shape = (*x.shape[:2], worker.stage.cfg.d_model)
            extra = decode_activation(msg.body.get("grad"), self.codec, out_shape, max_numel)
        if msg.kind in ("backward", "loss"):  # each one is an optimizer step of this stage: bound what it steps on
            if not embed:
                self._plausible(f"stage {stage}'s input activations", x, stream.peer)
            if msg.kind == "backward":
                extra = self._bounded_gradient(f"stage {stage}'s output gradient", extra, stream.peer)  # type: ignore[arg-type]
        assert self.queue is not None
        job = _Job(msg.kind, x, extra, asyncio.get_running_loop().create_future(), embed)
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.refused_busy += 1
            await stream.send_error("busy", f"stage {stage} has {self.queue_limit} requests waiting; try another replica")
            return
        result = await job.future
        if msg.kind == "forward":
            await stream.send("activation", {"y": encode_activation(result, self.codec)})
        elif msg.kind == "backward":
            await stream.send("grad", {"g": None if result is None else encode_activation(result, self.codec)})
        elif msg.kind == "loss":
            loss, grad = result
            await stream.send("loss", {"loss": loss, "g": None if grad is None else encode_activation(grad, self.codec)})
        else:
            await stream.send("loss", {"loss": result})

    def _plausible(self, what: str, t: torch.Tensor, source: str) -> None:
        why = self.scales.setdefault(what, ScaleCheck(what)).check(t, source)
        if why is not None:
            self.refused_implausible += 1
            logger.info("refused a training request: %s", why)
            raise SchemaError(f"{why}; this stage does not step on it")

    def _bounded_gradient(self, what: str, t: torch.Tensor, source: str) -> torch.Tensor:
        bounded, factor = self.scales.setdefault(what, ScaleCheck(what)).clip(t, source)
        if factor < 1.0:
            self.clipped_gradients += 1
            logger.info("scaled a request's %s by %.3g (over %g× its recent median)", what, factor, self.scales[what].ratio)
        return bounded

    async def _consume(self) -> None:
        assert self.queue is not None
        while True:
            jobs = [await self.queue.get()]
            head = jobs[0]
            if head.kind in ("forward", "backward"):
                while len(jobs) < self.max_batch and not self.queue.empty():
                    nxt = self.queue._queue[0]  # type: ignore[attr-defined]  # peek: batch only same-kind, same-shape jobs
                    if nxt.kind != head.kind or nxt.embed != head.embed or nxt.x.shape[1:] != head.x.shape[1:] or nxt.x.dtype != head.x.dtype:
                        break
                    jobs.append(self.queue.get_nowait())
            started = time.monotonic()
            try:
                results = await asyncio.to_thread(self._run, jobs)
                worker = self.worker()
                if worker is not None and worker.slowdown > 1:
                    await asyncio.sleep((worker.slowdown - 1) * (time.monotonic() - started))
            except Exception as e:  # a failed computation fails its requests, not the node
                logger.warning("stage request failed: %s: %s", type(e).__name__, e)
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(SchemaError(f"stage computation failed: {e}"))
                continue
            if head.kind != "evaluate":
                # a microbatch's samples count once, when its last request here (backward or loss) is
                # done, over all compute time, so stages that serve one request per microbatch and
                # stages that serve two compare fairly (batching gains count as capacity)
                done = sum(len(j.x) for j in jobs if j.kind in ("backward", "loss"))
                self._observe(done, time.monotonic() - started)
            for job, result in zip(jobs, results):
                if not job.future.done():
                    job.future.set_result(result)
            self.microbatches += sum(1 for j in jobs if j.kind in ("backward", "loss"))

    def _run(self, jobs: list[_Job]) -> list[Any]:
        worker = self.worker()
        if worker is None:
            raise RuntimeError("the node is switching stages")
        head = jobs[0]
        if head.kind in ("forward", "backward"):
            sizes = [len(j.x) for j in jobs]
            x = torch.cat([j.x for j in jobs]) if len(jobs) > 1 else head.x
            if head.kind == "forward":
                out = worker.forward(x, embed=head.embed)
            else:
                grad = torch.cat([j.extra for j in jobs]) if len(jobs) > 1 else head.extra  # type: ignore[misc]
                out = worker.backward(x, grad, embed=head.embed)
            return [None] * len(jobs) if out is None else list(out.split(sizes))
        if head.kind == "loss":
            return [worker.loss_step(head.x, head.extra, embed=head.embed)]  # type: ignore[arg-type]
        return [worker.evaluate(head.x, head.extra, embed=head.embed)]  # type: ignore[arg-type]

    def reset_throughput(self) -> None:
        self.throughput, self._samples, self._seconds = 0.0, 0.0, 0.0

    def _observe(self, samples: int, seconds: float, alpha: float = 0.1) -> None:
        # both averages start at 0 with the same weights, so their ratio needs no bias correction
        self._samples = (1 - alpha) * self._samples + alpha * samples
        self._seconds = (1 - alpha) * self._seconds + alpha * seconds
        self.throughput = self._samples / max(self._seconds, 1e-9)


class StageCallError(Exception):
    """A stage call failed (connection, timeout, refusal); the trainer retries on another replica.
    ``busy`` says the server was alive but its queue was full (no reason to avoid it for long)."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


async def call_stage(
    transport: Transport, peer: str, run_id: str, stage: int, kind: str, x: torch.Tensor, *, codec: str,
    y: torch.Tensor | None = None, grad: torch.Tensor | None = None, timeout: float = 30.0, max_numel: int = 1 << 28,
    embed: bool | None = None, head: bool | None = None,
) -> dict[str, Any]:
    """One request to ``peer``; returns the decoded answer ({"y"}, {"g"} or {"loss", "g"})."""

    async def go() -> dict[str, Any]:
        stream = await transport.open(peer, ids.STAGE)
        try:
            body: dict[str, Any] = {"run_id": run_id, "stage": stage}
            if embed is not None:
                body["embed"] = embed
            if head is not None:
                body["head"] = head
            body["x"] = tensor_to_wire(x) if not torch.is_floating_point(x) else encode_activation(x, codec)
            if y is not None:
                body["y"] = tensor_to_wire(y)
            if grad is not None:
                body["grad"] = encode_activation(grad, codec)
            await stream.send(kind, body)
            answer = await stream.recv(expect=("activation", "grad", "loss"))
            out: dict[str, Any] = {}
            if "loss" in answer.body:
                loss = answer.body["loss"]
                if not isinstance(loss, (int, float)):
                    raise SchemaError("loss must be a number")
                out["loss"] = float(loss)
            for key in ("y", "g"):
                if answer.body.get(key) is not None:
                    out[key] = decode_activation(answer.body[key], codec, None, max_numel)
            return out
        finally:
            transport.account(ids.STAGE, stream)
            await stream.close()

    try:
        return await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        raise StageCallError(f"stage {stage} peer {peer[-8:]} did not answer within {timeout:.0f}s") from None
    except asyncio.CancelledError:
        raise
    except Exception as e:
        busy = isinstance(e, RemoteError) and e.remote_code == "busy"
        raise StageCallError(f"stage {stage} peer {peer[-8:]}: {type(e).__name__}: {e}", busy=busy) from e

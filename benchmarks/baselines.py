"""Baseline training workers for ``benchmarks.convergence``: synchronous data-parallel (gloo) and hivemind.

One process per worker; each writes a JSON result file and exits. The harness starts them, on loopback
or each inside its own network namespace:

    python -m benchmarks.baselines ddp --rank R --world N --master-addr A --master-port P --out r.json ...
    python -m benchmarks.baselines hivemind --rank R --world N --rendezvous DIR --host IP --out r.json ...

Both use the node's model presets, data (``ByteBatches`` seeded ``seed + rank``, the held-out
``validation_batches``) and the inner optimizer of :class:`node.runtime.local_training.LocalTrainer` (AdamW, betas
(0.9, 0.95), weight decay 0.1 on matrices only, linear warmup then constant lr, gradient clipping at 1.0),
with the same initial weights on every worker (``torch.manual_seed(seed)`` before the model is built).

- ``ddp``: every step, the gradients of all workers are summed with one ``all_reduce`` of a flat fp32
  buffer (gloo's ring), divided by N, then clipped and applied: synchronous data parallelism on an
  N× larger batch. ``--world 1`` is the single-process baseline (no process group, no communication).
  Bytes sent are *computed*, not measured: a ring all-reduce sends 2·(N−1)/N of the buffer per worker.
  Comm wait is measured: wall time inside ``all_reduce`` (which includes waiting for a slower worker).
- ``hivemind``: ``hivemind.Optimizer(use_local_updates=True)``: local AdamW steps every step, parameters
  averaged with the swarm at every epoch, one epoch being ``target_batch_size = H·B·N`` samples. Bytes
  sent are an *estimate*: 2·(n−1)/n·4·params per completed averaging round of n peers (butterfly
  all-reduce of fp32 parameters), rounds counted from hivemind's own log records; ``--compression fp16``
  or ``8bit`` averages with hivemind's ``Float16Compression`` or ``Uniform8BitQuantization``
  (``state_averaging_compression``: 2 or 1 bytes per value in the estimate). Comm wait is measured
  as the time inside ``Optimizer.step`` above its median (a step without averaging).
  By default parameters are averaged inside ``step`` (``delay_state_averaging=False``), with
  ``matchmaking_time`` 1 s and ``averaging_timeout`` 10 s: with hivemind's default background averaging
  and epochs of a few seconds, peers drift into different epochs, miss each other's groups and each
  round waits out the averaging timeout (``--background`` restores hivemind's default). The peers
  start and stop together (file barriers), as the gloo workers do. ``--slowdown S`` sleeps (S − 1) × each
  step's forward and backward (the node's ``--slowdown``) and ``--duration`` stops a worker after that many
  seconds (``benchmarks.heterogeneous``: peers of different speeds); ``inner_s`` in the result is the time in
  forward, backward and the steps' share of ``Optimizer.step`` up to its median.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from node.data.byte_corpus import load_corpus
from node.data.bytes import ByteBatches, validation_batches
from swarm.models.presets import preset
from node.runtime.local_training import LocalTrainer


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--out", required=True, help="result JSON of this worker")
    parser.add_argument("--model", default="nano")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps of this worker")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps (0 = only at the end)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="init seed (same on every worker); data seed is seed + rank")


class Worker:
    """What both baselines share: model, data, evaluation, and the result record."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(args.threads)
        self.args = args
        self.cfg = preset(args.model)
        corpus = load_corpus(None, context=self.cfg.context)
        self.val = validation_batches(corpus.val, args.batch_size, self.cfg.context, max_batches=args.eval_batches)
        self.trainer = LocalTrainer(cfg=self.cfg, device=torch.device("cpu"), lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed)
        self.batches = ByteBatches(data=corpus.train, batch_size=args.batch_size, context=self.cfg.context, seed=args.seed + args.rank)
        self.params = self.trainer.parameters()
        self.num_params = sum(p.numel() for p in self.params)
        self.tokens_per_step = args.batch_size * self.cfg.context
        self.evals: list[dict[str, Any]] = []
        self.train_losses: list[float] = []

    def lr_at(self, step: int) -> float:
        """The schedule of LocalTrainer.current_lr (linear warmup, then constant)."""
        self.trainer.steps = step
        return self.trainer.current_lr()

    def forward_backward(self) -> float:
        x, y = self.batches.next()
        self.trainer.model.train()
        _, loss = self.trainer.model(x, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss.item()} at step {len(self.train_losses)}")
        self.trainer.model.zero_grad(set_to_none=True)
        loss.backward()
        self.train_losses.append(float(loss.item()))
        return self.train_losses[-1]

    def maybe_eval(self, step: int, global_tokens: int, force: bool = False) -> None:
        every = self.args.eval_every
        if force or (every and step % every == 0):
            if self.evals and self.evals[-1]["step"] == step:
                return
            self.evals.append({"step": step, "tokens": global_tokens, "t": time.time(),
                               "val_loss": self.trainer.evaluate(self.val)})

    def write(self, **fields: Any) -> None:
        out = Path(self.args.out)
        result = {
            "rank": self.args.rank, "world": self.args.world, "model": self.args.model, "num_params": self.num_params,
            "batch_size": self.args.batch_size, "context": self.cfg.context, "steps": len(self.train_losses),
            "tokens": len(self.train_losses) * self.tokens_per_step,
            "train_loss_first": self.train_losses[0] if self.train_losses else None,
            "train_loss_last": self.train_losses[-1] if self.train_losses else None,
            "val_loss": self.evals[-1]["val_loss"] if self.evals else None,
            "evals": self.evals, **fields,
        }
        results_io.write_json(out, result, indent=2)


# ---------------------------------------------------------------------------------------- ddp


def run_ddp(args: argparse.Namespace) -> None:
    w = Worker(args)
    world = args.world
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                rank=args.rank, world_size=world, timeout=timedelta(seconds=args.timeout))
        dist.barrier()  # every worker starts its clock together
    flat = torch.zeros(w.num_params, dtype=torch.float32)
    opt = w.trainer.optimizer
    comm_s = 0.0
    t_start = time.time()
    started = time.perf_counter()
    for step in range(args.steps):
        lr = w.lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        w.forward_backward()
        if world > 1:
            offset = 0
            for p in w.params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.grad.reshape(-1))
                offset += n
            t0 = time.perf_counter()
            dist.all_reduce(flat)  # sum over workers (gloo ring)
            comm_s += time.perf_counter() - t0
            flat.div_(world)
            offset = 0
            for p in w.params:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        torch.nn.utils.clip_grad_norm_(w.params, 1.0)
        opt.step()
        w.maybe_eval(step + 1, (step + 1) * w.tokens_per_step * world)
    w.maybe_eval(args.steps, args.steps * w.tokens_per_step * world, force=True)
    wall = time.perf_counter() - started
    bytes_per_step = 2 * (world - 1) / world * 4 * w.num_params if world > 1 else 0
    w.write(kind="ddp" if world > 1 else "single", t_start=t_start, t_end=time.time(), wall_s=wall, comm_wait_s=comm_s,
            comm_wait_method="measured: wall time inside torch.distributed.all_reduce (gloo)",
            bytes_sent=int(bytes_per_step * args.steps),
            bytes_method="computed, not measured: ring all-reduce of fp32 gradients, 2(N-1)/N x 4 x params per step")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------- hivemind


class _RoundCounter(logging.Handler):
    """Counts hivemind's own 'Averaged parameters with N peers' / 'Averaging failed' log records."""

    PATTERN = re.compile(r"Averaged parameters with (\d+) peers")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.groups: list[int] = []
        self.failed = 0
        self.out_of_sync = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        m = self.PATTERN.search(msg)
        if m:
            self.groups.append(int(m.group(1)))
        elif msg.startswith("Averaging failed"):
            self.failed += 1
        elif "out of sync" in msg:
            self.out_of_sync += 1


BYTES_PER_VALUE = {"none": 4, "fp16": 2, "8bit": 1}  # what hivemind's codecs send per averaged value


def hivemind_codec(name: str) -> Any:
    """hivemind's compression object for ``--compression`` (none, fp16 or 8bit)."""
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    return {"none": NoCompression, "fp16": Float16Compression, "8bit": Uniform8BitQuantization}[name]()


def _barrier(directory: Path, name: str, rank: int, world: int, timeout: float) -> bool:
    """A file barrier among the hivemind peers (they share no process group)."""
    (directory / f"{name}.{rank}").touch()
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all((directory / f"{name}.{r}").exists() for r in range(world)):
            return True
        time.sleep(0.1)
    return False


def run_hivemind(args: argparse.Namespace) -> None:
    import hivemind

    counter = _RoundCounter()
    for name in ("hivemind.optim.state_averager", "hivemind.optim.optimizer"):
        lg = logging.getLogger(name)
        lg.addHandler(counter)
        lg.setLevel(logging.INFO)

    w = Worker(args)
    rdv = Path(args.rendezvous)
    rdv.mkdir(parents=True, exist_ok=True)
    maddr_file = rdv / "maddrs.json"
    initial: list[str] = []
    if args.rank > 0:
        deadline = time.time() + args.timeout
        while not maddr_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        initial = json.loads(maddr_file.read_text())
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=initial)
    if args.rank == 0:
        results_io.write_json(maddr_file, [str(a) for a in dht.get_visible_maddrs()])

    decay = [p for n, p in w.trainer.model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in w.trainer.model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id,
        target_batch_size=args.inner_steps * args.batch_size * args.world,  # one epoch = H local steps on every peer
        batch_size_per_step=args.batch_size,
        params=groups,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95)),
        use_local_updates=True,
        delay_state_averaging=args.background,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        averager_opts={"request_timeout": args.matchmaking_time / 2},  # hivemind warns unless < matchmaking_time
        state_averaging_compression=hivemind_codec(args.compression),
        verbose=True,
    )
    # hivemind.Optimizer.param_groups returns copies: the lr must be set on the wrapped torch optimizer
    inner = opt.state_averager.optimizer
    _barrier(rdv, "ready", args.rank, args.world, args.timeout)
    step_s: list[float] = []
    epochs: list[int] = []
    t_start = time.time()
    started = time.perf_counter()
    compute_s = 0.0  # forward, backward and clipping, with --slowdown's sleep
    for step in range(args.steps):
        if args.duration and time.perf_counter() - started >= args.duration:
            break
        lr = w.lr_at(step)
        for group in inner.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        w.forward_backward()
        torch.nn.utils.clip_grad_norm_(w.params, 1.0)
        if args.slowdown > 1:  # as the node's --slowdown: this peer's compute takes that many times as long
            time.sleep((args.slowdown - 1) * (time.perf_counter() - t0))
        compute_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        epochs.append(opt.local_epoch)
        w.maybe_eval(len(step_s), len(step_s) * w.tokens_per_step * args.world)
    try:  # take in a background averaging round still in flight before the final evaluation
        opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
    except Exception as e:  # noqa: BLE001 - a failed last round is data, not a crash
        logging.getLogger(__name__).warning("last averaging round: %s", e)
    w.maybe_eval(len(step_s), len(step_s) * w.tokens_per_step * args.world, force=True)
    wall = time.perf_counter() - started
    median = statistics.median(step_s) if step_s else 0.0
    comm = sum(max(0.0, s - median) for s in step_s)
    inner_s = compute_s + sum(min(s, median) for s in step_s)  # the steps without averaging's share of Optimizer.step
    width = BYTES_PER_VALUE[args.compression]
    n_bytes = sum(2 * (n - 1) / n * width * w.num_params for n in counter.groups if n > 1)
    w.write(kind="hivemind", t_start=t_start, t_end=time.time(), wall_s=wall, comm_wait_s=comm, inner_s=inner_s,
            slowdown=args.slowdown,
            comm_wait_method="measured: time inside hivemind.Optimizer.step above its median step",
            bytes_sent=int(n_bytes),
            bytes_method=f"estimate: 2(n-1)/n x {width} x params per averaging round of n peers (butterfly all-reduce, "
                         f"{args.compression} averaging), rounds counted from hivemind's log; DHT and progress-tracker "
                         "traffic not counted" + (", nor the 8-bit code tables" if args.compression == "8bit" else ""),
            compression=args.compression,
            averaging_rounds=len(counter.groups), averaging_group_sizes=counter.groups,
            averaging_failed=counter.failed, out_of_sync=counter.out_of_sync,
            epochs=epochs[-1] if epochs else 0, target_batch_size=args.inner_steps * args.batch_size * args.world,
            delay_state_averaging=args.background, matchmaking_time=args.matchmaking_time)
    _barrier(rdv, "done", args.rank, args.world, args.timeout)  # stay reachable until every peer is done
    try:
        opt.shutdown()
    finally:
        dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    ddp = sub.add_parser("ddp", help="synchronous data parallel with gloo (world 1 = single process)")
    _common(ddp)
    ddp.add_argument("--master-addr", default="127.0.0.1")
    ddp.add_argument("--master-port", type=int, default=29500)
    ddp.add_argument("--timeout", type=float, default=300)
    hm = sub.add_parser("hivemind", help="hivemind.Optimizer with use_local_updates=True")
    _common(hm)
    hm.add_argument("--rendezvous", required=True, help="folder shared by the peers (bootstrap address, barriers)")
    hm.add_argument("--host", default="127.0.0.1", help="IP the DHT listens on")
    hm.add_argument("--run-id", default="convergence")
    hm.add_argument("--inner-steps", type=int, default=30, help="local steps per epoch on every peer (H)")
    hm.add_argument("--matchmaking-time", type=float, default=1.0)
    hm.add_argument("--averaging-timeout", type=float, default=10.0)
    hm.add_argument("--compression", choices=sorted(BYTES_PER_VALUE), default="none",
                    help="hivemind's parameter averaging codec: none (fp32), fp16 (Float16Compression) or "
                         "8bit (Uniform8BitQuantization)")
    hm.add_argument("--background", action="store_true",
                    help="hivemind's default delay_state_averaging=True (average in a background thread); by default "
                         "this worker averages inside step (False): with epochs of a few seconds the background mode "
                         "lets peers drift into different epochs, miss each other's groups and wait out averaging_timeout")
    hm.add_argument("--timeout", type=float, default=300)
    hm.add_argument("--slowdown", type=float, default=1.0,
                    help="experiments: sleep (S - 1) x each step's forward and backward (the node's --slowdown)")
    hm.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds of training (0: --steps only)")
    args = parser.parse_args()
    if args.kind == "ddp":
        run_ddp(args)
    else:
        run_hivemind(args)


if __name__ == "__main__":
    main()

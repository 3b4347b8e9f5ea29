"""Stage-recovery benchmark: CheckFree and its baselines under simulated stage failures.

    python -m benchmarks.recovery --out runs/bench/recovery.json [--quick]
    python -m benchmarks.recovery --churn --out runs/bench/churn.json [--minutes 15] [--nodes 8]   # real processes

An in-process pipeline (the ``micro`` model, 4 blocks, cut into 4 stages, one AdamW per stage, the
stage code of ``swarm/``) trains on the embedded corpus. Every step each stage fails with
probability p = rate × step_seconds / 3600, the per-hour failure rates of the paper (5, 10, 16 %)
at a nominal pipeline step time (``--step-seconds``, default 300 s: a large model's pipeline step
over slow volunteer links; the real step time here is milliseconds, so at real-time rates a short
run would see no failure at all). The failure schedule is drawn once per rate and shared
by every strategy. As in the paper's CheckFree experiments, failures hit the intermediate stages
(CheckFree cannot rebuild a first or last stage); two more rows let every stage fail, for CheckFree
(first/last stage: copy the neighbour's blocks, fresh embeddings/head) and CheckFree+. Strategies:

- ``random``: fresh initialisation; ``copy``: the previous (or, for stage 0, next) neighbour's blocks;
- ``uniform``: mean of both neighbours; ``checkfree``: gradient-norm-weighted mean (first/last stage:
  copy its only neighbour, embeddings/head fresh), fresh optimizer with lr × 1.1;
- ``checkfree+``: as checkfree, plus out-of-order microbatches and embedding/head replicas, so a lost
  first/last stage is copied from its neighbour;
- ``checkpoint``: every N steps all stages are saved (timed), a failure rolls everything back to the
  last checkpoint (timed read; the steps since then are lost and redone).

Reported per rate and strategy: steps (including redone ones) and wall seconds to a target held-out
loss (the no-failure run's loss at 80 % of its budget; both read between the two evaluations that
bracket it), final held-out loss at the fixed budget, failures, and checkpoint costs. ``--rates``
picks the hourly failure rates. The report is written with ``benchmarks.results_io``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from benchmarks.curves import crossing
from node.data.byte_corpus import load_corpus
from node.data.bytes import ByteBatches, validation_batches
from swarm.models.presets import preset
from swarm.checkfree import rebuild_stage, restore_from_replica, swap_order
from swarm.stages import Stage

STRATEGIES = ("random", "copy", "uniform", "checkfree", "checkfree+", "checkpoint")


class SimPipeline:
    """S stages with their optimizers, trained in one process."""

    def __init__(self, stages: int, seed: int, plus: bool, lr: float) -> None:
        self.cfg, self.count, self.seed, self.plus, self.lr = preset("micro"), stages, seed, plus, lr
        self.stages = [Stage(self.cfg, i, stages, seed, plus=plus) for i in range(stages)]
        self.opts = [self._optimizer(s, lr) for s in self.stages]
        self.grad_norms = [0.0] * stages
        self.step_no = 0

    @staticmethod
    def _optimizer(stage: Stage, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(stage.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, order: list[int]) -> torch.Tensor:
        h = x
        for pos, s in enumerate(order):
            h = self.stages[s](h, y if pos == len(order) - 1 else None, embed=pos == 0, head=pos == len(order) - 1)
        return h

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        order = swap_order(self.count, self.step_no) if self.plus else list(range(self.count))
        for s in self.stages:
            s.train()
        loss = self.forward_loss(x, y, order)
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for i, (s, o) in enumerate(zip(self.stages, self.opts)):
            self.grad_norms[i] = float(torch.nn.utils.clip_grad_norm_(s.parameters(), 1.0))
            o.step()
        self.step_no += 1
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        for s in self.stages:
            s.eval()
        losses = [float(self.forward_loss(x, y, list(range(self.count)))) for x, y in batches]
        return sum(losses) / len(losses)

    def recover(self, i: int, strategy: str) -> None:
        cfg, n = self.cfg, self.count
        prev = self.stages[i - 1] if i > 0 else None
        nxt = self.stages[i + 1] if i < n - 1 else None
        lr = self.lr
        if strategy == "random":
            new = rebuild_stage(cfg, i, n, self.seed + 1000 + self.step_no, "random", plus=self.plus)
        elif strategy == "copy" or (strategy in ("uniform", "checkfree") and (prev is None or nxt is None)):
            new = rebuild_stage(cfg, i, n, self.seed + 1000 + self.step_no, "copy", prev=prev or nxt, plus=self.plus)
            lr = self.lr * (1.1 if strategy == "checkfree" else 1.0)
        elif strategy in ("uniform", "checkfree") or (strategy == "checkfree+" and prev is not None and nxt is not None):
            method = "uniform" if strategy == "uniform" else "checkfree"
            norms = (self.grad_norms[i - 1], self.grad_norms[i + 1])
            new = rebuild_stage(cfg, i, n, self.seed + 1000 + self.step_no, method, prev, nxt, norms, plus=self.plus)
            lr = self.lr * 1.1 if method == "checkfree" else self.lr
        elif strategy == "checkfree+":
            new = restore_from_replica(cfg, i, n, self.seed + 1000 + self.step_no, self.stages[1] if i == 0 else self.stages[n - 2],
                                       plus=True)
            lr = self.lr * 1.1
        else:
            raise ValueError(strategy)
        self.stages[i] = new
        self.opts[i] = self._optimizer(new, lr)


def failure_schedule(steps: int, stages: int, p: float, seed: int, ends: bool = False) -> dict[int, list[int]]:
    """Per step, the stages that fail (intermediate ones only unless ``ends``)."""
    rng = random.Random(seed)
    candidates = range(stages) if ends else range(1, stages - 1)
    out: dict[int, list[int]] = {}
    for step in range(steps):
        failed = [s for s in candidates if rng.random() < p]
        if failed:
            out[step] = failed
    return out


def run(strategy: str | None, steps: int, schedule: dict[int, list[int]], data: Any, val: list, eval_every: int,
        checkpoint_every: int, seed: int = 0, stages: int = 4) -> dict[str, Any]:
    torch.manual_seed(seed)
    pipe = SimPipeline(stages, seed, plus=strategy == "checkfree+", lr=2e-3)
    batches = ByteBatches(data=data, batch_size=16, context=pipe.cfg.context, seed=seed)
    curve, failures, ckpt_write, ckpt_read, lost_steps = [], 0, 0.0, 0.0, 0
    saved: tuple[int, bytes] | None = None
    started = time.monotonic()
    done = 0  # steps of progress (the step index whose failure schedule applies)
    executed = 0  # optimizer steps really run, redone ones included
    fired: set[int] = set()  # a scheduled failure happens once, not again when a restart redoes its step
    while done < steps:
        if strategy == "checkpoint" and done % checkpoint_every == 0 and (saved is None or saved[0] != done):
            t0 = time.monotonic()
            buffer = io.BytesIO()
            torch.save({"stages": [s.state_dict() for s in pipe.stages], "opts": [o.state_dict() for o in pipe.opts],
                        "data": batches.state_dict()}, buffer)
            saved = (done, buffer.getvalue())
            ckpt_write += time.monotonic() - t0
        pipe.train_step(*batches.next())
        executed += 1
        due = schedule.get(done, []) if strategy is not None and done not in fired else []
        fired.add(done)
        for s in due:
            failures += 1
            if strategy == "checkpoint":
                assert saved is not None
                t0 = time.monotonic()
                state = torch.load(io.BytesIO(saved[1]), weights_only=False)
                for stage, sd in zip(pipe.stages, state["stages"]):
                    stage.load_state_dict(sd)
                for opt, sd in zip(pipe.opts, state["opts"]):
                    opt.load_state_dict(sd)
                batches.load_state_dict(state["data"])
                ckpt_read += time.monotonic() - t0
                lost_steps += done + 1 - saved[0]
                done = saved[0] - 1
                break
            pipe.recover(s, strategy)
        done += 1
        if done % eval_every == 0 and done > 0:
            curve.append({"step": done, "executed": executed, "seconds": time.monotonic() - started, "val_loss": pipe.evaluate(val)})
    return {"strategy": strategy or "no-failure", "curve": curve, "final_val_loss": curve[-1]["val_loss"], "failures": failures,
            "executed_steps": executed, "wall_s": time.monotonic() - started, "checkpoint_write_s": ckpt_write,
            "checkpoint_read_s": ckpt_read, "lost_steps": lost_steps}


def to_target(result: dict[str, Any], target: float) -> tuple[float | None, float | None]:
    """(steps executed, seconds) when the held-out loss reached ``target``, each read between the two
    evaluations that bracket it; (None, None) when it never did."""
    curve = result["curve"]
    steps = crossing([(p["executed"], p["val_loss"]) for p in curve], target)
    seconds = crossing([(p["seconds"], p["val_loss"]) for p in curve], target)
    return (None if steps is None else round(steps, 1)), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="one failure rate (16 %%/h), 700 steps: a few minutes")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--step-seconds", type=float, default=300.0, help="nominal pipeline step time the hourly rates refer to")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--rates", help="comma-separated failure rates per stage per hour, e.g. 0.05,0.16 "
                        "(default: 0.05,0.10,0.16; 0.16 with --quick)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--churn", action="store_true", help="instead: a real-process churn run (benchmarks/churn.py), with and without kills")
    parser.add_argument("--minutes", type=float, default=15.0, help="with --churn: wall time of each run")
    parser.add_argument("--nodes", type=int, default=8, help="with --churn: nodes in the swarm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="with --churn: swarm seeds, a killed and a calm run each")
    parser.add_argument("--no-restart", action="store_true", help="with --churn: killed nodes stay dead (stages must be rebuilt)")
    args = parser.parse_args()
    meta = results_io.begin()
    torch.set_num_threads(args.threads)
    if args.churn:
        from benchmarks.churn import churn

        print(json.dumps(churn(args.out, args.nodes, args.minutes, tuple(args.seeds), restart=not args.no_restart, meta=meta), indent=2))
        return
    steps = args.steps or (700 if args.quick else 1500)
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else (0.16,) if args.quick else (0.05, 0.10, 0.16)
    corpus = load_corpus(None, context=preset("micro").context)
    val = validation_batches(corpus.val, 16, preset("micro").context, max_batches=8)
    eval_every = 50
    baseline = run(None, steps, {}, corpus.train, val, eval_every, args.checkpoint_every)
    reached = [p for p in baseline["curve"] if p["step"] <= 0.8 * steps]
    target = reached[-1]["val_loss"]
    print(f"no failure: final val {baseline['final_val_loss']:.3f}; target {target:.3f} (its loss at step {reached[-1]['step']})", flush=True)
    results: dict[str, Any] = {"steps": steps, "stages": 4, "model": "micro", "step_seconds": args.step_seconds,
                               "target_val_loss": target, "no_failure": baseline, "rates": {}}
    for rate in rates:
        p = rate * args.step_seconds / 3600
        schedule = failure_schedule(steps, 4, p, seed=int(rate * 1000))
        every_stage = failure_schedule(steps, 4, p, seed=int(rate * 1000) + 1, ends=True)
        rows = {}
        runs = [(strategy, strategy, schedule) for strategy in STRATEGIES]
        runs += [("checkfree, all stages fail", "checkfree", every_stage), ("checkfree+, all stages fail", "checkfree+", every_stage)]
        for label, strategy, plan in runs:
            res = run(strategy, steps, plan, corpus.train, val, eval_every, args.checkpoint_every)
            res["steps_to_target"], res["seconds_to_target"] = to_target(res, target)
            rows[label] = res
            print(f"rate {rate:.0%}/h (p={p:.4f}/stage/step): {label:28s} final {res['final_val_loss']:.3f} "
                  f"steps-to-target {res['steps_to_target']} failures {res['failures']} lost {res['lost_steps']}", flush=True)
        results["rates"][f"{rate:.2f}"] = {"p_per_stage_step": p, "schedule": schedule, "schedule_all_stages": every_stage, "strategies": rows}
    results_io.write(args.out, results, meta)
    print("\n| rate/h | strategy | final val loss | steps to target | seconds to target | failures | lost steps |\n|---|---|---|---|---|---|---|")
    base_steps, base_secs = to_target(baseline, target)
    print(f"| - | no failure | {baseline['final_val_loss']:.3f} | {base_steps} | {'-' if base_secs is None else f'{base_secs:.0f}'} | 0 | 0 |")
    for rate, block in results["rates"].items():
        for strategy, res in block["strategies"].items():
            secs = res["seconds_to_target"]
            print(f"| {float(rate):.0%} | {strategy} | {res['final_val_loss']:.3f} | {res['steps_to_target'] or '-'} | "
                  f"{'-' if secs is None else f'{secs:.0f}'} | {res['failures']} | {res['lost_steps']} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

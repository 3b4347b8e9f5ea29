"""Transient loss spikes of a small model: one process training the whole model against the same model
cut into a 2-stage pipeline and stepped synchronously (stage workers, no network), same seeds.

Why it exists: the whole-pipeline restart test saw a held-out loss near 9 at the stop in a few runs
of `nano` (lr 1e-3, batch 8, warm-up 10), and the checkpoint was faithful. This benchmark separates
the model's own training dynamics from the daemon: every run evaluates the held-out batches after each
step from ``--from-step`` on and records the worst loss, the largest rise between two consecutive
evaluations and the smallest RMS of the activations stage 0 hands on (the residual stream after
block 0; in one process, the same tensor inside the model). For the pipeline it also records how far
the RMS of those activations and of the gradient the last stage sends back rose above the median of
their last 64 values (what ``swarm.plausible`` bounds peers' tensors against).

The pipeline differs from one process in three ways that a run cannot separate: its head is untied
(stage 0 owns the token embedding, the last stage a copy as its head), each stage clips its own
gradient norm, and each stage's AdamW sees only its own parameters (the last is the same maths).

    python -m benchmarks.stage_spikes --out benchmarks/results/stage_spikes.json --seeds 0-23
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from benchmarks import results_io
from node.data.byte_corpus import load_corpus
from node.data.bytes import ByteBatches, validation_batches
from swarm.inner_optimizer import build_inner_optimizer
from swarm.lr_schedule import LrSchedule
from swarm.plausible import WARMUP, WINDOW, rms as tensor_rms
from swarm.models.presets import build_model, preset
from swarm.stage_worker import StageWorker
from swarm.stages import Stage, model_seed

RUN_ID = "pipe-restart"  # the restart test's run id: the same initial weights
SPIKE = 0.5  # a rise of the held-out loss between two consecutive evaluations above this counts as a spike


def _whole(cfg: Any, lr: float, schedule: LrSchedule) -> tuple[Callable, Callable]:
    torch.manual_seed(model_seed(RUN_ID))
    model = build_model(cfg)
    optimizer = build_inner_optimizer(model.named_parameters(), "adamw", lr, 0.1)
    block0: list[float] = []
    model.blocks[0].register_forward_hook(lambda _m, _i, out: block0.append(float(out.detach().pow(2).mean().sqrt())))
    steps = [0]

    def train(x: torch.Tensor, y: torch.Tensor) -> float:
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr * schedule.factor(steps[0])
        block0.clear()
        loss = model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps[0] += 1
        return block0[-1], None

    @torch.no_grad()
    def evaluate(batches: list) -> float:
        model.eval()
        return sum(float(model(x, y)[1]) for x, y in batches) / len(batches)

    return train, evaluate


def _pipeline(cfg: Any, lr: float, schedule: LrSchedule) -> tuple[Callable, Callable]:
    workers = [StageWorker(Stage(cfg, i, 2, model_seed(RUN_ID)), torch.device("cpu"), lr, 0.1, schedule=schedule) for i in range(2)]

    def train(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        h = workers[0].forward(x)
        _, grad = workers[1].loss_step(h, y)
        workers[0].backward(x, grad)
        return tensor_rms(h), tensor_rms(grad)

    def evaluate(batches: list) -> float:
        return sum(workers[1].evaluate(workers[0].forward(x), y) for x, y in batches) / len(batches)

    return train, evaluate


def run_one(kind: str, seed: int, steps: int, from_step: int, lr: float) -> dict[str, Any]:
    """One run: ``kind`` is ``whole`` or ``pipeline``; the training batches are seeded by ``seed``."""
    torch.manual_seed(seed)
    cfg = preset("nano")
    corpus = load_corpus(None, context=cfg.context)
    batches = ByteBatches(data=corpus.train, batch_size=8, context=cfg.context, seed=seed)
    held_out = validation_batches(corpus.val, 8, cfg.context, max_batches=4)
    train, evaluate = (_whole if kind == "whole" else _pipeline)(cfg, lr, LrSchedule("constant", 10))
    losses: list[tuple[int, float]] = []
    rms: list[float] = []
    grads: list[float] = []
    for step in range(1, steps + 1):
        h, g = train(*batches.next())
        rms.append(h)
        if g is not None:
            grads.append(g)
        if step >= from_step:
            losses.append((step, evaluate(held_out)))
    worst = max(losses, key=lambda s: s[1])
    rises = [b[1] - a[1] for a, b in zip(losses, losses[1:])]
    return {"kind": kind, "seed": seed, "final": losses[-1][1], "worst": worst[1], "worst_step": worst[0],
            "largest_rise": max(rises), "spikes": sum(r > SPIKE for r in rises),
            "min_stage0_rms": min(rms[from_step - 1:]), "stage0_rms_at_from_step": rms[from_step - 1],
            "max_activation_ratio": max_ratio_to_median(rms), "max_gradient_ratio": max_ratio_to_median(grads) if grads else None}


def max_ratio_to_median(values: list[float]) -> float:
    """The largest value / median of the up to WINDOW values before it (once WARMUP are known)."""
    ratios = [v / statistics.median(values[max(0, i - WINDOW):i]) for i, v in enumerate(values) if i >= WARMUP]
    return max(ratios, default=1.0)


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: runs, runs with a spike, worst loss over all runs, mean final loss."""
    out = {}
    for kind in sorted({r["kind"] for r in runs}):
        mine = [r for r in runs if r["kind"] == kind]
        out[kind] = {"runs": len(mine), "with_spike": sum(r["spikes"] > 0 for r in mine),
                     "worst": max(r["worst"] for r in mine), "final_mean": statistics.mean(r["final"] for r in mine),
                     "min_stage0_rms": min(r["min_stage0_rms"] for r in mine),
                     "max_activation_ratio": max(r["max_activation_ratio"] for r in mine),
                     "max_gradient_ratio": max((r["max_gradient_ratio"] for r in mine if r["max_gradient_ratio"] is not None), default=None)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="0-23", help="e.g. 0-23 or 0,1,2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--from-step", type=int, default=20, help="evaluate after every step from this one on")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    meta = results_io.begin()
    torch.set_num_threads(1)
    runs = []
    for seed in _seeds(args.seeds):
        for kind in ("whole", "pipeline"):  # alternated, so machine load falls on both alike
            runs.append(run_one(kind, seed, args.steps, args.from_step, args.lr))
            print(f"{kind:8s} seed {seed:2d}: worst {runs[-1]['worst']:.3f} at step {runs[-1]['worst_step']}, "
                  f"largest rise {runs[-1]['largest_rise']:+.3f}, final {runs[-1]['final']:.3f}", flush=True)
    report = {"model": "nano", "batch_size": 8, "lr": args.lr, "warmup_steps": 10, "steps": args.steps,
              "from_step": args.from_step, "spike_threshold": SPIKE, "summary": summarise(runs), "runs": runs}
    results_io.write(args.out, report, meta)
    for kind, s in report["summary"].items():
        print(f"{kind}: {s['with_spike']} of {s['runs']} runs spiked; worst {s['worst']:.3f}; mean final {s['final_mean']:.3f}")


if __name__ == "__main__":
    main()

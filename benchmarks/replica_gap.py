"""N replicas against one process on the same tokens: DiLoCo's held-out loss against one process trained with
N× the batch, for each replica count, outer recipe (η, μ, Nesterov) and H, over several seeds.

    python -m benchmarks.replica_gap --out benchmarks/results/replica_gap.json --nodes 2,4,8 \\
        --outer 0.7:0.9,1:0.9,1:0 --h 20 --total-steps 300 --seeds 0,1,2

Every run is simulated in this process (``benchmarks.replica_sim``): exact averaging, replica i of seed s
drawing batches seeded ``100·s + i``, the one-process baseline training on the concatenation of those
batches step for step (same tokens, same order, same inner optimizer, lr and schedule). Every recipe of a
replica count runs the same total inner steps per replica (``--total-steps``; ``rounds = total / H``).
The gap is the ratio of held-out losses within a seed, minus 1 (mean and range over seeds): the
noise between seeds cancels there, which a ratio of means would not. ``--outer`` entries are
``η:μ`` (Nesterov) or ``η:μ:plain`` (heavy-ball momentum, no look-ahead).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from benchmarks.replica_sim import Recipe, simulate_diloco, simulate_single
from node.data.byte_corpus import load_embedded_corpus
from node.data.bytes import validation_batches
from swarm.models.presets import PRESETS

SINGLE = "single"


def parse_outer(spec: str) -> tuple[float, float, bool]:
    """``η:μ`` or ``η:μ:plain`` → (η, μ, nesterov)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "plain"):
        raise ValueError(f"--outer entry {spec!r}: expected η:μ or η:μ:plain")
    return float(parts[0]), float(parts[1]), len(parts) == 2


def config_name(h: int, outer_lr: float, momentum: float, nesterov: bool) -> str:
    return f"H{h} η{outer_lr:g} μ{momentum:g}" + ("" if nesterov else " plain")


def gaps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (nodes, config): held-out loss over seeds, and its ratio to the one-process run of the same seed
    and replica count, minus 1 (mean, min, max over seeds)."""
    single = {(r["nodes"], r["seed"]): r["val_loss"] for r in rows if r["config"] == SINGLE}
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["nodes"], row["config"]), []).append(row)
    out = []
    for (nodes, config), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != SINGLE, kv[0][1])):
        losses = [r["val_loss"] for r in runs]
        ratios = [r["val_loss"] / single[(nodes, r["seed"])] - 1 for r in runs if (nodes, r["seed"]) in single]
        out.append({"nodes": nodes, "config": config, "seeds": len(runs),
                    "val_loss_mean": round(statistics.fmean(losses), 4),
                    "val_loss_std": round(statistics.stdev(losses), 4) if len(losses) > 1 else 0.0,
                    "gap_mean": round(statistics.fmean(ratios), 4) if ratios else None,
                    "gap_min": round(min(ratios), 4) if ratios else None,
                    "gap_max": round(max(ratios), 4) if ratios else None})
    return out


def table(result: dict[str, Any]) -> str:
    """A markdown table of the summary: one row per replica count and recipe."""
    lines = ["| replicas | recipe | held-out loss (mean ± std, n) | vs one process (mean, range) |", "|---|---|---|---|"]
    for r in result["summary"]:
        gap = "–" if r["config"] == SINGLE or r["gap_mean"] is None else (
            f"{100 * r['gap_mean']:+.1f} % ({100 * r['gap_min']:+.1f} … {100 * r['gap_max']:+.1f})")
        name = f"one process, {r['nodes']}× batch" if r["config"] == SINGLE else r["config"]
        lines.append(f"| {r['nodes']} | {name} | {r['val_loss_mean']:.3f} ± {r['val_loss_std']:.3f} (n={r['seeds']}) | {gap} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="nano")
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--outer", default="0.7:0.9", help="comma-separated η:μ or η:μ:plain")
    parser.add_argument("--h", default="20", help="comma-separated inner steps per round")
    parser.add_argument("--total-steps", type=int, default=300, help="inner steps per replica, every recipe")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--schedule", default="constant")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--no-single", action="store_true", help="skip the one-process baseline (rows of another run)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    meta = results_io.begin()
    torch.set_num_threads(args.threads)
    hs = [int(x) for x in args.h.split(",")]
    if any(args.total_steps % h for h in hs):
        parser.error(f"--total-steps {args.total_steps} must be a multiple of every H in --h {args.h}")
    outers = [parse_outer(x) for x in args.outer.split(",")]
    base = Recipe(model=args.model, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                  schedule=args.schedule, optimizer=args.optimizer)
    corpus = load_embedded_corpus()
    val = validation_batches(corpus.val, 16, PRESETS[args.model].context, max_batches=args.eval_batches)
    commit, dirty = results_io.git_state()
    env = {"commit": commit or "", "dirty": bool(dirty), "torch": torch.__version__, "python": platform.python_version(),
           "cores": os.cpu_count(), "threads": args.threads, "load_before": os.getloadavg()}
    started, rows = time.time(), []
    for nodes, seed in itertools.product([int(x) for x in args.nodes.split(",")], [int(x) for x in args.seeds.split(",")]):
        plans: list[tuple[str, Recipe]] = [] if args.no_single else [
            (SINGLE, replace(base, nodes=nodes, rounds=args.total_steps // hs[0], inner_steps=hs[0]))]
        for h, (outer_lr, momentum, nesterov) in itertools.product(hs, outers):
            plans.append((config_name(h, outer_lr, momentum, nesterov),
                          replace(base, nodes=nodes, rounds=args.total_steps // h, inner_steps=h, outer_lr=outer_lr,
                                  outer_momentum=momentum, nesterov=nesterov)))
        for name, recipe in plans:
            run = simulate_single if name == SINGLE else simulate_diloco
            row = {"nodes": nodes, "config": name, "seed": seed, **run(recipe, seed, corpus.train, val)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    env.update(load_after=os.getloadavg(), seconds=round(time.time() - started, 1))
    result = {"command": "python -m benchmarks.replica_gap " + " ".join(sys.argv[1:]), "environment": env,
              "recipe": asdict(base), "total_steps": args.total_steps, "runs": rows, "summary": gaps(rows)}
    results_io.write(args.out, result, meta)
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""N replicas against one process on the same tokens: DiLoCo's held-out loss against one process trained with
N× the batch, for each replica count, outer recipe (η, μ, Nesterov) and H, over several seeds.

    python -m benchmarks.replica_gap --out benchmarks/results/replica_gap.json --nodes 2,4,8 \\
        --outer 0.7:0.9,1:0.9,1:0 --h 20 --total-steps 300 --seeds 0,1,2

Every run is simulated in this process (``benchmarks.replica_sim``): no network, the replicas' updates
combined as a node combines them (``--aggregate``, by default a node's centered-clip), replica i of seed s
drawing batches seeded ``100·s + i``, the one-process baseline training on the concatenation of those
batches step for step (same tokens, same order, same inner optimizer, lr and schedule). Every recipe of a
replica count runs the same total inner steps per replica (``--total-steps``; ``rounds = total / H``).
The gap is the ratio of held-out losses within a seed, minus 1 (mean and range over seeds): the
noise between seeds cancels there, which a ratio of means would not. ``--outer`` entries are
``η:μ`` (Nesterov), then optionally ``:plain`` (heavy-ball momentum, no look-ahead) and ``:wN`` (η warmed
up linearly over the first N rounds, ``NesterovOuter``'s warm-up). ``--sparseloco`` adds SparseLoCo at a
node's defaults (H, codec, error feedback, outer step, aggregation: whatever ``NodeConfig`` says);
``--sparse-variants`` the same with another codec and H (``topk:32/4096+q2@30``), for the bytes frontier.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from benchmarks.replica_sim import Recipe, simulate_diloco, simulate_single
from node.config import NodeConfig
from node.data.byte_corpus import load_embedded_corpus
from node.data.bytes import validation_batches
from swarm.models.presets import PRESETS

SINGLE = "single"
SPARSELOCO = "SparseLoCo defaults"


def sparseloco_recipe(base: Recipe, nodes: int) -> Recipe:
    """``base`` with what a node running ``--algorithm sparseloco`` uses by default among ``nodes`` replicas: H,
    codec, error-feedback β, outer η and μ, outer warm-up and aggregation, read from ``NodeConfig`` so the run
    follows the defaults."""
    cfg = NodeConfig(algorithm="sparseloco")
    outer_lr, momentum = cfg.outer_hyper
    h = cfg.steps_for(nodes) or cfg.median_steps(nodes)  # auto: the median-speed peer's H (equal speeds here)
    return replace(base, nodes=nodes, inner_steps=h, rounds=base.total_steps // h, codec=cfg.codec,
                   feedback_decay=cfg.feedback_decay(), outer_lr=outer_lr, outer_momentum=momentum, nesterov=True,
                   outer_warmup_rounds=cfg.outer_warmup, aggregate=cfg.aggregation)


def parse_outer(spec: str) -> tuple[float, float, bool, int]:
    """``η:μ`` followed by optional ``:plain`` (heavy-ball, no Nesterov look-ahead) and ``:wN`` (outer lr
    warmed up over N rounds) → (η, μ, nesterov, warm-up rounds)."""
    parts = spec.split(":")
    extras = parts[2:]
    if len(parts) < 2 or any(x != "plain" and not (x.startswith("w") and x[1:].isdigit()) for x in extras):
        raise ValueError(f"--outer entry {spec!r}: expected η:μ, then optionally :plain and :wN")
    warmup = next((int(x[1:]) for x in extras if x.startswith("w")), 0)
    return float(parts[0]), float(parts[1]), "plain" not in extras, warmup


def config_name(h: int, outer_lr: float, momentum: float, nesterov: bool, warmup: int = 0) -> str:
    return f"H{h} η{outer_lr:g} μ{momentum:g}" + ("" if nesterov else " plain") + (f" warm-up {warmup}" if warmup else "")


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
                    "bytes_per_inner_step": round(statistics.fmean(r.get("bytes_per_node_round", 0) / r.get("h", 1) for r in runs), 1),
                    "gap_mean": round(statistics.fmean(ratios), 4) if ratios else None,
                    "gap_min": round(min(ratios), 4) if ratios else None,
                    "gap_max": round(max(ratios), 4) if ratios else None})
    return out


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    """The gap to one process against the replica count, one line per recipe (mean, bars: min to max over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in sorted({s["config"] for s in summary if s["config"] != SINGLE}):
        rows = sorted((s for s in summary if s["config"] == config and s["gap_mean"] is not None), key=lambda s: s["nodes"])
        nodes = [s["nodes"] for s in rows]
        mean = [100 * s["gap_mean"] for s in rows]
        spread = [[100 * (s["gap_mean"] - s["gap_min"]) for s in rows], [100 * (s["gap_max"] - s["gap_mean"]) for s in rows]]
        ax.errorbar(nodes, mean, yerr=spread, marker="o", capsize=3, label=config)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({s["nodes"] for s in summary}), labels=[str(n) for n in sorted({s["nodes"] for s in summary})])
    ax.set_xlabel("replicas")
    ax.set_ylabel("held-out loss vs one process on the same tokens (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_WORKER: dict[str, Any] = {}


def _init_worker(threads: int, model: str, eval_batches: int) -> None:
    torch.set_num_threads(threads)
    corpus = load_embedded_corpus()
    _WORKER.update(train=corpus.train, val=validation_batches(corpus.val, 16, PRESETS[model].context, max_batches=eval_batches))


def _run_task(task: tuple[int, str, int, Recipe]) -> dict[str, Any]:
    nodes, name, seed, recipe = task
    run = simulate_single if name == SINGLE else simulate_diloco
    return {"nodes": nodes, "config": name, "seed": seed, "h": recipe.inner_steps, "codec": recipe.codec,
            **run(recipe, seed, _WORKER["train"], _WORKER["val"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", action="store_true", help="only draw --out's plot (FILE.png beside it) from its summary")
    parser.add_argument("--model", default="nano")
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--outer", default="0.7:0.9", help="comma-separated η:μ[:plain][:wN]")
    parser.add_argument("--h", default="20", help="comma-separated inner steps per round")
    parser.add_argument("--total-steps", type=int, default=300, help="inner steps per replica, every recipe")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--schedule", default="constant")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--aggregate", default="centered-clip",
                        help="how the replicas' updates are combined (gossip.aggregate; a node's default: centered-clip)")
    parser.add_argument("--sparseloco", action="store_true", help="also run SparseLoCo at a node's defaults")
    parser.add_argument("--sparse-variants", default="",
                        help="comma-separated CODEC@H: SparseLoCo at a node's defaults but this codec and H")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--no-single", action="store_true", help="skip the one-process baseline (rows of another run)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense DiLoCo recipes (--h × --outer)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.out.read_text())["summary"], args.out.with_suffix(".png"))
        return
    meta = results_io.begin()
    hs = [int(x) for x in args.h.split(",")]
    outers = [parse_outer(x) for x in args.outer.split(",")]
    base = Recipe(model=args.model, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                  schedule=args.schedule, optimizer=args.optimizer, aggregate=args.aggregate,
                  rounds=args.total_steps // hs[0], inner_steps=hs[0])
    node_counts = [int(x) for x in args.nodes.split(",")]
    variants: dict[tuple[int, str], Recipe] = {}
    for nodes in node_counts:
        sparse = sparseloco_recipe(base, nodes)
        if args.sparseloco:
            variants[nodes, SPARSELOCO] = sparse
        for spec in filter(None, args.sparse_variants.split(",")):
            codec, _, h = spec.rpartition("@")
            if not codec or not h.isdigit():
                parser.error(f"--sparse-variants entry {spec!r}: expected CODEC@H, e.g. topk:32/4096+q2@30")
            variants[nodes, f"SparseLoCo {codec} H{h}"] = replace(sparse, codec=codec, inner_steps=int(h), rounds=args.total_steps // int(h))
    if any(args.total_steps % h for h in hs + [v.inner_steps for v in variants.values()]):
        parser.error(f"--total-steps {args.total_steps} must be a multiple of every H (--h {args.h}, SparseLoCo's)")
    commit, dirty = results_io.git_state()
    env = {"commit": commit or "", "dirty": bool(dirty), "torch": torch.__version__, "python": platform.python_version(),
           "cores": os.cpu_count(), "threads": args.threads, "jobs": args.jobs, "load_before": os.getloadavg()}
    tasks = []
    for nodes, seed in itertools.product(node_counts, [int(x) for x in args.seeds.split(",")]):
        if not args.no_single:
            tasks.append((nodes, SINGLE, seed, replace(base, nodes=nodes)))
        tasks.extend((nodes, name, seed, recipe) for (n, name), recipe in variants.items() if n == nodes)
        for h, (outer_lr, momentum, nesterov, warmup) in itertools.product([] if args.no_dense else hs, outers):
            tasks.append((nodes, config_name(h, outer_lr, momentum, nesterov, warmup), seed,
                          replace(base, nodes=nodes, rounds=args.total_steps // h, inner_steps=h, outer_lr=outer_lr,
                                  outer_momentum=momentum, nesterov=nesterov, outer_warmup_rounds=warmup)))
    started, rows = time.time(), []
    # the largest runs first, so the last to finish are short ones; every run is deterministic whatever process runs it
    tasks.sort(key=lambda t: -t[3].nodes)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                             initargs=(args.threads, args.model, args.eval_batches)) as pool:
        for row in pool.map(_run_task, tasks):
            rows.append(row)
            print(json.dumps(row), flush=True)
    env.update(load_after=os.getloadavg(), seconds=round(time.time() - started, 1))
    result = {"command": "python -m benchmarks.replica_gap " + " ".join(sys.argv[1:]), "environment": env,
              "recipe": asdict(base), "total_steps": args.total_steps, "runs": rows, "summary": gaps(rows)}
    results_io.write(args.out, result, meta)
    plot(result["summary"], args.out.with_suffix(".png"))
    for row in result["summary"]:
        print(json.dumps(row))
    print(f"wrote {args.out} (its table: python -m benchmarks.tables, `replica_gap`)")


if __name__ == "__main__":
    main()

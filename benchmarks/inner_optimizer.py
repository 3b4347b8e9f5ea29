"""Inner optimizer and lr schedule benchmark: AdamW against Muon (MuLoCo), constant against cosine inner lr,
dense DiLoCo and DiLoCo with the q2 codec, held-out loss at equal inner steps over several seeds.

    python -m benchmarks.inner_optimizer --out benchmarks/results/inner_optimizer.json

Every run is N replicas of one model trained in this process, one after another, with the pieces a node
uses: ``LocalTrainer`` (the inner optimizer ``--inner-optimizer`` and lr schedule ``--lr-schedule`` as a
node builds them, one ``--lr`` for both optimizers: Muon's update is RMS-matched to AdamW's), the embedded
corpus (replica i its own data seed, all replicas the same initialisation), the codec with the node's
error feedback, the mean of the decoded pseudo-gradients, and the outer step a node runs with these
settings by default (``NodeConfig.outer_hyper`` and ``outer_warmup``: dense Nesterov η 1, μ 0.7 since
the replica-gap measurement, 0.7/0.9 before it; q2 η 1, μ 0.5 over a 5-round warm-up). No network: the
averaging is exact, what differs between the configurations is the inner steps. The held-out loss is
φ's after the last round on the corpus's held-out split, in nats per byte; every configuration sees the
same tokens (same seeds, steps, batches).
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
from benchmarks.replica_sim import Recipe, simulate_diloco
from node.config import NodeConfig
from node.data.byte_corpus import load_embedded_corpus
from node.data.bytes import validation_batches
from swarm.models.presets import PRESETS


EVAL_BATCHES = 16


def run_one(base: Recipe, optimizer: str, schedule: str, codec_spec: str, seed: int, corpus: Any, val: list) -> dict[str, Any]:
    """One simulated DiLoCo run of ``base`` with the node's outer defaults for the codec; returns its held-out
    loss and the averaging bytes one node sends per round."""
    cfg = NodeConfig(model=base.model, algorithm="diloco", compression=codec_spec)
    outer_lr, momentum = cfg.outer_hyper
    recipe = replace(base, schedule=schedule, optimizer=optimizer, codec=codec_spec, outer_lr=outer_lr, outer_momentum=momentum,
                     nesterov=True, outer_warmup_rounds=cfg.outer_warmup, feedback_decay=cfg.feedback_decay())
    return {"optimizer": optimizer, "schedule": schedule, "codec": codec_spec, "seed": seed,
            **simulate_diloco(recipe, seed, corpus.train, val)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean, sample standard deviation and range of the held-out loss per configuration, and the change of the
    mean against AdamW with a constant lr on the same codec."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for row in rows:
        groups.setdefault((row["codec"], row["optimizer"], row["schedule"]), []).append(row["val_loss"])
    means = {k: statistics.fmean(v) for k, v in groups.items()}
    out = []
    for (codec, optimizer, schedule), losses in groups.items():
        base = means.get((codec, "adamw", "constant"))
        out.append({"codec": codec, "optimizer": optimizer, "schedule": schedule, "seeds": len(losses),
                    "val_loss_mean": round(means[(codec, optimizer, schedule)], 4),
                    "val_loss_std": round(statistics.stdev(losses), 4) if len(losses) > 1 else 0.0,
                    "val_loss_min": round(min(losses), 4), "val_loss_max": round(max(losses), 4),
                    "vs_adamw_constant": None if base is None else round(means[(codec, optimizer, schedule)] / base - 1, 4)})
    return out


def table(result: dict[str, Any]) -> str:
    """A markdown table of the summary."""
    lines = ["| codec | inner optimizer | lr schedule | held-out loss (mean ± std, n) | vs adamw constant |", "|---|---|---|---|---|"]
    for r in result["summary"]:
        change = "–" if r["vs_adamw_constant"] is None else f"{100 * r['vs_adamw_constant']:+.1f} %"
        lines.append(f"| {r['codec']} | {r['optimizer']} | {r['schedule']} | {r['val_loss_mean']:.3f} ± {r['val_loss_std']:.3f} "
                     f"(n={r['seeds']}) | {change} |")
    return "\n".join(lines)


def _environment() -> dict[str, Any]:
    commit, dirty = results_io.git_state()
    return {"commit": commit or "", "dirty": bool(dirty), "torch": torch.__version__, "python": platform.python_version(),
            "cores": os.cpu_count(), "load_before": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--schedules", default="constant,cosine")
    parser.add_argument("--codecs", default="none,q2")
    parser.add_argument("--model", default=Recipe.model)
    parser.add_argument("--nodes", type=int, default=Recipe.nodes)
    parser.add_argument("--rounds", type=int, default=Recipe.rounds)
    parser.add_argument("--inner-steps", type=int, default=Recipe.inner_steps)
    parser.add_argument("--lr", type=float, default=Recipe.lr)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    meta = results_io.begin()
    torch.set_num_threads(args.threads)
    s = Recipe(model=args.model, nodes=args.nodes, rounds=args.rounds, inner_steps=args.inner_steps, lr=args.lr)
    corpus = load_embedded_corpus()
    val = validation_batches(corpus.val, 16, PRESETS[s.model].context, max_batches=EVAL_BATCHES)
    env = _environment()
    started = time.time()
    rows = []
    for codec, optimizer, schedule, seed in itertools.product(args.codecs.split(","), args.optimizers.split(","),
                                                             args.schedules.split(","), [int(x) for x in args.seeds.split(",")]):
        row = run_one(s, optimizer, schedule, codec, seed, corpus, val)
        rows.append(row)
        print(json.dumps(row), flush=True)
    env.update(load_after=os.getloadavg(), seconds=round(time.time() - started, 1), cpu_seconds=round(time.process_time(), 1))
    result = {"command": "python -m benchmarks.inner_optimizer " + " ".join(sys.argv[1:]), "environment": env,
              "settings": asdict(s), "runs": rows, "summary": summarize(rows)}
    results_io.write(args.out, result, meta)
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

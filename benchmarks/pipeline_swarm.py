"""Pipeline benchmark: rebalancing, activation codecs, and loss against a single process.

    python -m benchmarks.pipeline_swarm --out runs/bench/pipeline.json [--quick]

Real processes on loopback (``node swarm`` machinery), 2 stages, one trainer with 8 microbatches in
flight. Heterogeneous stage servers are emulated with ``--slowdown`` (a server sleeps so each request
takes that many times longer; the sleep leaves the CPU to the others, so on this 2-core machine the
speeds really differ by those factors).

1. Rebalancing: servers A, B, C on stage 0 and a slower D on stage 1 (the bottleneck), run with and
   without rebalancing, and the optimal assignment (A, B | C, D) started directly. Reported:
   trainer samples/s over the last 40 % of each run and its fraction of the optimal run's.
2. Bytes per sample across stage boundaries for each activation codec (trainer's stage traffic).
3. Held-out loss after a fixed number of microbatches through the pipeline vs the same model and
   optimizer trained by one process on the same number of batches.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from node.cli.app import parse_join_args
from node.ops.launcher import SwarmLauncher
from node.ops.progress import scrape, total

BASE = ["--model", "tiny", "--batch-size", "8", "--threads", "1", "--warmup-steps", "20", "--eval-batches", "8",
        "--stages", "2", "--sync-every", "10", "--microbatches", "8", "--eval-every", "0", "--averaging-timeout", "10"]


def _server(stage: int, slowdown: float) -> list[str]:
    return ["--role", "stage", "--stage", str(stage), "--slowdown", str(slowdown)]


def run_swarm(name: str, workdir: Path, node_args: dict[int, list[str]], duration: float, extra: list[str] | None = None,
              ) -> dict[str, Any]:
    """Launch the nodes, sample the trainer's step counter every second, return the report and the series."""
    join_args = [*BASE, "--run-id", f"bench-{name}", *(extra or [])]
    launcher = SwarmLauncher(nodes=len(node_args), duration=duration, report=workdir / name / "report.json", metrics_port=0,
                             run_dir=workdir / name, join_args=join_args, config=parse_join_args(join_args), node_args=node_args)
    trainer = max(node_args)
    series: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            metrics = scrape(launcher.nodes[trainer].metrics_port)
            if metrics:
                series.append((time.time() - launcher.t0, total(metrics, "locomesh_inner_steps_total")))
            time.sleep(1.0)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    code = launcher.run()
    done.set()
    thread.join()
    report = json.loads((workdir / name / "report.json").read_text())
    return {"exit": code, "report": report, "series": series}


def tail_rate(series: list[tuple[float, float]], fraction: float = 0.4) -> float:
    """Steps/s over the last ``fraction`` of the sampled interval."""
    live = [(t, s) for t, s in series if s > 0]
    if len(live) < 3:
        return 0.0
    t_end, s_end = live[-1]
    start = t_end - fraction * (t_end - live[0][0])
    t0, s0 = min(live, key=lambda p: abs(p[0] - start))
    return (s_end - s0) / max(t_end - t0, 1e-9)


def single_process_loss(steps: int, seed: int = 0) -> float:
    from node.data.byte_corpus import load_corpus
    from node.data.bytes import ByteBatches, validation_batches
    from swarm.models.presets import preset
    from node.runtime.local_training import LocalTrainer

    torch.set_num_threads(2)
    cfg = preset("tiny")
    corpus = load_corpus(None, context=cfg.context)
    trainer = LocalTrainer(cfg=cfg, device=torch.device("cpu"), lr=1e-3, weight_decay=0.1, warmup_steps=20, seed=seed)
    batches = ByteBatches(data=corpus.train, batch_size=8, context=cfg.context, seed=seed)
    for _ in range(steps):
        trainer.step(*batches.next())
    return trainer.evaluate(validation_batches(corpus.val, 8, cfg.context, max_batches=8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 8 minutes in all)")
    parser.add_argument("--parts", default="rebalancing,codecs,budget", help="comma-separated subset of the three parts")
    parser.add_argument("--duration", type=float, help="seconds of each rebalancing run (default 150, 75 with --quick)")
    parser.add_argument("--codec-duration", type=float, help="seconds of each activation codec run (default 60, 35 with --quick)")
    parser.add_argument("--budget-duration", type=float, help="seconds of the equal-budget run (default 240, 90 with --quick)")
    args = parser.parse_args()
    meta = results_io.begin()
    duration = args.duration or (75.0 if args.quick else 150.0)
    workdir = Path(tempfile.mkdtemp(prefix="locomesh-pipeline-"))
    results: dict[str, Any] = {"duration_s": duration, "setup": "2 stages; A,B,C slowdown 3, D slowdown 6; 1 trainer, 8 microbatches in flight"}

    layouts = {
        "imbalanced": ({0: _server(0, 3), 1: _server(1, 6), 2: _server(0, 3), 3: _server(0, 3), 4: ["--role", "trainer"]},
                       ["--rebalance-period", "0"]),
        "rebalancing": ({0: _server(0, 3), 1: _server(1, 6), 2: _server(0, 3), 3: _server(0, 3), 4: ["--role", "trainer"]},
                        ["--rebalance-period", "15"]),
        "optimal": ({0: _server(0, 3), 1: _server(1, 6), 2: _server(0, 3), 3: _server(1, 3), 4: ["--role", "trainer"]},
                    ["--rebalance-period", "0"]),
    }
    parts = set(args.parts.split(","))
    rates = {}
    for name, (node_args, extra) in layouts.items() if "rebalancing" in parts else []:
        run = run_swarm(name, workdir, node_args, duration, extra)
        rates[name] = tail_rate(run["series"])
        moves = [e for e in run["report"]["events"] if e["event"] in ("rebalance", "stage_moved")]
        results[name] = {"samples_per_s": rates[name] * 8, "steps_per_s": rates[name], "exit": run["exit"], "moves": moves,
                         "trainer_steps": run["report"]["nodes"][-1]["steps"], "series": run["series"]}
        print(f"{name}: {rates[name] * 8:.1f} samples/s, moves {[(m.get('from_stage'), m.get('to_stage')) for m in moves if m['event'] == 'rebalance']}", flush=True)
    for name in ("imbalanced", "rebalancing") if "rebalancing" in parts else []:
        results[name]["fraction_of_optimal"] = rates[name] / rates["optimal"] if rates["optimal"] else math.nan

    codec_duration = args.codec_duration or (35.0 if args.quick else 60.0)
    results["activation_codecs"] = {}
    for codec in ("none", "fp16", "int8-block") if "codecs" in parts else []:
        node_args = {0: _server(0, 1), 1: _server(1, 1), 2: ["--role", "trainer"]}
        run = run_swarm(f"codec-{codec}", workdir, node_args, codec_duration, ["--activation-compression", codec])
        trainer = run["report"]["nodes"][-1]
        stage_bytes = trainer["bytes_sent_by_kind"].get("stage", 0) + trainer["bytes_received_by_kind"].get("stage", 0)
        samples = trainer["steps"] * 8
        results["activation_codecs"][codec] = {"bytes_per_sample": stage_bytes / samples if samples else None, "steps": trainer["steps"],
                                               "train_loss_last": trainer["train_loss_last"], "val_loss": trainer["val_loss"]}
        print(f"activations {codec}: " + (f"{stage_bytes / samples / 1e3:.1f} kB per sample" if samples else
                                         f"no step in {codec_duration:.0f} s (the nodes did not start in time)"), flush=True)

    # equal budget: the single process trains on as many batches as the pipeline's trainer got through
    if "budget" in parts:
        _budget(results, workdir, args.budget_duration or (90.0 if args.quick else 240.0))
    results_io.write(args.out, results, meta)
    if "rebalancing" in parts:
        print("| run | samples/s | fraction of optimal |\n|---|---|---|")
        for name in ("imbalanced", "rebalancing", "optimal"):
            print(f"| {name} | {results[name]['samples_per_s']:.1f} | {results[name].get('fraction_of_optimal', 1.0):.2f} |")
    print(f"wrote {args.out}")


def _budget(results: dict[str, Any], workdir: Path, seconds: float) -> None:
    node_args = {0: _server(0, 1), 1: _server(1, 1), 2: ["--role", "trainer"]}
    run = run_swarm("budget", workdir, node_args, seconds)
    trainer = run["report"]["nodes"][-1]
    budget = trainer["steps"]
    results["fixed_budget"] = {"batches": budget, "pipeline_val_loss": trainer["val_loss"],
                               "single_process_val_loss": single_process_loss(budget)}
    print(f"after {budget} batches: pipeline val {trainer['val_loss']:.3f}, one process {results['fixed_budget']['single_process_val_loss']:.3f}")


if __name__ == "__main__":
    main()

"""Byzantine benchmark: held-out loss of DiLoCo and SparseLoCo under each attack, for each aggregator.

    python -m benchmarks.byzantine --out runs/bench/byzantine.json [--scale quick|full] [--seeds 0,1]

Every run is N replicas of one model trained in this process, one after another, with the real
pieces a node uses: ``LocalTrainer`` (inner AdamW), the embedded corpus (each replica its own data
seed), ``gossip.aggregate`` with the run's sample cap (batch size × H), ``gossip.byzantine`` for the
attackers and the outer step, codec, error feedback and H of the algorithm as ``NodeConfig``'s defaults
set them (H by replica count, ``--inner-steps by-replicas``; every config runs the same inner steps in
all, the scale's rounds × H, so fewer rounds where H is larger). An aggregator named ``X+scores`` is
``X`` after the contribution screen (``gossip.scores``, the node's ``--contribution-scores``), with
the node's own scorer (``node.replica.scoring``). No network: what is measured is what the
aggregation lets through, which is where an attack acts; the live test (tests/integration/
test_byzantine_swarm.py) shows the same defence in real daemons.

Attackers train like everyone else and then send their attack instead of their update; ``alie`` and
``ipm`` read the honest updates of the round (the exchange is open). The clean run of each
aggregator uses the same seeds and steps. The held-out loss is φ's on the held-out plays, in nats
per byte; "vs clean" is the ratio to the clean run of *mean* (the plain baseline) at the same seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from compression import get_codec
from compression.feedback import ErrorFeedback
from gossip.aggregate import aggregate
from gossip.byzantine import Attacker, parse_attacks
from gossip.outer import NesterovOuter
from gossip.scores import ContributionScorer
from node.config import NodeConfig
from node.data.byte_corpus import load_embedded_corpus
from node.data.bytes import ByteBatches, validation_batches
from node.replica.scoring import SCORE_SEED, ModelLoss, score_rows, scoring_batches
from node.runtime.local_training import LocalTrainer
from swarm.models.presets import PRESETS

ATTACKS = ("samples", "scale:50", "sign", "noise", "alie", "ipm", "stale", "concentrate")


@dataclass
class Scale:
    model: str
    rounds: int
    inner_steps: int  # 0: the node's default H for each replica count (the scale's inner steps in all stay rounds × 20)
    batch_size: int
    eval_batches: int
    configs: tuple[tuple[int, int], ...]  # (nodes, attackers)


SCALES = {
    "quick": Scale("nano", 12, 0, 16, 8, ((4, 1), (8, 2))),
    "full": Scale("tiny", 20, 0, 16, 16, ((4, 1), (8, 2))),
}
TOTAL_STEPS_PER_ROUND = 20  # with inner_steps 0: a run's inner steps are rounds × this, whatever H
ALGORITHMS = {  # aggregators compared per algorithm; the first is the plain baseline
    "diloco": ("mean", "centered-clip", "centered-clip+scores", "trimmed-mean", "median-clip"),
    "sparseloco": ("sparse-mean", "sparse-clip", "sparse-clip+scores"),
}


def schedule(algorithm: str, nodes: int, scale: Scale) -> tuple[int, int]:
    """(rounds, H) of a run: the scale's, or the node's default H with the same inner steps in all."""
    if scale.inner_steps:
        return scale.rounds, scale.inner_steps
    h = NodeConfig(algorithm=algorithm).steps_for(nodes)
    assert h is not None
    return max(1, scale.rounds * TOTAL_STEPS_PER_ROUND // h), h


def run_one(algorithm: str, method: str, attack: str | None, nodes: int, attackers: int, seed: int,
            scale: Scale, corpus: Any, val: list) -> dict[str, Any]:
    """One simulated run; returns its held-out loss and what the aggregator and the screen dropped or clipped."""
    cfg = PRESETS[scale.model]
    defaults = NodeConfig(algorithm=algorithm)
    rounds, h = schedule(algorithm, nodes, scale)
    trainers = [LocalTrainer(cfg=cfg, device=torch.device("cpu"), lr=1e-3, warmup_steps=20, seed=1000 + seed) for _ in range(nodes)]
    data = [ByteBatches(data=corpus.train, batch_size=scale.batch_size, context=cfg.context, seed=seed * 100 + i) for i in range(nodes)]
    phi = [p.detach().clone() for p in trainers[0].parameters()]
    sparse = algorithm == "sparseloco"
    outer_lr, outer_momentum = defaults.outer_hyper
    outer = NesterovOuter(lr=outer_lr, momentum=outer_momentum, nesterov=algorithm == "diloco")
    codec = get_codec(defaults.codec) if sparse else None
    feedback = [[ErrorFeedback(defaults.feedback_decay()) for _ in phi] for _ in range(nodes)] if sparse else None
    method, scored = method.removesuffix("+scores"), method.endswith("+scores")
    scorer = None
    if scored:
        batches = scoring_batches(ByteBatches(data=corpus.train, batch_size=score_rows(cfg.context), context=cfg.context, seed=SCORE_SEED))
        scorer = ContributionScorer(ModelLoss(cfg, batches, torch.device("cpu")).loss_for)
    hostile = {nodes - 1 - k: Attacker(parse_attacks(attack), seed=seed * 31 + k) for k in range(attackers)} if attack else {}
    peers = [f"peer{i:02d}" for i in range(nodes)]
    max_samples = scale.batch_size * h
    clipped_honest = dropped_honest = screened_honest = screened_hostile = 0
    t0 = time.time()
    for r in range(rounds):
        deltas = []
        for i, (trainer, batches) in enumerate(zip(trainers, data)):
            trainer.load_weights(phi)
            for _ in range(h):
                trainer.step(*batches.next())
            delta = [p.detach() - t.detach() for p, t in zip(phi, trainer.parameters())]
            if sparse:
                decoded = []
                for d, ef in zip(delta, feedback[i]):
                    decoded.append(codec.decode(codec.encode(d, state=ef)))
                delta = decoded
            deltas.append(delta)
        honest = [deltas[i] for i in range(nodes) if i not in hostile]
        sent, samples = [], []
        for i, delta in enumerate(deltas):
            if i in hostile:
                d, s = hostile[i].contribution(delta, max_samples, honest=honest)
                if sparse:  # what travels is a top-k payload: the attack is encoded like any update
                    d = [codec.decode(codec.encode(t)) for t in d]
            else:
                d, s = delta, max_samples
            sent.append(d)
            samples.append(s)
        members = list(range(nodes))
        if scorer is not None:
            shown = scorer(r, phi, {peers[i]: sent[i] for i in members})
            screened_honest += sum(1 for p in shown.dropped if int(p[4:]) not in hostile)
            screened_hostile += sum(1 for p in shown.dropped if int(p[4:]) in hostile)
            members = [i for i in members if peers[i] not in shown.dropped]
            if not members:
                continue
        agg = aggregate([peers[i] for i in members], [sent[i] for i in members], [samples[i] for i in members], method,
                        max_samples=max_samples)
        clipped_honest += sum(1 for p in agg.clipped if int(p[4:]) not in hostile)
        dropped_honest += sum(1 for p in agg.dropped if int(p[4:]) not in hostile)
        outer.step(phi, agg.update, round_no=r)
    trainers[0].load_weights(phi)
    loss = trainers[0].evaluate(val)
    row = {"algorithm": algorithm, "aggregator": method + ("+scores" if scored else ""), "attack": attack or "none", "nodes": nodes,
           "attackers": attackers, "seed": seed, "rounds": rounds, "inner_steps": h, "val_loss": loss,
           "honest_clipped": clipped_honest, "honest_dropped": dropped_honest, "seconds": round(time.time() - t0, 1)}
    if scored:
        row.update(honest_screened=screened_honest, hostile_screened=screened_hostile)
    return row


def _environment() -> dict[str, Any]:
    commit, dirty = results_io.git_state()
    return {"commit": commit or "", "dirty": bool(dirty), "torch": torch.__version__, "python": platform.python_version(),
            "cores": os.cpu_count(), "load_before": os.getloadavg()}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean held-out loss per (algorithm, config, attack, aggregator) over seeds, and its ratio to the
    clean run of the algorithm's plain aggregator at the same seeds."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["algorithm"], row["nodes"], row["attackers"], row["attack"], row["aggregator"])
        groups.setdefault(key, []).append(row)
    out = []
    for (algorithm, nodes, attackers, attack, method), runs in sorted(groups.items()):
        base = ALGORITHMS[algorithm][0]
        clean = {r["seed"]: r["val_loss"] for r in rows if r["algorithm"] == algorithm and r["nodes"] == nodes
                 and r["attack"] == "none" and r["aggregator"] == base}
        losses = [r["val_loss"] for r in runs]
        ratios = [r["val_loss"] / clean[r["seed"]] - 1 for r in runs if r["seed"] in clean]
        out.append({"algorithm": algorithm, "nodes": nodes, "attackers": attackers if attack != "none" else 0,
                    "attack": attack, "aggregator": method, "seeds": len(runs),
                    "val_loss": sum(losses) / len(losses), "spread": max(losses) - min(losses),
                    "vs_clean_plain": sum(ratios) / len(ratios) if ratios else None,
                    "honest_clipped": sum(r["honest_clipped"] for r in runs),
                    "honest_dropped": sum(r["honest_dropped"] for r in runs)})
    return out


def markdown_table(result: dict[str, Any], source: str) -> str:
    """One row per (config, attack), one column per aggregator: mean held-out loss over the seeds and its
    change against the clean run of the plain aggregator; the file and commit it came from."""
    rows = result["summary"]
    order = ALGORITHMS[result["runs"][0]["algorithm"]]
    methods = sorted(dict.fromkeys(r["aggregator"] for r in rows), key=lambda m: order.index(m) if m in order else len(order))
    keys = list(dict.fromkeys((r["nodes"], r["attackers"], r["attack"]) for r in rows))
    env = result["environment"]
    lines = [f"`{source}` (commit {env['commit'][:7]}{', dirty' if env['dirty'] else ''}, {result['runs'][0]['algorithm']}, "
             f"{result['scale']['model']}, {result['scale']['rounds']} rounds × H {result['scale']['inner_steps']}, "
             f"seeds {sorted({r['seed'] for r in result['runs']})})", "",
             "| nodes | attack | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for nodes, attackers, attack in keys:
        cells = []
        for m in methods:
            row = next((r for r in rows if (r["nodes"], r["attackers"], r["attack"], r["aggregator"]) == (nodes, attackers, attack, m)), None)
            cells.append("–" if row is None else f"{row['val_loss']:.3f} ({100 * row['vs_clean_plain']:+.1f} %)")
        who = f"{nodes}" if attack == "none" else f"{nodes} ({attackers} attacking)"
        lines.append(f"| {who} | {attack} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(files: list[Path], out: Path) -> None:
    """One results file from several runs of the same algorithm and scale: their runs, a summary of all,
    and each part's meta, command and environment."""
    parts = [json.loads(f.read_text()) for f in files]
    settings = {json.dumps({k: v for k, v in p["scale"].items() if k != "configs"}, sort_keys=True) for p in parts}
    if len(settings) != 1 or len({p["runs"][0]["algorithm"] for p in parts}) != 1:
        raise SystemExit("--merge: the files differ in algorithm or scale")
    rows = [r for p in parts for r in p["runs"]]
    configs = [c for p in parts for c in p["scale"]["configs"]]
    results_io.write_json(out, {"meta": [p["meta"] for p in parts], "command": [p["command"] for p in parts],
                                "environment": [p["environment"] for p in parts],
                                "scale": {**parts[0]["scale"], "configs": list(dict.fromkeys(map(tuple, configs)))},
                                "parts": [str(f) for f in files], "runs": rows, "summary": summarize(rows)})
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, nargs="+", help="print the markdown table of these results files and exit")
    parser.add_argument("--merge", type=Path, nargs="+", help="combine results files of one algorithm and scale (e.g. "
                        "one process per --configs, run side by side) into --out, with every part's meta, and exit")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--scale", choices=sorted(SCALES), default="quick")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated attacks (each may carry :PARAM)")
    parser.add_argument("--algorithms", default="diloco,sparseloco")
    parser.add_argument("--aggregators", default="", help="comma-separated; default: every aggregator of ALGORITHMS "
                        "(the plain one is always run: it is the baseline)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, help="outer rounds (default: the scale's)")
    parser.add_argument("--inner-steps", type=int, help="H (default: the scale's)")
    parser.add_argument("--configs", help="comma-separated NODES:ATTACKERS, e.g. 4:1,8:2 (default: the scale's)")
    args = parser.parse_args()
    if args.table:
        print("\n\n".join(markdown_table(json.loads(f.read_text()), str(f)) for f in args.table))
        return
    if args.out is None:
        parser.error("--out is required to run the benchmark")
    if args.merge:
        merge(args.merge, args.out)
        return
    meta = results_io.begin()
    torch.set_num_threads(args.threads)
    scale = SCALES[args.scale]
    if args.rounds is not None:
        scale = dataclasses.replace(scale, rounds=args.rounds)
    if args.inner_steps is not None:
        scale = dataclasses.replace(scale, inner_steps=args.inner_steps)
    if args.configs:
        pairs = tuple(tuple(int(x) for x in c.split(":")) for c in args.configs.split(","))
        if any(len(c) != 2 or not 0 < c[1] < c[0] for c in pairs):
            parser.error("--configs: NODES:ATTACKERS pairs with 0 < ATTACKERS < NODES")
        scale = dataclasses.replace(scale, configs=pairs)
    corpus = load_embedded_corpus()
    val = validation_batches(corpus.val, 16, PRESETS[scale.model].context, max_batches=scale.eval_batches)
    seeds = [int(s) for s in args.seeds.split(",")]
    attacks = [None] + [a for a in args.attacks.split(",") if a]
    env = _environment()
    started = time.time()
    rows = []
    for algorithm in args.algorithms.split(","):
        for nodes, attackers in scale.configs:
            for attack in attacks:
                if attack == "concentrate" and algorithm != "sparseloco":
                    continue  # an attack on sparse payloads
                chosen = [m for m in ALGORITHMS[algorithm] if not args.aggregators or m in args.aggregators.split(",")
                          or m == ALGORITHMS[algorithm][0]]
                for method in chosen:
                    for seed in seeds:
                        row = run_one(algorithm, method, attack, nodes, attackers if attack else 0, seed, scale, corpus, val)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    env.update(load_after=os.getloadavg(), seconds=round(time.time() - started, 1))
    result = {"command": "python -m benchmarks.byzantine " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "environment": env, "scale": asdict(scale), "runs": rows, "summary": summarize(rows)}
    results_io.write(args.out, result, meta)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A modified member inside a live swarm of three, against a clean swarm of the same three seeds.

    python -m benchmarks.hostile_member [--model tiny] [--max-steps 1000] [--seeds 0,1,2]
        [--attacks "cap,samples;future;relayed,state"] [--extra "--batch-size 2 --threads 1"] --out benchmarks/results/hostile_member.json

Each run is one ``node swarm --nodes 3`` of real daemons on loopback, with a fresh checkpoint folder; node i
has seed S + i and stops after ``--max-steps`` inner steps (equal tokens in every run of a seed). In an
``attack:A`` run (one per ``;``-separated set in ``--attacks``) node 2 is the modified peer
(``--byzantine 2:A``, ``gossip.byzantine``); the default sets leave its update honest and abuse the
protocol around it: ``cap,samples`` (an upload cap of 10⁻³⁰⁰ Mbit/s in its entries and records, and a
claim of 10⁹ samples), ``future`` (requests for every member's next 16 rounds at each of its
rounds) and ``relayed,state`` (40 relayed streams to every member each round, each from a made-up origin
asking for the whole state, and a sign-flipped φ served to anyone who downloads its state: here only
resyncs, as all three start together). A ``pair`` run has the two honest peers alone (what they reach without the third peer's work:
a member whose requests are refused averages alone, and its updates no longer count). Per run and
honest peer (nodes 0 and 1): the held-out loss at the end, rounds, the rounds both honest peers
averaged together in sync, the longest rendezvous deadline, out-of-sync rounds and failures naming an
honest peer. The summary per seed: the honest peers' mean held-out loss, hostile against clean and
against the pair (the issue's bar: within 5 % of a clean run).

``--layout pipeline`` (defaults: ``nano``, 400 steps per trainer, 120 s): five daemons in a 2-stage pipeline,
stage 0 on node 0, stage 1 on nodes 1 and 2, trainers on nodes 3 and 4, each with seed S + i. The default
attack run has node 2 claim 10⁹ samples at its stage rounds (``samples``) and trainer 4 multiply the
activations it sends by 10⁶ (``activations``); the ``honest`` run has nodes 0, 1 and 3 alone. Trainers
stop at ``--max-steps`` (stage servers count served microbatches as steps, so they run the whole
``--timeout``), and the held-out loss compared is trainer 3's.

    python -m benchmarks.hostile_member --layout pipeline --out benchmarks/results/hostile_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import results_io

NODES = 3
HONEST = (0, 1)
# --layout pipeline: 2 stages, stage 1 held by two replicas, two trainers; nodes 2 and 4 are the modified
# peers of an attack run, the honest run has nodes 0, 1 and 3 alone, and trainer 3's held-out loss is compared
PIPELINE_ROLES = ("--role stage --stage 0", "--role stage --stage 1", "--role stage --stage 1", "--role trainer", "--role trainer")
PIPELINE_HONEST = (0, 1, 3)
PIPELINE_MEASURED = 3
DEFAULTS = {
    "replicas": {"model": "tiny", "max_steps": 1000, "timeout": 600.0, "attacks": "cap,samples;future;relayed,state",
                 "extra": "--batch-size 2 --threads 1 --eval-batches 8"},
    "pipeline": {"model": "nano", "max_steps": 400, "timeout": 120.0, "attacks": "2:samples+4:activations",
                 "extra": "--batch-size 8 --threads 1 --eval-batches 8 --stages 2 --sync-every 6 --averaging-timeout 10 --warmup-steps 10"},
}


def byzantine_flags(attack_set: str, position: dict[int, int]) -> list[str]:
    """``cap,samples`` (node 2's attacks) or ``2:samples+4:activations`` (per node) → ``--byzantine`` flags for
    the launched nodes (``position``: node → its index in this run)."""
    flags = []
    for part in attack_set.split("+"):
        head, _, rest = part.partition(":")
        node, attacks = (int(head), rest) if head.isdigit() else (2, part)
        flags += ["--byzantine", f"{position[node]}:{attacks}"]
    return flags


def run(args: argparse.Namespace, mode: str, seed: int, folder: Path) -> dict[str, Any]:
    name = f"{mode}-{seed}"
    report = folder / f"{name.replace(':', '-').replace(',', '-').replace('+', '-')}.json"
    pipeline = args.layout == "pipeline"
    if pipeline:
        launched = list(PIPELINE_HONEST) if mode == "honest" else list(range(len(PIPELINE_ROLES)))
        stops = []  # trainers stop at --max-steps; stage servers count microbatches as steps, so they run the duration
        for k, node in enumerate(launched):
            trainer = "trainer" in PIPELINE_ROLES[node]
            stops += ["--node-args", f"{k}:{PIPELINE_ROLES[node]} --seed {seed + node} --init-seed {seed}"
                      + (f" --max-steps {args.max_steps}" if trainer else "")]
    else:
        launched = list(HONEST) if mode == "pair" else list(range(NODES))
        stops = ["--max-steps", str(args.max_steps)]
    position = {node: k for k, node in enumerate(launched)}
    cmd = [sys.executable, "-m", "node", "swarm", "--nodes", str(len(launched)), "--model", args.model, "--duration", str(args.timeout),
           *stops, "--seed", str(seed), "--report", str(report), "--checkpoint-dir", str(folder / report.stem),
           "--run-id", f"hostile-{report.stem}", *shlex.split(args.extra)]
    if mode.startswith("attack:"):
        cmd += byzantine_flags(mode.removeprefix("attack:"), position)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * 2 + 300)
    wall = time.monotonic() - started
    if not report.exists():
        return {"mode": mode, "seed": seed, "error": done.stderr[-2000:] or done.stdout[-2000:]}
    nodes = json.loads(report.read_text())["nodes"]
    measured = [PIPELINE_MEASURED] if pipeline else list(HONEST)
    honest_ids = {nodes[position[i]]["peer_id"] for i in measured}
    attacker = 4 if pipeline else 2
    return {"mode": mode, "seed": seed, "wall_s": round(wall, 1), "peers": [peer(nodes[position[i]], honest_ids) for i in measured],
            "attacker": peer(nodes[position[attacker]], honest_ids) if attacker in position else None}


def peer(n: dict[str, Any], honest_ids: set[str]) -> dict[str, Any]:
    rounds = [r for r in n.get("rounds", []) if "in_sync" in r]  # averaging rounds (a pipeline trainer has none)
    short = {p[-8:] for p in honest_ids}
    joint = [r for r in rounds if r["in_sync"] and short <= set(r.get("members", []))]
    return {
        "exit_code": n["exit_code"], "steps": n["steps"], "outer_rounds": n["outer_rounds"], "val_loss": n["val_loss"],
        "joint_rounds": len(joint), "out_of_sync": sum(not r["in_sync"] for r in rounds),
        "max_deadline_s": max((r["deadline_s"] for r in rounds), default=None),
        "honest_failures": sum(1 for r in rounds for p in r.get("failures", {}) if p in honest_ids),
        "tokens": rounds[-1].get("tokens", 0) if rounds else 0,
        # what serving its rounds cost it: a member asking again and again for a round once made it many times this
        "average_mb_sent_per_round": round((n.get("average_bytes_sent_per_round") or 0) / 1e6, 2),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per attack set and seed: the honest peers' mean held-out loss against the clean run and the pair."""
    by = {(r["mode"], r["seed"]): r for r in runs if "error" not in r}

    def honest_val(mode: str, seed: int) -> float | None:
        run = by.get((mode, seed))
        return None if run is None else statistics.mean(p["val_loss"] for p in run["peers"])

    out: dict[str, Any] = {}
    for mode in sorted({m for m, _ in by if m.startswith("attack:")}):
        per_seed, to_clean, to_pair = {}, [], []
        for seed in sorted({s for m, s in by if m == mode}):
            h, c, two = honest_val(mode, seed), honest_val("clean", seed), honest_val("pair", seed) or honest_val("honest", seed)
            peers = by[(mode, seed)]["peers"]
            row = {"val": round(h, 4), "clean_val": None if c is None else round(c, 4), "pair_val": None if two is None else round(two, 4),
                   "joint_rounds": [p["joint_rounds"] for p in peers], "max_deadline_s": max(p["max_deadline_s"] or 0 for p in peers),
                   "honest_failures": sum(p["honest_failures"] for p in peers)}
            if c is not None:
                to_clean.append((h - c) / c)
                row["gap"] = round(to_clean[-1], 4)
            if two is not None:
                to_pair.append((h - two) / two)
                row["gap_to_pair"] = round(to_pair[-1], 4)
            per_seed[str(seed)] = row
        out[mode] = {"per_seed": per_seed, "worst_gap": round(max(to_clean), 4) if to_clean else None,
                     "within_5_percent": max(to_clean) <= 0.05 if to_clean else None,
                     "worst_gap_to_pair": round(max(to_pair), 4) if to_pair else None}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(DEFAULTS), default="replicas")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-steps", type=int, default=None, help="inner steps per replica (replicas), per trainer (pipeline)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="--duration of each swarm: a bound for replicas; a pipeline's stage servers run it whole")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--attacks", default=None, help="attack sets separated by ';': node 2's (cap,samples) or per node (2:samples+4:activations)")
    parser.add_argument("--extra", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.layout].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.hostile_member", *argv])
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hostile-member-") as tmp:
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            alone = "honest" if args.layout == "pipeline" else "pair"
            for mode in ("clean", alone, *(f"attack:{a}" for a in args.attacks.split(";") if a)):
                runs.append(run(args, mode, seed, Path(tmp)))
                print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("peers", "attacker")}), flush=True)
    summary = summarise(runs)
    results_io.write(args.out, {"options": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summary}, meta)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

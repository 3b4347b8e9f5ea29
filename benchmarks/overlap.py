"""Rounds beside training: the same swarm with blocking rounds and with ``--overlap``, at equal inner steps.

    python -m benchmarks.overlap [--nodes 2] [--model medium] [--max-steps 100] [--seeds 0,1]
        [--extra "--batch-size 1 --context 32 --inner-steps 5 --threads 1"] --out PATH.json

For each seed and mode (``--no-overlap``, ``--overlap``) one ``node swarm`` of ``--nodes`` real daemons on
loopback runs until every node has taken ``--max-steps`` inner steps (``--duration`` bounds it), with
a fresh checkpoint folder. Per run: wall time, each node's share of its training loop spent blocked in
rounds (``comm_wait_s / train_s``), inner steps per second, and the held-out loss at the end (the same
steps and seeds in both modes, so the losses compare like with like). ``--revs A,B`` runs every mode of
each seed once per build (git revisions in temporary worktrees, ``benchmarks.revisions``; ``.`` is the
working tree), alternating which build goes first from seed to seed; each run then names its ``build``.
The JSON::

    {"runs": [{"mode", "seed", "wall_s", "blocked_share": [..], "val_loss": [..], "steps": [..], ...}],
     "summary": {"<mode>": {"blocked_share": mean, "val_loss": mean, "steps_per_s": mean}}}
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
from benchmarks.revisions import ROOT, checkouts, env_for

# α (--fragment-alpha) explicit where it matters, so a mode means what its results files measured whatever the default
MODES = {"blocking": ["--no-overlap"], "overlap": ["--overlap", "--fragment-alpha", "0"], "eager": ["--overlap", "--overlap-mode", "eager"],
         "delayed": ["--overlap", "--overlap-mode", "delayed", "--fragment-alpha", "0"], "mixed": ["--overlap", "--fragment-alpha", "0.5"],
         "blocking-mixed": ["--no-overlap", "--fragment-alpha", "0.5"], "auto": ["--auto-overlap", "--fragment-alpha", "0"]}


def run(args: argparse.Namespace, mode: str, seed: int, folder: Path, code: Path = ROOT, build: str = "") -> dict[str, Any]:
    """One swarm of ``mode`` and ``seed``, its daemons run from ``code`` (a checkout, ``--revs``) labelled ``build``."""
    name = f"{mode}-{seed}" + (f"-{build.split()[0]}" if build else "")
    report = folder / f"{name}.json"
    cmd = [sys.executable, "-m", "node", "swarm", "--nodes", str(args.nodes), "--model", args.model,
           "--max-steps", str(args.max_steps), "--duration", str(args.duration), "--seed", str(seed),
           "--report", str(report), "--checkpoint-dir", str(folder / name),
           *shlex.split(args.extra), *MODES[mode]]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 300, cwd=code, env=env_for(code))
    wall = time.monotonic() - started
    labels = {"build": build} if build else {}
    if not report.exists():
        return {"mode": mode, "seed": seed, **labels, "error": done.stderr[-2000:] or done.stdout[-2000:]}
    swarm = json.loads(report.read_text())
    nodes = swarm["nodes"]
    chosen = [[[e["event"], e["round"]] for e in swarm.get("events", []) if e.get("node") == i and e["event"].startswith("overlap_")]
              for i in range(len(nodes))]
    return {
        "mode": mode, "seed": seed, **labels, "wall_s": round(wall, 1), "exit_codes": [n["exit_code"] for n in nodes],
        "steps": [n["steps"] for n in nodes], "outer_rounds": [n["outer_rounds"] for n in nodes],
        "train_s": [round(n["train_s"], 2) for n in nodes], "comm_wait_s": [round(n["comm_wait_s"], 2) for n in nodes],
        "blocked_share": [round(n["comm_wait_s"] / n["train_s"], 4) if n["train_s"] else None for n in nodes],
        "steps_per_s": [round(n["steps"] / n["train_s"], 3) if n["train_s"] else None for n in nodes],
        "val_loss": [n["val_loss"] for n in nodes],
        "round_exchange_s": [statistics.median(r["exchange_s"] for r in n["rounds"]) if n["rounds"] else None for n in nodes],
        "round_steps": [statistics.median(r["steps"] for r in n["rounds"]) if n["rounds"] else None for n in nodes],
        # --auto-overlap: each node's choices ([event, round]) and the mode it ended in
        "overlap_choices": chosen, "overlap": [n.get("overlap") for n in nodes],
        # each node's evaluations during the run: [round, tokens so far, held-out loss]
        "val_curve": [[[r["round"], r["tokens"], round(r["val_loss"], 4)] for r in n["rounds"] if r.get("val_loss") is not None]
                      for n in nodes],
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over nodes and seeds, by mode (``mode @ build`` with ``--revs``), and each mode's loss over blocking rounds'."""
    out: dict[str, Any] = {}
    builds = list(dict.fromkeys(r.get("build", "") for r in runs))
    for build in builds:
        suffix = f" @ {build}" if build else ""
        for mode in MODES:
            done = [r for r in runs if r["mode"] == mode and r.get("build", "") == build and "error" not in r]
            if not done:
                continue
            values = {key: [v for r in done for v in r[key] if v is not None] for key in ("blocked_share", "val_loss", "steps_per_s")}
            out[mode + suffix] = {key: round(statistics.mean(v), 4) for key, v in values.items() if v}
        for mode in MODES:
            base, this = "blocking" + suffix, mode + suffix
            if mode != "blocking" and base in out and this in out:
                out[f"val_loss_{mode}_over_blocking{suffix}"] = round(out[this]["val_loss"] / out[base]["val_loss"], 4)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", default="medium")
    parser.add_argument("--max-steps", type=int, default=100, help="inner steps of every node (default: 100)")
    parser.add_argument("--duration", type=float, default=600, help="longest run in seconds (default: 600)")
    parser.add_argument("--seeds", default="0", help="comma separated (default: 0)")
    parser.add_argument("--extra", default="--batch-size 1 --context 32 --inner-steps 5 --threads 1",
                        help="more node join options for every node")
    parser.add_argument("--modes", default="blocking,overlap")
    parser.add_argument("--revs", default=".", help="comma-separated git revisions whose daemons run ('.' = the working tree)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.overlap", *argv])
    runs = []
    revs = [r for r in args.revs.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp, checkouts(revs) as builds:
        for seed in (int(s) for s in args.seeds.split(",")):
            for mode in args.modes.split(","):
                for rev in revs if seed % 2 == 0 else revs[::-1]:  # a build that always ran first would meet a cooler machine
                    code, build = builds[rev]
                    runs.append(run(args, mode, seed, Path(tmp), code, build if len(revs) > 1 else ""))
                    print(json.dumps(runs[-1]), flush=True)
    results_io.write(args.out, {"options": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summarise(runs)}, meta)


if __name__ == "__main__":
    main()

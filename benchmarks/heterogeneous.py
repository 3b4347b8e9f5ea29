"""Volunteers of every speed: a swarm of 4 peers of speeds 1×, 1×, ½× and ¼×, every peer at the same H
(``--inner-steps by-replicas``) against rounds paced by time (``--inner-steps auto``, the default).

    python -m benchmarks.heterogeneous [--model tiny] [--duration 120] [--seeds 0,1] [--base-slowdown 2]
        [--churn-seeds 0] [--cpu-seeds 0] [--extra "--batch-size 2 --threads 1"] --out benchmarks/results/heterogeneous.json

Each run is one ``node swarm`` of 4 real daemons on loopback with a fresh checkpoint folder; node i has seed
S + i. Speeds come from ``--slowdown``: ``--base-slowdown`` B gives the peers B, B, 2B and 4B, so the four
of them ask for 1.9 cores at most and the 2-core machine does not decide the speeds (B = 2; at B = 1
the fast peers would compete for the CPU). Modes (``--modes``): ``fixed``, ``auto`` and ``overlap`` (``auto`` with
``--overlap``: the round runs beside the next round's inner steps), and ``hivemind``: ``hivemind.Optimizer`` with a
target batch of H = 50 steps × 4 peers' batches (``benchmarks.baselines hivemind``, the same model, data, inner
AdamW and slowdowns; parameters averaged each time the swarm's samples reach it, so a fast peer contributes more
of each epoch), in the ``speeds`` scenario only. Scenarios, each in every mode asked for:

- ``speeds``: the four speeds for ``--duration`` seconds;
- ``churn`` (``--churn-seeds``): the same, except that peer 1 runs unslowed (twice the fast peers' speed) for a
  third of the run and then 8× slower (``--slowdown 8 --slowdown-after``: a quarter of their speed),
  and peer 3 is killed 2 s in and restarted 20 s later (it joins late,
  downloading the swarm's state);
- ``cpu`` (``--cpu-seeds``): peers of speeds 1, 1, ½ and 1/40 (a CPU among GPUs: ``--slowdown`` 40 B for the
  last), in the modes asked for; mode ``trainers`` is ``auto`` with ``--helper-below 0`` (every peer trains,
  as before the helper role), against ``auto``, where the last peer helps once it has measured itself;
- ``stall`` (``--stall-seeds``): the ``speeds`` peers, and peer 1 (a fast one) paused every 30 s for 8 s
  (``--chaos pause``: SIGSTOP, its p2pd still taking streams: a laptop that slept, a stalled machine);
  mode ``wait-all`` is ``auto`` with ``--quorum 1`` (every round waits for every member to the deadline, as before
  the quorum), against ``auto``, where a round closes a grace after 3 of the 4 came (``gossip.quorum``);
- mode ``stop-at-budget`` (any scenario): ``auto`` with ``--no-step-while-gathering``: every peer stops at its
  budget and waits at the rendezvous, as before fast peers stepped on through it;
- ``homogeneous`` (per seed of ``speeds``): four peers at the fast speed, each stopping after the mean
  inner steps of that seed's ``auto`` run: the same total tokens, for the quality comparison.

``--revs A,B`` runs every node mode of each seed once per build (git revisions checked out in temporary
worktrees, ``benchmarks.revisions``), alternating which build goes first from seed to seed, and labels the
modes ``mode@commit``: builds compared side by side in one invocation.

Per peer: shares of its training loop's wall time spent in inner steps (``training``), waiting at the
rendezvous for the others (``waiting``, the rounds' ``gather_s``), exchanging (the rest of the
rounds' time), in the held-out evaluations after every round that this benchmark asks for
(``evaluating``; a default node evaluates every 5 rounds) and writing checkpoints (``checkpointing``),
the training share of the loop's time less those evaluations (``training_besides_evaluations``),
tokens, the held-out loss at the end, and the held-out curve (every ``--eval-every`` rounds) against
wall time and tokens. The summary per scenario and mode: the least training share of any peer, the
mean final held-out loss, and for the modes other than ``fixed``, the share of the fixed-H run's wall
time it took to reach the fixed-H run's final held-out loss (peer 0's curves).
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
from node.config.defaults import steps_for_replicas

MODES = {"fixed": ["--inner-steps", "by-replicas"], "auto": ["--inner-steps", "auto"],
         "overlap": ["--inner-steps", "auto", "--overlap"], "trainers": ["--inner-steps", "auto", "--helper-below", "0"],
         "stop-at-budget": ["--inner-steps", "auto", "--no-step-while-gathering"],
         "wait-all": ["--inner-steps", "auto", "--quorum", "1"]}
STALL_EVERY_S, STALL_FOR_S = 30, 8  # the stall scenario pauses peer 1 this often, this long
CPU_SLOWDOWN = 40  # the cpu scenario's last peer, × --base-slowdown: 1/40 of the fast peers' speed
NODES = 4
HIVEMIND = "hivemind"  # hivemind.Optimizer's target batch on the same peers (benchmarks.baselines), not a node mode
HIVEMIND_H = steps_for_replicas(NODES)  # one epoch = the by-replicas table's H for these peers, times their batches


def node_args(base: float, churn: bool, duration: float, cpu: bool = False) -> list[str]:
    speeds = speeds_of(base)
    if cpu:
        speeds[-1] = CPU_SLOWDOWN * base
    args = [f"{i}:--slowdown {s:g}" for i, s in enumerate(speeds)]
    if churn:
        args[1] += f" --slowdown-after {duration / 3:.0f}"
        args[1] = args[1].replace(f"--slowdown {base:g}", f"--slowdown {4 * base:g}")
    out: list[str] = []
    for a in args:
        out += ["--node-args", a]
    return out


def speeds_of(base: float) -> list[float]:
    """Each peer's ``--slowdown``."""
    return [base, base, 2 * base, 4 * base]


def run_hivemind(args: argparse.Namespace, seed: int, folder: Path) -> dict[str, Any]:
    """The ``speeds`` scenario with ``hivemind.Optimizer`` (``benchmarks.baselines hivemind``): 4 workers of the same
    speeds for ``--duration`` s, averaging parameters whenever the swarm's samples reach the target batch."""
    extra = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--batch-size", 2), ("--threads", 1), ("--eval-batches", 8)):
        extra.add_argument(flag, type=int, default=default)
    known, _ = extra.parse_known_args(shlex.split(args.extra))
    rdv = folder / f"speeds-{HIVEMIND}-{seed}"
    rdv.mkdir(parents=True, exist_ok=True)
    procs = []
    started = time.monotonic()
    for rank, slowdown in enumerate(speeds_of(args.base_slowdown)):
        cmd = [sys.executable, "-m", "benchmarks.baselines", "hivemind", "--rank", str(rank), "--world", str(NODES),
               "--rendezvous", str(rdv), "--out", str(rdv / f"worker{rank}.json"), "--model", args.model,
               "--batch-size", str(known.batch_size), "--threads", str(known.threads), "--eval-batches", str(known.eval_batches),
               "--steps", "100000000", "--duration", str(args.duration), "--slowdown", f"{slowdown:g}",
               "--inner-steps", str(HIVEMIND_H), "--eval-every", str(args.hivemind_eval_steps), "--seed", str(seed),
               "--run-id", f"heterogeneous-{seed}", "--timeout", str(args.duration + 300)]
        with open(rdv / f"worker{rank}.log", "w") as log:  # (hivemind logs a lot: a pipe would fill and stall it)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    errors = []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, args.duration * 3 + 300 - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            errors.append(f"worker {rank} exited with {proc.returncode}: " + (rdv / f"worker{rank}.log").read_text()[-1500:])
    wall = time.monotonic() - started
    results = [rdv / f"worker{rank}.json" for rank in range(NODES)]
    if errors or not all(r.exists() for r in results):
        return {"scenario": "speeds", "mode": HIVEMIND, "seed": seed, "error": "\n".join(errors) or "a worker wrote no result"}
    workers = [json.loads(r.read_text()) for r in results]
    return {"scenario": "speeds", "mode": HIVEMIND, "seed": seed, "wall_s": round(wall, 1),
            "peers": [hivemind_peer(w) for w in workers]}


def hivemind_peer(w: dict[str, Any]) -> dict[str, Any]:
    """A hivemind worker's result in this benchmark's terms: its blocked time inside ``Optimizer.step`` (matchmaking
    and averaging; hivemind does not tell the two apart) counts as waiting."""
    wall = w["wall_s"]
    tokens_per_step = w["batch_size"] * w["context"]
    return {
        "exit_code": 0, "steps": w["steps"], "outer_rounds": w["epochs"], "train_s": round(wall, 2),
        "training": round(w["inner_s"] / wall, 4), "waiting": round(w["comm_wait_s"] / wall, 4), "exchanging": 0.0,
        "steps_per_round": round(w["steps"] / max(1, w["epochs"]), 1), "out_of_sync": w["out_of_sync"],
        "val_loss": w["val_loss"], "tokens": w["tokens"],
        "curve": [[round(e["t"] - w["t_start"], 2), e["step"] * tokens_per_step, round(e["val_loss"], 4)] for e in w["evals"]],
        "first_round_t": round(w["t_start"], 2),
    }


def run(args: argparse.Namespace, scenario: str, mode: str, seed: int, folder: Path, max_steps: int | None = None,
        code: Path = ROOT) -> dict[str, Any]:
    """One run; ``code``: the checkout whose daemons run (``--revs``)."""
    if mode == HIVEMIND:
        return run_hivemind(args, seed, folder)
    name = f"{scenario}-{mode}-{seed}-{code.name}"
    report = folder / f"{name}.json"
    cmd = [sys.executable, "-m", "node", "swarm", "--nodes", str(NODES), "--model", args.model, "--duration", str(args.duration),
           "--seed", str(seed), "--report", str(report), "--checkpoint-dir", str(folder / name), "--eval-every", str(args.eval_every),
           *shlex.split(args.extra), *MODES[mode]]
    if scenario == "homogeneous":
        cmd += ["--slowdown", f"{args.base_slowdown:g}", "--max-steps", str(max_steps)]
    else:
        cmd += node_args(args.base_slowdown, scenario == "churn", args.duration, cpu=scenario == "cpu")
    if scenario == "churn":
        cmd += ["--chaos", "kill:node=3:at=2s", "--restart-killed", "20"]
    if scenario == "stall":
        cmd += ["--chaos", f"pause:node=1:every={STALL_EVERY_S}s:for={STALL_FOR_S}s"]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 3 + 300, cwd=code, env=env_for(code))
    wall = time.monotonic() - started
    if not report.exists():
        return {"scenario": scenario, "mode": mode, "seed": seed, "error": done.stderr[-2000:] or done.stdout[-2000:]}
    nodes = json.loads(report.read_text())["nodes"]
    return {"scenario": scenario, "mode": mode, "seed": seed, "wall_s": round(wall, 1), "peers": [peer(n) for n in nodes]}


def peer(n: dict[str, Any]) -> dict[str, Any]:
    rounds = n.get("rounds", [])
    train_s = n.get("train_s") or 0.0
    eval_s = n.get("eval_s") or 0.0
    gather = sum(r["gather_s"] for r in rounds)
    blocked = n.get("comm_wait_s", 0.0)
    start = rounds[0]["t"] - rounds[0]["duration_s"] if rounds else 0.0
    share = (lambda x: round(x / train_s, 4)) if train_s else (lambda x: None)
    return {
        "exit_code": n["exit_code"], "role": n.get("role", "trainer"), "steps": n["steps"], "outer_rounds": n["outer_rounds"], "train_s": round(train_s, 2),
        # an overlapped round's rendezvous runs beside training: only the time the loop was blocked counts
        "training": share(n.get("inner_s", 0.0)), "waiting": share(min(gather, blocked)), "exchanging": share(max(blocked - gather, 0.0)),
        # the held-out evaluations this benchmark asks for after every round (a default node: every 5) and checkpoints
        "evaluating": share(eval_s), "checkpointing": share(n.get("checkpoint_s") or 0.0),
        "training_besides_evaluations": round(n.get("inner_s", 0.0) / (train_s - eval_s), 4) if train_s > eval_s else None,
        "steps_per_round": statistics.median(r["steps"] for r in rounds) if rounds else None,
        "out_of_sync": sum(not r["in_sync"] for r in rounds), "val_loss": n["val_loss"],
        "closed_by": {how: sum(r.get("closed_by") == how for r in rounds) for how in ("complete", "grace", "deadline")},
        "late": sum(bool(r.get("late_for")) for r in rounds), "round_s": statistics.median(r["duration_s"] for r in rounds) if rounds else None,
        "tokens": rounds[-1]["tokens"] if rounds else 0,
        "curve": [[round(r["t"] - start, 2), r["tokens"], round(r["val_loss"], 4)] for r in rounds if r.get("val_loss") is not None],
        "first_round_t": round(start, 2),
    }


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Seconds (from this peer's first round) until its held-out loss first reached ``target``."""
    return next((t for t, _, loss in curve if loss <= target), None)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    ok = [r for r in runs if "error" not in r]
    for scenario in sorted({r["scenario"] for r in ok}):
        for mode in modes:
            mine = [r for r in ok if r["scenario"] == scenario and r["mode"] == mode]
            if not mine:
                continue
            key = f"{scenario}/{mode}"
            out[key] = {
                "runs": len(mine),
                # of the peers that trained: a helper (--helper-below) stops on purpose
                "least_training_share": min(p["training"] for r in mine for p in r["peers"]
                                            if p["training"] is not None and p.get("role") != "helper"),
                "helpers": sum(p.get("role") == "helper" for r in mine for p in r["peers"]),
                "fast_peers_waiting": statistics.mean(p["waiting"] for r in mine for p in r["peers"][:2] if p["waiting"] is not None),
                "val_loss": statistics.mean(p["val_loss"] for r in mine for p in r["peers"] if p["val_loss"] is not None),
                "tokens": statistics.mean(sum(p["tokens"] for p in r["peers"]) for r in mine),
                "out_of_sync": sum(p["out_of_sync"] for r in mine for p in r["peers"]),
                "rounds": statistics.mean(max(p["outer_rounds"] for p in r["peers"]) for r in mine),
                "closed_by": {how: sum(p.get("closed_by", {}).get(how, 0) for r in mine for p in r["peers"])
                              for how in ("complete", "grace", "deadline")},
                "late": sum(p.get("late", 0) for r in mine for p in r["peers"]),
            }
            base, at, build = mode.partition("@")
            if base != "fixed":
                fractions = []
                for r in mine:
                    fixed = next((f for f in ok if (f["scenario"], f["mode"], f["seed"]) == (scenario, "fixed" + at + build, r["seed"])), None)
                    if fixed is None or not fixed["peers"][0]["curve"]:
                        continue
                    target = statistics.mean(p["val_loss"] for p in fixed["peers"] if p["val_loss"] is not None)
                    reached = time_to(r["peers"][0]["curve"], target)
                    fixed_s = fixed["peers"][0]["curve"][-1][0]
                    fractions.append(None if reached is None else round(reached / fixed_s, 3))
                out[key]["time_to_fixed_loss"] = fractions
    homogeneous = [r for r in ok if r["scenario"] == "homogeneous"]
    if homogeneous:
        out["homogeneous/auto"] = {
            "runs": len(homogeneous),
            "val_loss": statistics.mean(p["val_loss"] for r in homogeneous for p in r["peers"] if p["val_loss"] is not None),
            "tokens": statistics.mean(sum(p["tokens"] for p in r["peers"]) for r in homogeneous),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--churn-seeds", default="0")
    parser.add_argument("--cpu-seeds", default="", help="seeds of the cpu scenario (a peer 40 times slower)")
    parser.add_argument("--stall-seeds", default="", help="seeds of the stall scenario (a fast peer paused every 30 s for 8 s)")
    parser.add_argument("--base-slowdown", type=float, default=2.0)
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--homogeneous", action=argparse.BooleanOptionalAction, default=True,
                        help="per seed, a homogeneous swarm to the auto run's tokens")
    parser.add_argument("--modes", default="fixed,auto", help=f"comma-separated, of {', '.join([*MODES, HIVEMIND])}")
    parser.add_argument("--hivemind-eval-steps", type=int, default=60,
                        help="the hivemind workers evaluate every this many of their steps (the nodes: every round)")
    parser.add_argument("--extra", default="--batch-size 2 --threads 1 --eval-batches 8")
    parser.add_argument("--revs", default=".", help="comma-separated git revisions whose daemons run ('.' = the working tree); "
                        "with more than one, every run of a seed runs for each, alternating their order from seed to seed, and "
                        "modes are labelled mode@commit")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES and m != HIVEMIND]:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join([*MODES, HIVEMIND])})")
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.heterogeneous", *argv])
    revs = [r for r in args.revs.split(",") if r]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="heterogeneous-") as tmp, checkouts(revs) as builds:
        folder = Path(tmp)

        def each_build(scenario: str, seed: int, mode: str, **kwargs: Any) -> None:
            order = revs if seed % 2 == 0 else revs[::-1]  # a build that always ran first would meet a cooler machine
            for rev in order if mode != HIVEMIND else revs[:1]:
                code, name = builds[rev]
                result = run(args, scenario, mode, seed, folder, code=code, **kwargs)
                if len(revs) > 1:
                    result["mode"] = f"{mode}@{name}"
                runs.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "peers"}), flush=True)

        for seed in [int(s) for s in args.seeds.split(",") if s]:
            for mode in modes:
                each_build("speeds", seed, mode)
            auto = next((r for r in runs if (r["scenario"], r["mode"].split("@")[0], r["seed"]) == ("speeds", "auto", seed)), None)
            if args.homogeneous and auto is not None and "error" not in auto:
                steps = round(statistics.mean(p["steps"] for p in auto["peers"]))
                each_build("homogeneous", seed, "auto", max_steps=steps)
        for seed in [int(s) for s in args.churn_seeds.split(",") if s]:
            for mode in [m for m in modes if m != HIVEMIND]:  # (hivemind runs the speeds scenario only)
                each_build("churn", seed, mode)
        for seed in [int(s) for s in args.cpu_seeds.split(",") if s]:
            for mode in [m for m in modes if m != HIVEMIND]:
                each_build("cpu", seed, mode)
        for seed in [int(s) for s in args.stall_seeds.split(",") if s]:
            for mode in [m for m in modes if m != HIVEMIND]:
                each_build("stall", seed, mode)
    summary = summarise(runs)
    results_io.write(args.out, {"options": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summary}, meta)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

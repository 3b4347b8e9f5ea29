"""Zeroth-order fine-tuning benchmark (``--algorithm zo``): one byte per step, 1, 2 and 4 peers.

    python -m benchmarks.zo --out runs/bench/zo.json [--quick]

1. Pretrain ``nano`` with a short DiLoCo run (one ``node join``, ``--max-steps``) on the embedded
   corpus's training plays.
2. The "other text" is the corpus's held-out plays (never seen in pretraining), written one file per
   play; ``node.data.byte_corpus.load_text_corpus`` fine-tunes on all but one and holds the last one out.
3. For N = 1, 2, 4: N real ``node join --algorithm zo`` daemons on loopback start from the pretrained
   checkpoint (``--init-from``), wait for each other (``--min-peers N``) and take the same number of
   steps each (``--max-steps``, ``--inner-steps H``). Every node reports the held-out loss at exit.

Per configuration the JSON report holds the held-out loss before (the checkpoint, evaluated on the
same windows the nodes use) and after (each node; all must be equal since the replicas are
identical), bytes sent per peer per step on the code exchange (``bytes_sent_by_kind['zo']`` /
steps, measured) and on every locomesh protocol, whether every round's fingerprints matched on every
node and between nodes, rounds, wall time. A markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from node.ops.launcher import free_port


@dataclass
class Settings:
    pretrain_steps: int = 1500
    steps: int = 600  # ZO steps per peer
    inner_steps: int = 30  # H
    batch_size: int = 8
    zo_lr: float = 1e-4
    zo_eps: float = 1e-3
    eval_batches: int = 16
    peers: tuple[int, ...] = (1, 2, 4)
    threads: int = 1
    timeout: float = 1800.0


QUICK = Settings(pretrain_steps=300, steps=150)


def _node(run_dir: Path, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
    folder = run_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    info = folder / "info.json"
    info.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "node", "join", *args, "--listen", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(folder),
           "--info-file", str(info), "--fresh"]
    log = open(folder / "log.txt", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), info


def _read(info: Path) -> dict[str, Any]:
    try:
        return json.loads(info.read_text())
    except (OSError, ValueError):
        return {}


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def pretrain(s: Settings, run_dir: Path) -> Path:
    args = ["--model", "nano", "--batch-size", str(s.batch_size), "--inner-steps", "50", "--threads", str(s.threads),
            "--warmup-steps", "20", "--eval-batches", "4", "--max-steps", str(s.pretrain_steps), "--run-id", "bench-zo-pre",
            "--metrics-port", str(free_port())]
    proc, _ = _node(run_dir, "pretrain", args)
    if _wait_all([proc], s.timeout) != [0]:
        raise SystemExit(f"pretraining failed; see {run_dir / 'pretrain' / 'log.txt'}")
    return run_dir / "pretrain" / "checkpoint.pt"


def write_text(run_dir: Path) -> Path:
    """The embedded corpus's held-out plays, one file each (the last one is the fine-tuning's held-out split)."""
    from node.data.byte_corpus import load_embedded_corpus

    folder = run_dir / "text"
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(load_embedded_corpus().val_docs):
        (folder / f"play{i}.txt").write_text(doc)
    return folder


def held_out_loss(checkpoint: Path, text: Path, s: Settings) -> float:
    """The loss the nodes report at exit, for the pretrained weights (same windows, same batches)."""
    from node.checkpoints.checkpoint import load
    from node.data.byte_corpus import load_text_corpus
    from node.data.bytes import validation_batches
    from node.runtime.local_training import LocalTrainer
    from swarm.models.presets import preset

    cfg = preset("nano")
    trainer = LocalTrainer(cfg=cfg, device=torch.device("cpu"), lr=1e-3)
    trainer.load_weights(load(checkpoint)["phi"])
    corpus = load_text_corpus(text, context=cfg.context)
    return trainer.evaluate(validation_batches(corpus.val, s.batch_size, cfg.context, max_batches=s.eval_batches))


def fine_tune(s: Settings, run_dir: Path, checkpoint: Path, text: Path, peers: int, pool: int = 0) -> dict[str, Any]:
    common = ["--algorithm", "zo", "--model", "nano", "--data", str(text), "--init-from", str(checkpoint),
              "--batch-size", str(s.batch_size), "--inner-steps", str(s.inner_steps), "--threads", str(s.threads),
              "--zo-lr", str(s.zo_lr), "--zo-eps", str(s.zo_eps), "--eval-batches", str(s.eval_batches), "--eval-every", "0",
              "--max-steps", str(s.steps), "--min-peers", str(peers), "--join-timeout", "600", "--averaging-timeout", "60",
              "--run-id", f"bench-zo-{peers}-{pool}", "--zo-seed-pool", str(pool)]
    folder = run_dir / (f"peers{peers}" + (f"-pool{pool}" if pool else ""))
    started = time.time()
    procs, infos = [], []
    first, info0 = _node(folder, "n0", [*common, "--seed", "0", "--metrics-port", str(free_port())])
    procs.append(first)
    infos.append(info0)
    deadline = time.time() + 300
    while not _read(info0).get("multiaddrs"):
        if first.poll() is not None or time.time() > deadline:
            raise SystemExit(f"node 0 of {peers} did not start; see {folder / 'n0' / 'log.txt'}")
        time.sleep(0.5)
    boot = _read(info0)["multiaddrs"][0]
    for i in range(1, peers):
        proc, info = _node(folder, f"n{i}", [*common, "--seed", str(i), "--metrics-port", str(free_port()), "--initial-peers", boot])
        procs.append(proc)
        infos.append(info)
    codes = _wait_all(procs, s.timeout)
    nodes = [_read(i) for i in infos]
    rounds = [{r["round"]: r for r in n.get("rounds", [])} for n in nodes]
    common_rounds = sorted(set.intersection(*(set(r) for r in rounds))) if rounds else []
    agree = all(len({r[n]["fingerprint"] for r in rounds}) == 1 for n in common_rounds)
    matched = all(r["matched"] for n in nodes for r in n.get("rounds", []))
    zo_bytes = [n.get("bytes_sent_by_kind", {}).get("zo", 0) / max(1, n.get("steps", 0)) for n in nodes]
    all_bytes = [n.get("bytes_sent", 0) / max(1, n.get("steps", 0)) for n in nodes]
    return {
        "peers": peers, "seed_pool": pool, "exit_codes": codes, "wall_s": round(time.time() - started, 1),
        "steps_per_peer": [n.get("steps") for n in nodes], "rounds": [n.get("outer_rounds") for n in nodes],
        "val_loss_after": [n.get("val_loss") for n in nodes],
        "fingerprints_matched_every_round": matched and agree, "rounds_compared_between_nodes": len(common_rounds),
        "zo_bytes_per_peer_per_step": [round(b, 2) for b in zo_bytes],
        "all_bytes_per_peer_per_step": [round(b, 2) for b in all_bytes],
        "joined": [next((e.get("how") for e in n.get("events", []) if e["event"] == "joined"), None) for n in nodes],
        "events": sorted({e["event"] for n in nodes for e in n.get("events", [])}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/zo.json"))
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.pretrain_steps} pretraining steps, {QUICK.steps} ZO steps per peer")
    parser.add_argument("--peers", default=None, help="comma-separated swarm sizes (default 1,2,4)")
    parser.add_argument("--pretrain-steps", type=int, help="DiLoCo steps of the pretraining run (default: the scale's)")
    parser.add_argument("--steps", type=int, help="ZO steps per peer (default: the scale's)")
    parser.add_argument("--seed-pool", type=int, default=0,
                        help="also run the largest swarm with a FedKSeed pool of K seeds (--zo-seed-pool K)")
    args = parser.parse_args()
    meta = results_io.begin()
    s = QUICK if args.quick else Settings()
    if args.peers:
        s.peers = tuple(int(p) for p in args.peers.split(","))
    if args.pretrain_steps:
        s.pretrain_steps = args.pretrain_steps
    if args.steps:
        s.steps = args.steps
    run_dir = args.out.with_suffix("")
    run_dir.mkdir(parents=True, exist_ok=True)
    began = time.time()
    checkpoint = pretrain(s, run_dir)
    text = write_text(run_dir)
    before = held_out_loss(checkpoint, text, s)
    results = []
    runs = [(peers, 0) for peers in s.peers] + ([(max(s.peers), args.seed_pool)] if args.seed_pool else [])
    for peers, pool in runs:
        result = fine_tune(s, run_dir, checkpoint, text, peers, pool)
        result["val_loss_before"] = before
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {"settings": asdict(s), "quick": args.quick, "host": platform.node(), "torch": torch.__version__,
              "wall_s": round(time.time() - began, 1), "val_loss_before": before, "results": results}
    results_io.write(args.out, report, meta)
    print(f"\nheld-out loss before: {before:.4f} nats/byte (the pretrained nano on an unseen play)")
    print("| peers | seed pool | held-out loss after | Δ | zo bytes/peer/step | all bytes/peer/step | fingerprints matched | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        after = max(v for v in r["val_loss_after"] if v is not None) if any(r["val_loss_after"]) else float("nan")
        print(f"| {r['peers']} | {r['seed_pool'] or '-'} | {after:.4f} | {after - before:+.4f} | {max(r['zo_bytes_per_peer_per_step']):.2f} | "
              f"{max(r['all_bytes_per_peer_per_step']):.2f} | {r['fingerprints_matched_every_round']} | {r['wall_s']} |")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()

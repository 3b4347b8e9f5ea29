"""What one checkpoint write costs at a model's size: the training loop stands still while it runs.

    python -m benchmarks.checkpoint_write [--models medium,llama-150m] [--runs 3] [--dir DIR] --out PATH.json

A replica's checkpoint holds θ, φ, the outer momentum and AdamW's two moments (five float32 copies
of the model, what ``node join`` writes), written with the node's own atomic write
(``node.checkpoints.checkpoint.save_atomic``: a temporary file, fsync, rename, fsync of the folder)
into ``--dir`` (default: a fresh temporary folder, removed after). Per model: parameters, bytes on
disk and the seconds of each write. The daemon writes one after its first outer round, then every
``--checkpoint-every`` seconds and at exit (it used to write one after every round).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io
from node.checkpoints.checkpoint import save_atomic
from swarm.models.presets import build_model, preset


def measure(name: str, runs: int, folder: Path) -> dict[str, Any]:
    """Write a checkpoint-sized state of preset ``name`` ``runs`` times into ``folder``."""
    params = [p.detach() for p in build_model(preset(name)).parameters()]
    state = {"theta": params, "phi": [p.clone() for p in params], "momentum": [torch.zeros_like(p) for p in params],
             "inner_optimizer": [[torch.zeros_like(p), torch.zeros_like(p)] for p in params]}
    seconds = []
    for _ in range(runs):
        started = time.monotonic()
        path = save_atomic(state, folder / "checkpoint.pt")
        seconds.append(round(time.monotonic() - started, 3))
    return {"model": name, "params": sum(p.numel() for p in params), "bytes": path.stat().st_size, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="medium,llama-150m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a fresh temporary folder)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.checkpoint_write", *argv])
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-write-", dir=args.dir))
    try:
        rows = []
        for name in [m for m in args.models.split(",") if m]:
            rows.append(measure(name, args.runs, folder))
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results_io.write(args.out, {"options": {"models": args.models, "runs": args.runs, "dir": str(args.dir or tempfile.gettempdir())},
                                "rows": rows}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())

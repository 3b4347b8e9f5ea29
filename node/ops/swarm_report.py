"""``node swarm``'s report: one entry per node from its exit summary (``--info-file``), the file written
atomically, and the few lines printed at the end."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

# what each node's entry copies from its info file, and the value when the node never wrote it
COPIED: dict[str, Any] = {
    "role": None, "stage": None, "seed": None, "peer_id": "", "resumed_from": None, "steps": 0, "outer_rounds": 0,
    "train_loss_first": None, "train_loss_last": None, "val_loss": None, "val_bits_per_byte": None, "bytes_sent": 0,
    "bytes_received": 0, "bytes_sent_by_kind": {}, "bytes_received_by_kind": {}, "checkpoint": "", "multiaddrs": [],
    "protocols": [], "joined_round": None, "wall_s": None, "train_s": None, "comm_wait_s": None, "overlap": None,
    "inner_s": None, "eval_s": None, "checkpoint_s": None, "tokens_per_s": None, "mfu": None, "peak_mem_mb": None,
    "rounds": [],
}


def node_entry(info: dict[str, Any], *, index: int, killed: bool, exit_code: int | None, metrics_port: int,
               log: Path) -> dict[str, Any]:
    """A node's entry in the report: its info file's fields (``COPIED``) and what the launcher knows of it."""
    average = info.get("bytes_sent_by_kind", {}).get("average", 0)
    return {"index": index, "killed": killed, "exit_code": exit_code, "metrics_port": metrics_port,
            **{key: info.get(key, default) for key, default in COPIED.items()},
            "average_bytes_sent_per_round": average / info["outer_rounds"] if info.get("outer_rounds") else None,
            "log": str(log)}


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write the report atomically (a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)


def print_summary(report: dict[str, Any], path: Path) -> None:
    """One line per node: exit code, steps, rounds, losses and traffic."""
    print(f"\nswarm of {len(report['nodes'])} nodes ran {report['duration_s']:.0f}s; report: {path}")
    for n in report["nodes"]:
        first, last, val = (n.get(k) if n.get(k) is not None else math.nan for k in ("train_loss_first", "train_loss_last", "val_loss"))
        print(f"  node {n['index']} {n['peer_id'][-8:]}: exit {n['exit_code']}, {n['steps']} steps, "
              f"{n['outer_rounds']} outer rounds, train loss {first:.3f} -> {last:.3f}, val loss {val:.3f}, "
              f"sent {n['bytes_sent'] / 1e6:.1f} MB, received {n['bytes_received'] / 1e6:.1f} MB")

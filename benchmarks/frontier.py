"""Quality-for-bytes frontier: DiLoCo with each pseudo-gradient codec, held-out loss against averaging bytes.

    python -m benchmarks.frontier --out runs/frontier/report.json
    python -m benchmarks.frontier --out runs/frontier/report.json --codecs none,rot2 --nodes 2

Every codec trains the same swarm the same way (``benchmarks.convergence``'s real ``node join``
processes: same model, seeds, data order, inner steps and evaluation windows) with ``--algorithm
diloco --compression SPEC`` and the run's default error feedback (β = 0.95 for lossy codecs). Per codec
the report holds the final held-out loss (mean over nodes), its gap to dense (``none``), the averaging
bytes each node sent per outer round (the exchange alone: state downloads and status queries are not
counted), how many times fewer that is than dense, and whether the run diverged (a non-finite or rising
loss). A PNG next to the report plots held-out loss against bytes per round, one point per codec.

Targets (shared-seed issue): ``rot2`` within 1.5 % of dense at ≥ 16× fewer bytes per round, ``rot1``
within 3 % at ≥ 32×, and no shared-seed codec (``rot*``, ``seed:*``) diverging.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from benchmarks import convergence
from benchmarks.convergence import Settings

CODECS = ("none", "q8", "q4", "q2", "rot1", "rot2", "topk:64/4096+q2", "topk:64/4096+rot2", "seed:r=8")
SHARED_SEED = ("rot", "seed:", "topk:64/4096+rot")


def config_name(spec: str) -> str:
    """The configuration's name, also its run id: the spec with every character a run id refuses as ``_``."""
    return "codec-" + re.sub(r"[^A-Za-z0-9_.-]", "_", spec)


def register(spec: str) -> str:
    """Make ``spec`` a locomesh configuration of the convergence benchmark; returns its name."""
    name = config_name(spec)
    convergence.LOCOMESH[name] = ["--algorithm", "diloco", "--compression", spec]
    return name


def per_round(rec: dict[str, Any]) -> float | None:
    """Averaging bytes one node sent per outer round it averaged with company (mean over nodes); a
    round alone (a peer still starting, or already gone) sends nothing and is not counted."""
    nodes = rec.get("nodes") or []
    if rec.get("status") != "ok" or not nodes or rec.get("exchange_bytes_per_node") is None:
        return None
    rounds = sum(n.get("outer_rounds", 0) - n.get("rounds_alone", 0) for n in nodes)
    return rec["exchange_bytes_per_node"] * len(nodes) / rounds if rounds > 0 else None


def diverged(rec: dict[str, Any]) -> bool:
    """A non-finite final loss, or a final loss above the first evaluation's."""
    final = rec.get("final_val_loss")
    curve = rec.get("curve") or []
    if final is None or not math.isfinite(final):
        return True
    return bool(curve) and final > curve[0]["val_loss"]


def frontier(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per codec: loss, gap to dense, bytes per round and how many times fewer than dense."""
    dense = results.get("none", {})
    dense_loss, dense_bytes = dense.get("final_val_loss"), per_round(dense)
    rows = []
    for spec, rec in results.items():
        loss, b = rec.get("final_val_loss"), per_round(rec)
        rows.append({
            "codec": spec, "status": rec.get("status"), "val_loss": loss,
            "gap_to_dense": None if loss is None or not dense_loss else loss / dense_loss - 1.0,
            "bytes_per_round_per_node": b,
            "fewer_bytes_than_dense": None if not b or not dense_bytes else dense_bytes / b,
            "diverged": diverged(rec) if rec.get("status") == "ok" else None,
            "outer_rounds": [n.get("outer_rounds") for n in rec.get("nodes") or []],
        })
    return rows


def check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["codec"]: r for r in rows}
    out = []
    for spec, gap, fewer in (("rot2", 0.015, 16.0), ("rot1", 0.03, 32.0)):
        r = by.get(spec)
        if not r or r["gap_to_dense"] is None:
            out.append({"target": f"{spec} within {gap:.1%} at ≥ {fewer:g}× fewer bytes", "result": "n/a"})
            continue
        ok = r["gap_to_dense"] <= gap and (r["fewer_bytes_than_dense"] or 0) >= fewer
        out.append({"target": f"{spec} within {gap:.1%} at ≥ {fewer:g}× fewer bytes", "result": "pass" if ok else "FAIL",
                    "detail": f"gap {r['gap_to_dense']:+.2%}, {r['fewer_bytes_than_dense']:.1f}× fewer"})
    seeded = [r for r in rows if r["codec"].startswith(SHARED_SEED)]
    bad = [r["codec"] for r in seeded if r["diverged"] is not False]
    out.append({"target": "no shared-seed codec diverges", "result": "pass" if seeded and not bad else "FAIL",
                "detail": f"diverged or failed: {', '.join(bad) or 'none'} of {', '.join(r['codec'] for r in seeded)}"})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| codec | held-out loss | vs dense | bytes/round/node | fewer bytes | diverged |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["val_loss"] is None:
            lines.append(f"| `{r['codec']}` | {r['status']} | | | | |")
            continue
        gap = "–" if r["gap_to_dense"] is None else f"{r['gap_to_dense']:+.2%}"
        b = "–" if r["bytes_per_round_per_node"] is None else f"{r['bytes_per_round_per_node'] / 1e3:,.1f} kB"
        fewer = "–" if r["fewer_bytes_than_dense"] is None else f"{r['fewer_bytes_than_dense']:.1f}×"
        lines.append(f"| `{r['codec']}` | {r['val_loss']:.4f} | {gap} | {b} | {fewer} | {'yes' if r['diverged'] else 'no'} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str, references: dict[str, float] | None = None) -> None:
    """Held-out loss against bytes per round, one point per codec; ``references`` adds labelled
    horizontal lines (e.g. dense DiLoCo with another outer step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r["val_loss"] is None or not r["bytes_per_round_per_node"] or not math.isfinite(r["val_loss"]):
            continue
        seeded = r["codec"].startswith(SHARED_SEED)
        ax.scatter(r["bytes_per_round_per_node"], r["val_loss"], marker="o" if seeded else "s",
                   color="tab:red" if seeded else "tab:blue")
        ax.annotate(r["codec"], (r["bytes_per_round_per_node"], r["val_loss"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    for i, (label, loss) in enumerate((references or {}).items()):
        ax.axhline(loss, linestyle="--", linewidth=0.8, color=f"C{i + 2}", label=label)
    if references:
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("averaging bytes sent per node per outer round (log)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON report; the plot is written next to it (.png)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma separated codec specs")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per node")
    parser.add_argument("--inner-steps", type=int, default=30, help="H: local steps per outer round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--config-timeout", type=float, default=1200.0)
    parser.add_argument("--from-report", type=Path, help="recompute the frontier, targets and plot of an earlier report")
    args = parser.parse_args()
    if args.from_report:
        earlier = json.loads(args.from_report.read_text())
        rows = frontier(earlier["configs"])
        earlier.update(frontier=rows, targets=check(rows))
        plot(rows, args.from_report.with_suffix(".png"), earlier.get("title", ""))
        args.from_report.write_text(json.dumps(earlier, indent=2, default=str))
        print(table(rows))
        for t in earlier["targets"]:
            print(f"- [{t['result']}] {t['target']}: {t.get('detail', '')}")
        return
    if not args.out:
        parser.error("--out is required (or --from-report)")
    settings = Settings(model=args.model, nodes=args.nodes, steps=args.steps, inner_steps=args.inner_steps,
                        batch_size=args.batch_size, warmup_steps=30, config_timeout=args.config_timeout)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    for spec in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        name = register(spec)
        directory = out.parent / f"{out.stem}-{name}"
        directory.mkdir(parents=True, exist_ok=True)
        print(f"== {spec}", flush=True)
        t0 = time.time()
        try:
            rec = convergence.run_locomesh(name, settings, directory)
        except Exception as e:  # noqa: BLE001 - one broken codec must not lose the others
            rec = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
        rec["directory"] = str(directory)
        results[spec] = convergence.summarize(name, rec)
        r = results[spec]
        print(f"   {r.get('status')}: val {r.get('final_val_loss')}, {per_round(r)} B/round/node, "
              f"{time.time() - t0:.0f}s {r.get('reason', '')}", flush=True)
    rows = frontier(results)
    title = (f"{settings.model}, {settings.nodes} nodes x {settings.steps} steps, H={settings.inner_steps}, "
             f"batch {settings.batch_size}, DiLoCo, loopback")
    png = out.with_suffix(".png")
    plot(rows, png, title)
    report = {"settings": {k: v for k, v in vars(args).items() if k != "from_report"}, "title": title, "environment": convergence._environment(), "elapsed_s": round(time.time() - started, 1),
              "frontier": rows, "targets": check(rows), "configs": results, "plot": str(png)}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out)
    print(f"\n{title}\n\n{table(rows)}\n")
    for t in report["targets"]:
        print(f"- [{t['result']}] {t['target']}: {t.get('detail', '')}")
    print(f"\nreport: {out}, plot: {png}")


if __name__ == "__main__":
    main()

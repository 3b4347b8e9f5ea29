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

``--seeds 0,1,2`` runs every codec once per seed, alternating (every codec for seed 0, then for seed
1, ...), and reports the mean loss with its spread; a codec counts as diverged when any seed did.
The report is written with ``benchmarks.results_io`` (a ``meta`` record).

Targets (shared-seed issue): ``rot2`` within 1.5 % of dense at ≥ 16× fewer bytes per round, ``rot1``
within 3 % at ≥ 32×, and no shared-seed codec (``rot*``, ``seed:*``) diverging.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from benchmarks import convergence, results_io
from benchmarks.convergence import Settings
from benchmarks.convergence_report import HEADLINE, combine_seeds

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


def _bytes(rec: dict[str, Any]) -> float | None:
    return rec["bytes_per_round_per_node"] if "bytes_per_round_per_node" in rec else per_round(rec)


def frontier(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per codec: loss, gap to dense, bytes per round and how many times fewer than dense
    (with several seeds: means, and the loss's standard deviation over the seeds)."""
    dense = results.get("none", {})
    dense_loss, dense_bytes = dense.get("final_val_loss"), _bytes(dense)
    rows = []
    for spec, rec in results.items():
        loss, b = rec.get("final_val_loss"), _bytes(rec)
        spread = rec.get("spread", {}).get("final_val_loss")
        rows.append({
            "codec": spec, "status": rec.get("status"), "val_loss": loss,
            **({"val_loss_std": spread["std"], "seeds": spread["n"]} if spread else {}),
            "gap_to_dense": None if loss is None or not dense_loss else loss / dense_loss - 1.0,
            "bytes_per_round_per_node": b,
            "fewer_bytes_than_dense": None if not b or not dense_bytes else dense_bytes / b,
            "diverged": rec.get("diverged", diverged(rec)) if rec.get("status") == "ok" else None,
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
    out.append({"target": "no shared-seed codec diverges", "result": "n/a" if not seeded else "FAIL" if bad else "pass",
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
        loss = f"{r['val_loss']:.4f}" + (f" ± {r['val_loss_std']:.4f}" if "val_loss_std" in r else "")
        lines.append(f"| `{r['codec']}` | {loss} | {gap} | {b} | {fewer} | {'yes' if r['diverged'] else 'no'} |")
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
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--seeds", default="0", help="comma separated seeds; every codec runs once per seed, alternating")
    parser.add_argument("--config-timeout", type=float, default=1200.0)
    parser.add_argument("--from-report", type=Path, help="recompute the frontier, targets and plot of an earlier report")
    args = parser.parse_args()
    if args.from_report:
        earlier = json.loads(args.from_report.read_text())
        rows = frontier(earlier["configs"])
        earlier.update(frontier=rows, targets=check(rows))
        plot(rows, args.from_report.with_suffix(".png"), earlier.get("title", ""))
        results_io.write_json(args.from_report, earlier, indent=2)
        print(table(rows))
        for t in earlier["targets"]:
            print(f"- [{t['result']}] {t['target']}: {t.get('detail', '')}")
        return
    if not args.out:
        parser.error("--out is required (or --from-report)")
    meta = results_io.begin()
    settings = Settings(model=args.model, nodes=args.nodes, steps=args.steps, inner_steps=args.inner_steps,
                        batch_size=args.batch_size, warmup_steps=args.warmup_steps, config_timeout=args.config_timeout)
    seeds = [int(x) for x in args.seeds.split(",")]
    specs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    per_seed: dict[str, dict[int, dict[str, Any]]] = {spec: {} for spec in specs}
    started = time.time()
    for seed in seeds:  # seed-major: every codec once per seed, so the machine's slow spells fall on all of them
        for spec in specs:
            name = register(spec)
            directory = out.parent / (f"{out.stem}-{name}" + (f"-seed{seed}" if len(seeds) > 1 else ""))
            directory.mkdir(parents=True, exist_ok=True)
            print(f"== {spec}" + (f", seed {seed}" if len(seeds) > 1 else ""), flush=True)
            t0 = time.time()
            try:
                rec = convergence.run_locomesh(name, dataclasses.replace(settings, seed=seed), directory)
            except Exception as e:  # noqa: BLE001 - one broken codec must not lose the others
                rec = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            rec["directory"] = str(directory)
            r = per_seed[spec][seed] = convergence.summarize(name, rec)
            r["bytes_per_round_per_node"] = per_round(r)
            r["diverged"] = diverged(r) if r.get("status") == "ok" else None
            print(f"   {r.get('status')}: val {r.get('final_val_loss')}, {r['bytes_per_round_per_node']} B/round/node, "
                  f"{time.time() - t0:.0f}s {r.get('reason', '')}", flush=True)
    if len(seeds) == 1:
        results = {spec: runs[seeds[0]] for spec, runs in per_seed.items()}
    else:
        results = {}
        for spec, runs in per_seed.items():
            results[spec] = combine_seeds(runs, (*HEADLINE, "bytes_per_round_per_node"))
            results[spec]["diverged"] = any(r.get("diverged") is not False for r in runs.values())
    rows = frontier(results)
    title = (f"{settings.model}, {settings.nodes} nodes x {settings.steps} steps, H={settings.inner_steps}, "
             f"batch {settings.batch_size}, DiLoCo, loopback" + (f", {len(seeds)} seeds" if len(seeds) > 1 else ""))
    png = out.with_suffix(".png")
    plot(rows, png, title)
    report = {"settings": {k: v for k, v in vars(args).items() if k != "from_report"}, "title": title, "environment": convergence._environment(), "elapsed_s": round(time.time() - started, 1),
              "frontier": rows, "targets": check(rows), "configs": results, "plot": str(png)}
    results_io.write(out, report, meta)
    print(f"\n{title}\n\n{table(rows)}\n")
    for t in report["targets"]:
        print(f"- [{t['result']}] {t['target']}: {t.get('detail', '')}")
    print(f"\nreport: {out}, plot: {png}")


if __name__ == "__main__":
    main()

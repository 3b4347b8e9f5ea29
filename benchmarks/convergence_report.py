"""What ``benchmarks.convergence`` reports: per-configuration numbers, the time-to-target race, the
issue's targets, seeds combined, the markdown table and the plot (pure functions of the records).

Like with like: the race's target is the data-parallel run's final loss *of the same seed*, each
time to target is read between evaluations (``benchmarks.curves``), several seeds are combined as
mean, standard deviation and range (``combine_seeds``), hivemind is judged at its best variant
(``hivemind``, ``hivemind-fp16``, ``hivemind-8bit``) and each locomesh configuration is compared with
dense DiLoCo at its own H (``dense_same_h``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.curves import crossing

HIVEMIND = {"hivemind": "none", "hivemind-fp16": "fp16", "hivemind-8bit": "8bit"}  # config: averaging codec
BASELINES = ("single", "ddp", *HIVEMIND)
COMPRESSED = ("sparseloco", "noloco-sparse")
UNIFORM_LOSS = math.log(256)  # nats/byte of the uniform predictor: where every run starts
HEADLINE = ("final_val_loss", "tokens_total", "bytes_sent_per_node", "exchange_bytes_per_node", "link_tx_bytes_per_node",
            "tokens_per_s_per_node", "comm_wait_s_per_node", "comm_wait_fraction", "loss_drop_per_mb", "time_to_target_s",
            "wall_s")


def hivemind_best(ok: dict[str, dict[str, Any]], key: str, pick: Callable[..., Any]) -> tuple[float | None, str | None]:
    """hivemind's best value of ``key`` over its variants that ran (``pick`` = max or min) and which one."""
    values = {k: ok[k][key] for k in HIVEMIND if k in ok and ok[k].get(key) is not None}
    if not values:
        return None, None
    best = pick(values, key=values.get)
    return values[best], best


def inner_steps(flags: Sequence[str], default: int) -> int:
    """H of a locomesh configuration: its last ``--inner-steps`` flag, else the run's."""
    h = default
    for i, flag in enumerate(flags[:-1]):
        if flag == "--inner-steps":
            h = int(flags[i + 1])
    return h


def is_dense_diloco(flags: Sequence[str]) -> bool:
    """Plain DiLoCo: ``--algorithm diloco`` and at most an ``--inner-steps``, nothing else."""
    rest = [f for i, f in enumerate(flags) if f != "--inner-steps" and (i == 0 or flags[i - 1] != "--inner-steps")]
    return rest == ["--algorithm", "diloco"]


def dense_same_h(results: dict[str, dict[str, Any]], flags: dict[str, list[str]], default_h: int) -> None:
    """Add ``vs_dense`` to every locomesh record: its final loss against the dense DiLoCo run *at the
    same H* (None where no such run finished), never against a dense run at another H."""
    dense = {inner_steps(flags[k], default_h): k for k in results if k in flags and is_dense_diloco(flags[k])}
    for name, rec in results.items():
        if name not in flags or rec.get("final_val_loss") is None:
            continue
        h = inner_steps(flags[name], default_h)
        base = results.get(dense.get(h, ""), {})
        loss = base.get("final_val_loss")
        rec["vs_dense"] = {"config": dense.get(h), "inner_steps": h,
                           "gap": None if not loss or name == dense.get(h) else rec["final_val_loss"] / loss - 1.0}


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def combine_seeds(per_seed: dict[int, dict[str, Any]], fields: Sequence[str] = HEADLINE) -> dict[str, Any]:
    """One configuration's record over several seeds: the first finished seed's record (curve, nodes)
    with every headline field replaced by its mean over the seeds that have it, ``spread`` (mean, std,
    min, max, n per field) and ``per_seed`` (every seed's own record). Its status is ``ok`` only when
    every seed finished: a mean over fewer seeds does not compare with the others."""
    ok = {s: r for s, r in per_seed.items() if r.get("status") == "ok"}
    first = next(iter(ok.values()), next(iter(per_seed.values()), {}))
    rec = {k: v for k, v in first.items() if k not in fields and k != "seed"}
    rec["seeds"] = list(per_seed)
    rec["per_seed"] = {str(s): r for s, r in per_seed.items()}
    if len(ok) < len(per_seed):
        bad = [f"seed {s}: {r.get('status')} {r.get('reason', '')}".strip() for s, r in per_seed.items() if s not in ok]
        rec.update(status="failed", reason="; ".join(bad))
    rec["spread"] = {}
    for f in fields:
        values = [r[f] for r in ok.values() if isinstance(r.get(f), (int, float)) and math.isfinite(r[f])]
        if values:
            rec["spread"][f] = _stats(values)
            rec[f] = rec["spread"][f]["mean"]
        elif any(f in r for r in ok.values()):
            rec[f] = None
    if "time_to_target_s" in rec["spread"] and rec["spread"]["time_to_target_s"]["n"] < len(ok):
        rec["time_to_target_s"] = None  # some seeds never reached the target: no mean time
    return rec




def summarize(name: str, rec: dict[str, Any]) -> dict[str, Any]:
    """Per-config headline numbers, added to ``rec``."""
    nodes = rec.get("nodes") or []
    if rec.get("status") != "ok" or not nodes:
        return rec
    finals = [n["val_loss"] for n in nodes if n["val_loss"] is not None and math.isfinite(n["val_loss"])]
    rec["final_val_loss"] = statistics.fmean(finals) if finals else None
    rec["tokens_total"] = sum(n["tokens"] for n in nodes)
    rec["bytes_sent_per_node"] = statistics.fmean(n["bytes_sent"] for n in nodes)
    # the training exchange alone: without one-off state downloads (joins, catch-ups) and status queries,
    # which the baselines do not have (they start from the same seed)
    rec["exchange_bytes_per_node"] = statistics.fmean(
        n["bytes_sent"] - sum(v for k, v in n.get("bytes_sent_by_kind", {}).items() if k in ("state", "status")) for n in nodes)
    link = [n.get("link_tx_bytes") for n in nodes]
    rec["link_tx_bytes_per_node"] = statistics.fmean(link) if all(b is not None for b in link) else None
    rec["tokens_per_s_per_node"] = statistics.fmean(n["tokens"] / n["train_wall_s"] for n in nodes if n["train_wall_s"] > 0)
    rec["comm_wait_s_per_node"] = statistics.fmean(n["comm_wait_s"] for n in nodes)
    rec["comm_wait_fraction"] = statistics.fmean(n["comm_wait_s"] / n["train_wall_s"] for n in nodes if n["train_wall_s"] > 0)
    if rec["final_val_loss"] is not None and rec["exchange_bytes_per_node"] > 0:
        rec["loss_drop_per_mb"] = (UNIFORM_LOSS - rec["final_val_loss"]) / (rec["exchange_bytes_per_node"] / 1e6)
    else:
        rec["loss_drop_per_mb"] = None
    total = rec["tokens_total"] or 1
    for p in rec.get("curve", []):  # exchange bytes grow with rounds, i.e. with tokens
        p["exchange_bytes_per_node"] = rec["exchange_bytes_per_node"] * min(1.0, p["tokens"] / total)
    return rec


def target_loss(results: dict[str, dict[str, Any]], given: float | None) -> tuple[float | None, str]:
    """The held-out loss every configuration races to, and where it came from: ``--target-loss``, else
    data-parallel's final loss (what synchronous training reaches with these tokens: a target that
    only the best configurations reach), else the worst final loss of the run."""
    if given is not None:
        return given, "--target-loss"
    ddp = results.get("ddp", {})
    if ddp.get("status") == "ok" and ddp.get("final_val_loss") is not None:
        return ddp["final_val_loss"], "ddp final val loss"
    finals = [r["final_val_loss"] for r in results.values() if r.get("status") == "ok" and r.get("final_val_loss") is not None]
    return (max(finals), "worst final val loss") if finals else (None, "none: no configuration finished")


def time_to_target(rec: dict[str, Any], target: float) -> float | None:
    """Seconds since launch at which the run's held-out loss reached ``target``, read between the two
    evaluations that bracket it (``benchmarks.curves.crossing``); None when it never did."""
    return crossing([(p["t_s"], p["val_loss"]) for p in rec.get("curve", [])], target)


def check_targets(results: dict[str, dict[str, Any]], settings: Any) -> list[dict[str, Any]]:
    """The issue's targets, each pass, FAIL or n/a with its numbers; hivemind is its best variant on
    each measure (``hivemind_best``). ``settings`` needs ``link_mbit``."""
    ok = {k: v for k, v in results.items() if v.get("status") == "ok" and v.get("final_val_loss") is not None}
    loco = [k for k in ok if k not in BASELINES]
    out: list[dict[str, Any]] = []

    def add(target: str, passed: bool | None, detail: str) -> None:
        out.append({"target": target, "result": "n/a" if passed is None else ("pass" if passed else "FAIL"), "detail": detail})

    t = "every locomesh config ahead of hivemind in tokens/s and in val-loss drop per MB sent"
    h_speed, h_speed_name = hivemind_best(ok, "tokens_per_s_per_node", max)
    h_drop, h_drop_name = hivemind_best(ok, "loss_drop_per_mb", max)
    if h_speed is None or not loco:
        add(t, None, "needs hivemind and at least one locomesh config")
    else:
        rows, good = [], True
        for k in loco:
            r = ok[k]
            a = r["tokens_per_s_per_node"] > h_speed
            b = (r["loss_drop_per_mb"] or 0) > (h_drop or 0)
            good &= a and b
            rows.append(f"{k}: {r['tokens_per_s_per_node']:.0f} vs {h_speed:.0f} tok/s ({h_speed_name}), "
                        f"{r['loss_drop_per_mb'] or 0:.3g} vs {h_drop or 0:.3g} nats of val loss per MB ({h_drop_name})")
        missing = [k for k in results if k not in ok and k not in BASELINES]
        add(t, good, "; ".join(rows) + (f" (not run or failed: {', '.join(missing)})" if missing else ""))

    t = "best compressed config within 3% of ddp val loss with >=1000x fewer bytes per node"
    comp = [k for k in COMPRESSED if k in ok]
    if "ddp" not in ok or not comp:
        add(t, None, "needs ddp and sparseloco or noloco-sparse")
    else:
        best = min(comp, key=lambda k: ok[k]["final_val_loss"])
        d, r = ok["ddp"], ok[best]
        rel = r["final_val_loss"] / d["final_val_loss"] - 1
        ratio = d["exchange_bytes_per_node"] / max(1.0, r["exchange_bytes_per_node"])
        add(t, rel <= 0.03 and ratio >= 1000,
            f"{best}: val {r['final_val_loss']:.4f} vs ddp {d['final_val_loss']:.4f} ({rel:+.1%}), {ratio:.0f}x fewer bytes")

    t = "noloco within 2% of diloco val loss"
    if "noloco" not in ok or "diloco" not in ok:
        add(t, None, "needs noloco and diloco")
    else:
        rel = ok["noloco"]["final_val_loss"] / ok["diloco"]["final_val_loss"] - 1
        add(t, rel <= 0.02, f"noloco {ok['noloco']['final_val_loss']:.4f} vs diloco {ok['diloco']['final_val_loss']:.4f} ({rel:+.1%})")

    t = "comm wait < 5% with overlap (streaming)"
    if "streaming" not in ok:
        add(t, None, "needs streaming")
    else:
        f = ok["streaming"]["comm_wait_fraction"]
        add(t, f < 0.05, f"streaming waits {f:.1%} of its training time ({ok['streaming']['comm_wait_method']})")

    t = "at 20 Mbit/s, time to target >=5x shorter than ddp"
    if settings.link_mbit is None:
        add(t, None, "loopback run; use --link-mbit 20")
    elif "ddp" not in ok or not loco or ok["ddp"].get("time_to_target_s") is None:
        add(t, None, "needs ddp reaching the target and a locomesh config")
    else:
        ddp_t = ok["ddp"]["time_to_target_s"]
        ratios = {k: ddp_t / ok[k]["time_to_target_s"] for k in loco if ok[k].get("time_to_target_s")}
        best = max(ratios, key=ratios.get) if ratios else None
        note = "" if settings.link_mbit == 20 else f" (measured at {settings.link_mbit:g} Mbit/s, not 20)"
        add(t, None if best is None or settings.link_mbit != 20 else ratios[best] >= 5,
            ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()) + f" faster than ddp ({ddp_t:.0f}s){note}")

    t = "at 20 Mbit/s, time to target >=1.5x shorter than hivemind"
    reached = {k: ok[k]["time_to_target_s"] for k in loco if ok[k].get("time_to_target_s")}
    if settings.link_mbit is None:
        add(t, None, "loopback run; use --link-mbit 20")
    elif not any(k in ok for k in HIVEMIND) or not reached:
        add(t, None, "needs hivemind and a locomesh config that reached the target")
    else:
        best = min(reached, key=reached.get)
        h_t, h_name = hivemind_best(ok, "time_to_target_s", min)
        if h_t is None:
            add(t, None if settings.link_mbit != 20 else True, f"{best} reached the target in {reached[best]:.0f}s; hivemind never did")
        else:
            add(t, None if settings.link_mbit != 20 else h_t / reached[best] >= 1.5,
                f"{best} {h_t / reached[best]:.1f}x faster than {h_name} ({h_t:.0f}s)")
    return out


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def markdown_table(results: dict[str, dict[str, Any]], link: bool) -> str:
    ddp_bytes = results.get("ddp", {}).get("exchange_bytes_per_node")
    head = ["config", "status", "final val loss", "tokens", "exchange sent/node", "x fewer than ddp", "all sent/node",
            "wall s", "tok/s/node", "comm wait", "time to target s"]
    if link:
        head.insert(7, "link tx/node")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        if r.get("status") != "ok":
            row = [name, r.get("status", "?") + (": " + r["reason"] if r.get("reason") else "")] + [""] * (len(head) - 2)
        else:
            b = r["exchange_bytes_per_node"]
            fewer = f"{ddp_bytes / b:.0f}x" if ddp_bytes and b else ("no comm" if not b else "-")
            ttt = r.get("time_to_target_s")
            loss = f"{r['final_val_loss']:.4f}"
            if "final_val_loss" in r.get("spread", {}):
                s = r["spread"]["final_val_loss"]
                loss += f" ± {s['std']:.4f} (n={s['n']})"
            row = [name, "ok", loss, f"{r['tokens_total'] / 1e6:.2f} M", _fmt_bytes(b), fewer,
                   _fmt_bytes(r["bytes_sent_per_node"]), f"{r['wall_s']:.0f}", f"{r['tokens_per_s_per_node']:.0f}",
                   f"{r['comm_wait_fraction']:.1%}", "-" if ttt is None else f"{ttt:.0f}"]
            if link:
                row.insert(7, _fmt_bytes(r.get("link_tx_bytes_per_node")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str, target: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(19, 5))
    colors = plt.get_cmap("tab10")
    for name, r in results.items():
        curve = r.get("curve") or []
        if r.get("status") != "ok" or not curve:
            continue
        style = "--" if name in BASELINES else "-"
        color = colors(list(results).index(name) % 10)
        ax1.plot([p["tokens"] / 1e6 for p in curve], [p["val_loss"] for p in curve], style, marker=".", label=name, color=color)
        ax3.plot([p["t_s"] for p in curve], [p["val_loss"] for p in curve], style, marker=".", label=name, color=color)
        pts = [(p["exchange_bytes_per_node"], p["val_loss"]) for p in curve if p.get("exchange_bytes_per_node", 0) > 0]
        if pts:
            ax2.plot([x for x, _ in pts], [y for _, y in pts], style, marker=".", label=name, color=color)
    ax1.set_xlabel("tokens trained, all nodes (M)")
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.set_title("validation loss vs tokens")
    ax2.set_xscale("log")
    ax2.set_xlabel("bytes sent per node for the training exchange (log; assumed linear in tokens)")
    ax2.set_title("validation loss vs bytes sent (single: none)")
    ax3.set_xlabel("wall time since launch (s)")
    ax3.set_title("validation loss vs wall time")
    if target is not None:
        ax3.axhline(target, color="gray", linestyle=":", label=f"target {target:.3f}")
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

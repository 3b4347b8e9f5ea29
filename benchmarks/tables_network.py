"""Docs tables of what links and peers cost: thin-link races, NAT relays, swarm scale, upload caps, churn.

Each function takes the :class:`~benchmarks.table_format.Results` to read and returns the markdown that
goes between a ``<!-- table: NAME -->`` marker pair (``benchmarks.tables``): a caption naming the files,
their commits and dates, then the table.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.replica_gap import SPARSELOCO, config_name
from benchmarks.table_format import Results, loss, mean_std, seconds, share, size, table, times
from node.config.defaults import OUTER_DEFAULTS, steps_for_replicas

ABLATION = "thin20_race_e64c396.json"  # the 20 Mbit/s race's one-run-per-config ablation (overlap, q8/q4) of build e64c396
RACE_ROWS = {
    "ddp": "ddp (gloo all-reduce every step, 300 steps)",
    "hivemind": "hivemind `Optimizer(use_local_updates=True)`, fp32",
    "hivemind-fp16": "hivemind, Float16 averaging",
    "hivemind-8bit": "hivemind, 8-bit averaging",
    "diloco": "diloco",
    "diloco-q8": "diloco `--compression q8`",
    "diloco-q4": "diloco `--compression q4`",
    "diloco-q2": "diloco `--compression q2`",
    "diloco-overlap": "diloco `--overlap` (asap)",
    "diloco-eager": "diloco `--overlap-mode eager`",
    "diloco-q8-eager": "diloco q8, eager",
    "sparseloco": "sparseloco",
}


def _crossing(curve: list[dict[str, Any]], target: float) -> tuple[float | None, float | None]:
    """The evaluation before the one that reached ``target``, and that one (seconds)."""
    before = None
    for point in curve:
        if point["val_loss"] <= target + 1e-9:
            return before, point["t_s"]
        before = point["t_s"]
    return before, None


def race(r: Results, name: str) -> str:
    """Time to data-parallel's held-out loss over thin links, one run per config."""
    d = r.load(name)
    configs, target = d["configs"], d["target_loss"]
    ddp_t, hm_t = configs["ddp"]["time_to_target_s"], configs["hivemind"]["time_to_target_s"]
    ddp_tokens = configs["ddp"]["tokens_total"]
    rows = []
    for key, label in RACE_ROWS.items():
        if key not in configs:
            continue
        c = configs[key]
        t = c["time_to_target_s"]
        at_ddp = min(c["curve"], key=lambda p: abs(p["tokens"] - ddp_tokens))["val_loss"]
        before, _ = _crossing(c.get("curve", []), target)
        window = "–" if t is None or before is None or key == "ddp" else f"{before:.0f}–{t:.0f} s"
        rows.append([label, seconds(t), window, "–" if t is None else times(ddp_t / t, 2),
                     "–" if t is None or key == "ddp" else times(hm_t / t, 2), loss(at_ddp), loss(c["final_val_loss"]),
                     size(c["exchange_bytes_per_node"]), share(c["comm_wait_fraction"])])
    header = [f"{d['link_mbit']} Mbit/s", f"time to {target:.3f}", "reached between evaluations at", "vs ddp",
              "vs hivemind", "loss at ddp's tokens", "final loss", "exchange/node", "comm wait"]
    what = (f"{d['title']}; one run per row. ddp's final loss sets the target, so ddp's time is its whole run; "
            "the others train 600 steps per node; the loss at ddp's tokens is their evaluation nearest to ddp's 300 steps.")
    return r.caption(name, what=what) + "\n\n" + table(header, rows)


def _seed_records(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A configuration's record per seed (a one-seed file is its own record)."""
    return rec.get("per_seed") or {str(rec.get("seed", 0)): rec}


def _seed_times(configs: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Time to target per configuration and seed, plus ``hivemind*``: the best hivemind variant's, per seed."""
    out = {k: {seed: x.get("time_to_target_s") for seed, x in _seed_records(c).items()} for k, c in configs.items()}
    seeds = next(iter(out.values()), {})
    variants = [k for k in configs if k.startswith("hivemind")]
    out["hivemind*"] = {seed: min((t for k in variants if (t := out[k].get(seed)) is not None), default=None)
                        for seed in seeds}
    return out


def seed_ratios(times: dict[str, dict[str, float | None]], config: str, base: str) -> list[float]:
    """``base``'s time to target over ``config``'s (``times`` from ``_seed_times``), one ratio per seed where
    both reached it (``hivemind*``: the best hivemind variant of that seed). Ratios are taken within a seed."""
    return [b / t for seed, t in times[config].items() if t and (b := times[base].get(seed))]


def _ratio_cell(ratios: list[float], seeds: int) -> str:
    if not ratios:
        return "–"
    spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
    missing = f"; not reached in {seeds - len(ratios)} of {seeds} seeds" if len(ratios) < seeds else ""
    return f"{statistics.fmean(ratios):.2f}×{spread}{missing}"


def race_seeds(r: Results, name: str = "thin20_race.json") -> str:
    """Time to data-parallel's held-out loss over thin links, several seeds alternated: each ratio is taken
    within a seed (against that seed's ddp and best hivemind variant), then mean (min–max)."""
    d = r.load(name)
    configs, s = d["configs"], d["settings"]
    seeds = [str(x) for x in d.get("seeds") or [s["seed"]]]
    times = _seed_times(configs)
    labels = {**RACE_ROWS, "ddp": "ddp (gloo all-reduce every step)"}
    ddp_tokens = configs["ddp"]["tokens_total"]
    rows = []
    for key, c in configs.items():
        if c.get("status") != "ok":
            rows.append([labels.get(key, f"`{key}`"), c.get("status", "?"), *["–"] * 6])
            continue
        reached = [t for t in times[key].values() if t is not None]
        when = (f"{statistics.fmean(reached):.0f} ± {statistics.stdev(reached) if len(reached) > 1 else 0:.0f} s"
                if len(reached) == len(seeds) else f"reached in {len(reached)} of {len(seeds)}")
        baseline = key == "ddp" or key.startswith("hivemind")
        at_ddp = statistics.fmean(min(x["curve"], key=lambda p: abs(p["tokens"] - ddp_tokens))["val_loss"]
                                  for x in _seed_records(c).values() if x.get("curve"))
        rows.append([labels.get(key, f"`{key}`"), when,
                     "–" if key == "ddp" else _ratio_cell(seed_ratios(times, key, "ddp"), len(seeds)),
                     "–" if baseline else _ratio_cell(seed_ratios(times, key, "hivemind*"), len(seeds)),
                     loss(at_ddp), mean_std(c, "final_val_loss"), size(c["exchange_bytes_per_node"]),
                     share(c["comm_wait_fraction"])])
    header = [f"{d['link_mbit']:g} Mbit/s", "time to ddp's loss", "sooner than ddp, per seed", "sooner than hivemind's best",
              "loss at ddp's tokens", "final loss", "exchange/node", "comm wait"]
    ddp_steps = s.get("baseline_steps") or s["steps"]
    what = (f"`{s['model']}`, {s['nodes']} nodes, H = {s['inner_steps']}, batch {s['batch_size']}, {d['link_mbit']:g} Mbit/s "
            f"links (tc tbf, each process in its own namespace), seeds {', '.join(seeds)} (configurations alternated per "
            f"seed). ddp trains {ddp_steps} steps per node and its final held-out loss, per seed, is the target "
            f"(mean {d['target_loss']:.3f}); the others train {s['steps']} steps per node and race to it. Times are read "
            "between evaluations; each ratio is taken within a seed (against that seed's ddp, or the fastest hivemind "
            "variant of that seed), then mean (min–max); loss at ddp's tokens is the evaluation nearest them.")
    return r.caption(name, what=what) + "\n\n" + table(header, rows)


def targets(r: Results) -> str:
    """Each target the benchmarks set, met or missed, from the files that measure it."""
    rows: list[list[str]] = []
    for name in ("frontier.json", "sparse_gap.json"):
        for t in r.load(name).get("targets", []):
            if t["result"] != "n/a":
                rows.append([t["target"], f"`{name}`", "met" if t["result"] == "pass" else "missed", t["detail"]])
    gap, h30 = r.load("gap_closed.json")["configs"], r.load("sparse_gap.json")["configs"]["diloco"]["final_val_loss"]
    noloco = gap["noloco-h30-lr1"]["val_loss"] / h30 - 1
    rows.append(["noloco at its defaults (β = γ = 1) within 2 % of diloco, both H = 30", "`gap_closed.json`, `sparse_gap.json`",
                 "met" if noloco <= 0.02 else "missed", f"{100 * noloco:+.1f} % (two builds)"])
    h50 = gap["diloco-h50"]
    sparse = {k: (c["val_loss"] / h50["val_loss"] - 1, h50["averaging_bytes_sent_per_node"] / c["averaging_bytes_sent_per_node"])
              for k, c in gap.items() if k.startswith("sparseloco")}
    hit = [k for k, (rel, fewer) in sparse.items() if rel <= 0.03 and fewer >= 100]
    near = max(sparse, key=lambda k: sparse[k][1])
    rows.append(["sparseloco within 3 % of dense diloco (H = 50) at ≥ 100× fewer bytes", "`gap_closed.json`",
                 "met" if hit else "missed", f"fewest bytes: `{near}` {sparse[near][1]:.0f}× at {100 * sparse[near][0]:+.1f} %"])
    race = r.load("thin20_race.json")["configs"]
    times = _seed_times(race)
    loco = [k for k in race if k != "ddp" and not k.startswith("hivemind") and race[k].get("status") == "ok"]
    for base, bar, what in (("ddp", 5.0, "ddp"), ("hivemind*", 1.5, "hivemind's best variant")):
        ratios = {k: seed_ratios(times, k, base) for k in loco}
        met = [k for k, v in ratios.items() if v and statistics.fmean(v) >= bar]
        rows.append([f"at 20 Mbit/s, time to target ≥ {bar:g}× shorter than {what} (mean over seeds)", "`thin20_race.json`",
                     f"met by {len(met)} of {len(loco)} configs" if met else "missed",
                     "; ".join(f"`{k}` {_ratio_cell(v, len(_seed_records(race[k])))}" for k, v in ratios.items())])
    variants = [race[k] for k in race if k.startswith("hivemind") and race[k].get("status") == "ok"]
    speed, drop = max(h["tokens_per_s_per_node"] for h in variants), max(h["loss_drop_per_mb"] for h in variants)
    behind = [k for k in loco if race[k]["tokens_per_s_per_node"] <= speed or race[k]["loss_drop_per_mb"] <= drop]
    rows.append(["every locomesh config ahead of hivemind's best variant in tokens/s and in loss drop per MB sent",
                 "`thin20_race.json`", "missed" if behind else "met",
                 ", ".join(f"`{k}` {race[k]['tokens_per_s_per_node']:.0f} tok/s, {race[k]['loss_drop_per_mb']:.3f} nats/MB"
                           for k in loco) + f" against hivemind's best {speed:.0f} tok/s, {drop:.3f} nats/MB"])
    ablation = r.load(ABLATION)["configs"]
    overlap = {k: ablation[k]["comm_wait_fraction"] for k in ("diloco-overlap", "diloco-eager", "diloco-q8-eager") if k in ablation}
    rows.append(["comm wait < 5 % with overlap", f"`{ABLATION}`", "met" if max(overlap.values()) < 0.05 else "missed",
                 ", ".join(f"`{k}` {share(v)}" for k, v in overlap.items()) + " (one run each; the `streaming` config was not run)"])
    for name in ("churn.json", "churn_no_restart.json"):
        for seed, s in r.load(name)["per_seed"].items():
            gap, at = s.get("val_loss_gap_pipeline_steps"), f"{s.get('equal_pipeline_steps')} pipeline steps (all trainers)"
            if gap is None:  # a file from before trainers' evaluations carried their time
                gap, at = s["val_loss_gap"], f"{s['equal_steps']} trainer steps"
            rows.append([f"churn: held-out loss within 5 % of the calm run ({'with' if name == 'churn.json' else 'without'} restarts, seed {seed})",
                         f"`{name}`", "met" if gap <= 0.05 else "missed",
                         f"{100 * gap:+.1f} % at {at}, {share(s['progress_fraction'])} progressing"])
    # the node's default in an open swarm: dense rounds of 3+ reduce-scatter (no contribution screen);
    # SparseLoCo gathers whole updates, which the screen scores before sparse-clip
    for name, default in (("byzantine_diloco.json", "centered-clip"), ("byzantine_sparseloco.json", "sparse-clip+scores")):
        summary = [s for s in r.load(name)["summary"] if s["aggregator"] == default]
        worst = max((s for s in summary if s["attack"] != "none"), key=lambda s: s["vs_clean_plain"])
        clean = max(s["vs_clean_plain"] for s in summary if s["attack"] == "none")
        rows.append([f"`{default}`: every attack within 5 % of the clean plain mean", f"`{name}`",
                     "met" if worst["vs_clean_plain"] <= 0.05 else "missed",
                     f"worst `{worst['attack']}` at {worst['nodes']} nodes: {100 * worst['vs_clean_plain']:+.1f} %"])
        rows.append([f"`{default}`: clean run within 1 % of the plain mean", f"`{name}`", "met" if clean <= 0.01 else "missed",
                     f"worst {100 * clean:+.1f} %"])
    rows += _replica_gap_targets(r.load("replica_gap.json")["summary"])
    files = ["frontier.json", "sparse_gap.json", "gap_closed.json", "thin20_race.json", ABLATION, "churn.json", "churn_no_restart.json",
             "byzantine_diloco.json", "byzantine_sparseloco.json", "replica_gap.json"]
    return r.caption(*files) + "\n\n" + table(["target", "file", "result", "detail"], rows)


def thin_nat(r: Results) -> str:
    """Three peers at 20 Mbit/s, all public or two behind NAT relayed through the third."""
    rows = []
    for c in r.load("thin_nat.json")["nat_cases"]:
        homes = [n["relayed_bytes_per_round"] for n in c["per_node"] if n["reachability"] == "private"]
        relayed = "–" if not homes else size(min(homes)) if size(min(homes)) == size(max(homes)) else f"{size(min(homes))} – {size(max(homes))}"
        rows.append([f"`{c['codec']}`", c["topology"], f"{c['round_s_median']:.2f}", f"{c['exchange_s_median']:.2f}",
                     str(c["full_rounds_min"]), size(c["average_bytes_sent_per_node_per_round"]), relayed])
    header = ["codec", "path", "round s (median)", "exchange s", "full rounds (fewest of a node)", "averaging bytes/node/round",
              "relayed bytes/home/round"]
    return (r.caption("thin_nat.json", what="`tiny` DiLoCo, 3 peers at 20 Mbit/s each, H = 30, batch 8, one 120 s run per row.")
            + "\n\n" + table(header, rows))


def scale(r: Results) -> str:
    """What one peer pays per dense round, measured with real lightweight peers on one machine."""
    rows = []
    for name in ("scale.json", "scale_groups.json"):
        for run in r.load(name)["runs"]:
            payload, spread = run["payload_bytes"], run["spread_after_each_round"]
            groups = str(run["groups"][0]) if run["groups"] == [1] else \
                f"{'/'.join(map(str, run['groups']))} (of {min(run['group_sizes'])}–{max(run['group_sizes'])})"
            spread_text = "0" if max(spread) < 0.005 else f"{min(spread):.2f}–{max(spread):.2f}"
            rows.append([str(run["peers"]), groups, f"{run['bytes_sent_per_node_per_round'] / payload:.2f} ×",
                         f"{run['bytes_sent_per_node_per_round_max'] / payload:.2f} ×", f"{run['round_s_median']:.1f} s",
                         f"{run['dht_requests_per_node_per_round']:.1f}", spread_text, f"{run['rss_mb_per_peer']:.0f} MB"])
    header = ["peers", "groups", "sent/peer/round (× payload)", "busiest peer", "round (median)", "DHT requests/peer/round",
              "replicas' spread", "RSS/peer"]
    what = "Synthetic 1 M-parameter updates (a 4 MB payload), `none` codec, loopback on one 2-core machine."
    return r.caption("scale.json", "scale_groups.json", what=what) + "\n\n" + table(header, rows)


def scale_simulated(r: Results) -> str:
    """The cost model's extrapolation, bounded groups (drawn as the daemon draws them: unequal) against one group."""
    d = r.load("scale.json")
    one = {(s["peers"], s["link"]): s for s in d["simulated_one_group"]}
    rows = []
    for s in d["simulated"]:
        o = one[(s["peers"], s["link"])]
        p = s["payload_bytes"]

        def cost(x: dict[str, Any]) -> str:
            return (f"{x['bytes_sent_per_node_per_round'] / p:.2f} ×, {x['bytes_sent_busiest_node_per_round'] / p:.2f} ×, "
                    f"{x['round_s_median']:.2f} s")
        members = f"{s['group']:.1f}" + (f" (largest {s['largest_group']:.0f})" if "largest_group" in s else " (assumed equal)")
        rows.append([str(s["peers"]), s["link"], members, cost(s), cost(o), f"{s['dht_requests_per_node_per_round']:.0f}"])
    header = ["peers", "link", "members per group: mean (largest)", "groups of ≤ 32: mean sent, busiest, round",
              "one group: mean sent, busiest, round", "DHT requests"]
    what = "`simulated` and `simulated_one_group` (benchmarks/scale_model.py)"
    if "resimulated" in d:
        what += f", recomputed from the file's measured runs at commit {str(d['resimulated']['commit'])[:7]}"
    return r.caption("scale.json", what=what + ".") + "\n\n" + table(header, rows)


def bandwidth_cap(r: Results) -> str:
    """A node under `--max-upload-mbit`, measured on its namespace's interface."""
    rows = []
    for run in r.load("bandwidth_cap.json")["runs"]:
        peak = run["peak_tx_mbit"]
        rows.append(["uncapped" if not run["cap_mbit"] else f"{run['cap_mbit']:g} Mbit/s", f"{run['window_s']:.0f} s",
                     f"{run['wire_tx_mbit']:.2f}", f"{run['locomesh_sent_mbit']:.2f}",
                     f"{peak['1s']:.2f} / {peak['3s']:.2f} / {peak['10s']:.2f}", str(run["rounds_in_window"])])
    header = ["upload cap", "window", "wire tx Mbit/s", "locomesh sent Mbit/s", "peak tx over 1 s / 3 s / 10 s", "rounds in window"]
    return r.caption("bandwidth_cap.json") + "\n\n" + table(header, rows)


def churn(r: Results) -> str:
    """A 3-stage pipeline under random SIGKILLs, against a calm run of the same seed."""
    rows = []
    for name in ("churn.json", "churn_no_restart.json"):
        d = r.load(name)
        restarts = "restarts" if name == "churn.json" else "no restarts"
        for seed, s in d["per_seed"].items():
            v = s["val_loss_at_equal_steps"]
            w = s.get("val_loss_at_equal_pipeline_steps")
            tokens = ("–" if not s.get("val_loss_gap_pipeline_steps") else
                      f"{w['killed']:.3f} vs {w['calm']:.3f} ({100 * s['val_loss_gap_pipeline_steps']:+.1f} %) at {s['equal_pipeline_steps']}")
            kills = f"{s['kills']} / {s['trainers_killed']}" if "trainers_killed" in s else f"{s['kills']} / {s['trainer_kills']}"
            rows.append([f"{restarts}, seed {seed}", f"{d['minutes']:g} min", kills,
                         f"{share(s['progress_fraction'])} of {s['wall_s']:.0f} s", str(len(s["recoveries"])),
                         str(s["fresh_initialisations"]), str(s["stages_emptied_by_recovery"]),
                         f"{v['killed']:.3f} vs {v['calm']:.3f} ({100 * s['val_loss_gap']:+.1f} %) at {s['equal_steps']}", tokens])
    header = ["run", "length", "kills / of trainers", "trainer progressing", "stage rebuilds", "fresh initialisations",
              "stages emptied by a recovery", "held-out loss at equal steps of the evaluated trainer, killed vs calm",
              "at equal pipeline steps (all trainers' microbatches)"]
    what = ("`node swarm --stages 3 --checkfree-plus --model micro`, 8 processes on 2 cores (two of them trainers), kills every "
            "45 s. A run whose other trainer was killed has trained its stages on about half the tokens at the same steps of "
            "the evaluated trainer, so equal pipeline steps (tokens) are the like-with-like comparison; files measured before "
            "trainers' evaluations carried their time have only the first (–).")
    return r.caption("churn.json", "churn_no_restart.json", what=what) + "\n\n" + table(header, rows)


def quick_suite(r: Results) -> str:
    """What the last ``make bench SCALE=quick`` ran: every entry's status and minutes, and the total."""
    name = "quick/suite.json"
    from benchmarks.suite_entries import ENTRIES

    d = r.load(name)
    order = {e.name: i for i, e in enumerate(ENTRIES)}
    rows, total = [], 0.0
    for e in sorted(d["entries"], key=lambda e: order.get(e["name"], len(order))):
        minutes = e.get("seconds", 0.0) / 60
        total += minutes if e["status"] != "skipped" else 0.0
        what = e["status"] if e["status"] != "skipped" else f"skipped: {e.get('detail', '')}"
        rows.append([f"`{e['name']}`", what, f"{minutes:.1f}" if e["status"] != "skipped" else "–"])
    rows.append(["all", f"{d['summary']['ok']} ok, {d['summary']['failed']} failed, {d['summary']['skipped']} skipped", f"{total:.1f}"])
    what = ("Each entry's results file is in `benchmarks/results/quick/` with its own commit; entries marked "
            "`earlier` in the file ran in an earlier invocation at the same scale (`--only`).")
    return r.caption(name, what=what) + "\n\n" + table(["entry", "status", "minutes"], rows)


def _replica_gap_targets(summary: list[dict[str, Any]]) -> list[list[str]]:
    """#37's targets against one process on the same tokens: dense DiLoCo at its defaults (H by replica
    count, ``steps_for_replicas``) within 2 %, SparseLoCo at its defaults within 4 %, per replica count."""
    rows = []
    for s in summary:
        dense = config_name(steps_for_replicas(s["nodes"]), *OUTER_DEFAULTS["diloco"], True)
        if s["config"] not in (dense, SPARSELOCO):
            continue
        what, bound = ("dense diloco", 0.02) if s["config"] == dense else ("sparseloco", 0.04)
        rows.append([f"{what} at its defaults within {100 * bound:.0f} % of one process on the same tokens, {s['nodes']} replicas",
                     "`replica_gap.json`", "met" if s["gap_mean"] <= bound else "missed",
                     f"{100 * s['gap_mean']:+.1f} % ({100 * s['gap_min']:+.1f} … {100 * s['gap_max']:+.1f}) over "
                     f"{s['seeds']} seeds, `{s['config']}`, in one process"])
    return rows


def wire(r: Results) -> str:
    """A dense round between peer processes against raw TCP and hivemind's averager (benchmarks/wire.py)."""
    runs = r.load("wire.json")["runs"]
    floor = {(x["params"], x["peers"], x["dtype"]): x for x in runs if x["system"] == "tcp" and "round_s" in x}
    hive = {(x["params"], x["peers"], x["dtype"]): x for x in runs if x["system"] == "hivemind" and "round_s" in x}
    rows = []
    for x in runs:
        key = (x["params"], x["peers"], x["dtype"])
        if "round_s" not in x:
            rows.append([f"{x['params'] / 1e6:.0f} M {x['dtype']}", str(x["peers"]), x["system"], "did not finish"] + [""] * 8)
            continue
        tcp = f"{x['round_s'] / floor[key]['round_s']:.1f} ×" if key in floor and x["system"] != "tcp" else "–"
        vs_hive = f"{hive[key]['round_s'] / x['round_s']:.2f} ×" if key in hive and x["system"].startswith("locomesh") else "–"
        parts = f"{x['gather_s']:.2f} / {x['exchange_s']:.2f} s" if "exchange_s" in x else "–"
        rows.append([f"{x['params'] / 1e6:.0f} M {x['dtype']} ({x['payload_mb']:.0f} MB)", str(x["peers"]), x["system"],
                     f"{x['round_s']:.2f} s", parts, tcp, vs_hive, f"{x['complete_rounds']}/{x['rounds'] - 1}",
                     f"{x['cpu_s']:.2f} s", f"{x['transient_x_payload']:.1f} ×",
                     f"{x['held_x_payload']:.1f} ×" if "held_x_payload" in x else "–",
                     f"{x['fresh_mb']:.0f} MB" if "fresh_mb" in x else "–"])
    header = ["size (payload)", "peers", "system", "round (median)", "start / exchange", "÷ TCP floor",
              "hivemind ÷ this", "complete rounds", "CPU s/peer/round", "transient memory (× payload)",
              "held beyond φ, θ (× payload)", "fresh memory touched per round"]
    what = ("One process per peer on loopback, one 2-core machine (the peers share it: from 4 peers on, round time is "
            "about the peers' CPU seconds over 2 cores). `locomesh`: bulk streams over the data channel; "
            "`locomesh-libp2p`: through p2pd. Start: Δ, encoding and the rendezvous; the rest of a round after the "
            "exchange is aggregation and the outer step. Steady rounds only (the first is left out). Transient: a "
            "round's peak beyond the resident memory just before it; held: a steady round's peak beyond the resident "
            "memory before the first round (for locomesh that includes the outer momentum, 1 × the fp32 payload, "
            "and the wire parts still served from the round before). Fresh memory: a steady round's minor page faults "
            "× 4 KiB, the peer and its p2pd together (memory the heap did not reuse).")
    return r.caption("wire.json", what=what) + "\n\n" + table(header, rows)

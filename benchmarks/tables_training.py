"""Docs tables of what training reaches: codecs, SparseLoCo's and NoLoCo's gap, inner optimizers, attacks, mutants.

Each function takes the :class:`~benchmarks.table_format.Results` to read and returns the markdown that
goes between a ``<!-- table: NAME -->`` marker pair (``benchmarks.tables``): a caption naming the
files, their commits and dates, then the table. Only numbers read from the files go in a table; the
row labels are prose.
"""

from __future__ import annotations

import statistics

from benchmarks.table_format import Results, loss, mean_std, pct, size, table, times

# configs of sparse_gap.json and gap_closed.json as a reader knows them (their flags are in each file)
SPARSE_GAP_ROWS = {
    "diloco": "diloco (H = 30)",
    "sparseloco-mean": "sparseloco, `--aggregate mean` (the aggregation before `sparse-mean`)",
    "sparseloco": "sparseloco, `sparse-mean`, η 1",
    "sparseloco-mu5": "sparseloco, `sparse-mean`, η 1, outer μ 0.5",
    "sparseloco-h20": "sparseloco, `sparse-mean`, η 1, H = 20 (a second run)",
    "noloco": "noloco, H = 30, β = γ = 0.7",
}
GAP_CLOSED_ROWS = {
    "diloco-h50": "diloco, defaults (H = 50, reduce-scatter)",
    "sparseloco-final": "**sparseloco, defaults (H = 30, η 2, `topk:64/4096+q2`)**",
    "sparseloco-h30-lr2": "sparseloco, η 2, q2 levels split at the median",
    "sparseloco-h30-lr15": "sparseloco, η 1.5",
    "sparseloco-cl-h30": "sparseloco, η 1",
    "sparseloco-h30-lr3": "sparseloco, η 3",
    "sparseloco-h27": "sparseloco, η 1, H = 27",
    "sparseloco-cl-h24": "sparseloco, η 1, H = 24",
    "sparseloco-h24-k52": "sparseloco, η 1, H = 24, `topk:52/4096+q2`",
    "sparseloco-h30-k32-lr2": "sparseloco, η 2, `topk:32/4096+q2`",
    "sparseloco-h30": "sparseloco, η 1, one q2 table per flat run (discarded)",
    "noloco-h30-lr1": "**noloco, defaults (H = 30, β = γ = 1)**",
    "noloco-h30": "noloco, H = 30, β = γ = 0.7 (the paper's)",
}


def frontier(r: Results) -> str:
    """Held-out loss against averaging bytes per round, one DiLoCo run per codec (a column against dense
    DiLoCo stepped like the lossy codecs where the file has that run: full scale only)."""
    d = r.load("frontier.json")
    lossy_outer = (d.get("dense_with_lossy_outer_step") or {}).get("val_loss")
    rows = []
    for row in d["frontier"]:
        cells = [f"`{row['codec']}`", loss(row["val_loss"]), "–" if row["codec"] == "none" else pct(row["gap_to_dense"])]
        if lossy_outer is not None:
            cells.append(pct(row["val_loss"] / lossy_outer - 1))
        rows.append(cells + [size(row["bytes_per_round_per_node"]), times(row["fewer_bytes_than_dense"])])
    header = ["codec", "held-out loss", "vs dense (lr 0.7, μ 0.9)" if lossy_outer is not None else "vs dense"]
    if lossy_outer is not None:
        header.append(f"vs dense (lr 1.0, μ 0.5: {loss(lossy_outer)})")
    header += ["bytes/round/node", "fewer bytes"]
    return r.caption("frontier.json", what=d["title"] + ".") + "\n\n" + table(header, rows)


def q2_reduce_scatter(r: Results) -> str:
    """2-bit DiLoCo against dense DiLoCo, both reduce-scattering at H = 50: two files, two builds."""
    dense = r.load("gap_closed.json")["configs"]["diloco-h50"]
    q2 = r.load("diloco_q2_reduce_scatter.json")["configs"]["diloco-q2-h50"]
    q2_rounds = min(n["rounds_with_every_node"] for n in q2["nodes"])
    rows = [
        ["dense DiLoCo (`none`)", f"`gap_closed.json` `diloco-h50`, build {dense['build'].split()[0]}", loss(dense["val_loss"]),
         "–", size(dense["averaging_bytes_sent_per_node"]), "1×", str(min(dense["rounds_with_every_node"]))],
        ["DiLoCo `--compression q2`", "`diloco_q2_reduce_scatter.json`", loss(q2["final_val_loss"]),
         pct(q2["final_val_loss"] / dense["val_loss"] - 1), size(q2["exchange_bytes_per_node"]),
         times(dense["averaging_bytes_sent_per_node"] / q2["exchange_bytes_per_node"]), str(q2_rounds)],
    ]
    header = ["run", "from", "held-out loss", "vs dense", "averaging bytes/node", "fewer bytes", "rounds with every node"]
    return (r.caption("diloco_q2_reduce_scatter.json", "gap_closed.json",
                      what="`tiny`, 4 nodes × 600 steps, H = 50, batch 16, loopback, one run each.")
            + "\n\n" + table(header, rows))


def sparse_gap(r: Results) -> str:
    """SparseLoCo and NoLoCo against dense DiLoCo at H = 30 (all-gather rounds), one build."""
    d = r.load("sparse_gap.json")["configs"]
    base = d["diloco"]
    rows = []
    for key, label in SPARSE_GAP_ROWS.items():
        c = d[key]
        rows.append([label, loss(c["final_val_loss"]), "–" if key == "diloco" else pct(c["final_val_loss"] / base["final_val_loss"] - 1),
                     size(c["exchange_bytes_per_node"]), times(base["exchange_bytes_per_node"] / c["exchange_bytes_per_node"])])
    header = ["config", "held-out loss", "vs diloco", "averaging bytes/node", "fewer bytes"]
    return (r.caption("sparse_gap.json", what="`tiny`, 4 nodes × 600 steps, H = 30 unless the row says, batch 16, loopback, one run each.")
            + "\n\n" + table(header, rows))


def gap_closed(r: Results) -> str:
    """The hand-made summary of SparseLoCo and NoLoCo runs from several builds, against both dense baselines."""
    configs = r.load("gap_closed.json")["configs"]
    h50 = configs["diloco-h50"]
    h30 = r.load("sparse_gap.json")["configs"]["diloco"]
    builds = sorted({c["build"].split()[0] for c in configs.values()})
    rows = []
    for key, label in GAP_CLOSED_ROWS.items():
        c = configs[key]
        rows.append([label, c["build"].split()[0] + (" (dirty)" if "working tree" in c["build"] else ""), loss(c["val_loss"]),
                     "–" if key == "diloco-h50" else pct(c["val_loss"] / h50["val_loss"] - 1),
                     pct(c["val_loss"] / h30["final_val_loss"] - 1), size(c["averaging_bytes_sent_per_node"]),
                     times(h50["averaging_bytes_sent_per_node"] / c["averaging_bytes_sent_per_node"])])
    header = ["config", "build", "held-out loss", f"vs diloco H = 50 ({loss(h50['val_loss'])})",
              f"vs diloco H = 30 ({loss(h30['final_val_loss'])}, `sparse_gap.json`)", "averaging bytes/node",
              "fewer bytes than diloco H = 50"]
    what = (f"A hand-made summary of single runs from {len(builds)} builds ({', '.join(builds)}; each row names its own), "
            "`tiny`, 4 nodes × 600 steps, batch 16, loopback; the H = 30 baseline is from `sparse_gap.json`.")
    return r.caption("gap_closed.json", "sparse_gap.json", what=what) + "\n\n" + table(header, rows)


def inner_optimizer(r: Results) -> str:
    """AdamW against Muon, constant against cosine, mean ± std over seeds."""
    header = ["--lr", "codec", "adamw constant", "adamw cosine", "muon constant", "muon cosine"]
    rows = []
    for name in ("inner_optimizer.json", "inner_optimizer_lr3e-3.json"):
        d = r.load(name)
        cells: dict[tuple[str, str, str], str] = {}
        for s in d["summary"]:
            cells[(s["codec"], s["optimizer"], s["schedule"])] = f"{s['val_loss_mean']:.3f} ± {s['val_loss_std']:.3f}"
        for codec in dict.fromkeys(s["codec"] for s in d["summary"]):
            rows.append([f"{d['settings']['lr']:g}", codec] + [cells.get((codec, o, s), "–") for o in ("adamw", "muon")
                                                              for s in ("constant", "cosine")])
    settings = r.load("inner_optimizer.json")["settings"]
    what = (f"`{settings['model']}`, {settings['nodes']} replicas in one process, {settings['rounds']} rounds × H "
            f"{settings['inner_steps']}, warm-up {settings['warmup_steps']}, seeds 0–2; held-out loss, nats per byte.")
    return r.caption("inner_optimizer.json", "inner_optimizer_lr3e-3.json", what=what) + "\n\n" + table(header, rows)


def replica_gap(r: Results) -> str:
    """N replicas against one process on the same tokens: held-out loss per replica count and recipe, the gap
    to one process within each seed, and what one replica sends per inner step."""
    d = r.load("replica_gap.json")
    rows = []
    for s in d["summary"]:
        single = s["config"] == "single"
        gap = "–" if single or s["gap_mean"] is None else f"{pct(s['gap_mean'])} ({pct(s['gap_min'])} … {pct(s['gap_max'])})"
        sent = "–" if single or "bytes_per_inner_step" not in s else size(s["bytes_per_inner_step"])
        rows.append([str(s["nodes"]), f"one process, {s['nodes']}× batch" if single else s["config"],
                     f"{s['val_loss_mean']:.3f} ± {s['val_loss_std']:.3f}", gap, sent])
    recipe = d["recipe"]
    seeds = sorted({run["seed"] for run in d["runs"]})
    what = (f"`{recipe['model']}`, {d['total_steps']} inner steps per replica (one process: the same steps at N× the batch), "
            f"batch {recipe['batch_size']}, lr {recipe['lr']:g} ({recipe['schedule']}, warm-up {recipe['warmup_steps']}), "
            f"{recipe['optimizer']}; dense DiLoCo's updates combined with `{recipe.get('aggregate', 'mean')}`, SparseLoCo "
            f"rows at a node's defaults; seeds {', '.join(map(str, seeds))}; held-out loss, nats per byte; the gap is "
            "taken within each seed (mean and range).")
    header = ["replicas", "recipe (H, outer η, μ; Nesterov)", "held-out loss (mean ± std)", "vs one process", "sent per inner step"]
    return r.caption("replica_gap.json", what=what) + "\n\n" + table(header, rows)


def stage_spikes(r: Results) -> str:
    """Transient held-out loss spikes of nano, one process against a synchronous 2-stage pipeline."""
    d = r.load("stage_spikes.json")
    names = {"whole": "one process (tied head)", "pipeline": "2-stage pipeline (untied head, per-stage clip)"}
    rows = []
    for kind in ("whole", "pipeline"):
        s = d["summary"][kind]
        grad = "–" if s["max_gradient_ratio"] is None else f"{s['max_gradient_ratio']:.0f}×"
        rows.append([names[kind], f"{s['with_spike']} of {s['runs']}", f"{s['worst']:.2f}", f"{s['final_mean']:.3f}",
                     f"{s['max_activation_ratio']:.1f}×", grad])
    what = (f"`{d['model']}`, batch {d['batch_size']}, lr {d['lr']:g} (warm-up {d['warmup_steps']}), {d['steps']} steps, "
            f"held-out loss after every step from step {d['from_step']}; a spike is a rise of more than {d['spike_threshold']:g} "
            "between two evaluations. Ratios: an RMS over the median of its last 64 (stage 0's output activations; the "
            "gradient the last stage sends back).")
    header = ["training", "runs with a spike", "worst held-out loss", "final held-out loss (mean)",
              "largest activation ratio", "largest gradient ratio"]
    return r.caption("stage_spikes.json", what=what) + "\n\n" + table(header, rows)


BYZANTINE_ORDER = {"diloco": ["mean", "centered-clip", "centered-clip+scores"],
                   "sparseloco": ["sparse-mean", "sparse-clip", "sparse-clip+scores"]}


def byzantine(r: Results, name: str) -> str:
    """Mean held-out loss per (swarm, attack) and aggregator, with its change against the clean plain mean."""
    d = r.load(name)
    summary = d["summary"]
    algorithm = d["runs"][0]["algorithm"]
    methods = [m for m in BYZANTINE_ORDER[algorithm] if any(s["aggregator"] == m for s in summary)]
    keys = list(dict.fromkeys((s["nodes"], s["attackers"], s["attack"]) for s in summary))
    rows = []
    for nodes, attackers, attack in keys:
        cells = []
        for m in methods:
            s = next((s for s in summary if (s["nodes"], s["attackers"], s["attack"], s["aggregator"]) == (nodes, attackers, attack, m)), None)
            cells.append("–" if s is None else f"{s['val_loss']:.3f} ({pct(s['vs_clean_plain'])})")
        rows.append([str(nodes) if attack == "none" else f"{nodes} ({attackers} attacking)", attack, *cells])
    scale = d["scale"]
    if scale["inner_steps"]:
        steps = f"{scale['rounds']} rounds × H {scale['inner_steps']}"
    else:  # the node's default H by replica count, the same inner steps in all
        plans = sorted({(x["nodes"], x["rounds"], x["inner_steps"]) for x in d["runs"]})
        steps = "the node's default H by replica count (" + ", ".join(f"{n} nodes: {k} rounds × H {h}" for n, k, h in plans) + ")"
    what = (f"{algorithm}, `{scale['model']}`, {steps}, "
            f"seeds {sorted({x['seed'] for x in d['runs']})}; in brackets the change against the clean run of `{methods[0]}`.")
    return r.caption(name, what=what) + "\n\n" + table(["nodes", "attack", *methods], rows)


def mutation(r: Results) -> str:
    """Mutants killed per module by the math modules' unit tests."""
    modules = r.load("mutation.json")["modules"]
    rows = [[f"`{name}`", str(m["mutants"]), str(m["killed"]), f"{100 * m['score']:.1f} %"]
            for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["score"])]
    total, killed = sum(m["mutants"] for m in modules.values()), sum(m["killed"] for m in modules.values())
    rows.append(["all", str(total), str(killed), f"{100 * killed / total:.1f} %"])
    return r.caption("mutation.json", what="`make mutate`.") + "\n\n" + table(["module", "mutants", "killed", "score"], rows)


def codecs(r: Results) -> str:
    """Bits per parameter and normalised squared error of every codec (speeds left out: the run shared its cores)."""
    d = r.load("codecs.json")
    rows = []
    named = [(f"`{k}`", v) for k, v in d["codecs"].items()] + [(f"hivemind `{k}`", v) for k, v in d["hivemind"].items()]
    for label, c in named:
        e = c["errors"]
        rows.append([label, f"{c['bits_per_param']:.3g}", *(_nse(e[k]["nse"]) for k in ("gaussian", "student_t2", "low_rank"))])
    what = (f"{d['numel']:,} values ({d['shape'][0]} × {d['shape'][1]}); normalised squared error ‖x̂−x‖²/‖x‖² "
            "on a Gaussian, a Student-t(2) and a rank-4 matrix.")
    return r.caption("codecs.json", what=what) + "\n\n" + table(["codec", "bits/param", "Gaussian", "Student-t(2)", "low-rank"], rows)


CODEC_RIVALS = (("fp16", "Float16Compression"), ("q8", "Uniform8BitQuantization"))


def codec_speed(r: Results) -> str:
    """Encode and decode speed of fp16 and q8 against hivemind's Float16 and 8-bit codecs, and of topk+q2
    against a bare ``torch.topk``, bytes to bytes, on one thread and on all."""
    d = r.load("codec_speed.json")
    threads = d.get("machine", {}).get("torch_threads") or d["meta"].get("cpu_count")
    rows = []
    for ours, theirs in CODEC_RIVALS:
        a, b = d["codecs"].get(ours), d["hivemind"].get(theirs)
        if a is None or b is None:
            continue
        for way in ("encode", "decode"):
            cells = []
            for suffix in ("_1t", ""):
                key = f"{way}_gbps{suffix}"
                cells += [f"{a[key]:.2f}", f"{b[key]:.2f}", f"{a[key] / b[key]:.2f}×"]
            rows.append([f"`{ours}` / hivemind `{theirs}`", way, *cells])
    topk, bare = d["codecs"].get("topk:64/4096+q2"), d.get("baselines", {}).get("torch.topk")
    if topk is not None and bare is not None:
        cells = []
        for suffix in ("_1t", ""):
            ours, theirs = topk[f"encode_gbps{suffix}"], bare[f"gbps{suffix}"]
            cells += [f"{ours:.2f}", f"{theirs:.2f}", f"{ours / theirs:.2f}×"]
        rows.append(["`topk:64/4096+q2` / bare `torch.topk` (k=64, rows of 4096)", "encode", *cells])
    what = (f"{d['numel']:,} float32 values, median of {d['runs']} runs, from a tensor to the bytes that travel "
            f"and back (GB/s of float32 input), on one thread and on all {threads}.")
    head = ["codecs", "", "locomesh, 1 thread", "rival, 1 thread", "ratio", "locomesh, all", "rival, all", "ratio"]
    return r.caption("codec_speed.json", what=what) + "\n\n" + table(head, rows)


def _nse(x: float) -> str:
    return "0" if x == 0 else f"{x:.3f}" if x >= 0.01 else f"{x:.1e}"


def _seeds(d: dict) -> str:
    seeds = d.get("seeds") or [d["settings"]["seed"]]
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def convergence(r: Results, name: str = "convergence.json") -> str:
    """Held-out loss, bytes and time to data-parallel's loss per configuration, mean ± std over the seeds."""
    d = r.load(name)
    configs, s = d["configs"], d["settings"]
    ddp = configs.get("ddp", {})
    rows = []
    for config, rec in configs.items():
        if rec.get("status") != "ok":
            rows.append([f"`{config}`", rec.get("status", "?"), "–", "–", "–", "–"])
            continue
        ttt = rec.get("time_to_target_s")
        sooner = "–"
        if ttt and ddp.get("time_to_target_s") and config != "ddp":
            sooner = f"{ddp['time_to_target_s'] / ttt:.2f}×"
        seeds = rec.get("per_seed") or {}
        reached = sum(1 for x in seeds.values() if x.get("time_to_target_s") is not None)
        when = f"{ttt:.0f}" if ttt is not None else (f"– (reached in {reached} of {len(seeds)} seeds)" if seeds else "–")
        rows.append([f"`{config}`", mean_std(rec, "final_val_loss"), size(rec["exchange_bytes_per_node"]),
                     when, sooner, f"{rec['tokens_per_s_per_node']:.0f}"])
    link = f"{d['link_mbit']:g} Mbit/s links (tc tbf, each process in its own namespace)" if d.get("link_mbit") else "loopback"
    what = (f"`{s['model']}`, {s['nodes']} nodes × {s['steps']} steps, H = {s['inner_steps']}, batch {s['batch_size']}, "
            f"{link}, {_seeds(d)} (configurations alternated per seed); held-out loss mean ± std over the seeds; "
            "time to target: to each seed's data-parallel loss, read between evaluations, mean over the seeds "
            "(– where a seed never reached it).")
    return r.caption(name, what=what) + "\n\n" + table(
        ["config", "held-out loss", "sent/node", "time to ddp's loss (s)", "sooner than ddp", "tokens/s/node"], rows)


def forging(r: Results) -> str:
    """DiLoCo's held-out loss beside a forging peer against the clean run of the same seeds, and (where the
    file has it) the clean run repeated: the change timing alone makes, which the forger's must be read against."""
    d = r.load("forging.json")
    configs, s = d["configs"], d["settings"]
    clean, forged, again = configs["diloco"], configs["diloco-forged"], configs.get("diloco-again")

    def run(config: dict, seed: str) -> dict:
        return config.get("per_seed", {}).get(seed, config)

    rows = []
    for seed in map(str, d.get("seeds") or [s["seed"]]):
        a, b = run(clean, seed), run(forged, seed)
        if a.get("status") != "ok" or b.get("status") != "ok":
            rows.append([seed, "–", "–", "–", a.get("status", "?") + " / " + b.get("status", "?")] + (["–", "–"] if again else []))
            continue
        passes = (b.get("forger") or {}).get("passes", 0)
        row = [seed, loss(a["final_val_loss"]), loss(b["final_val_loss"]), pct(b["final_val_loss"] / a["final_val_loss"] - 1), str(passes)]
        if again is not None:
            c = run(again, seed)
            ok = c.get("status") == "ok"
            row += [loss(c["final_val_loss"]) if ok else "–", pct(c["final_val_loss"] / a["final_val_loss"] - 1) if ok else "–"]
        rows.append(row)
    what = (f"`{s['model']}`, {s['nodes']} honest nodes × {s['steps']} steps, H = {s['inner_steps']}, loopback, default "
            "aggregation; the forger (`tests/helpers/attacker.py`) stores, every second, records \"of\" every member "
            "announcing round R + 1000, invented members, and its own record 1000 rounds ahead.")
    headers = ["seed", "clean held-out loss", "with the forger", "change", "forger passes"]
    if again is not None:
        what += " \"Clean again\" is the clean run repeated in the same invocation: its change is timing noise alone."
        headers += ["clean again", "change (noise)"]
    return r.caption("forging.json", what=what) + "\n\n" + table(headers, rows)


def _share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def heterogeneous(r: Results) -> str:
    """Peers of four speeds, every peer at the same H against rounds paced by time (benchmarks/heterogeneous.py)."""
    d = r.load("heterogeneous.json")
    o = d["options"]
    rows = []
    for run in d["runs"]:
        if "error" in run:
            rows.append([run["scenario"], run["mode"], str(run["seed"]), "failed", "", "", "", "", ""])
            continue
        peers = run["peers"]
        rows.append([run["scenario"], run["mode"], str(run["seed"]),
                     " / ".join(_share(p["training"]) for p in peers), " / ".join(_share(p["waiting"]) for p in peers),
                     " / ".join(_share(p.get("evaluating")) for p in peers),
                     " / ".join(f"{p['steps_per_round']:g}" for p in peers), loss(statistics.mean(p["val_loss"] for p in peers)),
                     f"{sum(p['tokens'] for p in peers) / 1e6:.2f} M"])
    s = d["summary"]
    reached = [f"{k} {100 * f:.0f} %" if f is not None else f"{k} not reached"
               for k, v in s.items() for f in v.get("time_to_fixed_loss", [])]
    what = (f"4 daemons of `{o['model']}` on loopback, one 2-core machine, `{o['extra']}`, `--slowdown` "
            f"{float(o['base_slowdown']):g} / {float(o['base_slowdown']):g} / {2 * float(o['base_slowdown']):g} / "
            f"{4 * float(o['base_slowdown']):g} (speeds 1, 1, ½, ¼), {float(o['duration']):g} s each, a fresh checkpoint "
            "folder per run. `churn`: peer 1 runs unslowed (twice the fast peers' speed) for a third of the run, then "
            "8× slower (a quarter of theirs), peer 3 is killed 2 s in and restarted 20 s later. `homogeneous`: four peers at the fast speed, each to the mean inner steps of that seed's `auto` run. "
            "`overlap`: `auto` with `--overlap` (each round runs beside the next round's inner steps). `hivemind`: "
            "hivemind.Optimizer on the same peers, model, data, inner AdamW and slowdowns, averaging parameters each time "
            "the swarm's samples reach a target batch of 50 steps × 4 peers' batches (its waiting: all of its time blocked "
            "in `Optimizer.step` beyond a step's median, matchmaking and averaging together). "
            "Training / waiting / evaluating: shares of each peer's training loop in inner steps, at the rendezvous and in "
            "the held-out evaluations this benchmark asks for after every round (a default node: every 5 rounds) (peers 0 / 1 / 2 / 3). "
            f"Held-out loss: mean over the peers at the end. Time to reach the fixed-H run's final held-out loss, "
            f"as a share of the fixed-H run's time (peer 0; scenario/mode, one per seed): {', '.join(reached) or 'no curve'}.")
    header = ["scenario", "H", "seed", "training", "waiting", "evaluating", "steps per round", "held-out loss", "tokens"]
    return r.caption("heterogeneous.json", what=what) + "\n\n" + table(header, rows)


def hostile_member(r: Results) -> str:
    """A modified member in a swarm of three against a clean swarm (benchmarks/hostile_member.py)."""
    d = r.load("hostile_member.json")
    o = d["options"]
    rows = []
    for run in d["runs"]:
        if "error" in run:
            rows.append([run["mode"], str(run["seed"]), "failed", "", "", "", "", ""])
            continue
        peers = run["peers"]
        sent = [p.get("average_mb_sent_per_round") for p in peers]
        rows.append([run["mode"], str(run["seed"]), " / ".join(loss(p["val_loss"]) for p in peers),
                     " / ".join(f"{p['joint_rounds']} of {p['outer_rounds']}" for p in peers),
                     f"{max(p['max_deadline_s'] or 0 for p in peers):.1f} s", str(sum(p["honest_failures"] for p in peers)),
                     str(sum(p["out_of_sync"] for p in peers)), " / ".join("–" if x is None else f"{x:.1f}" for x in sent)])
    gaps = "; ".join(f"`{mode.removeprefix('attack:')}`: {100 * v['worst_gap']:+.1f} % against clean, {100 * v['worst_gap_to_pair']:+.1f} % "
                     "against the pair" for mode, v in d["summary"].items() if v.get("worst_gap") is not None and v.get("worst_gap_to_pair") is not None)
    what = (f"3 daemons of `{o['model']}` on loopback, one 2-core machine, `{o['extra']}`, {o['max_steps']} inner steps each "
            "(equal tokens), a fresh checkpoint folder per run; `attack:A`: node 2 runs `--attack A`; `pair`: the two honest "
            "peers alone. Columns for the two honest peers (0 / 1): held-out loss at the end, rounds they averaged together in "
            "sync, the longest rendezvous deadline, failures naming an honest peer, rounds out of sync, MB each sent a round "
            "serving its contributions (`/locomesh/average`). Worst gap of the honest "
            f"peers' mean held-out loss over the seeds (bar: within 5 % of the clean run): {gaps}.")
    header = ["run", "seed", "held-out loss", "rounds together", "longest deadline", "honest failures", "out of sync", "sent a round"]
    return r.caption("hostile_member.json", what=what) + "\n\n" + table(header, rows)

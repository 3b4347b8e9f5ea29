"""Generated tables of docs/benchmarks.md for the GPU path and for rounds beside training."""

from __future__ import annotations

from benchmarks.overlap import MODES
from benchmarks.table_format import Results, loss, table

LOOPS = (("eager", "gpu/loop_eager_h100.json"), ("compiled", "gpu/loop_compiled_h100.json"),
         ("compiled, rotary tables cached", "gpu/loop_compiled_rope_h100.json"),
         ("same, --compile-mode reduce-overhead (CUDA graphs)", "gpu/loop_cudagraphs_h100.json"))


def gpu_loop(r: Results) -> str:
    """The bare training loop on one H100 (benchmarks.throughput --bare-only), eager against compiled."""
    rows = []
    for label, name in LOOPS:
        for run in r.load(name)["runs"]:
            busy = next((p["ms_per_step"] for p in run.get("profile", []) if p["name"].startswith("(all")), None)
            step_ms = 1000 * run["batch"] * run["context"] / run["tokens_per_s_bare"]
            rows.append([f"`{run['model']}` ({run['params'] / 1e6:.0f} M)", label, f"{run['tokens_per_s_bare'] / 1e3:.0f} k",
                         f"{100 * run['mfu']:.1f} %", f"{step_ms:.1f} ms" + (f" ({busy:.1f} busy)" if busy else ""),
                         f"{run['peak_mem_mb'] / 1024:.1f} GiB", f"{run['warmup_s']:.0f} s"])
    what = ("Batch 16 × the model's context, bf16 autocast, fused AdamW, byte data (a 32,000-token vocabulary for the "
            "llama preset all the same); 20 timed steps (40 for the last two rows) after 3 warm-up ones, whose time "
            "(the compilation with torch.compile) is the last column. Busy: the GPU's kernel time per step "
            "(torch.profiler over 3 more steps); the rest of the step the GPU waited for the host. One run each: "
            "the small models' 20 steps last under a second, so their rates are rough.")
    names = [name for _, name in LOOPS]
    header = ["model", "loop", "tokens/s", "MFU", "step (GPU busy)", "peak memory", "warm-up"]
    return r.caption(*names, what=what) + "\n\n" + table(header, rows)


def gpu_replicas(r: Results) -> str:
    """Two llama-150m replicas sharing one H100 (two processes), blocking rounds against --overlap."""
    rows = []
    for label, name in (("blocking rounds", "gpu/replicas_llama150m_h100.json"),
                        ("--overlap (asap; steps meanwhile dropped, as of that build)", "gpu/replicas_llama150m_overlap_h100.json")):
        for node in r.load(name)["nodes"]:
            rounds = [x["duration_s"] for x in node["rounds"]]
            rows.append([label, str(node["index"]), str(node["steps"]), str(node["outer_rounds"]),
                         f"{node['tokens_per_s'] / 1e3:.0f} k", f"{node['comm_wait_s']:.1f} s / {node['train_s']:.0f} s",
                         f"{min(rounds):.1f}–{max(rounds):.1f} s" if rounds else "–", loss(node["val_loss"])])
    what = ("`node swarm --nodes 2 --model llama-150m --device cuda --duration 70` (bytes: vocabulary 256, 126 M "
            "parameters), H = 50, compiled (the default on CUDA). In the blocking run both processes compiled at "
            "once for ~50 s of the 70 (an empty kernel cache), so it holds 2 rounds and its rate and "
            "blocked time include that compilation; the overlap run found the cache warm. Tokens/s: the inner steps' rate per process (the two share the GPU).")
    header = ["rounds", "node", "steps", "rounds done", "tokens/s", "blocked / training loop", "round", "held-out loss"]
    return r.caption("gpu/replicas_llama150m_h100.json", "gpu/replicas_llama150m_overlap_h100.json", what=what) + "\n\n" + \
        table(header, rows)


def _per_node(run: dict) -> list[str]:
    """An overlap run's blocked shares and inner-step rates, node by node (benchmarks/overlap.py)."""
    return [" / ".join(f"{100 * b:.1f} %" for b in run["blocked_share"]), " / ".join(f"{s:.2f}" for s in run["steps_per_s"])]


def _rounds_and_alpha(mode: str) -> list[str]:
    """What a benchmarks.overlap mode ran with: blocking or overlapped rounds, and its α (--fragment-alpha)."""
    flags = MODES[mode]
    alpha = flags[flags.index("--fragment-alpha") + 1] if "--fragment-alpha" in flags else "0"
    rounds = "auto" if "--auto-overlap" in flags else "overlap" if "--overlap" in flags else "blocking"
    return [rounds, alpha]


def overlap_cpu(r: Results) -> str:
    """Blocking rounds against each overlap mode at equal inner steps (benchmarks/overlap.py)."""
    rows = []
    for name in ("overlap_medium_cpu.json", "overlap_tiny_cpu.json", "overlap_tiny_modes_cpu.json"):
        d = r.load(name)
        o = d["options"]
        for run in d["runs"]:
            if "error" in run:
                continue
            rows.append([f"`{o['model']}`", run["mode"], str(run["seed"]), str(run["steps"][0]), *_per_node(run),
                         loss(run["val_loss"][0])])
    what = ("Two daemons on loopback, one 2-core machine, `--inner-steps 5 --threads 1` (`medium`: also `--batch-size 1 "
            "--context 32`), every node to the same inner steps, a fresh checkpoint folder per run. Blocked: the share "
            "of each node's training loop spent waiting for rounds. Held-out loss after the last round (both nodes "
            "agree). Overlap runs use the progress-keeping merge of this build. Too few seeds for more than a direction.")
    header = ["model", "rounds", "seed", "steps", "blocked (node 0 / 1)", "steps/s", "held-out loss"]
    return r.caption("overlap_medium_cpu.json", "overlap_tiny_cpu.json", "overlap_tiny_modes_cpu.json", what=what) + "\n\n" + \
        table(header, rows)


def overlap_alpha_cpu(r: Results) -> str:
    """Blocking rounds and overlap, each with θ replaced by φ (α = 0) or mixed half and half (α = 0.5)."""
    names = ("overlap_medium_alpha_cpu.json", "overlap_tiny_alpha_cpu.json")
    rows = []
    for name in names:
        d = r.load(name)
        o = d["options"]
        for run in d["runs"]:
            if "error" in run:
                continue
            rows.append([f"`{o['model']}`", *_rounds_and_alpha(run["mode"]), str(run["seed"]),
                         str(run["steps"][0]), *_per_node(run), " / ".join(loss(v) for v in run["val_loss"])])
    what = ("Two daemons on loopback, one 2-core machine, H = 5 (`medium`: `--batch-size 1 --context 32 --inner-steps 5 "
            "--threads 1`, 100 inner steps per node; `tiny`: `--inner-steps 5 --threads 1`, 150), a fresh checkpoint folder "
            "per run, the modes of one seed one after the other. α: `--fragment-alpha`, "
            "θ ← (1 − α)·φ + α·θ when a round's result arrives (with overlap: θ ← θ + (1 − α)(φ − θ at the round's start)). "
            "Blocked: the share of each node's training loop spent waiting for rounds. Held-out loss of each node after "
            "the last round (with α > 0 the nodes' θ differ; φ is one).")
    header = ["model", "rounds", "α", "seed", "steps", "blocked (node 0 / 1)", "steps/s", "held-out loss (node 0 / 1)"]
    return r.caption(*names, what=what) + "\n\n" + table(header, rows)


STEPPING_ON = ("With `--overlap` a node whose round is due while the round before it still runs steps on (up to twice "
               "the round's steps), so the two nodes may end after different numbers of rounds (the one with rounds left "
               "averages them alone). α: `--fragment-alpha`. Blocked: the share of each node's training loop spent waiting "
               "for rounds. Wall: the run's seconds. Held-out loss of each node's final weights.")


def _overlap_runs(r: Results, name: str, what: str) -> str:
    """A benchmarks.overlap results file, run by run: rounds, α, rounds and blocked share per node, rates, wall time, losses."""
    rows = []
    for run in r.load(name)["runs"]:
        if "error" in run:
            continue
        rows.append([*_rounds_and_alpha(run["mode"]), str(run["seed"]), str(run["steps"][0]),
                     " / ".join(str(n) for n in run["outer_rounds"]), *_per_node(run), f"{run['wall_s']:.0f} s",
                     " / ".join(loss(v) for v in run["val_loss"])])
    header = ["rounds", "α", "seed", "steps", "rounds (node 0 / 1)", "blocked (node 0 / 1)", "steps/s", "wall",
              "held-out loss (node 0 / 1)"]
    return r.caption(name, what=what) + "\n\n" + table(header, rows)


def overlap_step_on_cpu(r: Results) -> str:
    """Blocking rounds against overlap where a node whose round is due steps on while the round before still runs."""
    return _overlap_runs(r, "overlap_step_on_medium_cpu.json", (
        "Two `medium` daemons on loopback, one 2-core machine, `--batch-size 1 --context 32 --inner-steps 5 --threads 1`, "
        "200 inner steps per node, a fresh checkpoint folder per run, the modes of one seed one after the other. " + STEPPING_ON))


def overlap_capped_cpu(r: Results) -> str:
    """The same at the default H, with each node's links capped so that a round's exchange takes seconds."""
    return _overlap_runs(r, "overlap_capped_tiny_cpu.json", (
        "Two `tiny` daemons on loopback, one 2-core machine, `--threads 1 --max-upload-mbit 4 --max-download-mbit 4`, "
        "rounds paced by time at the default H (50 steps at the median speed for two replicas), 600 inner steps per node, "
        "a fresh checkpoint folder per run, the modes of one seed one after the other. " + STEPPING_ON))


def overlap_capped_equal_time_cpu(r: Results) -> str:
    """The capped link again, every mode given the same training time instead of the same steps."""
    return _overlap_runs(r, "overlap_capped_equal_time_tiny_cpu.json", (
        "Two `tiny` daemons on loopback, one 2-core machine, `--threads 1 --max-upload-mbit 4 --max-download-mbit 4`, "
        "rounds paced by time at the default H, every run bounded by `--duration 125` (the node's last round is waited "
        "for after it), a fresh checkpoint folder per run, the modes of one seed one after the other. " + STEPPING_ON))


def auto_overlap_capped_cpu(r: Results) -> str:
    """The capped link at equal time: blocking rounds, overlap from the start and --auto-overlap, side by side."""
    name = "auto_overlap_capped_equal_time_tiny_cpu.json"
    text = _overlap_runs(r, name, (
        "Two `tiny` daemons on loopback, one 2-core machine, `--threads 1 --max-upload-mbit 4 --max-download-mbit 4`, "
        "rounds paced by time at the default H, every run bounded by `--duration 125`, a fresh checkpoint folder per run, "
        "the modes of one seed one after the other. auto: `--auto-overlap` (blocking rounds until it measured three, "
        "then overlap while it pays). " + STEPPING_ON))
    chosen = [f"seed {run['seed']}: " + " / ".join(", ".join(f"{event} at round {n}" for event, n in node) or "none"
                                                    for node in run["overlap_choices"])
              for run in r.load(name)["runs"] if run["mode"] == "auto" and "error" not in run]
    return text + "\n\n" + f"`--auto-overlap`'s choices (node 0 / node 1): {'; '.join(chosen)}."

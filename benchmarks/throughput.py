"""Training throughput, MFU and peak memory: a bare training loop against a real ``node join`` daemon.

    python -m benchmarks.throughput --model tiny,small [--device auto] [--batch-size 16] [--steps 30]
        [--warmup 5] [--micro-batch-size M] [--activation-checkpointing] [--compile auto|on|off] [--threads T]
        [--bare-only] [--profile] --out PATH.json

For every model (comma separated; ``all`` = every preset of ``swarm.models.presets.PRESETS`` that fits this
machine's memory and ``--budget-s``), at the same batch, data and trainer options:

- **bare**: a process that builds a :class:`node.runtime.local_training.LocalTrainer` on the node's data
  (``node.data.bytes.ByteBatches`` of the embedded corpus) and times ``--steps`` steps of
  ``batches.next()`` + ``trainer.step`` after ``--warmup`` untimed ones;
- **daemon**: one real ``node join`` process (a new swarm of one, loopback, a fresh
  ``--checkpoint-dir`` in a temporary folder, ``--max-steps`` warmup + steps, no outer round
  during the run). Its ``locomesh_tokens_total`` counter is read from ``/metrics`` every
  ``--poll-s``; tokens/s is the counter's rise between the first reading past the warm-up steps and
  the last one before the final step, i.e. the rate between outer rounds with everything a daemon
  runs beside training (network thread, heartbeats, metrics). The node's own summary
  (``--info-file``: inner steps' tokens/s over the whole run, MFU, peak memory) is reported too.

``--context N`` trains sequences of N tokens instead of the preset's (a CPU volunteer's setting: ``--model medium
--batch-size 1 --context 32 --threads 1``). ``--adamw-loop`` times the bare loop a second time with AdamW's
per-tensor loop instead of torch's fused kernel (the inner optimizer's default on the CPU before the fused
kernel; ``swarm.inner_optimizer``), back to back in the same invocation: ``tokens_per_s_bare_adamw_loop`` and
``fused_over_loop``. ``--bare-only`` skips the daemon; ``--profile`` adds the bare loop's 30 busiest device kernels over 3 more
steps (torch.profiler) and their total to each run. ``warmup_s`` is the warm-up steps' wall time (with compilation, the
compile time).

``daemon_over_bare`` = daemon tokens/s ÷ bare tokens/s (target ≥ 0.95); with ``--repeats R`` the two run
back to back R times and the medians (of the rates, and of the pairs' ratios) are reported. On a
machine shared with other work wall-clock rates swing with its load, so ``daemon_over_bare_cpu``
compares tokens per CPU second of each process (all its threads: what the daemon costs beside
training, but not time lost waiting for the GIL). MFU uses ``node.runtime.mfu`` (null on
the CPU unless ``--peak-tflops``); peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and the
process's peak RSS on the CPU. The JSON::

    {"device": ..., "runs": [{"model", "params", "batch", "context", "tokens_per_s_bare",
      "tokens_per_s_daemon", "daemon_over_bare", "mfu", "peak_mem_mb", ...}], "skipped": [...]}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from benchmarks import results_io


def _options(args: argparse.Namespace, bare: bool = False) -> list[str]:
    """The trainer options, as ``node join`` flags (the bare loop gets the same, as this module's flags)."""
    out = ["--device", args.device, "--batch-size", str(args.batch_size)] + (["--context", str(args.context)] if args.context else [])
    if args.micro_batch_size:
        out += ["--micro-batch-size", str(args.micro_batch_size)]
    if args.activation_checkpointing:
        out.append("--activation-checkpointing")
    if bare:
        out += ["--compile", args.compile] + (["--compile-mode", args.compile_mode] if args.compile_mode else [])
    elif args.compile != "auto":
        out.append("--compile" if args.compile == "on" else "--no-compile")
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.peak_tflops:
        out += ["--peak-tflops", str(args.peak_tflops)]
    return out


# ---- the bare loop (runs in a process of its own) ----------------------------------------------------
def bare(args: argparse.Namespace) -> dict[str, Any]:
    from node.data.byte_corpus import load_corpus
    from node.data.bytes import ByteBatches
    from node.runtime.mfu import flops_per_token, mfu, peak_flops, peak_memory_mb
    from node.runtime.local_training import LocalTrainer, pick_device
    from swarm.models.presets import preset

    if args.threads:
        torch.set_num_threads(args.threads)
    device, cfg = pick_device(args.device), preset(args.model)
    if args.context:
        cfg = dataclasses.replace(cfg, context=args.context)
    corpus = load_corpus(None, context=cfg.context)
    batches = ByteBatches(data=corpus.train, batch_size=args.batch_size, context=cfg.context, seed=0)
    trainer = LocalTrainer(cfg=cfg, device=device, lr=1e-3, micro_batch_size=args.micro_batch_size,
                           activation_checkpointing=args.activation_checkpointing,
                           compile={"auto": None, "on": True, "off": False}[args.compile], compile_mode=args.compile_mode)
    if args.adamw_loop:
        from swarm.inner_optimizer import build_inner_optimizer

        trainer.optimizer = build_inner_optimizer(trainer.model.named_parameters(), "adamw", 1e-3, 0.1, fused=False)
    warmup_started = time.perf_counter()
    for _ in range(args.warmup):
        trainer.step(*batches.next())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - warmup_started
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        trainer.step(*batches.next())  # returns loss.item(): the device has finished the step
    elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = args.steps * args.batch_size * cfg.context
    rate = tokens / elapsed
    extra = {"profile": profile_steps(trainer, batches, device)} if args.profile else {}
    return extra | {"params": sum(p.numel() for p in trainer.parameters()), "context": cfg.context, "tokens_per_s": rate,
            "adamw_fused": all(g.get("fused") for g in trainer.optimizer.param_groups),
            "compiled": trainer.train_model is not trainer.model, "warmup_s": round(warmup_s, 2),
            "tokens_per_cpu_s": tokens / cpu_s if cpu_s > 0 else None,
            "mfu": mfu(flops_per_token(cfg), rate, peak_flops(device, args.peak_tflops)),
            "peak_mem_mb": round(peak_memory_mb(device), 1), "flops_per_token": flops_per_token(cfg)}


def profile_steps(trainer: Any, batches: Any, device: torch.device, steps: int = 3) -> list[dict[str, Any]]:
    """The 30 kernels (CPU ops on the CPU) with the most self time over ``steps`` more steps, in ms per step, after
    a first row with all of them together (on a GPU: how busy it was; the step's wall time minus that is idle)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.step(*batches.next())
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = list(prof.key_averages())
    if device.type == "cuda":  # the kernels themselves (an operator's row repeats its kernels' time)
        averages = [e for e in averages if getattr(getattr(e, "device_type", None), "name", "") == "CUDA"] or averages
    events = sorted(averages, key=lambda e: getattr(e, key, 0.0), reverse=True)
    rows = [{"name": e.key[:120], "ms_per_step": round(getattr(e, key, 0.0) / 1000 / steps, 3), "calls": e.count // steps}
            for e in events[:30]]
    busy = sum(getattr(e, key, 0.0) for e in events) / 1000 / steps
    return [{"name": "(all of them: busy ms per step)", "ms_per_step": round(busy, 3), "calls": sum(e.count for e in events) // steps}] + rows


def run_bare(args: argparse.Namespace, model: str, adamw_loop: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--bare", "--model", model, "--steps", str(args.steps),
           "--warmup", str(args.warmup), *_options(args, bare=True), *(["--profile"] if args.profile else []),
           *(["--adamw-loop"] if adamw_loop else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"bare loop failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the daemon --------------------------------------------------------------------------------------
def _tokens(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("locomesh_tokens_total "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_daemon(args: argparse.Namespace, model: str, context: int) -> dict[str, Any]:
    from node.ops.launcher import free_port

    per_step = args.batch_size * context
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="locomesh-throughput-") as tmp:
        port, info_file = free_port(), Path(tmp) / "info.json"
        cmd = [sys.executable, "-m", "node", "join", "--model", model, *_options(args), "--max-steps", str(total),
               "--inner-steps", str(min(total + 1, 1_000_000)), "--eval-every", "0", "--eval-batches", "1",
               "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port), "--checkpoint-dir", str(Path(tmp) / "ckpt"),
               "--info-file", str(info_file), "--run-id", f"throughput-{os.getpid()}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")}
        log = open(Path(tmp) / "log.txt", "w")
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        samples: list[tuple[float, float, float | None]] = []
        deadline = time.monotonic() + args.timeout
        try:
            while process.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node join did not finish {total} steps within {args.timeout}s")
                tokens = _tokens(port)
                if tokens is not None:
                    samples.append((time.monotonic(), tokens, _cpu_s(process.pid)))
                time.sleep(args.poll_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.close()
        if process.returncode != 0:
            raise RuntimeError(f"node join exited with {process.returncode}: {(Path(tmp) / 'log.txt').read_text()[-2000:]}")
        info = json.loads(info_file.read_text())
    # the steady window: past the warm-up steps, before the last step (after it the node evaluates and stops)
    window = [s for s in samples if args.warmup * per_step <= s[1] < total * per_step]
    rate = cpu_rate = None
    if len(window) >= 2 and window[-1][1] > window[0][1]:
        (t0, k0, c0), (t1, k1, c1) = window[0], window[-1]
        rate = (k1 - k0) / (t1 - t0)
        cpu_rate = (k1 - k0) / (c1 - c0) if c0 is not None and c1 is not None and c1 > c0 else None
    return {"tokens_per_s": rate, "tokens_per_cpu_s": cpu_rate,
            "window_s": round(window[-1][0] - window[0][0], 2) if len(window) >= 2 else 0.0,
            "summary_tokens_per_s": info.get("tokens_per_s"), "mfu": info.get("mfu"), "peak_mem_mb": info.get("peak_mem_mb"),
            "steps": info.get("steps")}


# ---- choosing presets --------------------------------------------------------------------------------
def _available_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**20
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2**10


def _achievable_flops(device: torch.device, peak_tflops: float | None) -> float:
    """FLOP/s training may reach: 30 % of the device's peak, or what a short matmul probe achieves."""
    from node.runtime.mfu import peak_flops

    peak = peak_flops(device, peak_tflops)
    if peak is not None:
        return 0.3 * peak
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.3:
        a @ a
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * 1024**3 * n / (time.perf_counter() - started)


def _estimate(cfg: Any, batch: int, device: torch.device, args: argparse.Namespace, flops: float) -> tuple[float, float]:
    """(memory MiB, seconds of both runs) a preset needs, roughly: weights, gradients, AdamW's two moments
    and the outer state (fp32, 24 B per parameter), activations (~34·d bytes per token and layer in bf16,
    Korthikanti et al. 2022, twice that in fp32 on the CPU; one layer's worth under checkpointing) and
    fp32 logits and their gradient; time at ``flops`` FLOP/s."""
    from node.runtime.mfu import flops_per_token
    from swarm.models.presets import num_params

    rows = args.micro_batch_size or batch
    per_token = 34 * cfg.d_model * (1 if args.activation_checkpointing else cfg.n_layer) * (1 if device.type == "cuda" else 2)
    memory = 24 * num_params(cfg) + rows * cfg.context * (per_token + 8 * cfg.vocab_size)
    seconds = 2 * (args.warmup + args.steps) * flops_per_token(cfg) * batch * cfg.context / flops
    return memory / 2**20, seconds


def choose_models(args: argparse.Namespace, device: torch.device) -> tuple[list[str], list[dict[str, Any]]]:
    from swarm.models.presets import PRESETS

    names = [n.strip() for n in args.model.split(",") if n.strip()]
    unknown = [n for n in names if n != "all" and n not in PRESETS]
    if unknown:
        sys.exit(f"unknown model preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)} or all")
    if "all" not in names:
        return names, []
    chosen, skipped, free = [], [], _available_mb(device)
    flops = _achievable_flops(device, args.peak_tflops)
    for name, cfg in PRESETS.items():
        memory, seconds = _estimate(cfg, args.batch_size, device, args, flops)
        if memory > 0.8 * free:
            skipped.append({"model": name, "reason": f"needs about {memory:.0f} MiB, {free:.0f} MiB free"})
        elif seconds > args.budget_s:
            skipped.append({"model": name, "reason": f"would take about {seconds:.0f} s (--budget-s {args.budget_s:.0f})"})
        else:
            chosen.append(name)
    return chosen, skipped


def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Bare loop and daemon back to back, ``--repeats`` times: medians, and the median of the pairs' ratios
    (a pair runs under the same load, which matters on a shared machine)."""
    run: dict[str, Any] = {"model": model, "batch": args.batch_size}
    bares, daemons, loops = [], [], []
    try:
        for _ in range(args.repeats):
            bares.append(run_bare(args, model))
            if args.adamw_loop:
                loops.append(run_bare(args, model, adamw_loop=True))
            if not args.bare_only:
                daemons.append(run_daemon(args, model, bares[-1]["context"]))
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        run["error"] = str(e)
    if not bares:
        return run
    b = bares[len(bares) // 2]
    run.update(params=b["params"], context=b["context"], compiled=b["compiled"], warmup_s=b["warmup_s"],
               **({"profile": b["profile"]} if "profile" in b else {}))
    bare_rate = statistics.median(r["tokens_per_s"] for r in bares)
    pairs = [(r["tokens_per_s"], d["tokens_per_s"]) for r, d in zip(bares, daemons) if d["tokens_per_s"]]
    daemon_rate = statistics.median(d for _, d in pairs) if pairs else None
    run.update(tokens_per_s_bare=round(bare_rate, 1), tokens_per_s_daemon=None if daemon_rate is None else round(daemon_rate, 1),
               daemon_over_bare=round(statistics.median(d / r for r, d in pairs), 3) if pairs else None,
               mfu=statistics.median(r["mfu"] for r in bares) if all(r["mfu"] is not None for r in bares) else None,
               peak_mem_mb=max(r["peak_mem_mb"] for r in bares))
    if loops:
        loop_rate = statistics.median(r["tokens_per_s"] for r in loops)
        run.update(tokens_per_s_bare_adamw_loop=round(loop_rate, 1), adamw_fused=b["adamw_fused"],
                   fused_over_loop=round(statistics.median(f["tokens_per_s"] / r["tokens_per_s"] for f, r in zip(bares, loops)), 3))
    if daemons:
        run["daemon"] = {"mfu": daemons[-1]["mfu"], "peak_mem_mb": max(d["peak_mem_mb"] or 0 for d in daemons),
                         "summary_tokens_per_s": [d["summary_tokens_per_s"] for d in daemons],
                         "window_s": [d["window_s"] for d in daemons], "steps": daemons[-1]["steps"]}
    cpu_pairs = [(r["tokens_per_cpu_s"], d["tokens_per_cpu_s"]) for r, d in zip(bares, daemons)
                 if r["tokens_per_cpu_s"] and d["tokens_per_cpu_s"]]
    if cpu_pairs:  # per CPU second: the daemon's extra work, whatever else the machine runs
        run["daemon_over_bare_cpu"] = round(statistics.median(d / r for r, d in cpu_pairs), 3)
    if args.repeats > 1:
        run["pairs"] = [[round(r, 1), round(d, 1)] for r, d in pairs]
    return run


def estimated_training_mb(args: argparse.Namespace, model: str, device: torch.device) -> float:
    """What ``node join --dry-run`` estimates the daemon's training needs on ``device`` (MiB), without the
    fixed parts (process runtime, CUDA context and slack): the figure to hold against ``peak_mem_mb``."""
    from node.config import NodeConfig
    from node.ops.memory import architecture, estimate

    cfg = NodeConfig(model=model, device=device.type, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                     activation_checkpointing=args.activation_checkpointing)
    where = "VRAM" if device.type == "cuda" else "RAM"
    est = estimate(cfg, architecture(cfg), device.type, (0, 0))
    return round(sum(r.nbytes for r in est.rows if r.where == where and not r.what.startswith(("runtime", "CUDA"))) / 2**20, 1)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="preset(s), comma separated, or all (default: tiny)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5; more with --compile)")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--adamw-loop", action="store_true",
                        help="also time the bare loop with AdamW's per-tensor loop instead of the fused kernel")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="torch.compile the model: auto = as a daemon does (on with CUDA)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode in the bare loop (e.g. reduce-overhead)")
    parser.add_argument("--bare-only", action="store_true", help="the bare loop alone (no daemon)")
    parser.add_argument("--profile", action="store_true", help="each bare loop's busiest kernels over 3 more steps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads in both runs (default: torch's choice)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="bare + daemon pairs per model; medians are reported (default: 1)")
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between /metrics readings of the daemon")
    parser.add_argument("--budget-s", type=float, default=300, help="with --model all: skip presets estimated to take longer")
    parser.add_argument("--timeout", type=float, default=600, help="longest wait for one run")
    parser.add_argument("--out", type=Path, help="result JSON")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # the bare loop's own process
    args = parser.parse_args(argv)
    if args.bare:
        print(json.dumps(bare(args)))
        return
    if args.out is None:
        parser.error("--out is required")
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.throughput", *argv])
    from node.runtime.local_training import pick_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    models, skipped = choose_models(args, device)
    report: dict[str, Any] = {"device": device_name(device), "torch": torch.__version__, "options": vars(args) | {"out": str(args.out)},
                              "runs": [], "skipped": skipped}
    for model in models:
        report["runs"].append(measure(args, model) | {"estimated_mem_mb": estimated_training_mb(args, model, device)})
        print(json.dumps(report["runs"][-1]), flush=True)
    results_io.write(args.out, report, meta)


if __name__ == "__main__":
    main()

"""Convergence benchmark: locomesh's averaging algorithms against data-parallel and hivemind baselines.

    python -m benchmarks.convergence --out runs/conv/report.json --quick
    python -m benchmarks.convergence --out runs/conv/report.json [--configs ddp,diloco,...]
    sudo python -m benchmarks.convergence --out runs/conv20/report.json --quick --link-mbit 20

Every configuration trains the same model preset with real processes, the same number of tokens
(N nodes × S steps × batch × context), the same seeds (initial weights from seed 0, node i draws its
data with seed i) and the same inner optimizer (AdamW as in ``node.runtime.local_training.LocalTrainer``), and is
evaluated on the same held-out windows (``node.data.bytes.validation_batches``):

- ``single``: one process trains on all N·S batches (no communication).
- ``ddp``: N processes, gradients all-reduced with gloo every step (``benchmarks.baselines``).
- ``hivemind``: N processes with ``hivemind.Optimizer(use_local_updates=True)`` averaging parameters
  every epoch of H local steps per peer, over a hivemind DHT.
- ``diloco``, ``noloco``, ``sparseloco``, ``noloco-sparse``, ``streaming``: the real ``node swarm``
  CLI (``node join`` per namespace with ``--link-mbit``), ``--max-steps S --eval-every 1``. A
  configuration whose flags this build of ``node join`` does not accept is recorded as unsupported.

Per configuration the JSON report holds the final validation loss (mean over nodes), the curve of
validation loss against tokens (and seconds since launch), bytes sent per node (how each was obtained
is written next to it: measured, computed or estimated), wall time, tokens/s per node, the fraction
of training time blocked on communication, and the wall time to a target validation loss (the
data-parallel baseline's final loss, else the worst final loss, unless ``--target-loss``). A PNG next
to the report plots validation loss against tokens and against wall time, and a markdown table is printed.

``--link-mbit R`` puts every process in its own network namespace behind a ``tc tbf`` limit of R
Mbit/s each way (``benchmarks.thin_links``; root required) and also measures the bytes each node's
interface sent (every protocol, headers included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import thin_links

BASELINES = ("single", "ddp", "hivemind")
LOCOMESH: dict[str, list[str]] = {
    "diloco": ["--algorithm", "diloco"],
    "noloco": ["--algorithm", "noloco"],
    "sparseloco": ["--algorithm", "sparseloco"],  # its default codec is topk:64/4096+q2
    "noloco-sparse": ["--algorithm", "noloco", "--compression", "topk:64/4096+q2"],
    "streaming": ["--algorithm", "diloco", "--fragments", "4", "--overlap"],
}
ALL_CONFIGS = (*BASELINES, *LOCOMESH)
COMPRESSED = ("sparseloco", "noloco-sparse")
UNIFORM_LOSS = math.log(256)  # nats/byte of the uniform predictor: where every run starts


@dataclass
class Settings:
    model: str = "tiny"
    nodes: int = 2
    steps: int = 1000  # optimizer steps per node
    inner_steps: int = 50  # H: local steps per outer round (hivemind: per epoch)
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 50
    eval_batches: int = 8
    threads: int = 1
    seed: int = 0
    config_timeout: float = 3600.0
    link_mbit: float | None = None
    hivemind_background: bool = False
    swarm_launcher: bool = False

    @classmethod
    def quick(cls) -> "Settings":
        return cls(model="nano", nodes=2, steps=600, inner_steps=30, batch_size=16, warmup_steps=30,
                   eval_batches=8, config_timeout=300.0)


# ---------------------------------------------------------------------------------- processes


def _python() -> list[str]:
    return [sys.executable]


def _in_namespace(i: int, settings: Settings, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", thin_links.ns_of(i), *cmd] if settings.link_mbit else cmd


def _host(i: int, settings: Settings) -> str:
    return f"{thin_links.SUBNET}.{10 + i}" if settings.link_mbit else "127.0.0.1"


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int | None]:
    """Wait for every process until ``deadline``; then SIGTERM, and SIGKILL of the group after 30 s."""
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=30))
        except subprocess.TimeoutExpired:
            codes.append(None)
        try:  # children (p2pd, hivemind's averager processes) share the group: none may outlive the run
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if codes[-1] is None:
            codes[-1] = p.wait()
    return codes


def _link_tx_bytes(n: int) -> list[int | None]:
    """Bytes each node's namespace interface sent (all traffic: DHT, TCP/IP headers, everything)."""
    out: list[int | None] = []
    for i in range(n):
        r = thin_links.sh("ip", "netns", "exec", thin_links.ns_of(i), "cat", f"/sys/class/net/lmn{i}a/statistics/tx_bytes", check=False)
        out.append(int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None)
    return out


# ---------------------------------------------------------------------------------- baselines


def run_baseline(name: str, settings: Settings, directory: Path) -> dict[str, Any]:
    s = settings
    world = 1 if name == "single" else s.nodes
    steps = s.steps * s.nodes if name == "single" else s.steps
    eval_every = s.inner_steps * (s.nodes if name == "single" else 1)  # evaluate at the same token counts
    common = ["--world", str(world), "--model", s.model, "--batch-size", str(s.batch_size), "--steps", str(steps),
              "--lr", str(s.lr), "--warmup-steps", str(s.warmup_steps), "--eval-every", str(eval_every),
              "--eval-batches", str(s.eval_batches), "--threads", str(s.threads), "--seed", str(s.seed)]
    procs, outs = [], []
    t0 = time.time()
    if name == "hivemind":
        rdv = directory / "rendezvous"
        rdv.mkdir(parents=True, exist_ok=True)
    port = 29500 if s.link_mbit else _free_port()
    for rank in range(world):
        out = directory / f"worker{rank}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        if name == "hivemind":
            cmd = [*_python(), "-m", "benchmarks.baselines", "hivemind", "--rank", str(rank), *common, "--out", str(out),
                   "--rendezvous", str(rdv), "--host", _host(rank, s), "--inner-steps", str(s.inner_steps),
                   "--run-id", f"conv-{int(t0)}", "--timeout", str(min(600.0, s.config_timeout))]
            if s.hivemind_background:
                cmd.append("--background")
            env = None
        else:
            cmd = [*_python(), "-m", "benchmarks.baselines", "ddp", "--rank", str(rank), *common, "--out", str(out),
                   "--master-addr", _host(0, s), "--master-port", str(port), "--timeout", str(min(600.0, s.config_timeout))]
            env = {"GLOO_SOCKET_IFNAME": f"lmn{rank}a" if s.link_mbit else "lo"}
        procs.append(_spawn(_in_namespace(rank, s, cmd), directory / f"worker{rank}.log", env))
    codes = _wait_all(procs, t0 + s.config_timeout)
    wall = time.time() - t0
    link_bytes = _link_tx_bytes(world) if s.link_mbit else None
    workers = []
    for rank, out in enumerate(outs):
        try:
            workers.append(json.loads(out.read_text()))
        except (OSError, ValueError):
            workers.append(None)
    if any(w is None for w in workers):
        return {"status": "failed", "reason": f"worker exit codes {codes}; see {directory}/worker*.log", "wall_s": wall}
    nodes = []
    for rank, w in enumerate(workers):
        nodes.append({
            "exit_code": codes[rank], "steps": w["steps"], "tokens": w["tokens"], "val_loss": w["val_loss"],
            "train_loss_first": w["train_loss_first"], "train_loss_last": w["train_loss_last"],
            "bytes_sent": w["bytes_sent"], "link_tx_bytes": link_bytes[rank] if link_bytes else None,
            "train_wall_s": w["wall_s"], "comm_wait_s": w["comm_wait_s"],
            **{k: w[k] for k in ("averaging_rounds", "averaging_failed", "out_of_sync", "epochs") if k in w},
        })
    by_step: dict[int, list[dict[str, Any]]] = {}
    for w in workers:
        for e in w["evals"]:
            by_step.setdefault(e["step"], []).append(e)
    curve = [{"tokens": es[0]["tokens"], "val_loss": statistics.fmean(e["val_loss"] for e in es),
              "t_s": max(e["t"] for e in es) - t0} for _, es in sorted(by_step.items())]
    return {
        "status": "ok" if all(c == 0 for c in codes) else "failed",
        "reason": "" if all(c == 0 for c in codes) else f"worker exit codes {codes}",
        "wall_s": wall, "nodes": nodes, "curve": curve, "num_params": workers[0]["num_params"],
        "bytes_method": workers[0]["bytes_method"], "comm_wait_method": workers[0]["comm_wait_method"],
        "train_wall_method": "measured by the worker: its training loop (steps and evaluations)",
        **({"hivemind": {k: workers[0][k] for k in ("delay_state_averaging", "matchmaking_time", "target_batch_size")}}
           if name == "hivemind" else {}),
    }


def _free_port() -> int:
    from node.ops.launcher import free_port

    return free_port()


# ---------------------------------------------------------------------------------- locomesh


class InfoPoller(threading.Thread):
    """Reads every node's ``--info-file`` a few times a second, to timestamp its states and round records
    (the records carry no time of their own unless the daemon adds a ``t``)."""

    def __init__(self, directory: Path, n: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.paths = [directory / f"node{i}" / "info.json" for i in range(n)]
        self.interval = interval
        self.training_at: list[float | None] = [None] * n
        self.stopped_at: list[float | None] = [None] * n
        self.round_seen_at: list[list[float]] = [[] for _ in range(n)]
        self.halt = threading.Event()

    def poll_once(self) -> None:
        now = time.time()
        for i, path in enumerate(self.paths):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            state = info.get("state")
            if state == "training" and self.training_at[i] is None:
                self.training_at[i] = now
            if state in ("stopping", "stopped") and self.stopped_at[i] is None:
                self.stopped_at[i] = now
            seen = self.round_seen_at[i]
            seen.extend([now] * (len(info.get("rounds", [])) - len(seen)))

    def run(self) -> None:
        while not self.halt.is_set():
            self.poll_once()
            self.halt.wait(self.interval)


def fragments(settings: Settings) -> int:
    """Streaming splits the model into 4 fragments, or one per block when it has fewer (nano has 2)."""
    from swarm.models.presets import preset

    return min(4, preset(settings.model).n_layer)


def locomesh_flags(name: str, settings: Settings) -> list[str]:
    flags = list(LOCOMESH[name])
    if "--fragments" in flags:
        flags[flags.index("--fragments") + 1] = str(fragments(settings))
    return flags


def join_args(name: str, settings: Settings) -> list[str]:
    s = settings
    # one evaluation per H steps: a streaming round syncs one fragment every H/P steps
    eval_every = fragments(s) if "--fragments" in LOCOMESH[name] else 1
    return ["--model", s.model, "--batch-size", str(s.batch_size), "--inner-steps", str(s.inner_steps), "--lr", str(s.lr),
            "--warmup-steps", str(s.warmup_steps), "--threads", str(s.threads), "--eval-every", str(eval_every),
            "--eval-batches", str(s.eval_batches), "--max-steps", str(s.steps), "--run-id", f"conv-{name}",
            # every node starts from the same weights, as `node swarm` starts them (a joiner then
            # downloads only the state's header)
            "--init-seed", str(s.seed), *locomesh_flags(name, s)]


def supported(name: str, settings: Settings, help_text: str) -> str | None:
    """None when this build of ``node join`` takes the configuration's flags, else why not."""
    args = ["--model", settings.model, *locomesh_flags(name, settings)]
    missing = [a for a in args if a.startswith("--") and a not in help_text]
    if missing:
        return f"unsupported by this build: node join has no {', '.join(missing)}"
    check = subprocess.run(
        [*_python(), "-c", "import sys; from node.cli.app import parse_join_args; parse_join_args(sys.argv[1:])", *args],
        capture_output=True, text=True, timeout=120,
    )
    if check.returncode != 0:
        lines = (check.stderr or check.stdout).strip().splitlines()
        return f"unsupported by this build: node join refuses {' '.join(args[2:])}: {lines[-1] if lines else check.returncode}"
    return None


def launch_nodes(args: list[str], settings: Settings, directory: Path, t0: float) -> list[int | None]:
    """Start N ``node join`` processes at once (in namespaces with ``--link-mbit``): node 0 starts a swarm,
    the others do their imports meanwhile (``benchmarks.warm_join``) and join as soon as node 0 listens."""
    s = settings
    from hivemind.p2p import P2P, PeerID

    identity = directory / "node0.key"
    identity.unlink(missing_ok=True)
    P2P.generate_identity(str(identity))  # node 0's peer id is known before it starts
    peer_id = PeerID.from_identity(identity.read_bytes()).to_base58()
    port = 41000 if s.link_mbit else _free_port()
    bootstrap = f"/ip4/{_host(0, s)}/tcp/{port}/p2p/{peer_id}"
    procs = []
    for i in range(s.nodes):
        d = directory / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        node_args = [*args, "--seed", str(s.seed + i), "--checkpoint-dir", str(d), "--info-file", str(d / "info.json")]
        if i == 0:
            cmd = [*_python(), "-m", "node", "join", *node_args, "--listen", f"/ip4/{_host(0, s)}/tcp/{port}",
                   "--identity", str(identity)]
        else:
            cmd = [*_python(), "-m", "benchmarks.warm_join", "--bootstrap", bootstrap, "--timeout", "300", "--",
                   *node_args, "--listen", f"/ip4/{_host(i, s)}/tcp/0"]
        procs.append(_spawn(_in_namespace(i, s, cmd), d / "log.txt"))
    return _wait_all(procs, t0 + s.config_timeout)


def run_locomesh(name: str, settings: Settings, directory: Path) -> dict[str, Any]:
    s = settings
    args = join_args(name, s)
    poller = InfoPoller(directory, s.nodes)
    for i in range(s.nodes):
        (directory / f"node{i}" / "info.json").unlink(missing_ok=True)
    t0 = time.time()
    poller.start()
    codes: list[int | None]
    link_bytes = None
    if s.swarm_launcher and not s.link_mbit:
        report = directory / "report.json"
        cmd = [*_python(), "-m", "node", "swarm", "--nodes", str(s.nodes), "--duration", str(s.config_timeout),
               "--report", str(report), "--checkpoint-dir", str(directory), *args]
        proc = _spawn(cmd, directory / "swarm.log")
        _wait_all([proc], t0 + s.config_timeout + 90)  # the launcher stops its nodes itself at --duration
        try:
            codes = [n["exit_code"] for n in json.loads(report.read_text())["nodes"]]
        except (OSError, ValueError, KeyError):
            codes = [None] * s.nodes
    else:
        codes = launch_nodes(args, s, directory, t0)
        if s.link_mbit:
            link_bytes = _link_tx_bytes(s.nodes)
    wall = time.time() - t0
    poller.halt.set()
    poller.join()
    poller.poll_once()
    infos = [thin_links.info(directory, i) for i in range(s.nodes)]
    if not all(infos):
        return {"status": "failed", "reason": f"node exit codes {codes}; see logs under {directory}", "wall_s": wall}
    tokens_per_step = s.batch_size * _context(s.model)
    nodes = []
    comm_from_daemon = all("comm_wait_s" in inf for inf in infos)
    per_node_points: list[list[tuple[float, float, int]]] = []
    for i, inf in enumerate(infos):
        rounds = inf.get("rounds", [])
        seen = poller.round_seen_at[i]
        start = poller.training_at[i] or t0
        end = poller.stopped_at[i] or (seen[-1] if seen else t0 + wall)
        train_wall = max(1e-9, end - start)
        comm = float(inf["comm_wait_s"]) if comm_from_daemon else sum(float(r.get("duration_s", 0.0)) for r in rounds)
        nodes.append({
            "exit_code": codes[i], "steps": inf.get("steps", 0), "tokens": inf.get("steps", 0) * tokens_per_step,
            "val_loss": inf.get("val_loss"), "train_loss_first": inf.get("train_loss_first"),
            "train_loss_last": inf.get("train_loss_last"), "bytes_sent": inf.get("bytes_sent", 0),
            "bytes_sent_by_kind": inf.get("bytes_sent_by_kind", {}), "link_tx_bytes": link_bytes[i] if link_bytes else None,
            "outer_rounds": inf.get("outer_rounds", 0), "train_wall_s": train_wall, "comm_wait_s": comm,
            "daemon_wall_s": inf.get("wall_s"), "joined_round": inf.get("joined_round"),
            "rounds_with_every_node": sum(1 for r in rounds if r.get("contributors") == s.nodes),
            "rounds_alone": sum(1 for r in rounds if r.get("contributors") == 1),
            "events": [e.get("event") for e in inf.get("events", [])],
        })
        points = []
        for k, r in enumerate(rounds):
            if r.get("val_loss") is None or not math.isfinite(r["val_loss"]):
                continue
            t = float(r["t"]) if "t" in r else (seen[k] if k < len(seen) else t0 + wall)
            # tokens this node had trained on at this evaluation (older daemons: H steps per round)
            tokens = int(r["tokens"]) if "tokens" in r else (int(r["round"]) + 1) * s.inner_steps * tokens_per_step
            points.append((r["val_loss"], t - t0, tokens))
        per_node_points.append(points)
    # the k-th evaluation of every node is one point: tokens summed over nodes, loss averaged, time of the last
    curve = []
    for k in range(min((len(p) for p in per_node_points), default=0)):
        ps = [p[k] for p in per_node_points]
        curve.append({"tokens": sum(p[2] for p in ps), "val_loss": statistics.fmean(p[0] for p in ps),
                      "t_s": max(p[1] for p in ps)})
    total_tokens = sum(n["tokens"] for n in nodes)
    finals = [n["val_loss"] for n in nodes if n["val_loss"] is not None and math.isfinite(n["val_loss"])]
    if finals and (not curve or curve[-1]["tokens"] < total_tokens):
        ends = [poller.stopped_at[i] or t0 + wall for i in range(s.nodes)]
        curve.append({"tokens": total_tokens, "val_loss": statistics.fmean(finals), "t_s": max(ends) - t0})
    ok = all(c == 0 for c in codes)
    return {
        "status": "ok" if ok else "failed", "reason": "" if ok else f"node exit codes {codes}; see logs under {directory}",
        "wall_s": wall, "nodes": nodes, "curve": curve, "join_args": args,
        "bytes_method": "measured: wire bytes the node wrote on locomesh protocols (average, state, status); "
                        "DHT and p2pd control traffic not counted",
        "comm_wait_method": "reported by the daemon (comm_wait_s)" if comm_from_daemon else
                            "derived: sum of round duration_s (the training loop waits for every round)",
        "train_wall_method": "observed from the info file: first 'training' state to 'stopping' (±0.25 s); the "
                             "daemon's own wall_s (per node, daemon_wall_s) also counts its start-up and join",
    }


def _context(model: str) -> int:
    from swarm.models.presets import preset

    return preset(model).context


# ---------------------------------------------------------------------------------- analysis


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
    for p in rec.get("curve", []):
        if p["val_loss"] <= target + 1e-9:
            return p["t_s"]
    return None


def check_targets(results: dict[str, dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    ok = {k: v for k, v in results.items() if v.get("status") == "ok" and v.get("final_val_loss") is not None}
    loco = [k for k in LOCOMESH if k in ok]
    out: list[dict[str, Any]] = []

    def add(target: str, passed: bool | None, detail: str) -> None:
        out.append({"target": target, "result": "n/a" if passed is None else ("pass" if passed else "FAIL"), "detail": detail})

    t = "every locomesh config ahead of hivemind in tokens/s and in val-loss drop per MB sent"
    if "hivemind" not in ok or not loco:
        add(t, None, "needs hivemind and at least one locomesh config")
    else:
        h = ok["hivemind"]
        rows, good = [], True
        for k in loco:
            r = ok[k]
            a = r["tokens_per_s_per_node"] > h["tokens_per_s_per_node"]
            b = (r["loss_drop_per_mb"] or 0) > (h["loss_drop_per_mb"] or 0)
            good &= a and b
            rows.append(f"{k}: {r['tokens_per_s_per_node']:.0f} vs {h['tokens_per_s_per_node']:.0f} tok/s, "
                        f"{r['loss_drop_per_mb'] or 0:.3g} vs {h['loss_drop_per_mb'] or 0:.3g} nats of val loss per MB")
        missing = [k for k in LOCOMESH if k not in ok]
        add(t, good, "; ".join(rows) + (f" (not run: {', '.join(missing)})" if missing else ""))

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
    elif "hivemind" not in ok or not reached:
        add(t, None, "needs hivemind and a locomesh config that reached the target")
    else:
        best = min(reached, key=reached.get)
        h_t = ok["hivemind"].get("time_to_target_s")
        if h_t is None:
            add(t, None if settings.link_mbit != 20 else True, f"{best} reached the target in {reached[best]:.0f}s; hivemind never did")
        else:
            add(t, None if settings.link_mbit != 20 else h_t / reached[best] >= 1.5,
                f"{best} {h_t / reached[best]:.1f}x faster than hivemind ({h_t:.0f}s)")
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
            row = [name, "ok", f"{r['final_val_loss']:.4f}", f"{r['tokens_total'] / 1e6:.2f} M", _fmt_bytes(b), fewer,
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
        color = colors((ALL_CONFIGS.index(name) if name in ALL_CONFIGS else len(ALL_CONFIGS) + list(results).index(name)) % 10)
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


# ---------------------------------------------------------------------------------- main


def _environment() -> dict[str, Any]:
    import hivemind
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"python": platform.python_version(), "torch": torch.__version__, "hivemind": hivemind.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(), "git": commit, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON report; the plot is written next to it (.png)")
    parser.add_argument("--quick", action="store_true", help="nano model, 2 nodes x 600 steps, H=30: every config in minutes")
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"comma separated, of {', '.join(ALL_CONFIGS)}")
    parser.add_argument("--link-mbit", type=float, default=None, help="each process in a network namespace behind tc tbf R Mbit/s (root)")
    parser.add_argument("--target-loss", type=float, default=None, help="for time to target (default: ddp's final val loss, else the worst final val loss)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CONFIG:FLAGS",
                        help="an ablation: CONFIG's node flags plus FLAGS, reported as NAME (repeatable), "
                             "e.g. 'sparseloco-mean=sparseloco:--aggregate mean'")
    parser.add_argument("--model")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--steps", type=int, help="optimizer steps per node")
    parser.add_argument("--inner-steps", type=int, help="H: local steps per outer round / hivemind epoch")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--config-timeout", type=float, help="seconds before a configuration is stopped")
    parser.add_argument("--swarm-launcher", action="store_true",
                        help="launch locomesh nodes with `node swarm` (node 0 trains alone while the others start up) "
                             "instead of starting them together")
    parser.add_argument("--hivemind-background", action="store_true",
                        help="hivemind averages in the background (its default delay_state_averaging=True)")
    args = parser.parse_args()

    settings = Settings.quick() if args.quick else Settings()
    for key in ("model", "nodes", "steps", "inner_steps", "batch_size", "lr", "warmup_steps", "config_timeout"):
        if getattr(args, key) is not None:
            setattr(settings, key, getattr(args, key))
    settings.link_mbit = args.link_mbit
    settings.hivemind_background = args.hivemind_background
    settings.swarm_launcher = args.swarm_launcher
    for variant in args.variant:
        label, _, spec = variant.partition("=")
        base, _, extra = spec.partition(":")
        if not label or base not in LOCOMESH or label in ALL_CONFIGS:
            sys.exit(f"--variant {variant!r}: expected NEW_NAME=CONFIG:FLAGS with CONFIG one of {', '.join(LOCOMESH)}")
        LOCOMESH[label] = [*LOCOMESH[base], *shlex.split(extra)]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in ALL_CONFIGS and c not in LOCOMESH]
    if unknown:
        sys.exit(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(ALL_CONFIGS)} or a --variant")
    if settings.link_mbit is not None and os.geteuid() != 0:
        sys.exit("--link-mbit needs root for ip netns and tc; run it with sudo")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    help_text = subprocess.run([*_python(), "-m", "node", "join", "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}).stdout
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    for name in configs:
        directory = out.parent / f"{out.stem}-{name}"
        directory.mkdir(parents=True, exist_ok=True)
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            if name in LOCOMESH and (why := supported(name, settings, help_text)):
                rec = {"status": "unsupported", "reason": why}
            else:
                if settings.link_mbit is not None:
                    thin_links.setup(1 if name == "single" else settings.nodes, settings.link_mbit)
                try:
                    rec = run_baseline(name, settings, directory) if name in BASELINES else run_locomesh(name, settings, directory)
                finally:
                    if settings.link_mbit is not None:
                        thin_links.teardown(settings.nodes)
        except Exception as e:  # noqa: BLE001 - one broken config must not lose the others
            rec = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
        rec["directory"] = str(directory)
        results[name] = summarize(name, rec)
        r = results[name]
        if r.get("status") == "ok":
            print(f"   val {r['final_val_loss']:.4f}, {r['tokens_per_s_per_node']:.0f} tok/s/node, "
                  f"exchange {_fmt_bytes(r['exchange_bytes_per_node'])}/node, comm wait {r['comm_wait_fraction']:.1%}, "
                  f"{time.time() - t0:.0f}s", flush=True)
        else:
            print(f"   {r['status']}: {r.get('reason', '')}", flush=True)

    target, target_source = target_loss(results, args.target_loss)
    for r in results.values():
        if r.get("status") == "ok" and target is not None:
            r["time_to_target_s"] = time_to_target(r, target)
    targets = check_targets(results, settings)
    table = markdown_table(results, settings.link_mbit is not None)
    png = out.with_suffix(".png")
    link = f", {settings.link_mbit:g} Mbit/s links" if settings.link_mbit else ", loopback"
    title = (f"{settings.model}, {settings.nodes} nodes x {settings.steps} steps, H={settings.inner_steps}, "
             f"batch {settings.batch_size}{link}")
    try:
        plot(results, png, title, target)
    except Exception as e:  # noqa: BLE001 - the report matters more than the picture
        print(f"could not draw {png}: {e}", file=sys.stderr)
        png = None
    report = {
        "settings": asdict(settings), "environment": _environment(), "elapsed_s": round(time.time() - started, 1),
        "target_loss": target, "target_loss_source": target_source, "link_mbit": settings.link_mbit,
        "configs": results, "targets": targets, "table": table, "plot": str(png) if png else None,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out)
    print(f"\n{title}; target val loss {target if target is None else round(target, 4)}\n")
    print(table)
    print()
    for t in targets:
        print(f"- [{t['result']}] {t['target']}: {t['detail']}")
    print(f"\nreport: {out}" + (f", plot: {png}" if png else "") + f" ({report['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()

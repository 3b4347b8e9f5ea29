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
  every epoch of H local steps per peer, over a hivemind DHT; ``hivemind-fp16`` and ``hivemind-8bit``
  the same with hivemind's Float16Compression or Uniform8BitQuantization averaging (its best offered
  settings, beside the uncompressed one: every comparison with hivemind takes its best variant).
- ``diloco``, ``noloco``, ``sparseloco``, ``noloco-sparse``, ``streaming``: the real ``node swarm``
  CLI (``node join`` per namespace with ``--link-mbit``), ``--max-steps S --eval-every 1``. A
  configuration whose flags this build of ``node join`` does not accept is recorded as unsupported.

Per configuration the JSON report holds the final validation loss (mean over nodes), the curve of
validation loss against tokens (and seconds since launch), bytes sent per node (how each was obtained
is written next to it: measured, computed or estimated), wall time, tokens/s per node, the fraction
of training time blocked on communication, and the wall time to a target validation loss (the
data-parallel baseline's final loss of the same seed, else the worst final loss, unless
``--target-loss``; read between the evaluations that bracket it). ``--baseline-steps`` lets ddp (and
single) train fewer steps than the others: it then only sets the target, which the others race to. Each locomesh configuration's
``vs_dense`` compares it with dense DiLoCo at its own H: when ``diloco`` runs and a variant sets another
``--inner-steps``, a dense ``diloco-h<H>`` run at that H is added. ``--seeds 0,1,2`` runs every
configuration once per seed, alternating (A B C, A B C, ...: a change in the machine's load falls on
all of them), and reports mean ± spread; every seed's record is kept under ``per_seed``. A PNG next
to the report plots validation loss against tokens and against wall time (the first seed), and a
markdown table is printed. The report is written with ``benchmarks.results_io`` (a ``meta`` record).

``--link-mbit R`` puts every process in its own network namespace behind a ``tc tbf`` limit of R
Mbit/s each way (``benchmarks.thin_links``; root required) and also measures the bytes each node's
interface sent (every protocol, headers included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import results_io, thin_links
from benchmarks.convergence_report import (  # noqa: F401 - the analysis is part of this benchmark's interface
    BASELINES, COMPRESSED, HIVEMIND, UNIFORM_LOSS, _fmt_bytes, check_targets, combine_seeds, dense_same_h, inner_steps,
    is_dense_diloco, markdown_table, plot, summarize, target_loss, time_to_target)

LOCOMESH: dict[str, list[str]] = {
    "diloco": ["--algorithm", "diloco"],
    "noloco": ["--algorithm", "noloco"],
    "sparseloco": ["--algorithm", "sparseloco"],  # its default codec is topk:64/4096+q2
    "noloco-sparse": ["--algorithm", "noloco", "--compression", "topk:64/4096+q2"],
    "streaming": ["--algorithm", "diloco", "--fragments", "4", "--overlap"],
}
ALL_CONFIGS = (*BASELINES, *LOCOMESH)


@dataclass
class Settings:
    model: str = "tiny"
    nodes: int = 2
    steps: int = 1000  # optimizer steps per node
    baseline_steps: int | None = None  # ddp and single: steps per node when they only set the race's target
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
    forger: bool = False  # a forging peer (tests.helpers.attacker) runs beside the nodes

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
    own = s.baseline_steps if s.baseline_steps and name in ("single", "ddp") else s.steps
    steps = own * s.nodes if name == "single" else own
    eval_every = s.inner_steps * (s.nodes if name == "single" else 1)  # evaluate at the same token counts
    common = ["--world", str(world), "--model", s.model, "--batch-size", str(s.batch_size), "--steps", str(steps),
              "--lr", str(s.lr), "--warmup-steps", str(s.warmup_steps), "--eval-every", str(eval_every),
              "--eval-batches", str(s.eval_batches), "--threads", str(s.threads), "--seed", str(s.seed)]
    procs, outs = [], []
    t0 = time.time()
    if name in HIVEMIND:
        rdv = directory / "rendezvous"
        shutil.rmtree(rdv, ignore_errors=True)  # an earlier run's addresses and barriers must not be read
        rdv.mkdir(parents=True, exist_ok=True)
    port = 29500 if s.link_mbit else _free_port()
    for rank in range(world):
        out = directory / f"worker{rank}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        if name in HIVEMIND:
            cmd = [*_python(), "-m", "benchmarks.baselines", "hivemind", "--rank", str(rank), *common, "--out", str(out),
                   "--rendezvous", str(rdv), "--host", _host(rank, s), "--inner-steps", str(s.inner_steps),
                   "--run-id", f"conv-{int(t0)}", "--timeout", str(min(600.0, s.config_timeout)),
                   "--compression", HIVEMIND[name]]
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
        **({"hivemind": {k: workers[0].get(k) for k in ("delay_state_averaging", "matchmaking_time", "target_batch_size",
                                                           "compression")}}
           if name in HIVEMIND else {}),
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
    forger = None
    if s.forger:  # it joins as soon as node 0 listens, and forges records until the nodes are done
        run_id = args[args.index("--run-id") + 1]
        (directory / "forger.json").unlink(missing_ok=True)
        forger = _spawn([*_python(), "-m", "tests.helpers.attacker", "--initial-peers", bootstrap, "--run-id", run_id,
                         "--report", str(directory / "forger.json")], directory / "forger.log")
    codes = _wait_all(procs, t0 + s.config_timeout)
    if forger is not None:
        _wait_all([forger], time.time())
    return codes


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
    forger = None
    if s.forger:
        try:
            forger = json.loads((directory / "forger.json").read_text())
        except (OSError, ValueError):
            forger = {"passes": 0}
        if not forger.get("passes"):
            ok, codes = False, codes + ["the forger stored nothing (see forger.log)"]
    return ({"forger": forger} if forger is not None else {}) | {
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


# ---------------------------------------------------------------------------------- main


def _environment() -> dict[str, Any]:
    """The ``environment`` record of a report (its ``meta`` says more: ``benchmarks.results_io``)."""
    commit, _ = results_io.git_state()
    v = results_io.versions()
    return {"python": platform.python_version(), "torch": v["torch"], "hivemind": v["hivemind"],
            "cpus": os.cpu_count(), "platform": platform.platform(), "git": (commit or "")[:7],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def add_dense_per_h(configs: list[str], settings: Settings) -> list[str]:
    """When dense ``diloco`` runs, a dense run at every other H a locomesh configuration uses
    (``diloco-h<H>``), so each is compared with dense DiLoCo at its own H; returns the added names."""
    if not any(c in LOCOMESH and is_dense_diloco(LOCOMESH[c]) for c in configs):
        return []
    have = {inner_steps(LOCOMESH[c], settings.inner_steps) for c in configs if c in LOCOMESH and is_dense_diloco(LOCOMESH[c])}
    added = []
    for c in list(configs):
        h = inner_steps(LOCOMESH[c], settings.inner_steps) if c in LOCOMESH else None
        if h is not None and h not in have:
            name = f"diloco-h{h}"
            LOCOMESH[name] = ["--algorithm", "diloco", "--inner-steps", str(h)]
            configs.append(name)
            added.append(name)
            have.add(h)
    return added


def run_config(name: str, settings: Settings, directory: Path, help_text: str) -> dict[str, Any]:
    """One configuration, one seed: its summarized record (failures are records too)."""
    directory.mkdir(parents=True, exist_ok=True)
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
    rec["seed"] = settings.seed
    return summarize(name, rec)


def race(results: dict[str, dict[str, Any]], given: float | None) -> tuple[float | None, str]:
    """One seed's race: its target (``target_loss``) and every finished run's time to it."""
    target, source = target_loss(results, given)
    for r in results.values():
        if r.get("status") == "ok" and target is not None:
            r["time_to_target_s"] = time_to_target(r, target)
    return target, source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON report; the plot is written next to it (.png)")
    parser.add_argument("--quick", action="store_true", help="nano model, 2 nodes x 600 steps, H=30: every config in minutes")
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"comma separated, of {', '.join(ALL_CONFIGS)}")
    parser.add_argument("--seeds", default=None, help="comma separated seeds (init seed; node i draws data with seed + i); "
                        "every config runs once per seed, alternating; default: 0")
    parser.add_argument("--link-mbit", type=float, default=None, help="each process in a network namespace behind tc tbf R Mbit/s (root)")
    parser.add_argument("--target-loss", type=float, default=None, help="for time to target (default: ddp's final val loss, else the worst final val loss)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CONFIG:FLAGS",
                        help="an ablation: CONFIG's node flags plus FLAGS, reported as NAME (repeatable), "
                             "e.g. 'sparseloco-mean=sparseloco:--aggregate mean'")
    parser.add_argument("--no-dense-per-h", action="store_true",
                        help="do not add a dense diloco run at each other H a variant uses")
    parser.add_argument("--model")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--steps", type=int, help="optimizer steps per node")
    parser.add_argument("--baseline-steps", type=int,
                        help="ddp and single train this many steps per node (default: --steps): the race's target is "
                             "ddp's final loss, which the others then race to with --steps")
    parser.add_argument("--inner-steps", type=int, help="H: local steps per outer round / hivemind epoch")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--eval-batches", type=int)
    parser.add_argument("--config-timeout", type=float, help="seconds before a configuration is stopped")
    parser.add_argument("--swarm-launcher", action="store_true",
                        help="launch locomesh nodes with `node swarm` (node 0 trains alone while the others start up) "
                             "instead of starting them together")
    parser.add_argument("--forged", default="", metavar="NAME[,NAME]",
                        help="these locomesh configs run beside a forging peer (tests.helpers.attacker: records 'of' every "
                             "member, invented members, a round 1000 ahead); e.g. --variant 'diloco-forged=diloco:' "
                             "--forged diloco-forged compares DiLoCo with and without it")
    parser.add_argument("--hivemind-background", action="store_true",
                        help="hivemind averages in the background (its default delay_state_averaging=True)")
    args = parser.parse_args()
    meta = results_io.begin()

    settings = Settings.quick() if args.quick else Settings()
    for key in ("model", "nodes", "steps", "baseline_steps", "inner_steps", "batch_size", "lr", "warmup_steps", "eval_batches", "config_timeout"):
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
    if not args.no_dense_per_h and (added := add_dense_per_h(configs, settings)):
        print(f"added dense DiLoCo at the H of the variants, to compare like with like: {', '.join(added)}", flush=True)
    forged = {c.strip() for c in args.forged.split(",") if c.strip()}
    if not forged <= set(configs) or any(c not in LOCOMESH for c in forged):
        sys.exit(f"--forged {args.forged!r}: name locomesh configs of --configs")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [settings.seed]
    if settings.link_mbit is not None and os.geteuid() != 0:
        sys.exit("--link-mbit needs root for ip netns and tc; run it with sudo")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    help_text = subprocess.run([*_python(), "-m", "node", "join", "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}).stdout
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    targets_per_seed: dict[int, tuple[float | None, str]] = {}
    started = time.time()
    for seed in seeds:  # seed-major: A B C, A B C, ... so a slow spell of the machine falls on every config
        s = dataclasses.replace(settings, seed=seed)
        per_seed[seed] = {}
        for name in configs:
            directory = out.parent / (f"{out.stem}-{name}" + (f"-seed{seed}" if len(seeds) > 1 else ""))
            print(f"== {name}" + (f", seed {seed}" if len(seeds) > 1 else ""), flush=True)
            t0 = time.time()
            r = per_seed[seed][name] = run_config(name, dataclasses.replace(s, forger=name in forged), directory, help_text)
            if r.get("status") == "ok":
                print(f"   val {r['final_val_loss']:.4f}, {r['tokens_per_s_per_node']:.0f} tok/s/node, "
                      f"exchange {_fmt_bytes(r['exchange_bytes_per_node'])}/node, comm wait {r['comm_wait_fraction']:.1%}, "
                      f"{time.time() - t0:.0f}s", flush=True)
            else:
                print(f"   {r['status']}: {r.get('reason', '')}", flush=True)
        targets_per_seed[seed] = race(per_seed[seed], args.target_loss)
        dense_same_h(per_seed[seed], LOCOMESH, settings.inner_steps)

    if len(seeds) == 1:
        results = per_seed[seeds[0]]
        target, target_source = targets_per_seed[seeds[0]]
    else:
        results = {name: combine_seeds({seed: per_seed[seed][name] for seed in seeds}) for name in configs}
        dense_same_h(results, LOCOMESH, settings.inner_steps)
        found = [t for t, _ in targets_per_seed.values() if t is not None]
        target = statistics.fmean(found) if found else None
        target_source = f"mean over seeds of: {targets_per_seed[seeds[0]][1]} (each seed races to its own)"
    targets = check_targets(results, settings)
    table = markdown_table(results, settings.link_mbit is not None)
    png = out.with_suffix(".png")
    link = f", {settings.link_mbit:g} Mbit/s links" if settings.link_mbit else ", loopback"
    ddp_steps = f" (ddp {settings.baseline_steps})" if settings.baseline_steps else ""
    title = (f"{settings.model}, {settings.nodes} nodes x {settings.steps} steps{ddp_steps}, H={settings.inner_steps}, "
             f"batch {settings.batch_size}{link}" + (f", seed {seeds[0]} of {len(seeds)}" if len(seeds) > 1 else ""))
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
    if len(seeds) > 1:
        report.update(seeds=seeds, target_loss_per_seed={str(k): v[0] for k, v in targets_per_seed.items()})
    results_io.write(out, report, meta)
    print(f"\n{title}; target val loss {target if target is None else round(target, 4)}\n")
    print(table)
    print()
    for t in targets:
        print(f"- [{t['result']}] {t['target']}: {t['detail']}")
    print(f"\nreport: {out}" + (f", plot: {png}" if png else "") + f" ({report['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()

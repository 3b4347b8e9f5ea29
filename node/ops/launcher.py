"""``node swarm``: N real daemons on 127.0.0.1 as separate processes, live progress, a JSON report.

Node 0 bootstraps the swarm; the others join through its multiaddr. Every node gets ``--min-peers
<nodes>`` unless the user sets it (replicas only): none starts training before all are in the run. Progress is read from each
node's Prometheus endpoint. At the end every node gets SIGTERM (then SIGKILL of its process group
after a grace period), and the report collects each node's exit summary plus launcher events.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.ops.chaos import ChaosAction
from node.config import NodeConfig
from node.ops.progress import LiveProgress, progress_lines, progress_rows, progress_table, scrape
from node.ops.swarm_report import node_entry, print_summary, write_report

logger = logging.getLogger("locomesh.swarm")
STOP_GRACE_S = 60.0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free TCP port on loopback for a node's /metrics, below the kernel's ephemeral range when there is
    room: a port picked from that range (``bind(0)``) was once taken by a p2pd listening on ``tcp/0``
    between this pick and the node's own bind ("Address already in use" in a pipeline test)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(64) if low > 12000 else ():
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeProcess:
    index: int
    directory: Path
    metrics_port: int
    process: subprocess.Popen | None = None
    exit_code: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def info_file(self) -> Path:
        return self.directory / "info.json"

    def read_info(self) -> dict[str, Any]:
        try:
            self.info = json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            pass
        return self.info


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` less every ``flag VALUE`` / ``flag=VALUE`` (the launcher sets that flag per node)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def pipeline_role(index: int, nodes: int, stages: int) -> int | None:
    """Role of node ``index`` in a local pipeline swarm: the last ⌊N/(S+1)⌋ (at least 1) nodes are
    trainers, the others serve stages round-robin (node 0, the bootstrap, serves stage 0)."""
    trainers = max(1, nodes // (stages + 1))
    return index % stages if index < nodes - trainers else None


class SwarmLauncher:
    def __init__(
        self,
        *,
        nodes: int,
        duration: float,
        report: Path,
        metrics_port: int,
        run_dir: Path,
        join_args: list[str],
        config: NodeConfig,
        join_interval: float = 0.5,
        node_args: dict[int, list[str]] | None = None,
        chaos: list[ChaosAction] | None = None,
        restart_killed: float | None = None,
        seed: int = 0,
    ) -> None:
        if nodes < 1:
            raise ValueError("--nodes must be at least 1")
        self.duration, self.report, self.join_args, self.config = duration, Path(report), join_args, config
        self.join_interval = join_interval
        self.node_args = node_args or {}
        self.chaos, self.restart_killed = chaos or [], restart_killed
        self.rng = random.Random(seed)
        self.restarts: list[tuple[float, NodeProcess]] = []
        self.paused: list[tuple[float, NodeProcess]] = []  # (when to resume, node) of --chaos pause
        self.killed: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self.nodes = [
            NodeProcess(i, Path(run_dir) / f"node{i}", metrics_port + i if metrics_port else free_port()) for i in range(nodes)
        ]
        self.t0 = time.time()

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append({"t": round(time.time() - self.t0, 3), "event": kind, **fields})
        logger.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))

    def _spawn(self, node: NodeProcess, initial_peers: list[str]) -> None:
        node.directory.mkdir(parents=True, exist_ok=True)
        node.info_file.unlink(missing_ok=True)
        own = [*_without_flag(self.join_args, "--seed"), *self.node_args.get(node.index, [])]
        args = [sys.executable, "-m", "node", "join", *own,
                "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(node.metrics_port),
                "--checkpoint-dir", str(node.directory), "--info-file", str(node.info_file)]
        if not _has_flag(self.node_args.get(node.index, []), "--seed"):
            # each node its own data order, one common initialisation (a swarm-wide --seed S gives node i S + i)
            args += ["--seed", str(self.config.seed + node.index), "--init-seed", str(self.config.model_seed)]
        if self.config.stages > 1 and "--role" not in own:
            role = pipeline_role(node.index, len(self.nodes), self.config.stages)
            args += ["--role", "trainer"] if role is None else ["--role", "stage", "--stage", str(role)]
        if self.config.stages == 1 and self.config.min_peers == 1 and not _has_flag(own, "--min-peers"):
            args += ["--min-peers", str(len(self.nodes))]  # no node trains alone while the others start
        if "--threads" not in own:
            args += ["--threads", str(max(1, (os.cpu_count() or 1) // len(self.nodes)))]
        for peer in initial_peers:
            args += ["--initial-peers", peer]
        log = open(node.directory / "log.txt", "w")
        node.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.event("node_started", node=node.index, pid=node.process.pid, metrics_port=node.metrics_port)

    def _wait_ready(self, node: NodeProcess, timeout: float = 120.0) -> list[str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = node.read_info()
            if info.get("state") in ("waiting", "training") and info.get("multiaddrs"):  # waiting: for --min-peers
                return [f"{a}/p2p/{info['peer_id']}" if "/p2p/" not in a else a for a in info["multiaddrs"]]
            if node.process is not None and node.process.poll() is not None:
                raise RuntimeError(f"node {node.index} exited with code {node.process.returncode} before it was ready; see {node.directory / 'log.txt'}")
            time.sleep(0.2)
        raise RuntimeError(f"node {node.index} was not ready after {timeout:.0f}s; see {node.directory / 'log.txt'}")

    def _progress_table(self) -> Any:
        title = f"swarm of {len(self.nodes)} nodes, {time.time() - self.t0:.0f}s of {self.duration:.0f}s (Ctrl-C stops)"
        return progress_table(progress_rows(self.nodes), title)

    def _stop_all(self) -> None:
        # in a pipeline, trainers stop first: their final evaluation needs the stage servers
        trainers = [n for n in self.nodes if self._is_pipeline_trainer(n)]
        if trainers:
            self._stop(trainers)
        self._stop([n for n in self.nodes if n not in trainers])

    def _is_pipeline_trainer(self, node: NodeProcess) -> bool:
        if self.config.stages <= 1:
            return False
        own = [*self.join_args, *self.node_args.get(node.index, [])]
        if "--role" in own:
            last = len(own) - 1 - own[::-1].index("--role")
            return own[last + 1 : last + 2] == ["trainer"]
        return pipeline_role(node.index, len(self.nodes), self.config.stages) is None

    def _stop(self, nodes: list[NodeProcess]) -> None:
        for node in nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
                self.event("sigterm", node=node.index)
        deadline = time.time() + STOP_GRACE_S
        for node in nodes:
            if node.process is None:
                continue
            try:
                node.exit_code = node.process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.event("sigkill", node=node.index, reason=f"still running {STOP_GRACE_S:.0f}s after SIGTERM")
                os.killpg(node.process.pid, signal.SIGKILL)
                node.exit_code = node.process.wait()
            # p2pd and other children share the node's process group: nothing may outlive the node
            try:
                os.killpg(node.process.pid, signal.SIGKILL)
                self.event("orphans_killed", node=node.index)
            except ProcessLookupError:
                pass
            self.event("node_exited", node=node.index, exit_code=node.exit_code)

    def check_checkpoints(self) -> str | None:
        """Say which nodes will resume a checkpoint; the error to stop with when one was written with
        other settings (each node would refuse it)."""
        from node.runtime.resume import inspect_checkpoint
        from node.runtime.settings import run_settings

        if self.config.fresh:
            if any((n.directory / "checkpoint.pt").exists() for n in self.nodes):
                print("--fresh: every node moves its old checkpoint aside and starts over", flush=True)
            return None
        for node in self.nodes:
            found = inspect_checkpoint(node.directory, run_settings(self.config))
            if found is None:
                continue
            path, round_no, diffs = found
            if diffs:
                return (f"node {node.index}'s checkpoint {path} was written with {', '.join(diffs)}: resuming it would "
                        "mix two runs. Use another --checkpoint-dir (or --report folder), or add --fresh to start over")
            print(f"node {node.index} resumes {path} (round {round_no}); add --fresh to start over instead", flush=True)
        return None

    def run(self) -> int:
        self.report.parent.mkdir(parents=True, exist_ok=True)
        problem = self.check_checkpoints()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        interrupted = False
        self._stop_signal: int | None = None
        previous = {sig: signal.signal(sig, self._on_stop_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self._spawn(self.nodes[0], list(self.config.initial_peers))
            bootstrap = self._wait_ready(self.nodes[0])
            self.event("bootstrap_ready", node=0, multiaddrs=bootstrap)
            for node in self.nodes[1:]:
                time.sleep(self.join_interval)
                self._spawn(node, bootstrap[:1])
            for node in self.nodes[1:]:
                self._wait_ready(node)
            # --duration counts training, not start-up: on a loaded machine start-up alone took 35 s once,
            # and a swarm stopped before its last node was up reported that node as failed
            end = time.time() + self.duration
            self.event("swarm_ready", nodes=len(self.nodes), after_s=round(time.time() - self.t0, 1))
            next_line = 0.0
            live = LiveProgress(self._progress_table()) if sys.stdout.isatty() else None
            try:
                while time.time() < end:
                    if all(n.process is not None and n.process.poll() is not None for n in self.nodes) and not self.restarts:
                        self.event("all_exited_early")
                        break
                    self._inject_faults(bootstrap[:1])
                    if time.time() >= next_line:
                        if live is not None:
                            live.update(self._progress_table())
                            next_line = time.time() + 2
                        else:
                            print("\n".join(progress_lines(progress_rows(self.nodes), time.time() - self.t0)), flush=True)
                            next_line = time.time() + 10
                    time.sleep(0.5)
            finally:
                if live is not None:
                    live.stop(self._progress_table())
        except KeyboardInterrupt:
            interrupted = True
            self.event("interrupted", signal=signal.Signals(self._stop_signal).name if self._stop_signal else "SIGINT")
        except RuntimeError as e:
            self.event("launch_failed", error=str(e))
            print(f"error: {e}", file=sys.stderr)
        finally:
            # a second Ctrl-C or SIGTERM must not cut the shutdown short and leave nodes behind
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            try:
                self._resume(math.inf)  # a stopped node cannot stop
                self._stop_all()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                signal.signal(signal.SIGINT, signal.default_int_handler)
        report = self.write_report()
        print_summary(report, self.report)
        if interrupted:
            return 128 + (self._stop_signal or signal.SIGINT)
        ok = all(n["exit_code"] == 0 or n["index"] in self.killed for n in report["nodes"])
        return 0 if ok else 1

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        """SIGTERM (a supervisor, ``timeout``, ``docker stop``) and SIGHUP stop the swarm as Ctrl-C does."""
        self._stop_signal = signum
        raise KeyboardInterrupt

    def _live(self) -> list[NodeProcess]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def _inject_faults(self, bootstrap: list[str]) -> None:
        now = time.time() - self.t0
        for action in self.chaos:
            if action.next_t is None or now < action.next_t:
                continue
            action.next_t = now + action.every if action.every else None  # type: ignore[assignment]
            if action.target == "node":
                victims = [n for n in self._live() if n.index == action.value]
            elif action.target == "stage":
                victims = [n for n in self._live() if scrape(n.metrics_port).get("locomesh_stage") == action.value]
            else:
                live = [n for n in self._live() if n.index != 0]
                victims = [self.rng.choice(live)] if live else []
            if not victims:
                self.event("chaos_no_victim", spec=f"{action.target}={action.value}")
            for node in victims:
                if action.kind == "pause":
                    os.kill(node.process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
                    self.paused.append((now + action.pause_s, node))
                    self.event("chaos_pause", node=node.index, seconds=action.pause_s)
                    continue
                stage = scrape(node.metrics_port).get("locomesh_stage")
                os.killpg(node.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
                node.exit_code = node.process.wait()  # type: ignore[union-attr]
                self.killed.add(node.index)
                self.event("chaos_kill", node=node.index, stage=None if stage is None or stage < 0 else int(stage))
                if self.restart_killed is not None:
                    self.restarts.append((now + self.restart_killed, node))
        self._resume(now)
        for due, node in [r for r in self.restarts if r[0] <= now]:
            self.restarts.remove((due, node))
            peers = bootstrap if self.nodes[0].process and self.nodes[0].process.poll() is None else [
                a for n in self._live() for a in n.read_info().get("multiaddrs", [])[:1]]
            self._spawn(node, peers[:1])
            self.event("chaos_restart", node=node.index)

    def _resume(self, now: float) -> None:
        """SIGCONT the paused nodes whose pause is over at ``now`` (every one: ``math.inf``)."""
        for due, node in [p for p in self.paused if p[0] <= now]:
            self.paused.remove((due, node))
            if node.process is not None and node.process.poll() is None:
                os.kill(node.process.pid, signal.SIGCONT)
                self.event("chaos_resume", node=node.index)

    def write_report(self) -> dict[str, Any]:
        nodes = []
        for node in self.nodes:
            info = node.read_info()
            nodes.append(node_entry(info, index=node.index, killed=node.index in self.killed, exit_code=node.exit_code,
                                    metrics_port=node.metrics_port, log=node.directory / "log.txt"))
            for ev in info.get("events", []):
                self.events.append({**ev, "t": round(ev["t"] - self.t0, 3), "node": node.index})
        report = {
            "duration_s": round(time.time() - self.t0, 3),
            "config": {**json.loads(self.config.model_dump_json()), "nodes": len(self.nodes), "join_args": self.join_args,
                       "node_args": {str(i): a for i, a in self.node_args.items()}},
            "nodes": nodes,
            "events": sorted(self.events, key=lambda e: e["t"]),
        }
        write_report(self.report, report)
        return report

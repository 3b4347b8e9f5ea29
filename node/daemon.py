"""The volunteer daemon: join the swarm, train locally, average with DiLoCo, survive signals.

Lifecycle of ``node join``:

1. Build model, data and metrics; start the network thread (p2pd + DHT) and serve the locomesh
   protocols (state, average, status).
2. With ``--initial-peers``: download the swarm's current weights, outer-optimizer state and round
   from a live peer, and run only what is left of that round's inner steps. Without: resume from
   the checkpoint in ``--checkpoint-dir`` if there is one, else start a new swarm.
3. Loop: inner steps → outer round (rendezvous, exchange, outer step) → publish the new state.
   ``--algorithm`` picks the round (diloco: whole group; noloco: small random groups; sparseloco:
   top-k + EF-SGD), ``--fragments`` syncs one fragment per round (streaming), ``--overlap`` keeps
   training while a round runs, ``--inner-steps auto`` sizes each round from this peer's speed.
4. On SIGTERM/SIGINT, ``--max-steps`` or ``--duration``: stop at a step boundary, evaluate, write
   the checkpoint atomically, leave the DHT and stop p2pd.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compression import ErrorFeedback
from gossip.diloco import DiLoCoAverager, RoundResult
from gossip.exchange import PartSpec, RoundExchange
from gossip.fingerprint import fingerprint
from gossip.fragments import assign_fragments, fragment_of_round, merge_fragment, sync_interval
from gossip.noloco import NoLoCoAverager
from gossip.outer import NesterovOuter, NoLoCoOuter
from gossip.partition import part_shapes
from gossip.rendezvous import list_peers, publish_peer, reconnect_routing_table, rejoin_target
from gossip.state_transfer import StateServer, StateSnapshot, download_state
from node import __version__
from node.checkpoint import CHECKPOINT_NAME, newest_valid, save_atomic
from node.config import NodeConfig, read_swarm_key
from node.data import ByteBatches, load_corpus, validation_batches
from node.metrics import NodeMetrics
from swarm.model import preset
from node.network import Interrupted, NetworkThread
from node.status_service import StatusService
from node.trainer import LocalTrainer, pick_device
from protocol.errors import RemoteError
from protocol.records import PeerRecord

logger = logging.getLogger("locomesh.node")
HEARTBEAT_S = 2.0
RECORD_TTL_S = 8.0
AUTO_STEPS_MAX_FACTOR = 20  # --inner-steps auto never goes past this × --round-steps


@dataclass
class PendingRound:
    """An outer round running on the network thread while training goes on (``--overlap``)."""

    round: int
    fragment: int
    steps: int
    future: concurrent.futures.Future
    eager: list[torch.Tensor] | None = None  # the estimate of the fragment's new φ already applied (eager mode)


def count_traffic(metrics: NodeMetrics, summary: "Summary", protocol: str, direction: str, nbytes: int) -> None:
    """Account one stream's bytes by protocol kind (``/locomesh/<kind>/1.0``) in metrics and summary."""
    kind = protocol.split("/")[2] if protocol.count("/") >= 3 else protocol
    if direction == "sent":
        metrics.bytes_sent.labels(kind).inc(nbytes)
        summary.bytes_sent += nbytes
        by_kind = summary.bytes_sent_by_kind
    else:
        metrics.bytes_received.labels(kind).inc(nbytes)
        summary.bytes_received += nbytes
        by_kind = summary.bytes_received_by_kind
    by_kind[kind] = by_kind.get(kind, 0) + nbytes


def write_info(info_file: Path | None, summary: "Summary") -> None:
    """Write the node's summary (``--info-file``) atomically."""
    if info_file is None:
        return
    path = Path(info_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary.__dict__, default=str, allow_nan=True))
    os.replace(tmp, path)


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``: the node finishes its step, evaluates, checkpoints and leaves."""

    def _handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            return
        logger.info("received %s: stopping at the next step boundary", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


class JoinRefused(Exception):
    """Every peer of the run refused this node's credentials, or the run trains with other settings."""


def settings_mismatch(mine: dict[str, Any], swarm: dict[str, Any]) -> str | None:
    """What differs between this node's training settings and the swarm's (from its state's meta)."""
    keys = ("model", "algorithm", "compression", "fragments")
    diffs = [f"--{k} {swarm[k]} (this node: {mine[k]})" for k in keys if k in swarm and swarm[k] != mine.get(k)]
    return ", ".join(diffs) or None


@dataclass
class Summary:
    """What the node reports when it exits (``--info-file``, read by ``node swarm``)."""

    peer_id: str = ""
    multiaddrs: list[str] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    metrics_port: int = 0
    steps: int = 0
    outer_rounds: int = 0
    train_loss_first: float = math.nan
    train_loss_last: float = math.nan
    val_loss: float = math.nan
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_received_by_kind: dict[str, int] = field(default_factory=dict)
    checkpoint: str = ""
    joined_round: int | None = None
    comm_wait_s: float = 0.0
    wall_s: float = 0.0  # from start-up (model, corpus, networking, join) to the end of training
    train_s: float = 0.0  # the training loop alone
    rounds: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    state: str = "starting"


class NodeBase:
    """What every kind of node shares: config, stop event, metrics, summary, network thread, events."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.metrics = NodeMetrics()
        self.summary = Summary(metrics_port=cfg.metrics_port)
        self.net = NetworkThread()
        self.bytes_lock = threading.Lock()
        self.started = time.monotonic()
        self.last_loss = math.nan

    def event(self, kind: str, **fields: Any) -> None:
        self.summary.events.append({"t": time.time(), "event": kind, **fields})
        logger.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))

    def _on_bytes(self, protocol: str, direction: str, nbytes: int) -> None:
        with self.bytes_lock:
            count_traffic(self.metrics, self.summary, protocol, direction, nbytes)

    def _on_error(self, protocol: str, code: str, peer: str) -> None:
        self.metrics.errors.labels(code).inc()

    def _write_info(self) -> None:
        write_info(self.cfg.info_file, self.summary)

    def install_signal_handlers(self) -> None:
        install_stop_handlers(self.stop)

    def _deadline_reached(self) -> bool:
        cfg = self.cfg
        if cfg.max_steps is not None and self.summary.steps >= cfg.max_steps:
            return True
        return cfg.duration is not None and time.monotonic() - self.started >= cfg.duration


class Daemon(NodeBase):
    """One volunteer node. ``run()`` blocks until the node stops and returns its exit code."""

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.round = 0
        self.inner_step = 0  # inner steps taken in the current round
        self.tokens_per_s = 0.0
        self.compute_tokens_per_s = 0.0  # inner steps only, announced for --inner-steps auto
        self.peer_rates: dict[str, float] = {}
        self.round_target = 1
        self.pending: PendingRound | None = None
        self.eager_prev: dict[int, tuple[list[torch.Tensor], int]] = {}  # fragment → others' Σ samples·Δ, samples
        self.role = "trainer"  # announced in the DHT; "leaving" once the node stops

    def run(self) -> int:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        device = pick_device(cfg.device)
        model_cfg = preset(cfg.model)
        corpus = load_corpus(str(cfg.data) if cfg.data else None, context=model_cfg.context)
        self.val = validation_batches(corpus.val, cfg.batch_size, model_cfg.context, max_batches=cfg.eval_batches)
        self.trainer = LocalTrainer(model_cfg, device, cfg.lr, cfg.weight_decay, cfg.warmup_steps, seed=cfg.seed)
        self.phi = [p.detach().to("cpu", torch.float32).clone() for p in self.trainer.parameters()]
        outer_lr, outer_momentum = cfg.outer_hyper
        if cfg.algorithm == "noloco":
            self.outer: NesterovOuter | NoLoCoOuter = NoLoCoOuter(outer_lr, cfg.noloco_pull, outer_momentum)
        else:
            self.outer = NesterovOuter(outer_lr, outer_momentum, nesterov=cfg.algorithm == "diloco")
        self.started = time.monotonic()
        try:
            self.net.start(
                cfg.initial_peers,
                cfg.listen,
                cfg.announce,
                str(cfg.identity) if cfg.identity else None,
                on_bytes=self._on_bytes,
                on_error=self._on_error,
                swarm_key=read_swarm_key(cfg.swarm_key) if cfg.swarm_key else None,
                stream_timeout=cfg.stream_timeout,
            )
        except Exception as e:
            logger.error("could not start networking: %s. Check --listen/--initial-peers and that the port is free.", e)
            self.net.shutdown()
            return 2
        try:
            return self._run_joined(corpus, device)
        finally:
            self.net.shutdown()
            self.summary.state = "stopped"
            self._write_info()
            logger.info("stopped cleanly")

    def _run_joined(self, corpus: Any, device: torch.device) -> int:
        cfg, net = self.cfg, self.net
        assert net.transport is not None and net.dht is not None and net.p2p is not None
        peer_id = net.transport.peer_id
        self.summary.peer_id = peer_id
        self._setup_fragments()
        maddrs = [str(a) if "/p2p/" in str(a) else f"{a}/p2p/{peer_id}" for a in net.call(net.p2p.get_visible_maddrs())]
        self.summary.multiaddrs = maddrs
        self.metrics.info.labels(peer_id, cfg.run_id, device.type, cfg.model, cfg.algorithm, cfg.codec, __version__).set(1)
        self.batches = ByteBatches(corpus.train, cfg.batch_size, self.trainer.model.cfg.context, seed=cfg.seed)

        self.exchange = RoundExchange(net.transport, cfg.run_id, self._wire(), self._layout, serve_timeout=cfg.averaging_timeout * 2)
        self.state_server = StateServer(net.transport, cfg.run_id, progress=lambda: self.inner_step)
        self.status = StatusService(net.transport, self.status_snapshot)
        net.call(self.exchange.start())
        net.call(self.state_server.start())
        net.call(self.status.start())
        self.summary.protocols = list(net.transport.protocols)
        if isinstance(self.outer, NoLoCoOuter):
            self.averager: DiLoCoAverager | NoLoCoAverager = NoLoCoAverager(
                net.dht, net.validator, self.exchange, cfg.run_id, peer_id, self.outer, group_size=cfg.group_size,
                gather_timeout=cfg.averaging_timeout, fetch_timeout=cfg.averaging_timeout, aggregation=cfg.aggregate,
            )
        else:
            self.averager = DiLoCoAverager(
                net.dht, net.validator, self.exchange, cfg.run_id, peer_id, self.outer,
                gather_timeout=cfg.averaging_timeout, fetch_timeout=cfg.averaging_timeout, aggregation=cfg.aggregate,
                keep_others=cfg.overlap and cfg.overlap_mode == "eager",
            )
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port)

        # a restarted node reloads its own checkpoint (inner optimizer, data order), then takes the
        # swarm's newer weights and round if any peer answers
        resumed = self._maybe_resume()
        if cfg.initial_peers:
            try:
                self._join_swarm(resumed)
            except JoinRefused as e:
                logger.error("%s", e)
                self.event("join_refused", reason=str(e))
                return 3
        self._publish_snapshot()
        net.every(HEARTBEAT_S, self._heartbeat, "heartbeat")
        self.summary.state = "training"
        self._write_info()
        print(f"locomesh node {peer_id} is up. Others can join with:\n  node join --run-id {cfg.run_id} "
              + " ".join(f"--initial-peers {a}" for a in maddrs[:2]), flush=True)
        try:
            self._train()
        except Interrupted:
            logger.info("interrupted during an outer round")
        self._finish()
        return 0

    # ---- what travels ------------------------------------------------------------------------
    def _setup_fragments(self) -> None:
        cfg = self.cfg
        names = [name for name, _ in self.trainer.model.named_parameters()]
        self.fragments = assign_fragments(names, cfg.fragments)
        shapes = [tuple(p.shape) for p in self.phi]
        self.fragment_parts = [part_shapes([shapes[i] for i in fragment]) for fragment in self.fragments]
        decay = cfg.feedback_decay()
        self.feedback: list[list[ErrorFeedback | None] | None] = [
            [ErrorFeedback(decay) for _ in parts] if decay > 0 else None for parts in self.fragment_parts
        ]
        # NoLoCo also sends φ: near-lossless, since the pull toward the group's mean weights would turn
        # a lossy codec's error into weight noise
        self.phi_codec = "none" if cfg.codec == "none" else "fp16"

    def _wire(self) -> str:
        """Names everything that shapes the bytes of a round; members of a run must agree on it."""
        cfg = self.cfg
        wire = cfg.codec
        if cfg.fragments > 1:
            wire += f"|fragments={cfg.fragments}"
        if cfg.algorithm == "noloco":
            wire += f"|noloco:phi={self.phi_codec}"
        return wire

    def _layout(self, round_no: int) -> list[PartSpec]:
        parts = self.fragment_parts[fragment_of_round(round_no, self.cfg.fragments)]
        specs = [PartSpec(shape, self.cfg.codec) for shape in parts]
        if self.cfg.algorithm == "noloco":
            specs += [PartSpec(shape, self.phi_codec) for shape in parts]
        return specs

    def _round_steps(self) -> int:
        """Inner steps until this node's next outer round: H/P, with H sized from this node's speed
        relative to the swarm's median under ``--inner-steps auto`` (so peers finish together)."""
        cfg = self.cfg
        if cfg.inner_steps != "auto":
            return sync_interval(cfg.inner_steps, cfg.fragments)
        rates = [r for p, r in self.peer_rates.items() if r > 0 and p != self.summary.peer_id]
        mine = self.compute_tokens_per_s
        steps = cfg.round_steps
        if mine > 0 and rates:
            median = statistics.median(rates + [mine])
            steps = min(max(1, round(cfg.round_steps * mine / median)), AUTO_STEPS_MAX_FACTOR * cfg.round_steps)
        return sync_interval(max(steps, cfg.fragments), cfg.fragments)

    # ---- joining -----------------------------------------------------------------------------
    def _state_layout(self) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
        return {
            "params": [(tuple(p.shape), p.dtype) for p in self.phi],
            "outer_momentum": [(tuple(p.shape), torch.float32) for p in self.phi],
        }

    def _join_swarm(self, resumed: bool) -> bool:
        """Download state from a live peer and take over its progress into the current round, so this
        node runs only the round's remaining inner steps and meets its peers at the rendezvous.

        Retries for ``--join-timeout`` seconds; raises :class:`JoinRefused` when every peer refused
        this node's credentials (a private swarm and a missing or wrong ``--swarm-key``)."""
        net = self.net
        deadline = time.monotonic() + self.cfg.join_timeout
        refusals: set[str] = set()
        while not self.stop.is_set():
            peers = net.call(list_peers(net.dht, self.cfg.run_id), timeout=30)
            candidates = sorted(
                (rec for p, rec in peers.items() if p != self.summary.peer_id and rec.role == "trainer"),
                key=lambda r: (-r.round, r.peer_id),
            )
            for rec in candidates:
                try:
                    got = self._download_from(rec.peer_id)
                except JoinRefused:
                    raise
                except RemoteError as e:
                    logger.warning("state download from %s refused: %s", rec.peer_id, e)
                    self.metrics.state_downloads.labels("failed").inc()
                    if e.remote_code == "auth":
                        refusals.add(rec.peer_id)
                    continue
                except Exception as e:
                    logger.warning("state download from %s failed: %s", rec.peer_id, e)
                    self.metrics.state_downloads.labels("failed").inc()
                    continue
                self.summary.joined_round = got.snapshot.round
                # announce at once, so members finishing this round wait for us at the rendezvous
                self.net.call(self._heartbeat(), timeout=30)
                self.event("joined", peer=rec.peer_id, round=got.snapshot.round, inner_step=got.inner_step, bytes=got.nbytes,
                           fingerprint=fingerprint(self.phi), peer_fingerprint=got.snapshot.fingerprint)
                return True
            if candidates and refusals >= {rec.peer_id for rec in candidates}:
                raise JoinRefused(
                    f"every peer of run {self.cfg.run_id!r} refused this node: it is a private swarm. "
                    "Ask its operator for the swarm key and pass it with --swarm-key FILE."
                )
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        self.event("join_alone", reason="no peer of this run answered within --join-timeout; continuing from "
                   + ("the checkpoint" if resumed else "scratch"))
        return False

    def _download_from(self, peer: str):
        """Download and adopt a peer's state; shows a progress bar on a terminal, else logs quarters."""
        logged = [-1]
        bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            bar = Progress("state from " + peer[-8:], BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True)
            task = bar.add_task("download", total=None)
            bar.start()

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(task, completed=done, total=total)
                return
            quarter = 4 * done // max(total, 1)
            if quarter > logged[0]:
                logged[0] = quarter
                logger.info("downloading state from %s: %d%% of %.1f MB", peer, 25 * quarter, total / 1e6)

        try:
            got = self.net.call(download_state(self.net.transport, peer, self.cfg.run_id, self._state_layout(), progress), timeout=120)
        finally:
            if bar is not None:
                bar.stop()
        snap = got.snapshot
        mismatch = settings_mismatch(self._settings(), snap.meta)
        if mismatch:
            raise JoinRefused(f"run {self.cfg.run_id!r} trains with {mismatch}; restart with the swarm's settings")
        self.phi = [t.clone() for t in snap.tensors["params"]]
        self.outer.load_state_tensors(snap.tensors["outer_momentum"])
        self.trainer.load_weights(self.phi)
        self.round = snap.round
        # take over the peer's progress into the round, so this node runs only the steps left
        self.round_target = self._round_steps()
        self.inner_step = min(got.inner_step, self.round_target - 1)
        self.metrics.state_downloads.labels("ok").inc()
        self.metrics.outer_round.set(self.round)
        return got

    def _maybe_resume(self) -> bool:
        if self.cfg.checkpoint_dir is None:
            return False
        found = newest_valid(Path(self.cfg.checkpoint_dir))
        if found is None:
            return False
        path, state = found
        if [tuple(t.shape) for t in state["phi"]] != [tuple(p.shape) for p in self.phi]:
            logger.warning("checkpoint %s is for another model; ignoring it", path)
            return False
        self.phi = [t.float().clone() for t in state["phi"]]
        self.trainer.load_weights(state["theta"])
        self.outer.load_state_tensors(state["outer_momentum"])
        self.trainer.optimizer.load_state_dict(state["inner_optimizer"])
        self.trainer.steps = int(state["inner_steps_total"])
        if "data_order" in state:
            self.batches.load_state_dict(state["data_order"])
        self.round = int(state["round"])
        self.event("resumed", checkpoint=str(path), round=self.round)
        return True

    # ---- training ----------------------------------------------------------------------------
    def _train(self) -> None:
        cfg = self.cfg
        self.train_started = time.monotonic()
        tokens_per_step = cfg.batch_size * self.trainer.model.cfg.context
        window_start, window_tokens = time.monotonic(), 0
        samples = 0
        self.round_target = max(self._round_steps(), self.inner_step + 1)
        self.metrics.round_inner_steps.set(self.round_target)
        while not self.stop.is_set() and not self._deadline_reached():
            x, y = self.batches.next()
            step_started = time.monotonic()
            loss = self.trainer.step(x, y)
            if cfg.slowdown > 1:
                time.sleep((cfg.slowdown - 1) * (time.monotonic() - step_started))
            rate = tokens_per_step / max(time.monotonic() - step_started, 1e-6)
            self.compute_tokens_per_s = rate if self.compute_tokens_per_s == 0 else 0.9 * self.compute_tokens_per_s + 0.1 * rate
            self.inner_step += 1
            samples += x.shape[0]
            self.summary.steps += 1
            if math.isnan(self.summary.train_loss_first):
                self.summary.train_loss_first = loss
            self.summary.train_loss_last = self.last_loss = loss
            self.metrics.train_loss.set(loss)
            self.metrics.inner_steps.inc()
            self.metrics.tokens.inc(tokens_per_step)
            window_tokens += tokens_per_step
            elapsed = time.monotonic() - window_start
            if elapsed >= 2.0:
                self.tokens_per_s = window_tokens / elapsed
                self.metrics.tokens_per_second.set(self.tokens_per_s)
                window_start, window_tokens = time.monotonic(), 0
            if self.pending is not None and cfg.overlap_mode != "delayed" and self.pending.future.done():
                self._finish_pending()
            if self.inner_step >= self.round_target:
                self._finish_pending()
                self._start_round(samples)
                samples = 0
                self.round_target = self._round_steps()
                self.metrics.round_inner_steps.set(self.round_target)
        self._finish_pending(final=True)

    def _start_round(self, samples: int) -> None:
        """Run the outer round of the fragment that is due: in the background with ``--overlap``,
        else right away (the training loop waits)."""
        fragment = fragment_of_round(self.round, self.cfg.fragments)
        indices = self.fragments[fragment]
        params = self.trainer.parameters()
        theta = [params[i].detach().to("cpu", torch.float32).clone() for i in indices]
        phi = [self.phi[i] for i in indices]  # stepped in place by the round
        coro = self.averager.run_round(
            self.round, phi, theta, samples, before_gather=self._heartbeat, indices=indices, feedback=self.feedback[fragment]
        )
        eager = None
        if self.cfg.overlap and self.cfg.overlap_mode == "eager" and fragment in self.eager_prev:
            eager = self._apply_eager(fragment, indices, phi, theta, samples)  # before the round touches φ and momentum
        self.pending = PendingRound(self.round, fragment, self.inner_step, self.net.submit(coro), eager)
        self.inner_step = 0
        if not self.cfg.overlap:
            self._finish_pending()

    def _apply_eager(self, fragment: int, indices: list[int], phi: list[torch.Tensor], theta: list[torch.Tensor],
                     samples: int) -> list[torch.Tensor]:
        """Eager update: step at once with Δ̃ = (n_i·Δ_i + Σ_{j≠i} n_j·Δ_j(previous round)) / Σ n, this node's
        fresh pseudo-gradient standing in with the others' last ones; the true average corrects it later."""
        others_sum, others_samples = self.eager_prev[fragment]
        total = samples + others_samples
        estimate = [(samples * (p.float() - t) + o) / total for p, t, o in zip(phi, theta, others_sum)]
        phi_estimate = self.outer.preview(phi, estimate, indices)  # type: ignore[union-attr]
        params = self.trainer.parameters()
        merge_fragment([params[i].data for i in indices], phi_estimate, 0.0)
        return phi_estimate

    def _finish_pending(self, final: bool = False) -> None:
        """Wait for the round in flight (counted as communication wait) and apply its result."""
        pending = self.pending
        if pending is None:
            return
        waited = time.monotonic()
        limit = None if not final else 2 * self.cfg.averaging_timeout + 30
        try:
            while True:
                try:
                    result: RoundResult = pending.future.result(timeout=0.2)
                    break
                except concurrent.futures.TimeoutError:
                    if (self.stop.is_set() and not final) or (limit is not None and time.monotonic() - waited > limit):
                        pending.future.cancel()
                        raise Interrupted() from None
        finally:
            wait = time.monotonic() - waited
            self.summary.comm_wait_s += wait
            self.metrics.comm_wait.inc(wait)
            self.pending = None
        self._apply_round(result, pending)

    def _apply_round(self, result: RoundResult, pending: PendingRound) -> None:
        m = self.metrics
        for kind in result.failures.values():
            m.errors.labels(kind).inc()
        m.round_duration.observe(result.duration_s)
        m.round_wait.set(result.gather_s)
        m.round_deadline.set(result.deadline_s)
        m.group_size.set(len(result.contributors))
        record = {"t": round(time.time(), 3), "round": result.round, "fragment": pending.fragment, "steps": pending.steps, "group": len(result.group),
                  "contributors": len(result.contributors), "failures": result.failures, "duration_s": round(result.duration_s, 3),
                  "gather_s": round(result.gather_s, 3), "deadline_s": round(result.deadline_s, 3), "in_sync": result.in_sync,
                  "fingerprint": "", "loss": self.last_loss, "tokens": self.summary.steps * self.cfg.batch_size * self.trainer.model.cfg.context,
                  "norms": {p[-8:]: round(n, 6) for p, n in result.norms.items()}, "update_norm": round(result.update_norm, 6)}
        if not result.in_sync:
            m.outer_rounds.labels("failed").inc()
            m.errors.labels("out_of_sync").inc()
            self.event("out_of_sync", round=result.round, majority_peer=result.sync_peer)
            self._resync(result.sync_peer, result.round)
            self.inner_step = 0
        else:
            m.outer_rounds.labels("alone" if len(result.contributors) == 1 else "completed").inc()
            self.round += 1
            self.summary.outer_rounds += 1
            indices = self.fragments[pending.fragment]
            params = self.trainer.parameters()
            if pending.eager is not None:
                # keep the steps taken since the estimate, moved by how far the estimate was off
                with torch.no_grad():
                    for i, guess in zip(indices, pending.eager):
                        params[i].data.add_((self.phi[i] - guess).to(params[i].device, params[i].dtype))
            else:
                merge_fragment([params[i].data for i in indices], [self.phi[i] for i in indices], self.cfg.fragment_alpha)
            if result.others_sum is not None:
                self.eager_prev[pending.fragment] = (result.others_sum, result.others_samples)
            if result.failures:
                self.event("round_partial", round=result.round, failures=result.failures)
        self._catch_up()
        record["fingerprint"] = fingerprint(self.phi)
        self.summary.rounds.append(record)
        m.outer_round.set(self.round)
        self._publish_snapshot()
        if self.cfg.checkpoint_dir is not None:
            self._save_checkpoint()
        if self.cfg.eval_every and self.summary.outer_rounds % self.cfg.eval_every == 0 and result.in_sync:
            record["val_loss"] = self.summary.val_loss = self.trainer.evaluate(self.val)
            self.metrics.val_loss.set(self.summary.val_loss)
        self._write_info()
        logger.info("round %d done: %d/%d peers averaged in %.2fs (waited %.2fs), loss %.3f",
                    result.round, len(result.contributors), len(result.group), result.duration_s, result.gather_s, self.last_loss)

    def _catch_up(self) -> None:
        """Rejoin the swarm's round after drifting away from it (see ``gossip.rendezvous.rejoin_target``):
        forward after finishing a round alone, back to the majority after racing ahead in a partition."""
        if self.stop.is_set():
            return
        try:
            peers = self.net.call(list_peers(self.net.dht, self.cfg.run_id), timeout=30)
        except Exception as e:
            logger.info("could not list peers after the round: %s", e)
            return
        others = [rec for p, rec in peers.items() if p != self.summary.peer_id and rec.role == "trainer"]
        target = rejoin_target(self.round, [rec.round for rec in others])
        if target is None:
            return
        direction = "forward" if target > self.round else "back_to_majority"
        if self.cfg.algorithm == "noloco":
            # NoLoCo replicas differ by design: keep the weights, meet the others in their round
            self.event("caught_up", peer="", round=target, direction=direction, from_round=self.round)
            self.round = target
            return
        source = max((rec for rec in others if rec.round == target), key=lambda r: r.peer_id)
        try:
            self._download_from(source.peer_id)
        except Exception as e:
            logger.warning("could not rejoin round %d through %s: %s", target, source.peer_id, e)
            return
        self.event("caught_up", peer=source.peer_id, round=self.round, direction=direction)

    def _resync(self, peer: str | None, failed_round: int) -> None:
        """Re-download the group's state after drifting (the peer publishes it right after its round)."""
        if peer is None:
            return
        for _ in range(20):
            try:
                got = self._download_from(peer)
                if got.snapshot.round > failed_round:
                    self.event("resynced", peer=peer, round=self.round)
                    return
            except Exception as e:
                logger.warning("resync from %s failed: %s", peer, e)
            time.sleep(0.5)

    def _settings(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"model": cfg.model, "algorithm": cfg.algorithm, "compression": cfg.codec, "fragments": cfg.fragments}

    def _publish_snapshot(self) -> None:
        snap = StateSnapshot(
            round=self.round,
            tensors={"params": [t.clone() for t in self.phi], "outer_momentum": self.outer.state_tensors(self.phi)},
            fingerprint=fingerprint(self.phi),
            meta={**self._settings(), "error_feedback_decay": self.cfg.feedback_decay()},
        )
        self.state_server.publish(snap)

    async def _heartbeat(self) -> None:
        net = self.net
        record = PeerRecord(
            peer_id=self.summary.peer_id, role=self.role, device=self.trainer.device.type, model=self.cfg.model,
            algorithm=self.cfg.algorithm, compression=self.cfg.codec, round=self.round, inner_step=self.inner_step,
            tokens_per_s=self.compute_tokens_per_s, loss=self.last_loss, maddrs=self.summary.multiaddrs,
            protocols=self.summary.protocols, version=__version__, started_at=time.time() - (time.monotonic() - self.started),
        )
        connected = [info.peer_id for info in await net.p2p.list_peers()]
        await reconnect_routing_table(net.dht, connected)
        await publish_peer(net.dht, net.validator, self.cfg.run_id, record, RECORD_TTL_S)
        peers = await list_peers(net.dht, self.cfg.run_id)
        self.peer_rates = {p: rec.tokens_per_s for p, rec in peers.items() if rec.role == "trainer"}
        self.metrics.peers.set(len(peers))

    def status_snapshot(self) -> dict[str, Any]:
        return {
            "peer_id": self.summary.peer_id, "run_id": self.cfg.run_id, "round": self.round, "inner_step": self.inner_step,
            "steps": self.summary.steps, "loss": self.last_loss, "tokens_per_s": self.tokens_per_s,
            "device": self.trainer.device.type, "model": self.cfg.model, "algorithm": self.cfg.algorithm,
            "compression": self.cfg.codec, "fragments": self.cfg.fragments, "round_steps": self.round_target,
            "protocols": self.summary.protocols, "version": __version__,
            "state": self.summary.state, "time": time.time(),
        }

    # ---- stopping ----------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        state = {
            "format": 1,
            "config": json.loads(self.cfg.model_dump_json()),
            "model_config": self.trainer.model.cfg.to_dict(),
            "round": self.round,
            "inner_steps_total": self.trainer.steps,
            "phi": [t.clone() for t in self.phi],
            "theta": [p.detach().cpu().clone() for p in self.trainer.parameters()],
            "outer_momentum": self.outer.state_tensors(self.phi),
            "inner_optimizer": self.trainer.optimizer.state_dict(),
            "data_order": self.batches.state_dict(),
        }
        path = save_atomic(state, Path(self.cfg.checkpoint_dir) / CHECKPOINT_NAME)
        self.summary.checkpoint = str(path)
        self.metrics.checkpoints.inc()

    def _finish(self) -> None:
        self.summary.state = "stopping"
        self.summary.wall_s = time.monotonic() - self.started
        self.summary.train_s = time.monotonic() - getattr(self, "train_started", time.monotonic())
        self.role = "leaving"
        try:
            self.net.call(self._heartbeat(), timeout=10)
        except Exception as e:
            logger.info("could not announce leaving: %s", e)
        self.summary.val_loss = self.trainer.evaluate(self.val)
        self.metrics.val_loss.set(self.summary.val_loss)
        if self.cfg.checkpoint_dir is not None:
            self._save_checkpoint()
        logger.info("final: %d steps, %d outer rounds, train loss %.3f → %.3f, val loss %.3f",
                    self.summary.steps, self.summary.outer_rounds, self.summary.train_loss_first,
                    self.summary.train_loss_last, self.summary.val_loss)


def run_daemon(cfg: NodeConfig) -> int:
    if cfg.stages > 1:
        from node.pipeline import run_pipeline_node

        return run_pipeline_node(cfg)
    daemon = Daemon(cfg)
    daemon.install_signal_handlers()
    return daemon.run()


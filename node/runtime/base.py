"""The life of every kind of node, written once: prepare, start networking, join, work, leave.

:class:`NodeBase` runs the lifecycle (:meth:`NodeBase.run`) and holds what every kind shares: config,
stop event, metrics, summary (``node.runtime.summary``), network thread, events, traffic accounting,
its presence on the network (``node.runtime.presence``: start-up, the heartbeat that publishes the
node's DHT record, live members, the join hint), the status answer, the per-step loss bookkeeping,
the checkpoint dictionary, the bookkeeping after an outer round and the way a node leaves. A kind of
node fills in hooks:

- ``_prepare()``: model, data and its own checkpoint, before any networking;
- ``_services(status)``: what it serves on the network, in the order they start (status among them);
- ``_join()``: join the run (may raise :class:`JoinRefused`); the heartbeat starts after it;
- ``_work()``: train or serve until stopped or out of time;
- ``_record_fields()``, ``_status_fields()``, ``_checkpoint_state()``: its own fields of the DHT
  record, the status answer and the checkpoint (``_data_order()``: its training data's position);
- optionally ``_wait_for_peers()``, ``_observe_peers()``, ``_record_runs()``, ``_wind_down()``,
  ``_final_evaluation()``.

The whole-model replica (``Daemon``, ``node.replica.node``), the zeroth-order replica (``ZONode``,
``node.zo.node``) and the pipeline node (``PipelineNode``, ``node.pipeline.node``) build on it; none
imports another (the CLI picks one in ``node.cli.app``).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

from node.checkpoints.checkpoint import CHECKPOINT_NAME, remove_partial, save_atomic
from node.config import NodeConfig
from node.errors import JoinRefused, NotStarted
from node.runtime.barrier import wait_for_peers
from node.runtime.metrics import NodeMetrics
from node.runtime.network import Interrupted, NetworkThread
from node.runtime.presence import NetworkPresence
from node.runtime.resume import ResumeRefused, check_resumable
from node.runtime.settings import run_settings
from node.runtime.status_service import StatusService
from node.runtime.summary import Summary, count_steps, count_traffic, write_info
from protocol.records import PEER_RECORD_TTL_S, PeerRecord
from protocol.version import package_version, protocol_version

logger = logging.getLogger("locomesh.node")
HEARTBEAT_S = 2.0
RECORD_TTL_S = PEER_RECORD_TTL_S


class NodeBase(NetworkPresence):
    """One node of a run. ``run()`` blocks until the node stops and returns its exit code."""

    CODEC_LABEL: str | None = None  # the compression label of ``locomesh_node_info`` (None: --compression)
    INTERRUPTED: str | None = None  # logged when the stop event cuts the work short (None: nothing)
    FINAL_LOG = "final: %d steps, %d outer rounds, train loss %.3f → %.3f, val loss %.3f"
    LEAVE_TIMEOUT_S = 10.0  # how long the last heartbeat (role "leaving") may take
    round: int  # the outer round the node is in (the kinds keep it)

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.metrics = NodeMetrics()
        self.summary = Summary(metrics_port=cfg.metrics_port, seed=cfg.seed)
        self.net = NetworkThread()
        self.bytes_lock = threading.Lock()
        self._traffic_marks: dict[str, tuple[int, int]] = {}
        self.started = time.monotonic()
        self.train_started: float | None = None  # when the training loop began (the summary's train_s)
        self.last_loss = math.nan
        self.role = "trainer"  # announced in the DHT; "leaving" once the node stops
        self.heartbeats = 0
        self.device: Any = None
        self.folder_lock: Any = None  # the checkpoint folder's lock (node.checkpoints.folder_lock), named with our peer id once known
        self.last_checkpoint: float | None = None  # time.monotonic() of the last checkpoint written

    # ---- the lifecycle -----------------------------------------------------------------------
    def run(self) -> int:
        """Prepare, start networking, join, work until stopped, leave. Exit codes: 0 stopped cleanly,
        2 could not start (checkpoint of another run, networking, --min-peers not met, the run's peers stopped),
        3 refused by the run (settings, swarm key, protocol version)."""
        try:
            self._prepare()
        except ResumeRefused as e:
            logger.error("%s", e)
            return 2
        self.started = time.monotonic()
        if not self._start_network():
            return 2
        try:
            return self._run_joined()
        finally:
            self.net.shutdown()
            self.summary.state = "stopped"
            self._write_info()
            logger.info("stopped cleanly")

    def _run_joined(self) -> int:
        cfg, net = self.cfg, self.net
        assert net.transport is not None and net.dht is not None and net.p2p is not None
        peer_id = self.summary.peer_id = net.transport.peer_id
        self.summary.multiaddrs = self._own_multiaddrs()
        self.metrics.info.labels(peer_id, cfg.run_id, self.device.type, cfg.model, self.algorithm, self.CODEC_LABEL or cfg.codec,
                                 package_version()).set(1)
        for service in self._services(StatusService(net.transport, self.status_snapshot)):
            net.call(service.start())
        self.summary.protocols = list(net.transport.protocols)
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port)
        waiting = cfg.min_peers > 1  # --min-peers: hold the first step until the run is that big (node.runtime.barrier)
        try:
            self._join()
            net.every(HEARTBEAT_S, self._heartbeat, "heartbeat")
            self.summary.state = "waiting" if waiting else "training"
            self._write_info()
            self._print_join_hint()
            if waiting:
                self._wait_for_peers()
        except JoinRefused as e:
            logger.error("%s", e)
            self.event("join_refused", reason=str(e))
            return 3
        except NotStarted as e:
            logger.error("%s", e)
            self.event("not_started", reason=str(e))
            self._announce_leaving()  # peers waiting with it learn at once that it is gone
            return 2
        except Interrupted:
            self._finish()
            return 0
        if waiting:
            self.summary.state = "training"
            self._write_info()
        try:
            self._work()
        except Interrupted:
            if self.INTERRUPTED:
                logger.info(self.INTERRUPTED)
        self._finish()
        return 0

    def _finish(self) -> None:
        """Leave: announce it (role "leaving"), evaluate, checkpoint, log the final line."""
        self.summary.state = "stopping"
        self.summary.wall_s = time.monotonic() - self.started
        if self.train_started is not None:
            self.summary.train_s = time.monotonic() - self.train_started
        self._wind_down()
        self._announce_leaving()
        self._final_evaluation()
        s = self.summary
        logger.info(self.FINAL_LOG, s.steps, s.outer_rounds, s.train_loss_first, s.train_loss_last, s.val_loss)

    def _announce_leaving(self) -> None:
        self.role = "leaving"
        try:
            self.net.call(self._heartbeat(whole=True), timeout=self.LEAVE_TIMEOUT_S)
        except Exception as e:
            logger.info("could not announce leaving: %s", e)

    # ---- what a kind of node fills in ----------------------------------------------------------
    @property
    def algorithm(self) -> str:
        """The algorithm this node announces (DHT record, status, ``locomesh_node_info``)."""
        return self.cfg.algorithm

    def _prepare(self) -> None:
        """Model, data and this node's own checkpoint, before any networking (may raise ResumeRefused)."""
        raise NotImplementedError

    def _services(self, status: StatusService) -> list[Any]:
        """Build what this node serves on the network; the services to start, in order (``status`` among them)."""
        raise NotImplementedError

    def _join(self) -> None:
        """Join the run (or start it): take the swarm's state, or a role in it."""
        raise NotImplementedError

    def _work(self) -> None:
        """Train or serve until the stop event, --max-steps or --duration."""
        raise NotImplementedError

    def _record_fields(self) -> dict[str, Any]:
        """This kind's fields of the node's DHT record (progress, speed, ...)."""
        raise NotImplementedError

    def _status_fields(self) -> dict[str, Any]:
        """This kind's fields of the status answer."""
        raise NotImplementedError

    def _checkpoint_state(self) -> dict[str, Any]:
        """This kind's entries of the checkpoint (weights, optimizer state, step count)."""
        raise NotImplementedError

    def _data_order(self) -> dict[str, Any] | None:
        """The position of this node's training data (None: it draws none)."""
        return self.batches.state_dict()

    def _join_hint(self) -> tuple[str, str]:
        """What the join hint says this node is up as, and the flags a joiner needs besides the run id."""
        return "", ""

    def _wait_for_peers(self) -> None:
        """Hold the first step until --min-peers peers are in the run (raises NotStarted, Interrupted)."""
        have = wait_for_peers(self.net, self.cfg.run_id, self.summary.peer_id, self.cfg.min_peers, self.cfg.join_timeout, self.stop,
                              answering=self.reachable_members().check)
        self.event("peers_ready", peers=have, wanted=self.cfg.min_peers)

    def _observe_peers(self, peers: dict[str, PeerRecord]) -> None:
        """Take the run's records, read every PEER_READ_EVERY heartbeats."""

    def _record_runs(self) -> list[str]:
        """The runs (and sub-runs) under which the heartbeat publishes this node's record."""
        return [self.cfg.run_id]

    def _wind_down(self) -> None:
        """What a node does on stopping, before it announces that it leaves."""

    def _final_evaluation(self) -> None:
        """The held-out loss of the final weights, and the last checkpoint."""
        self._record_val_loss(self.trainer.evaluate(self.val))
        if self.cfg.checkpoint_dir is not None:
            self._save_checkpoint()

    def _current_loss(self) -> float:
        return self.last_loss

    # ---- status ----------------------------------------------------------------------------------
    def status_snapshot(self) -> dict[str, Any]:
        """What this node answers on ``/locomesh/status/1.0`` (``node status``)."""
        s = self.summary
        return {
            "peer_id": s.peer_id, "run_id": self.cfg.run_id, "round": self.round, "steps": s.steps, "loss": self._current_loss(),
            "device": self.device.type, "model": self.cfg.model, "protocols": s.protocols, "version": package_version(),
            "protocol": protocol_version(),
            "reachability": s.reachability, "state": s.state, "time": time.time(), **self._status_fields(),
        }

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _count_steps(self, steps: int, tokens: int = 0, loss: float | None = None) -> None:
        """Account training steps and the last one's loss (None: none computed here)."""
        count_steps(self.summary, self.metrics, steps, tokens, loss)
        if loss is not None:
            self.last_loss = loss

    def _round_done(self, record: dict[str, Any], in_sync: bool) -> None:
        """After an outer round: checkpoint when due, evaluate every --eval-every rounds (a round in sync only),
        keep the round's record (with the held-out loss when evaluated)."""
        cfg = self.cfg
        if cfg.checkpoint_dir is not None and self._checkpoint_due():
            self._save_checkpoint()
        if cfg.eval_every and in_sync and self.summary.outer_rounds % cfg.eval_every == 0:
            started = time.monotonic()
            self._record_val_loss(self.trainer.evaluate(self.val))
            self.summary.eval_s += time.monotonic() - started
            record["val_loss"] = self.summary.val_loss
        self.summary.rounds.append(record)

    # ---- checkpoints -----------------------------------------------------------------------------
    def _own_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """This node's checkpoint in --checkpoint-dir, if any; raises ResumeRefused when it was written
        with other settings (before any networking, so another run's checkpoint is refused at once)."""
        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return None
        remove_partial(Path(cfg.checkpoint_dir))  # the folder is this node's (locked): a killed write's leftovers go
        return check_resumable(cfg.checkpoint_dir, run_settings(cfg), cfg.fresh)

    def _resumed(self, path: Path, state: dict[str, Any]) -> None:
        """What resuming a checkpoint means for every kind: its round and data order, noted in the summary."""
        if "data_order" in state:
            self.batches.load_state_dict(state["data_order"])
        self.round = int(state["round"])
        self.summary.resumed_from = {"checkpoint": str(path), "round": self.round}
        self.event("resumed", checkpoint=str(path), round=self.round)

    def _checkpoint_due(self) -> bool:
        """Whether a round's end writes the checkpoint: after the first round, then once --checkpoint-every
        seconds have passed (every round writes the whole state: ~3 GB for a 150 M-parameter model with AdamW,
        seconds of standing still each round)."""
        every = self.cfg.checkpoint_every
        return every == 0 or self.last_checkpoint is None or time.monotonic() - self.last_checkpoint >= every

    def _save_checkpoint(self) -> None:
        """Write the checkpoint atomically: settings, model config, round, the kind's state, data order."""
        started = time.monotonic()
        state = {"format": 1, "config": json.loads(self.cfg.model_dump_json()), "settings": run_settings(self.cfg),
                 "model_config": self.model_cfg.to_dict(), "round": self.round, **self._checkpoint_state()}
        data_order = self._data_order()
        if data_order is not None:
            state["data_order"] = data_order
        if self.workload.tokenizer_json is not None:
            state["tokenizer"] = self.workload.tokenizer_json  # node eval and node export need nothing else
        self.summary.checkpoint = str(save_atomic(state, Path(self.cfg.checkpoint_dir) / CHECKPOINT_NAME))
        self.metrics.checkpoints.inc()
        self.last_checkpoint = time.monotonic()
        self.summary.checkpoint_s += self.last_checkpoint - started

    # ---- shared plumbing -------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        self.summary.events.append({"t": time.time(), "event": kind, **fields})
        logger.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))

    def _on_bytes(self, protocol: str, direction: str, nbytes: int, path: str = "direct") -> None:
        with self.bytes_lock:
            count_traffic(self.metrics, self.summary, protocol, direction, nbytes, path)

    def traffic_since_last(self, kind: str) -> tuple[int, int]:
        """(bytes sent, bytes received) on protocol ``kind`` since the previous call for that kind."""
        with self.bytes_lock:
            now = (self.summary.bytes_sent_by_kind.get(kind, 0), self.summary.bytes_received_by_kind.get(kind, 0))
        before = self._traffic_marks.get(kind, (0, 0))
        self._traffic_marks[kind] = now
        return now[0] - before[0], now[1] - before[1]

    def _on_error(self, protocol: str, code: str, peer: str) -> None:
        self.metrics.errors.labels(code).inc()

    def _write_info(self) -> None:
        write_info(self.cfg.info_file, self.summary)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT set the stop event: the node finishes its step, evaluates, checkpoints and leaves."""

        def handler(signum: int, _frame: Any) -> None:
            if not self.stop.is_set():
                logger.info("received %s: stopping at the next step boundary", signal.Signals(signum).name)
                self.stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _deadline_reached(self) -> bool:
        cfg = self.cfg
        if cfg.max_steps is not None and self.summary.steps >= cfg.max_steps:
            return True
        return cfg.duration is not None and time.monotonic() - self.started >= cfg.duration

    def _prepare_local(self, describe: bool = True) -> None:
        """What every node needs before networking: threads, seeds, ``self.device`` and its workload
        (``self.workload``, ``self.model_cfg``, held-out batches ``self.val``); ``describe`` logs the model."""
        import random

        import torch

        from compression.memory import tune_allocator
        from node.runtime.local_training import pick_device
        from node.runtime.workload import load_workload
        from swarm.models.presets import num_params

        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        tune_allocator()
        random.seed(cfg.seed)
        self.device = pick_device(cfg.device)
        self.workload = load_workload(cfg)  # the vocabulary of token shards sizes the embeddings and head
        self.model_cfg = self.workload.model_cfg
        self.val = self.workload.val
        if describe:
            logger.info("training %s (%s parameters) on %s", type(self.model_cfg).__name__.replace("Config", ""),
                        f"{num_params(self.model_cfg):,}", self.workload.source)

    def _record_val_loss(self, loss: float) -> None:
        """The held-out loss (nats per token, or per byte for byte-level data) and its bits per byte."""
        self.summary.val_loss = loss
        self.summary.val_bits_per_byte = self.workload.bits_per_byte(loss)
        self.metrics.val_loss.set(loss)

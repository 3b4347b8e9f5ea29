"""The daemon of a pipeline swarm (``node join --stages S``): a stage server or a trainer.

- A **stage server** holds one stage of the model (``swarm.stages``), serves forward/backward passes
  on ``/locomesh/stage/1.0`` from a bounded queue, takes one optimizer step per backward request,
  and every ``--inner-steps`` steps averages its stage with the other replicas of that stage
  (DiLoCo over the stage's own sub-run ``<run>.s<i>``, while it keeps serving). It announces (stage,
  throughput, queue length, gradient norm) in the run's DHT records. Every ``--rebalance-period`` it
  checks whether moving to the bottleneck stage would speed the pipeline up (``swarm.rebalance``)
  and moves, downloading that stage's weights from one of its replicas.
- A **trainer** holds the data and pushes microbatches through randomized pipelines
  (``swarm.router``, ``swarm.microbatch``), retrying failed calls on other replicas.

- A **spare** serves nothing until a stage has had no server for ``--recovery-grace`` seconds; then it
  rebuilds that stage from its neighbours (CheckFree: gradient-norm-weighted average of stages i−1
  and i+1; CheckFree+: a lost first/last stage copied from its neighbour's replica) and serves it
  with a fresh optimizer (learning rate × ``--recovery-lr-scale``). Without a spare, the slowest
  server of a stage with two or more replicas does it.

``--role auto`` picks what the swarm needs: a stage nobody serves, else a trainer when trainers are
fewer than the thinnest stage's replicas, else the stage with the least total throughput.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any

import torch

from gossip.diloco import DiLoCoAverager, RoundResult
from gossip.exchange import RoundExchange
from gossip.fingerprint import fingerprint
from gossip.outer import NesterovOuter
from gossip.partition import part_shapes
from gossip.rendezvous import list_peers, list_peers_with_expiry, publish_peer, reconnect_routing_table
from gossip.state_transfer import StateServer, StateSnapshot, download_state
from node import __version__
from node.runtime.base import HEARTBEAT_S, RECORD_TTL_S, NodeBase
from node.config import NodeConfig
from node.runtime.network import Interrupted
from node.pipeline.trainer import PipelineTrainer
from node.pipeline.recovery import StageRecoverer
from node.runtime.status_service import StatusService
from node.runtime.local_training import pick_device
from protocol.records import PeerRecord
from swarm.claims import claim_stage
from node.runtime.workload import load_workload
from swarm.stage_map import choose_role, refreshed_records
from swarm.rebalance import plan_move
from swarm.service import StageService
from swarm.stages import Stage, model_seed
from swarm.checkfree import recoverable
from swarm.stage_worker import StageWorker

logger = logging.getLogger("locomesh.pipeline")


def stage_run(run_id: str, stage: int) -> str:
    """The sub-run in which the replicas of one stage average and share state."""
    return f"{run_id}.s{stage}"


class PipelineNode(NodeBase):
    """One pipeline volunteer. ``run()`` blocks until it stops and returns the exit code."""

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.stage: int | None = None
        self.worker: StageWorker | None = None
        self.round = 0
        self.throughput = 0.0
        self.role = "starting"
        self.peers: dict[str, PeerRecord] = {}
        self.stage_since = 0.0
        self._info_written = 0.0  # when --info-file was last rewritten (monotonic)
        self.trainer: PipelineTrainer | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        self.device = pick_device(cfg.device)
        self.workload = load_workload(cfg)  # the vocabulary of token shards sizes the embeddings and head
        self.model_cfg = self.workload.model_cfg
        self.started = time.monotonic()
        if not self._start_network():
            return 2
        try:
            return self._run_joined()
        except Interrupted:
            self._finish()
            return 0
        finally:
            self.net.shutdown()
            self.summary.state = "stopped"
            self._write_info()
            logger.info("stopped cleanly")

    def _run_joined(self) -> int:
        cfg, net = self.cfg, self.net
        assert net.transport is not None and net.p2p is not None
        peer_id = self.summary.peer_id = net.transport.peer_id
        self.summary.multiaddrs = self._own_multiaddrs()
        self.metrics.info.labels(peer_id, cfg.run_id, self.device.type, cfg.model, f"pipeline:{cfg.algorithm}", cfg.codec, __version__).set(1)
        self.status = StatusService(net.transport, self.status_snapshot)
        net.call(self.status.start())
        self.service = StageService(net.transport, cfg.run_id, lambda: self.worker, cfg.activation_compression, queue_limit=cfg.stage_queue)
        net.call(self.service.start())
        self.state_server = StateServer(net.transport, stage_run(cfg.run_id, 0), progress=lambda: 0)
        net.call(self.state_server.start())
        self.outer = NesterovOuter(*cfg.outer_hyper)
        self.exchange = RoundExchange(net.transport, stage_run(cfg.run_id, 0), cfg.codec, [(1,)], serve_timeout=cfg.averaging_timeout * 2)
        net.call(self.exchange.start())
        self.averager = DiLoCoAverager(net.dht, net.validator, self.exchange, stage_run(cfg.run_id, 0), peer_id, self.outer,
                                       gather_timeout=cfg.averaging_timeout, fetch_timeout=cfg.averaging_timeout,
                                       aggregation=cfg.aggregation, member_role="stage")
        self.summary.protocols = list(net.transport.protocols)
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port)
        self.recoverer = StageRecoverer(
            stages=cfg.stages, model_cfg=self.model_cfg, seed=model_seed(cfg.run_id), plus=cfg.checkfree_plus, grace=cfg.recovery_grace, fetch_stage=self._fetch_stage,
            new_stage=self._new_stage, become=self._serve_rebuilt,
            claim=lambda stage: net.call(claim_stage(net.dht, net.validator, cfg.run_id, stage, peer_id), timeout=30),
            refresh=lambda: net.call(list_peers(net.dht, cfg.run_id), timeout=30), metrics=self.metrics, event=self.event,
        )
        target = None if cfg.role == "spare" else self._pick_role()
        if cfg.role == "spare":
            self.role = self.summary.role = "spare"
        elif target is None:
            self.role = self.summary.role = "trainer"
        else:
            self._become_stage(target)
        net.call(self._heartbeat(), timeout=30)
        net.every(HEARTBEAT_S, self._heartbeat, "heartbeat")
        self.summary.state = "training"
        self._write_info()
        what = self.role if self.stage is None else f"stage {self.stage} of {cfg.stages}"
        self._print_join_hint(f" as {what}", f" --stages {cfg.stages}")
        if self.role == "spare":
            self._wait_as_spare()
        if self.stage is None and self.role == "trainer":
            self.trainer = PipelineTrainer(cfg=cfg, workload=self.workload, net=net, metrics=self.metrics, summary=self.summary, event=self.event, stop=self.stop,
                                           done=self._deadline_reached, announce=self._heartbeat, write_info=self._write_info)
            self.trainer.run()
        elif self.stage is not None:
            self._serve()
        self._finish()
        return 0

    def _pick_role(self) -> int | None:
        cfg = self.cfg
        if cfg.role == "trainer":
            return None
        if cfg.role == "stage" and cfg.stage is not None:
            return cfg.stage
        records: list[PeerRecord] = []
        if cfg.initial_peers:
            first: dict[str, tuple[PeerRecord, float]] = {}
            for _ in range(3):  # let the DHT fill in
                first = self.net.call(list_peers_with_expiry(self.net.dht, cfg.run_id), timeout=30)
                if first:
                    break
                time.sleep(1.0)
            if first:  # only peers that announce themselves again count: a killed server's record lingers
                time.sleep(HEARTBEAT_S * 2)
                second = self.net.call(list_peers_with_expiry(self.net.dht, cfg.run_id), timeout=30)
                records = refreshed_records(first, second)
                if len(records) < len(second):
                    logger.info("role choice: %d of %d peer records were not refreshed (peers gone) and are ignored",
                                len(second) - len(records), len(second))
        choice = choose_role(records, cfg.stages)
        if cfg.role == "stage" and choice is None:
            totals = [sum(r.tokens_per_s for r in records if r.role == "stage" and r.stage == s) for s in range(cfg.stages)]
            choice = min(range(cfg.stages), key=lambda s: (totals[s], s))
        self.event("role_chosen", stage=choice if choice is not None else "trainer", peers=len(records))
        return choice

    # ---- stage server ----------------------------------------------------------------------------
    def _stage_layout(self, stage: Stage) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
        shapes = [(tuple(p.shape), torch.float32) for p in stage.parameters()]
        return {"params": shapes, "outer_momentum": shapes}

    def _become_stage(self, index: int, rebuilt: Stage | None = None, lr_scale: float = 1.0) -> None:
        """Serve stage ``index``: ``rebuilt`` weights (a recovery), else a live replica's, else the run's init."""
        cfg, net = self.cfg, self.net
        previous, self.worker = self.stage, None
        module = rebuilt if rebuilt is not None else self._new_stage(index)
        sub = stage_run(cfg.run_id, index)
        self.outer = NesterovOuter(*cfg.outer_hyper)
        self.round = 0
        source = None
        if rebuilt is None and (cfg.initial_peers or previous is not None):
            source = self._download_stage(module, sub, net.call(list_peers(net.dht, sub), timeout=30))
            if source is None and self._run_has_trained():
                self._rebuild_unserved(index)
                return
        self.phi = [p.detach().to("cpu", torch.float32).clone() for p in module.parameters()]
        self.round = max(self.round, int(time.time() // cfg.sync_every))  # first averaging at the next boundary
        self.state_server.run_id = sub
        self.exchange.run_id, self.exchange.layout = sub, RoundExchange(net.transport, sub, cfg.codec, part_shapes([p.shape for p in self.phi])).layout
        self.averager.run_id, self.averager.outer = sub, self.outer
        self.stage = index
        self.service.reset_throughput()
        self.worker = StageWorker(module, self.device, cfg.lr * lr_scale, cfg.weight_decay, cfg.warmup_steps, slowdown=cfg.slowdown)
        self.role = self.summary.role = "stage"
        self.summary.stage = index
        self.stage_since = time.time()
        self.metrics.stage.set(index)
        self._publish_stage_state()
        if rebuilt is None:
            self.event("stage_joined" if previous is None else "stage_moved", stage=index, previous=previous, source=source, round=self.round)

    def _run_has_trained(self) -> bool:
        """Whether any other peer of the run has trained or served steps (so every stage has weights
        worth more than the run's initialisation)."""
        records = self.net.call(list_peers(self.net.dht, self.cfg.run_id), timeout=30)
        return any(r.inner_step > 0 for p, r in records.items() if p != self.summary.peer_id)

    def _rebuild_unserved(self, index: int) -> None:
        """Take over stage ``index``, which has no live replica although the run has trained: rebuild it
        from its neighbours like a lost stage (never the run's fresh initialisation); when its sources
        do not answer, wait as a spare, whose checks try again."""
        plan = recoverable([index], self.cfg.stages, self.cfg.checkfree_plus)[index]
        logger.warning("stage %d has no live replica but the run has trained: rebuilding it (%s) instead of "
                       "starting it from the run's initialisation", index, plan)
        if not self.recoverer.recover(index, plan, 0.0):
            self.stage, self.role = None, "spare"
            self.summary.role, self.summary.stage = "spare", None

    def _serve_rebuilt(self, index: int, module: Stage) -> None:
        """Serve a stage the recoverer rebuilt, and announce it at once (so nobody else rebuilds it)."""
        self._become_stage(index, rebuilt=module, lr_scale=self.cfg.recovery_lr_scale)
        self.net.call(self._heartbeat(), timeout=30)

    def _new_stage(self, index: int) -> Stage:
        return Stage(self.model_cfg, index, self.cfg.stages, model_seed(self.cfg.run_id), plus=self.cfg.checkfree_plus)

    def _download_stage(self, module: Stage, sub: str, peers: dict[str, PeerRecord], adopt: bool = True,
                        serving: StageWorker | None = None) -> str | None:
        """Load a live replica's weights (and, with ``adopt``, outer momentum and round) into ``module``;
        returns its peer id. ``serving``: the worker computing on ``module`` meanwhile, whose lock the
        copy takes (a request's backward pass must not see its weights change under it)."""
        net = self.net
        for rec in sorted(peers.values(), key=lambda r: (-r.round, r.peer_id)):
            if rec.peer_id == self.summary.peer_id or rec.role != "stage":
                continue
            try:
                got = net.call(download_state(net.transport, rec.peer_id, sub, self._stage_layout(module)), timeout=120)
            except Exception as e:
                logger.warning("could not download %s from %s: %s", sub, rec.peer_id, e)
                continue
            if serving is not None:
                serving.load_weights(got.snapshot.tensors["params"])
            else:
                with torch.no_grad():
                    for p, t in zip(module.parameters(), got.snapshot.tensors["params"]):
                        p.copy_(t)
            if adopt:
                self.outer.load_state_tensors(got.snapshot.tensors["outer_momentum"])
                self.round = got.snapshot.round
            self.metrics.state_downloads.labels("ok").inc()
            return rec.peer_id
        return None

    def _publish_stage_state(self) -> None:
        self.state_server.publish(StateSnapshot(
            round=self.round,
            tensors={"params": [t.clone() for t in self.phi], "outer_momentum": self.outer.state_tensors(self.phi)},
            fingerprint=fingerprint(self.phi),
            meta={"model": self.cfg.model, "stage": self.stage, "stages": self.cfg.stages},
        ))

    def _serve(self) -> None:
        cfg = self.cfg
        pending = None
        next_rebalance = time.monotonic() + cfg.rebalance_period
        last_steps = 0
        while not self.stop.is_set() and not self._deadline_reached():
            time.sleep(0.1)
            self._refresh_info()
            worker = self.worker
            if worker is None:
                if self.role == "spare":  # a move into an unserved stage whose sources did not answer
                    self._wait_as_spare()
                continue
            new_steps = worker.steps - last_steps
            if new_steps:
                last_steps = worker.steps
                self.summary.steps += new_steps
                self.metrics.inner_steps.inc(new_steps)
                if worker.stage.last and not math.isnan(worker.last_loss):
                    self.last_loss = worker.last_loss
                    if math.isnan(self.summary.train_loss_first):
                        self.summary.train_loss_first = worker.last_loss
                    self.summary.train_loss_last = worker.last_loss
                    self.metrics.train_loss.set(worker.last_loss)
            self.throughput = self.service.throughput
            self.summary.microbatches_served, self.summary.refused_busy = self.service.microbatches, self.service.refused_busy
            self.metrics.tokens_per_second.set(self.throughput * self.model_cfg.context)
            self.metrics.stage_queue.set(self.service.queue_length)
            if pending is not None and pending[0].done():
                self._apply_round(pending[0].result(), pending[1])
                pending = None
            epoch = int(time.time() // cfg.sync_every)
            if pending is None and epoch > self.round:
                # replicas of a stage average on a shared wall-clock schedule, so they meet at the
                # rendezvous however unevenly the router spread the microbatches among them
                self.round = epoch
                theta = worker.snapshot()
                samples = max(1, worker.samples)
                worker.samples = 0
                pending = (self.net.submit(self.averager.run_round(epoch, self.phi, theta, samples)), worker)
            if pending is None and self.recoverer.check(self.summary.peer_id, self.role, self.stage):
                last_steps = self.worker.steps if self.worker else 0
                continue
            if pending is None and cfg.rebalance_period and time.monotonic() >= next_rebalance:
                next_rebalance = time.monotonic() + cfg.rebalance_period
                self._maybe_rebalance()
                last_steps = self.worker.steps if self.worker else 0
        if pending is not None:
            try:
                self._apply_round(pending[0].result(timeout=2 * cfg.averaging_timeout + 10), pending[1])
            except Exception as e:
                logger.info("last stage round did not finish: %s", e)

    def _apply_round(self, result: RoundResult, worker: StageWorker) -> None:
        m = self.metrics
        m.round_duration.observe(result.duration_s)
        m.group_size.set(len(result.contributors))
        for kind in result.failures.values():
            m.errors.labels(kind).inc()
        record = {"round": result.round, "stage": self.stage, "contributors": len(result.contributors), "in_sync": result.in_sync,
                  "duration_s": round(result.duration_s, 3), "loss": self.last_loss}
        if result.in_sync and worker is self.worker:
            self.summary.outer_rounds += 1
            m.outer_rounds.labels("alone" if len(result.contributors) == 1 else "completed").inc()
            worker.load_weights(self.phi)
            self._publish_stage_state()
        elif worker is self.worker and self.stage is not None:
            m.outer_rounds.labels("failed").inc()
            self.event("out_of_sync", stage=self.stage, round=result.round, majority_peer=result.sync_peer)
            peers = self.net.call(list_peers(self.net.dht, stage_run(self.cfg.run_id, self.stage)), timeout=30)
            preferred = {p: r for p, r in peers.items() if p == result.sync_peer} or peers
            if self._download_stage(worker.stage, stage_run(self.cfg.run_id, self.stage), preferred, serving=worker):
                self.phi = worker.snapshot()
                self.round = max(self.round, result.round)
                self._publish_stage_state()
        record["fingerprint"] = fingerprint(self.phi)
        self.summary.rounds.append(record)
        m.outer_round.set(self.round)
        self._write_info()

    def _stage_map(self, records: dict[str, PeerRecord]) -> list[dict[str, float]]:
        stages: list[dict[str, float]] = [{} for _ in range(self.cfg.stages)]
        for rec in records.values():
            if rec.role == "stage" and 0 <= rec.stage < self.cfg.stages:
                stages[rec.stage][rec.peer_id] = rec.tokens_per_s
        return stages

    def _maybe_rebalance(self) -> None:
        # plan on the DHT records alone (this node's own included), so every server computes the same
        # plan and exactly one of them moves
        records = self.net.call(list_peers(self.net.dht, self.cfg.run_id), timeout=30)
        settling = [r for r in records.values() if r.role == "stage" and time.time() - r.stage_since < self.cfg.rebalance_period]
        if settling:
            return  # a server joined or moved within the last period: let its throughput settle first
        stages = self._stage_map(records)
        target = plan_move(stages, self.summary.peer_id, self.cfg.rebalance_margin)
        if target is None:
            return
        before = [round(sum(s.values())) for s in stages]
        self.metrics.stage_moves.inc()
        self.event("rebalance", from_stage=self.stage, to_stage=target, stage_throughput=before)
        self._become_stage(target)  # its throughput is measured again on the new stage before anyone plans on it
        self.net.call(self._heartbeat(), timeout=30)  # announce the move (and the unmeasured throughput) at once

    # ---- lost stages ---------------------------------------------------------------------------------
    def _wait_as_spare(self) -> None:
        """A spare checks the stage map every half second and takes over the first lost stage it should;
        its info file follows every heartbeat, so ``node status`` and tests see its recovery events."""
        while not self.stop.is_set() and not self._deadline_reached() and self.stage is None:
            time.sleep(0.5)
            self.recoverer.check(self.summary.peer_id, self.role, self.stage)
            self._refresh_info()

    def _refresh_info(self) -> None:
        """Rewrite --info-file once per heartbeat, so it stays as fresh as the DHT record."""
        if time.monotonic() - self._info_written >= HEARTBEAT_S:
            self._write_info()
            self._info_written = time.monotonic()

    def _fetch_stage(self, index: int) -> tuple[Stage, PeerRecord | None]:
        """A neighbour stage's current weights, downloaded from one of its replicas."""
        module = self._new_stage(index)
        sub = stage_run(self.cfg.run_id, index)
        peers = self.net.call(list_peers(self.net.dht, sub), timeout=30)
        source = self._download_stage(module, sub, peers, adopt=False)
        if source is None:
            raise RuntimeError(f"no replica of stage {index} answered")
        return module, peers.get(source)

    # ---- announcements -----------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        await self._refresh_addresses()
        net, cfg = self.net, self.cfg
        worker = self.worker
        record = PeerRecord(
            peer_id=self.summary.peer_id, role=self.role if self.role != "starting" else "trainer", device=self.device.type,
            model=cfg.model, algorithm=f"pipeline:{cfg.algorithm}", compression=cfg.codec, round=self.round,
            inner_step=worker.steps if worker else self.summary.steps,
            tokens_per_s=self.throughput * self.model_cfg.context if self.stage is not None else self._trainer_throughput(),
            loss=self._current_loss(), maddrs=self.summary.multiaddrs, protocols=self.summary.protocols, version=__version__, reachability=self.summary.reachability,
            started_at=time.time() - (time.monotonic() - self.started), stage=self.stage if self.stage is not None else -1,
            queue=self.service.queue_length, grad_norm=worker.last_grad_norm if worker else 0.0,
            stage_since=self.stage_since,
        )
        connected = [info.peer_id for info in await net.p2p.list_peers()]
        await reconnect_routing_table(net.dht, connected)
        await publish_peer(net.dht, net.validator, cfg.run_id, record, RECORD_TTL_S)
        if self.stage is not None and self.role == "stage":
            await publish_peer(net.dht, net.validator, stage_run(cfg.run_id, self.stage), record, RECORD_TTL_S)
        peers = await list_peers(net.dht, cfg.run_id)
        self.peers = peers
        self.metrics.peers.set(len(peers))
        self.recoverer.observe(peers)
        if self.stage is None and self.trainer is not None:
            for s, members in enumerate(self._stage_map(peers)):
                for gone in sorted(set(self.trainer.router.peers(s)) - set(members)):
                    self.event("stage_peer_gone", stage=s, peer=gone)  # left the DHT: no longer routed to
                self.trainer.router.update(s, members)
            self.summary.route_throughput = {p: round(tp, 2) for p, tp in self.trainer.router.throughput.items()}

    def _trainer_throughput(self) -> float:
        return self.trainer.throughput if self.trainer is not None else 0.0

    def _current_loss(self) -> float:
        return self.trainer.last_loss if self.trainer is not None else self.last_loss

    def status_snapshot(self) -> dict[str, Any]:
        return {
            "peer_id": self.summary.peer_id, "run_id": self.cfg.run_id, "role": self.role, "stage": self.stage,
            "stages": self.cfg.stages, "round": self.round, "steps": self.summary.steps, "loss": self._current_loss(),
            "tokens_per_s": self.throughput if self.stage is not None else self._trainer_throughput(), "queue": self.service.queue_length, "device": self.device.type,
            "model": self.cfg.model, "protocols": self.summary.protocols, "version": __version__, "reachability": self.summary.reachability, "state": self.summary.state,
            "time": time.time(),
        }

    def _finish(self) -> None:
        self.summary.state = "stopping"
        self.summary.wall_s = time.monotonic() - self.started
        self.role = "leaving"
        try:
            self.net.call(self._heartbeat(), timeout=10)
        except Exception as e:
            logger.info("could not announce leaving: %s", e)
        if self.stage is None and self.trainer is not None:
            self.trainer.evaluate(final=True)
        logger.info("final: %d steps, %d outer rounds, loss %.3f → %.3f, val %.3f", self.summary.steps, self.summary.outer_rounds,
                    self.summary.train_loss_first, self.summary.train_loss_last, self.summary.val_loss)


def run_pipeline_node(cfg: NodeConfig) -> int:
    node = PipelineNode(cfg)
    node.install_signal_handlers()
    return node.run()

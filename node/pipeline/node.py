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

:class:`PipelineNode` picks the role, moves between stages (rebalancing, recovery), waits as a spare
and announces itself; the lifecycle is ``node.runtime.base``'s. Serving a stage is
``node.pipeline.stage_server``, the trainer role ``node.pipeline.trainer``, rebuilding a lost stage
``node.pipeline.recovery``, what a checkpoint holds and whose it is ``node.pipeline.checkpoint``.

With ``--checkpoint-dir`` a stage server writes its stage (weights, optimizer, outer state, round)
after every round and at exit, a trainer its data position at every evaluation and at exit; a
restarted node takes its checkpoint's role and stage again (``StageServer.become`` resumes it unless
a live replica of the stage is ahead of it).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from gossip.rendezvous import list_peers, list_peers_with_expiry
from node.config import NodeConfig
from node.pipeline.checkpoint import asked, check_cut, check_role, held
from node.pipeline.recovery import StageRecoverer
from node.pipeline.stage_server import StageServer, stage_init_seed, stage_run
from node.pipeline.trainer import PipelineTrainer
from node.runtime.base import HEARTBEAT_S, NodeBase
from node.runtime.status_service import StatusService
from protocol.records import PeerRecord
from swarm.checkfree import recoverable
from swarm.claims import claim_stage
from swarm.rebalance import plan_move
from swarm.stage_map import choose_role, refreshed_records
from swarm.stages import Stage

logger = logging.getLogger("locomesh.pipeline")
__all__ = ["PipelineNode", "run_pipeline_node", "stage_run"]


class PipelineNode(NodeBase):
    """One pipeline volunteer. ``run()`` blocks until it stops and returns the exit code."""

    FINAL_LOG = "final: %d steps, %d outer rounds, loss %.3f → %.3f, val %.3f"
    server: StageServer  # built once networking is up (``_services``)

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.role = "starting"
        self.peers: dict[str, PeerRecord] = {}
        self._info_written = 0.0  # when --info-file was last rewritten (monotonic)
        self.trainer: PipelineTrainer | None = None
        self.checkpoint: tuple[Path, dict[str, Any]] | None = None
        # a record signed by a key no daemon runs must not make a lost stage look served or draw microbatches
        self.live = self.reachable_members()

    @property
    def algorithm(self) -> str:
        return f"pipeline:{self.cfg.algorithm}"

    @property
    def stage(self) -> int | None:
        """The stage this node serves (None: a trainer, a spare, or not yet placed)."""
        return self.server.stage

    @property
    def round(self) -> int:  # type: ignore[override]
        return self.server.round

    # ---- lifecycle (node.runtime.base) ---------------------------------------------------------------
    def _prepare(self) -> None:
        cfg = self.cfg
        self._prepare_local(describe=False)
        self.checkpoint = self._own_checkpoint()  # another run's is refused here, before any networking
        if self.checkpoint is not None:
            check_role(cfg.checkpoint_dir, self.checkpoint[1], cfg)  # type: ignore[arg-type]
            check_cut(cfg.checkpoint_dir, self.checkpoint[1], self.model_cfg, cfg.stages, cfg.checkfree_plus)  # type: ignore[arg-type]

    def _services(self, status: StatusService) -> list[Any]:
        stage_checkpoint = self.checkpoint if self._held()["role"] == "stage" else None
        self.server = StageServer(cfg=self.cfg, net=self.net, device=self.device, model_cfg=self.model_cfg, metrics=self.metrics,
                                  summary=self.summary, event=self.event, resume=stage_checkpoint,
                                  save=self._checkpoint_when_due if self.cfg.checkpoint_dir is not None else None, reachable=self.live)
        return [status, *self.server.services]

    def _held(self) -> dict[str, Any]:
        """What this node's own checkpoint holds (``node.pipeline.checkpoint.held``)."""
        return held(self.checkpoint[1]) if self.checkpoint is not None else {"role": None, "stage": None}

    def _join(self) -> None:
        cfg, net, server = self.cfg, self.net, self.server
        peer_id = self.summary.peer_id
        self.recoverer = StageRecoverer(
            stages=cfg.stages, model_cfg=self.model_cfg, seed=stage_init_seed(cfg), plus=cfg.checkfree_plus,
            grace=cfg.recovery_grace, fetch_stage=server.fetch_stage, new_stage=server.new_stage, become=self._serve_rebuilt,
            claim=lambda stage, ignore: net.call(claim_stage(net.dht, net.validator, cfg.run_id, stage, peer_id, ignore=ignore), timeout=30),
            refresh=lambda: net.call(self._live_records(), timeout=30), metrics=self.metrics, event=self.event,
        )
        target = self._held()["stage"]  # a restarted server serves its checkpoint's stage again
        if target is not None:
            self.event("role_chosen", stage=target, peers=0, checkpoint=str(self.checkpoint[0]))  # type: ignore[index]
        elif cfg.role != "spare":
            target = self._pick_role()
        if target is None and cfg.role == "spare":
            self._set_role("spare")
        elif target is None:
            self._set_role("trainer")
        else:
            self._take_stage(target)
        net.call(self._heartbeat(whole=True), timeout=30)

    def _join_hint(self) -> tuple[str, str]:
        what = self.role if self.stage is None else f"stage {self.stage} of {self.cfg.stages}"
        return f" as {what}", f" --stages {self.cfg.stages}"

    def _work(self) -> None:
        if self.role == "spare":
            self._wait_as_spare()
        if self.stage is None and self.role == "trainer":
            resume = self.checkpoint if self._held()["role"] == "trainer" else None
            self.trainer = PipelineTrainer(cfg=self.cfg, workload=self.workload, net=self.net, metrics=self.metrics,
                                           summary=self.summary, event=self.event, stop=self.stop, done=self._deadline_reached,
                                           announce=lambda: self._heartbeat(whole=True), write_info=self._write_info, resume=resume,
                                           save=self._checkpoint_when_due if self.cfg.checkpoint_dir is not None else None)
            self.trainer.run()
        elif self.stage is not None:
            self._serve()

    def _final_evaluation(self) -> None:
        if self.stage is None and self.trainer is not None:
            self.trainer.evaluate(final=True)
        self._checkpoint()

    # ---- checkpoints -----------------------------------------------------------------------------------
    def _checkpoint_when_due(self) -> None:
        """After a stage round or a trainer's evaluation: the checkpoint, when --checkpoint-every says so."""
        if self._checkpoint_due():
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Write the checkpoint when this node holds something to resume: a stage, or a trainer's data
        position (a spare, or a server waiting as one, keeps the checkpoint it has)."""
        serving = self.stage is not None and self.server.worker is not None
        if self.cfg.checkpoint_dir is not None and (serving or (self.stage is None and self.trainer is not None)):
            self._save_checkpoint()

    def _checkpoint_state(self) -> dict[str, Any]:
        if self.stage is not None:
            state = self.server.checkpoint_state()
        elif self.trainer is not None:
            state = self.trainer.checkpoint_state()
        else:
            return {}
        return {**state, "asked": asked(self.cfg)} if state else {}

    def _data_order(self) -> dict[str, Any] | None:
        return self.trainer.data_order() if self.stage is None and self.trainer is not None else None

    # ---- roles ---------------------------------------------------------------------------------------
    def _set_role(self, role: str) -> None:
        self.role = self.summary.role = role

    def _pick_role(self) -> int | None:
        cfg = self.cfg
        if cfg.role == "trainer" or self._held()["role"] == "trainer":
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

    def _take_stage(self, index: int, rebuilt: Stage | None = None, lr_scale: float = 1.0) -> None:
        """Serve stage ``index``. One without a live replica although the run has trained is rebuilt from
        its neighbours like a lost stage (never the run's fresh initialisation); when its sources do
        not answer, the node waits as a spare, whose checks try again."""
        if self.server.become(index, rebuilt, lr_scale):
            self._set_role("stage")
            return
        plan = recoverable([index], self.cfg.stages, self.cfg.checkfree_plus)[index]
        logger.warning("stage %d has no live replica but the run has trained: rebuilding it (%s) instead of "
                       "starting it from the run's initialisation", index, plan)
        if not self.recoverer.recover(index, plan, 0.0):
            self.server.leave()
            self._set_role("spare")

    def _serve_rebuilt(self, index: int, module: Stage) -> None:
        """Serve a stage the recoverer rebuilt, and announce it at once (so nobody else rebuilds it)."""
        self._take_stage(index, rebuilt=module, lr_scale=self.cfg.recovery_lr_scale)
        self.net.call(self._heartbeat(whole=True), timeout=30)

    def _serve(self) -> None:
        """Serve the stage (``StageServer``) until stopped; between rounds, rebuild a lost stage or move
        to the bottleneck stage when this node is the one to."""
        cfg, server = self.cfg, self.server
        next_rebalance = time.monotonic() + cfg.rebalance_period
        while not self.stop.is_set() and not self._deadline_reached():
            time.sleep(0.1)
            self._refresh_info()
            if server.worker is None:
                if self.role == "spare":  # a move into an unserved stage whose sources did not answer
                    self._wait_as_spare()
                continue
            if server.poll():
                continue  # a round in flight: no recovery or move meanwhile
            if self.recoverer.check(self.summary.peer_id, self.role, self.stage):
                continue
            if cfg.rebalance_period and time.monotonic() >= next_rebalance:
                next_rebalance = time.monotonic() + cfg.rebalance_period
                self._maybe_rebalance()
        server.drain(2 * cfg.averaging_timeout + 10)

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
        self._take_stage(target)  # its throughput is measured again on the new stage before anyone plans on it
        self.net.call(self._heartbeat(whole=True), timeout=30)  # announce the move (and the unmeasured throughput) at once

    # ---- spares ------------------------------------------------------------------------------------
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

    # ---- announcements -----------------------------------------------------------------------------
    def _record_fields(self) -> dict[str, Any]:
        server, worker = self.server, self.server.worker
        serving = self.stage is not None
        return {
            "role": self.role if self.role != "starting" else "trainer", "inner_step": worker.steps if worker else self.summary.steps,
            "tokens_per_s": server.throughput * self.model_cfg.context if serving else self._trainer_throughput(),
            "stage": self.stage if serving else -1, "queue": server.service.queue_length,
            "grad_norm": worker.last_grad_norm if worker else 0.0, "stage_since": server.stage_since,
        }

    def _record_runs(self) -> list[str]:
        """The run, and the stage's sub-run while serving (where its replicas find each other)."""
        serving = self.stage is not None and self.role == "stage"
        return [self.cfg.run_id] + ([stage_run(self.cfg.run_id, self.stage)] if serving else [])  # type: ignore[arg-type]

    async def _live_records(self) -> dict[str, PeerRecord]:
        """The run's records of peers that answered a status probe (and this node's own), probing new ones."""
        peers = await list_peers(self.net.dht, self.cfg.run_id)
        alive = await self.live.check(set(peers) - {self.summary.peer_id})
        return {p: rec for p, rec in peers.items() if p in alive or p == self.summary.peer_id}

    def _observe_peers(self, peers: dict[str, PeerRecord]) -> None:
        alive = self.live.filter(set(peers))  # peers being probed for the first time count until they fail
        peers = {p: rec for p, rec in peers.items() if p in alive or p == self.summary.peer_id}
        self.peers = peers
        self.recoverer.observe(peers)
        if self.stage is None and self.trainer is not None:
            for s, members in enumerate(self._stage_map(peers)):
                for gone in sorted(set(self.trainer.router.peers(s)) - set(members)):
                    self.event("stage_peer_gone", stage=s, peer=gone)  # left the DHT: no longer routed to
                self.trainer.router.update(s, members)
            self.summary.route_throughput = {p: round(tp, 2) for p, tp in self.trainer.router.throughput.items()}

    def _status_fields(self) -> dict[str, Any]:
        tokens_per_s = self.server.throughput if self.stage is not None else self._trainer_throughput()
        return {"role": self.role, "stage": self.stage, "stages": self.cfg.stages, "tokens_per_s": tokens_per_s,
                "queue": self.server.service.queue_length}

    def _trainer_throughput(self) -> float:
        return self.trainer.throughput if self.trainer is not None else 0.0

    def _current_loss(self) -> float:
        return self.trainer.last_loss if self.trainer is not None else self.server.last_loss

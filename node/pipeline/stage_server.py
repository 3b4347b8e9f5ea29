"""Serving one stage of a pipeline: the stage's weights and optimizer (``swarm.stage_worker``), the
forward/backward service on ``/locomesh/stage/1.0`` (a bounded queue, ``swarm.service``), the stage's
state for replicas that join or move in (``node.pipeline.stage_state``), and the DiLoCo rounds with the other replicas of the stage
(over the stage's sub-run ``<run>.s<i>``, on a shared wall-clock schedule, while it keeps serving).
The rounds are the replicas' (``gossip.diloco``): error feedback (``--error-feedback-decay``) for a
lossy codec, the outer lr warmed up over ``--outer-warmup-rounds`` counted from the stage's first
round, bounded groups (``--max-group-size``), φ on ``--outer-device``, a round's result merged with
``--fragment-alpha``; MFU of the stage's compute is reported as a replica's (``--peak-tflops``).
What of the stage goes into the node's checkpoint (``node.pipeline.checkpoint``) is written after every
round and at exit, and resumed when the node is restarted unless a live replica is ahead of it.

:class:`StageServer` serves whichever stage the pipeline node gives it (:meth:`StageServer.become`);
which stage, when to move and when to rebuild a lost one is the node's choice (``node.pipeline.node``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from compression import ErrorFeedback, feedback_state, load_feedback_state
from gossip.byzantine import Attacker
from gossip.diloco import DiLoCoAverager
from gossip.group_round import RoundResult
from gossip.exchange import RoundExchange
from gossip.fingerprint import fingerprint
from gossip.outer import NesterovOuter
from gossip.placement import OuterPlacement
from gossip.reachable import Reachable
from gossip.rendezvous import list_peers
from gossip.state_server import StateServer
from node.config import NodeConfig
from node.pipeline.checkpoint import resumes_stage, stage_cut
from node.pipeline.stage_state import StageState
from node.runtime.metrics import NodeMetrics
from node.runtime.mfu import peak_flops, record_throughput
from node.runtime.network import NetworkThread
from node.runtime.summary import Summary, count_steps, write_info
from swarm.models.presets import ModelConfig
from swarm.service import StageService
from swarm.stage_worker import StageWorker
from swarm.stages import Stage, model_seed, stage_flops_per_token, stage_run

# A stage replica's sample count is its own claim (a liar's 1e18 owned every mean): it weighs at most
# CLAIM_FACTOR times the round's lower-median claim (the router may spread microbatches unevenly, within
# its 8x measured-rate bound). Every replica caps alike: a cap from what each stepped itself (the rule
# before) differed between the two replicas of a round, which then weighed, and stepped φ, apart.
CLAIM_FACTOR = 8

logger = logging.getLogger("locomesh.pipeline")


def stage_init_seed(cfg: NodeConfig) -> int:
    """The seed every replica of every stage initialises from: ``--init-seed``, else one derived from the
    run id (not ``--seed``, which differs from node to node)."""
    return cfg.init_seed if cfg.init_seed is not None else model_seed(cfg.run_id)


class StageServer(StageState):
    """Serves one stage at a time (none before :meth:`become`), and keeps the node's books on it.

    :param summary: the node's summary; the server counts its steps, loss, served microbatches and rounds there
    :param event: records one of the node's events
    :param save: writes the node's checkpoint when --checkpoint-every says so (called after every round; None: no --checkpoint-dir)
    :param resume: the node's own checkpoint of a stage, resumed when the node first serves that stage
    :param reachable: which peers answer a status probe (a record signed by a key no daemon runs must not be
        waited for at the stage's rendezvous, nor asked for its state); None: every record counts
    """

    def __init__(self, *, cfg: NodeConfig, net: NetworkThread, device: torch.device, model_cfg: ModelConfig,
                 metrics: NodeMetrics, summary: Summary, event: Callable[..., None], save: Callable[[], None] | None = None,
                 resume: tuple[Path, dict[str, Any]] | None = None, reachable: Reachable | None = None) -> None:
        self.cfg, self.net, self.device, self.model_cfg = cfg, net, device, model_cfg
        self.metrics, self.summary, self.event = metrics, summary, event
        self.save, self.resume, self.reachable = save, resume, reachable
        self.stage_steps = 0  # optimizer steps the stage's weights hold since the run began (node.pipeline.checkpoint)
        self.stage: int | None = None
        self.worker: StageWorker | None = None
        self.round = 0
        self.phi: list[torch.Tensor] = []
        self.throughput = 0.0
        self.last_loss = math.nan
        self.stage_since = 0.0  # wall-clock time the node began serving its stage
        self.counted = 0  # the worker's steps already in the summary
        self.schedule_step = 0  # where the next worker's lr schedule starts (the stage's, downloaded with its state)
        self.pending: tuple[concurrent.futures.Future, StageWorker] | None = None  # the round in flight
        self.pending_idle = False  # that round holds no step of this replica's (it joined to keep φ)
        self.placement = OuterPlacement.choose(device, cfg.outer_device)  # where φ and the outer momentum live
        self.feedback: list[ErrorFeedback] | None = None  # error feedback of each wire part (lossy codecs)
        self.flops_per_token, self.peak_flops = 0.0, peak_flops(device, cfg.peak_tflops)
        transport, first = net.transport, stage_run(cfg.run_id, 0)
        self.service = StageService(transport, cfg.run_id, lambda: self.worker, cfg.activation_compression, queue_limit=cfg.stage_queue)
        self.state_server = StateServer(transport, first, progress=lambda: 0)
        self.outer = self._new_outer()
        self.exchange = RoundExchange(transport, first, cfg.codec, [(1,)], serve_timeout=cfg.averaging_timeout * 2)
        self.averager = DiLoCoAverager(net.dht, net.validator, self.exchange, first, summary.peer_id, self.outer,
                                       gather_timeout=cfg.averaging_timeout, fetch_timeout=cfg.averaging_timeout,
                                       aggregation=cfg.aggregation, member_role="stage", max_group_size=cfg.max_group_size,
                                       weight_codec="none" if cfg.codec == "none" else "fp16",
                                       attacker=Attacker.from_spec(cfg.attack, seed=cfg.seed))  # experiments only
        self.averager.reachable = reachable
        self.averager.claim_factor = CLAIM_FACTOR
        self.averager.quorum = cfg.quorum

    def _new_outer(self) -> NesterovOuter:
        """The stage's outer optimizer; its warm-up's first round is set once the stage's rounds are known."""
        return NesterovOuter(*self.cfg.outer_hyper, warmup_rounds=self.cfg.outer_warmup)

    @property
    def services(self) -> list[Any]:
        """The protocols a stage server answers, in the order they start."""
        return [self.service, self.state_server, self.exchange]

    # ---- taking a stage ------------------------------------------------------------------------------
    def become(self, index: int, rebuilt: Stage | None = None, lr_scale: float = 1.0) -> bool:
        """Serve stage ``index``: ``rebuilt`` weights (a recovery), else a live replica's, else the run's
        init. False (serving nothing) when no replica answered although the run has trained: the stage
        must then be rebuilt from its neighbours, never started afresh."""
        cfg, net = self.cfg, self.net
        if self.pending is not None:  # an idle replica's round may be in flight (see poll): finish it first
            self.drain(2 * cfg.averaging_timeout + 10)
        previous, self.worker = self.stage, None
        module = rebuilt if rebuilt is not None else self.new_stage(index)
        sub = stage_run(cfg.run_id, index)
        self.outer = self._new_outer()
        self.round, self.stage_steps = 0, 0
        self.schedule_step = 0
        own = self._own_checkpoint(index, module) if rebuilt is None else None
        if own is not None:
            self._load_own(module, own[1]["stage"])
        source = None
        if rebuilt is None and (cfg.initial_peers or previous is not None):
            peers = net.call(list_peers(net.dht, sub), timeout=30)
            source = self._download(module, sub, peers, ahead_of=None if own is None else self.stage_steps)
            if source is None and own is None and self._run_has_trained():
                return False
        elif rebuilt is not None:
            self.schedule_step = self._stages_schedule_step()  # a rebuilt stage continues the pipeline's lr schedule
        if own is not None and source is None:
            self.phi = self.placement.copy_of(own[1]["stage"]["phi"])
        else:
            self.phi = self.placement.copy_of(list(module.parameters()))
        self.round = max(self.round, int(time.time() // cfg.sync_every))  # first averaging at the next boundary
        if source is None and own is None:  # the stage starts here: its outer lr warms up from its first round
            self.outer.first_round = self.round + 1
        parts = self.averager.partition.shapes([p.shape for p in self.phi])
        decay = cfg.feedback_decay()
        self.feedback = [ErrorFeedback(decay) for _ in parts] if decay > 0 else None
        if self.feedback is not None and own is not None and source is None:  # its own Δs' unsent remainder
            why = load_feedback_state(self.feedback, own[1]["stage"].get("error_feedback"), parts)
            if why is not None:
                logger.warning("checkpoint %s: error feedback starts empty (%s)", own[0], why)
        self.state_server.run_id = sub
        self.exchange.run_id, self.exchange.layout = sub, RoundExchange(net.transport, sub, cfg.codec, parts).layout
        self.averager.run_id, self.averager.outer = sub, self.outer
        self.stage = index
        self.service.reset_throughput()
        self.worker = StageWorker(module, self.device, cfg.lr * lr_scale, cfg.weight_decay, slowdown=cfg.slowdown, schedule=cfg.schedule(),
                                  inner_optimizer=cfg.inner_optimizer, steps=self.schedule_step)
        if own is not None:  # the inner optimizer is this node's own, whoever's weights it serves
            self.worker.optimizer.load_state_dict(own[1]["stage"]["inner_optimizer"])
            self.worker.steps = max(self.schedule_step, int(own[1]["stage"]["worker_steps"]))
        self.flops_per_token = stage_flops_per_token(module)
        self.counted = self.worker.steps
        self.summary.stage = index
        self.stage_since = time.time()
        self.metrics.stage.set(index)
        self.publish_state()
        if own is not None:
            self.event("resumed", checkpoint=str(own[0]), stage=index, round=self.round, stage_steps=self.stage_steps,
                       weights="checkpoint" if source is None else f"replica {source} (ahead of the checkpoint)")
            self.summary.resumed_from = {"checkpoint": str(own[0]), "round": self.round}
        if rebuilt is None:
            self.event("stage_joined" if previous is None else "stage_moved", stage=index, previous=previous, source=source, round=self.round,
                       schedule_step=self.schedule_step)
        return True

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _own_checkpoint(self, index: int, module: Stage) -> tuple[Path, dict[str, Any]] | None:
        """The node's checkpoint of stage ``index`` (taken once: a later move never goes back to it)."""
        own, self.resume = self.resume, None
        return own if own is not None and resumes_stage(own[0], own[1]["stage"], index, module) else None

    def _load_own(self, module: Stage, saved: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, t in zip(module.parameters(), saved["theta"]):
                p.copy_(t)
        self.outer.load_state_tensors(saved["outer_momentum"])
        self.outer.first_round = int(saved.get("first_round", 0))
        self.round, self.stage_steps = int(saved["round"]), int(saved["stage_steps"])

    def checkpoint_state(self) -> dict[str, Any] | None:
        """The stage's entries of the node's checkpoint (None: no stage served). Call between rounds:
        φ and the outer momentum change only when a round is applied, on this thread."""
        worker, stage = self.worker, self.stage
        if worker is None or stage is None:
            return None
        with worker.lock:  # a request's step must not change θ or the optimizer's moments while they are copied
            theta = [p.detach().to("cpu", torch.float32).clone() for p in worker.parameters()]
            optimizer = copy.deepcopy(worker.optimizer.state_dict())
            steps = worker.steps
        cut = stage_cut(self.model_cfg, stage, self.cfg.stages, self.cfg.checkfree_plus)
        return {"role": "stage", "stage": {
            **cut, "params": [[name, list(p.shape)] for name, p in worker.stage.named_parameters()],
            "phi": [t.clone() for t in self.phi], "theta": theta, "outer_momentum": self.outer.state_tensors(self.phi),
            "inner_optimizer": optimizer, "worker_steps": steps, "round": self.round, "first_round": self.outer.first_round,
            "stage_steps": self.stage_steps + steps - self.counted, "outer_rounds": self.summary.outer_rounds,
            "error_feedback": feedback_state(self.feedback)}}

    def leave(self) -> None:
        """Serve nothing (a stage whose rebuild failed: the node waits as a spare)."""
        self.stage, self.worker = None, None
        self.summary.stage = None

    def _run_has_trained(self) -> bool:
        """Whether another peer of the run has trained or served steps (stages worth more than the init)."""
        records = self.net.call(list_peers(self.net.dht, self.cfg.run_id), timeout=30)
        return any(r.inner_step > 0 for p, r in records.items() if p != self.summary.peer_id)

    def _stages_schedule_step(self) -> int:
        """The furthest lr schedule position (backward steps) any stage server of the run announces."""
        records = self.net.call(list_peers(self.net.dht, self.cfg.run_id), timeout=30)
        return max((r.inner_step for p, r in records.items() if p != self.summary.peer_id and r.role == "stage"), default=0)

    def new_stage(self, index: int) -> Stage:
        """Stage ``index`` as the run initialises it."""
        return Stage(self.model_cfg, index, self.cfg.stages, stage_init_seed(self.cfg), plus=self.cfg.checkfree_plus)

    # ---- serving ---------------------------------------------------------------------------------------
    def poll(self) -> bool:
        """One look at the stage being served: count its steps and loss, export its throughput, apply a
        finished round, start the next one at its boundary. Returns whether a round holding this replica's steps
        is in flight: an idle replica's round does not hold back a recovery or a move (``become`` finishes it first)."""
        worker = self.worker
        assert worker is not None
        new_steps = worker.steps - self.counted
        if new_steps:
            self.counted = worker.steps
            self.stage_steps += new_steps
            loss = worker.last_loss if worker.stage.last and not math.isnan(worker.last_loss) else None
            count_steps(self.summary, self.metrics, new_steps, loss=loss)
            if loss is not None:
                self.last_loss = loss
        self.throughput = self.service.throughput
        self.summary.microbatches_served, self.summary.refused_busy = self.service.microbatches, self.service.refused_busy
        self.summary.refused_implausible, self.summary.clipped_gradients = self.service.refused_implausible, self.service.clipped_gradients
        self._record_throughput(self.throughput * self.model_cfg.context)
        self.metrics.stage_queue.set(self.service.queue_length)
        if self.pending is not None and self.pending[0].done():
            self._apply_round(self.pending[0].result(), self.pending[1])
            self.pending = None
        epoch = int(time.time() // self.cfg.sync_every)
        if self.pending is None and epoch > self.round:
            # replicas of a stage meet on a shared wall-clock schedule, however unevenly the router spread the microbatches
            self.round = epoch
            self._start_round(epoch, worker)
        return self.pending is not None and not self.pending_idle

    def _start_round(self, epoch: int, worker: StageWorker) -> None:
        """Average this epoch's steps with the stage's other replicas. A replica's sample count is its
        claim: it weighs at most ``CLAIM_FACTOR`` × the round's lower-median claim. A replica of no microbatch
        since the last round joins unaveraged (``gossip.diloco``): sitting out left its φ a round behind."""
        theta = worker.snapshot(self.placement.device)
        samples, worker.samples = worker.samples, 0
        feedback = self.feedback if samples else None  # an update nobody averages leaves no residual to carry
        self.pending_idle = samples == 0
        self.pending = (self.net.submit(self.averager.run_round(epoch, self.phi, theta, samples, feedback=feedback)), worker)

    def _record_throughput(self, tokens_per_s: float) -> None:
        """The stage's tokens per second, its MFU (``node.runtime.mfu``, with the stage's own FLOPs per token) and peak memory."""
        self.metrics.tokens_per_second.set(tokens_per_s)
        record_throughput(self.summary, self.metrics, self.device, self.flops_per_token, self.peak_flops,
                          exported=tokens_per_s, summarized=tokens_per_s)

    def drain(self, timeout: float) -> None:
        """Apply the round still in flight (the node stops or takes another stage), if it finishes within ``timeout``."""
        if self.pending is None:
            return
        try:
            self._apply_round(self.pending[0].result(timeout=timeout), self.pending[1])
        except Exception as e:
            logger.info("last stage round did not finish: %s", e)
        self.pending = None

    def _apply_round(self, result: RoundResult, worker: StageWorker) -> None:
        if result.in_sync and not result.contributors:
            return  # no replica took a step: φ did not move, and there is nothing to count or save
        m = self.metrics
        m.round_duration.observe(result.duration_s)
        m.group_size.set(len(result.contributors))
        for kind in result.failures.values():
            m.errors.labels(kind).inc()
        record = {"round": result.round, "stage": self.stage, "contributors": len(result.contributors), "in_sync": result.in_sync,
                  "duration_s": round(result.duration_s, 3), "loss": self.last_loss}
        if result.in_sync and worker is self.worker:
            self.summary.outer_rounds += 1
            m.outer_rounds.labels("alone" if len(result.group) == 1 else "completed").inc()
            worker.load_weights(self.phi, keep=self.cfg.fragment_alpha)
            self.publish_state()
        elif worker is self.worker and self.stage is not None:
            m.outer_rounds.labels("failed").inc()
            self.event("out_of_sync", stage=self.stage, round=result.round, majority_peer=result.sync_peer)
            self.resync(worker, result)
        record["fingerprint"] = fingerprint(self.phi)
        self.summary.rounds.append(record)
        m.outer_round.set(self.round)
        if self.save is not None:
            self.save()
        write_info(self.cfg.info_file, self.summary)

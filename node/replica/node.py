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
   training while a round runs, ``--inner-steps auto`` paces rounds by time (``node.replica.pacing``).
4. On SIGTERM/SIGINT, ``--max-steps`` or ``--duration``: stop at a step boundary, evaluate, write
   the checkpoint atomically, leave the DHT and stop p2pd.

The lifecycle (steps 1, 4, the heartbeat, status and checkpoint) is ``node.runtime.base``'s; this module
fills in what a whole-model replica does. Collaborators: ``node.runtime.resume`` (its own checkpoint,
refused when written with other settings), ``node.replica.joiner`` (join, resync, catch up),
``node.replica.rounds`` (what travels, the round in flight).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from compression import feedback_state, load_feedback_state
from gossip.diloco import DiLoCoAverager
from gossip.group_round import RoundResult
from gossip.exchange import RoundExchange
from gossip.fingerprint import fingerprint
from gossip.fragments import fragment_of_round, merge_fragment
from gossip.noloco import NoLoCoAverager
from gossip.outer import NesterovOuter, NoLoCoOuter
from gossip.placement import OuterPlacement
from gossip.state_server import StateServer
from gossip.state_transfer import StateSnapshot
from gossip.byzantine import Attacker, served_params
from node.config import NodeConfig
from node.replica.adopted_state import AdoptedState
from node.replica.joiner import Joiner
from node.replica.overlap_choice import OverlapChooser
from node.replica.paced_rounds import PacedRounds
from node.replica.pacing import RoundPacer, slowdown_sleep, stall_capped
from node.replica.rounds import PendingRound, RoundPlan, RoundRunner
from node.replica.scoring import build_screening
from node.runtime.base import NodeBase
from node.runtime.local_training import LocalTrainer
from node.runtime.mfu import flops_per_token, peak_flops, record_throughput
from node.runtime.settings import run_settings
from node.runtime.status_service import StatusService
from node.runtime.summary import time_shares
from protocol.records import PeerRecord
from swarm.lr_schedule import SCHEDULE_STEP

logger = logging.getLogger("locomesh.node")


class Daemon(AdoptedState, PacedRounds, NodeBase):
    """One volunteer node. ``run()`` blocks until the node stops and returns its exit code."""

    INTERRUPTED = "interrupted during an outer round"
    PEER_READ_EVERY = 5  # the members' records (speeds for --inner-steps auto, the peers gauge) change slowly

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.round = 0
        self.inner_step = 0  # inner steps taken in the current round
        self.tokens_per_s = 0.0
        self.compute_tokens_per_s = 0.0  # inner steps only, announced for --inner-steps auto
        self.peer_rates: dict[str, float] = {}
        self.last_contributors = 0  # members of the last round in sync (--inner-steps by-replicas)
        self.pacer = RoundPacer(cfg, "")
        self.round_rates: dict[str, float] = {}  # the speeds the last round's members announced (pacing)
        self.round_ended: float | None = None  # when the last blocking round's result arrived (pacing)
        self.attacker = Attacker.from_spec(cfg.attack, seed=cfg.seed)  # experiments only (node swarm --byzantine)
        self.helping = False  # too slow to train: averages with 0 samples (--helper-below, node.replica.pacing)
        self.slow_rounds = 0  # rounds in a row this node measured itself below --helper-below × the median
        self.helped_steps = 0  # the median peer's steps of the rounds this node helped in (--max-steps counts them)
        self.overlapping = cfg.overlap  # --auto-overlap turns it on and off between rounds (node.replica.overlap_choice)
        self.overlap_chooser = OverlapChooser() if cfg.auto_overlap else None
        self.summary.overlap = "on" if cfg.overlap else self.overlap_chooser.state if self.overlap_chooser else "off"

    # ---- lifecycle (node.runtime.base) ------------------------------------------------------------
    def _prepare(self) -> None:
        cfg = self.cfg
        self._prepare_local()
        device, model_cfg, work = self.device, self.model_cfg, self.workload
        self.trainer = LocalTrainer(cfg=model_cfg, device=device, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                    schedule=cfg.schedule(), inner_optimizer=cfg.inner_optimizer, seed=cfg.model_seed,
                                    micro_batch_size=cfg.micro_batch_size,
                                    activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile, compile_mode=cfg.compile_mode)
        if work.init_weights is not None:  # a joiner still takes the swarm's state, a resumed node its checkpoint
            self.trainer.load_weights(work.init_weights)
            self.event("init_from", checkpoint=work.init_source)
        self.placement = OuterPlacement.choose(device, cfg.outer_device)  # φ, and the outer momentum with it
        self.phi = self.placement.copy_of(self.trainer.parameters())
        self._start_throughput()
        outer_lr, outer_momentum = cfg.outer_hyper
        if cfg.algorithm == "noloco":
            self.outer: NesterovOuter | NoLoCoOuter = NoLoCoOuter(outer_lr, cfg.noloco_pull, outer_momentum)
        else:
            self.outer = NesterovOuter(outer_lr, outer_momentum, nesterov=cfg.algorithm == "diloco", warmup_rounds=cfg.outer_warmup)
        self.batches = work.train_batches(cfg.batch_size, cfg.seed)
        self.checkpoint = self._own_checkpoint()

    def _services(self, status: StatusService) -> list[Any]:
        cfg, net = self.cfg, self.net
        peer_id = self.summary.peer_id
        names = [name for name, _ in self.trainer.model.named_parameters()]
        self.plan = RoundPlan(names=names, shapes=[tuple(p.shape) for p in self.phi], codec=cfg.codec,
                              feedback_decay=cfg.feedback_decay(), fragments=cfg.fragments, noloco=cfg.algorithm == "noloco")
        self.exchange = RoundExchange(net.transport, cfg.run_id, self.plan.wire(), self.plan.layout, serve_timeout=cfg.averaging_timeout * 2)
        self.state_server = StateServer(net.transport, cfg.run_id, progress=lambda: self.inner_step)
        self.outer.before_change = self.state_server.withdraw  # the state offered joiners is copied before it changes
        self.reachable = self.reachable_members()
        judge = None
        if isinstance(self.outer, NoLoCoOuter):
            self.averager: DiLoCoAverager | NoLoCoAverager = NoLoCoAverager(
                net.dht, net.validator, self.exchange, cfg.run_id, peer_id, self.outer, group_size=cfg.group_size, partition=self.plan.partition,
                gather_timeout=cfg.averaging_timeout, fetch_timeout=cfg.averaging_timeout, aggregation=cfg.aggregation,
                max_samples=cfg.max_round_samples, attacker=self.attacker,
            )
        else:
            self.averager = DiLoCoAverager(
                net.dht, net.validator, self.exchange, cfg.run_id, peer_id, self.outer, partition=self.plan.partition,
                gather_timeout=cfg.averaging_timeout, fetch_timeout=cfg.averaging_timeout, aggregation=cfg.aggregation,
                keep_others=cfg.overlap and cfg.overlap_mode == "eager", max_group_size=cfg.max_group_size,
                weight_codec=self.plan.phi_codec, max_samples=cfg.max_round_samples, attacker=self.attacker,
            )
            self.averager.reachable = self.reachable
            self.averager.quorum = cfg.quorum
            self.averager.scorer, judge = build_screening(cfg, self.model_cfg, self.workload, self.device, lambda: self.phi)
        self.rounds = RoundRunner(net=net, averager=self.averager, eager=cfg.overlap and cfg.overlap_mode == "eager",
                                  before_gather=self._announce_for_round, stop=self.stop, final_timeout=2 * cfg.averaging_timeout + 30,
                                  placement=self.placement)
        self.joiner = Joiner(net=net, run_id=cfg.run_id, peer_id=peer_id, settings=run_settings(cfg), layout=self._state_layout,
                             adopt=self._adopt, announce=self._heartbeat, metrics=self.metrics, event=self.event, stop=self.stop,
                             join_timeout=cfg.join_timeout,
                             held=lambda: {"params": self.phi, "outer_momentum": self.outer.state_tensors(self.phi)},
                             established=self._established, answering=self.reachable.check,
                             measured=lambda peer: self.exchange.rates.rates.get(peer, 0.0), judge=judge)
        return [self.exchange, self.state_server, status]

    def _join(self) -> None:
        # a restarted node reloads its own checkpoint (inner optimizer, data order), then takes the
        # swarm's newer weights and round if any peer answers
        resumed = self._resume()
        if self.cfg.initial_peers and self.joiner.join(resumed):
            self.summary.joined_round = self.round
        self._publish_snapshot()

    def _work(self) -> None:
        self._train()

    def _record_fields(self) -> dict[str, Any]:
        return {"inner_step": self.inner_step, "tokens_per_s": self._announced_rate()}

    def _observe_peers(self, peers: dict[str, PeerRecord]) -> None:
        self.peer_rates = {p: rec.tokens_per_s for p, rec in peers.items() if rec.role == "trainer"}

    def _status_fields(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"inner_step": self.inner_step, "tokens_per_s": self.tokens_per_s, "algorithm": cfg.algorithm, "compression": cfg.codec,
                "fragments": cfg.fragments, "round_steps": self.pacer.pace.expected_steps, "round_budget_s": self.pacer.pace.budget_s,
                "helping": self.helping, "overlap": self.summary.overlap,
                **time_shares(self.summary, self.train_started),
                "peer_scores": self.averager.scorer.peers.snapshot() if self.averager.scorer else {}}

    def _checkpoint_state(self) -> dict[str, Any]:
        return {"inner_steps_total": self.trainer.steps, "phi": [t.to("cpu", copy=True) for t in self.phi],
                "theta": [p.detach().cpu().clone() for p in self.trainer.parameters()],
                "outer_momentum": self.outer.state_tensors(self.phi), "inner_optimizer": self.trainer.optimizer.state_dict(),
                # None before the network (and the round plan) started: no round has left a residual yet
                "error_feedback": [feedback_state(b) for b in self.plan.feedback] if hasattr(self, "plan") else None}

    def _wind_down(self) -> None:
        self._record_throughput(inner_tokens_per_s=self._inner_rate())

    # ---- joining -----------------------------------------------------------------------------
    def _established(self, peer: str) -> bool:
        """Whether this node saw ``peer`` take part in enough of its rounds (NoLoCo keeps no tally: no)."""
        tenure = getattr(self.averager, "tenure", None)
        return tenure is not None and tenure.established(peer)

    def _state_layout(self) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
        return {
            "params": [(tuple(p.shape), p.dtype) for p in self.phi],
            "outer_momentum": [(tuple(p.shape), torch.float32) for p in self.phi],
        }

    def _resume(self) -> bool:
        """Reload this node's own checkpoint (already checked against the run's settings at start-up)."""
        if self.checkpoint is None:
            return False
        path, state = self.checkpoint
        if [tuple(t.shape) for t in state["phi"]] != [tuple(p.shape) for p in self.phi]:
            logger.warning("checkpoint %s holds tensors of other shapes; ignoring it", path)
            return False
        self.phi = self.placement.copy_of(state["phi"])
        self.trainer.load_weights(state["theta"])
        self.outer.load_state_tensors(state["outer_momentum"])
        self.trainer.optimizer.load_state_dict(state["inner_optimizer"])
        self.trainer.steps = int(state["inner_steps_total"])
        self._resume_feedback(path, state.get("error_feedback"))
        self._resumed(path, state)
        return True

    def _resume_feedback(self, path: Any, saved: Any) -> None:
        """The lossy codec's error-feedback residuals (what earlier rounds did not send yet), per fragment
        (a checkpoint written before any round, or by an older version, holds none: nothing to restore)."""
        if saved is None:
            return
        saved = saved if isinstance(saved, list) and len(saved) == len(self.plan.feedback) else [None] * len(self.plan.feedback)
        for fragment, buffers in enumerate(self.plan.feedback):
            if buffers is None:
                continue
            why = load_feedback_state(buffers, saved[fragment], self.plan.parts[fragment])
            if why is not None:
                logger.warning("checkpoint %s: error feedback starts empty (%s)", path, why)

    # ---- training ----------------------------------------------------------------------------
    def _train(self) -> None:
        cfg = self.cfg
        self.train_started = time.monotonic()
        tokens_per_step = cfg.batch_size * self.trainer.model.cfg.context
        window_start, window_tokens, typical_step_s = time.monotonic(), 0, 0.0
        self.summary.inner_s, self.inner_tokens = 0.0, 0  # the inner steps' time and tokens, outer rounds left out
        self.round_samples = 0
        if self.inner_step == 0:  # else a joiner's plan of what is left of its first round stands
            self._plan_round()
        while not self.stop.is_set() and not self._deadline_reached():
            if self.helping:
                self._help_round()
                continue
            fetch_started = time.monotonic()
            x, y = self.batches.next()
            step_started = time.monotonic()
            loss = self.trainer.step(x, y)
            compute_s = time.monotonic() - step_started
            if cfg.slowdown > 1 and step_started - self.train_started >= cfg.slowdown_after:
                time.sleep(slowdown_sleep(cfg.slowdown, compute_s, typical_step_s))
            counted = stall_capped(compute_s, typical_step_s)
            typical_step_s = counted if typical_step_s == 0 else 0.9 * typical_step_s + 0.1 * counted
            rate = tokens_per_step / max(time.monotonic() - step_started, 1e-6)
            self.compute_tokens_per_s = rate if self.compute_tokens_per_s == 0 else 0.9 * self.compute_tokens_per_s + 0.1 * rate
            self.inner_step += 1
            self.round_samples += x.shape[0]
            self._count_steps(1, tokens_per_step, loss)
            if self.pacer.provisional and any(r > 0 and p != self.summary.peer_id for p, r in self.peer_rates.items()):
                self._plan_round(start=self.pacer.pace.started)  # speeds are known now: the rest of the round by time
            window_tokens += tokens_per_step
            elapsed = time.monotonic() - window_start
            step_s = time.monotonic() - fetch_started
            self.summary.inner_s += step_s
            self.metrics.inner_time.inc(step_s)
            self.inner_tokens += tokens_per_step
            if elapsed >= 2.0:
                self.tokens_per_s = window_tokens / elapsed
                self.metrics.tokens_per_second.set(self.tokens_per_s)
                self._record_throughput(self.tokens_per_s, self._inner_rate())
                window_start, window_tokens = time.monotonic(), 0
            if cfg.overlap_mode != "delayed" and self.rounds.ready():
                self._finish_pending()
            if self.rounds.stepping():  # the round's rendezvous runs while this node steps on
                if self._hand_over_due():
                    self._hand_over()
                    self._next_round()
            elif self._round_due(step_s) and not self._steps_on_past_due():
                self._finish_pending()
                self._start_round(self.round_samples)
                if not self.rounds.stepping():
                    self._next_round()
        self._finish_pending(final=True)

    def _inner_rate(self) -> float:
        """Tokens per second of the inner steps so far (batch, step and bookkeeping; outer rounds left out)."""
        inner_s = self.summary.inner_s
        return self.inner_tokens / inner_s if inner_s > 0 else 0.0

    def _start_round(self, samples: int) -> None:
        """Run the outer round of the fragment that is due: in the background with ``--overlap``; registered at
        once while the training loop steps on until the group is complete (``--step-while-gathering``, a node
        that knows its speed); else right away (the training loop waits)."""
        fragment = fragment_of_round(self.round, self.cfg.fragments)
        self.averager.speed = self._announced_rate()
        stepping = samples > 0 and self._steps_while_gathering()
        self.rounds.start(self.round, fragment, self.plan.fragments[fragment], self.phi, self.trainer.parameters(), samples,
                          self.inner_step, self.plan.feedback[fragment], overlapped=self.overlapping, stepping=stepping,
                          due_at=self.pacer.due_at() if stepping else None)
        if stepping:
            return
        self.inner_step, self.round_samples = 0, 0
        if not self.overlapping:
            self._finish_pending()

    def _hand_over(self, final: bool = False) -> None:
        """Stop stepping for a round that registered first: hand θ over and wait for the round's result."""
        self.rounds.hand_over(self.trainer.parameters(), self.round_samples, self.inner_step)
        self.inner_step, self.round_samples = 0, 0
        self._finish_pending(final)

    def _finish_pending(self, final: bool = False) -> None:
        """Wait for the round in flight (counted as communication wait) and apply its result."""
        if self.rounds.stepping():
            if self.stop.is_set():  # stopped (a signal) while the round still gathers: given up, as a blocking round is
                self.rounds.give_up()
            else:  # the node's deadline (--max-steps, --duration): the round takes the steps so far
                self._hand_over(final)
            return
        waited = time.monotonic()
        try:
            done = self.rounds.wait(final)
        finally:
            wait = time.monotonic() - waited
            self.summary.comm_wait_s += wait
            self.metrics.comm_wait.inc(wait)
        if done is not None:
            self._apply_round(*done)

    def _apply_round(self, result: RoundResult, pending: PendingRound) -> None:
        m = self.metrics
        self.round_ended, self.round_rates = time.monotonic(), result.rates if result.in_sync else {}
        for kind in result.failures.values():
            m.errors.labels(kind).inc()
        m.round_duration.observe(result.duration_s)
        m.round_wait.set(result.gather_s)
        m.round_deadline.set(result.deadline_s)
        if result.closed_by:
            m.rendezvous_closes.labels(result.closed_by).inc()
        m.group_size.set(len(result.contributors))
        record = {"t": round(time.time(), 3), "round": result.round, "fragment": pending.fragment, "steps": pending.steps, "group": len(result.group),
                  "contributors": len(result.contributors), "members": sorted(p[-8:] for p in result.contributors), "failures": result.failures, "duration_s": round(result.duration_s, 3),
                  "gather_s": round(result.gather_s, 3), "exchange_s": round(result.exchange_s, 3), "deadline_s": round(result.deadline_s, 3), "closed_by": result.closed_by, "in_sync": result.in_sync,
                  "fingerprint": "", "loss": self.last_loss, "tokens": self.summary.steps * self.cfg.batch_size * self.trainer.model.cfg.context,
                  "norms": {p[-8:]: round(n, 6) for p, n in result.norms.items()}, "update_norm": round(result.update_norm, 6),
                  "aggregation": self.cfg.aggregation, "clipped": {p[-8:]: round(f, 4) for p, f in result.clipped.items()},
                  "capped": {p[-8:]: n for p, n in result.capped.items()}, "gains": {p[-8:]: round(g, 6) for p, g in result.gains.items()},
                  "overruled": [p[-8:] for p in result.overruled], "scheme": "reduce-scatter" if result.reduce_scatter else "all-gather", "groups": result.groups, "group_tag": result.group_tag}
        record["average_bytes_sent"], record["average_bytes_received"] = self.traffic_since_last("average")
        if result.late_for:
            record["late_for"] = [p[-8:] for p in result.late_for]
            self._follow_late_round(result, pending)
        elif not result.in_sync:
            m.outer_rounds.labels("failed").inc()
            m.errors.labels("out_of_sync").inc()
            self.event("out_of_sync", round=result.round, majority_peer=result.sync_peer)
            self.joiner.resync(result.sync_peer, result.round, members=result.contributors)
            self.inner_step = 0
        else:
            m.outer_rounds.labels("alone" if len(result.contributors) == 1 else "completed").inc()
            self.last_contributors = len(result.contributors)
            self.round += 1
            self.summary.outer_rounds += 1
            indices = self.plan.fragments[pending.fragment]
            params = self.trainer.parameters()
            if pending.eager is not None:
                # keep the steps taken since the estimate, moved by how far the estimate was off
                with torch.no_grad():
                    for i, guess in zip(indices, pending.eager):
                        params[i].data.add_((self.phi[i] - guess).to(params[i].device, params[i].dtype))
            else:  # an overlapped round that steps were taken beside keeps them (start); else θ ← φ exactly
                merge_fragment([params[i].data for i in indices], [self.phi[i] for i in indices], self.cfg.fragment_alpha,
                               start=pending.start if self.inner_step > 0 else None)
            if result.failures:
                self.event("round_partial", round=result.round, failures=result.failures)
        if not self.stop.is_set():
            moved = self.joiner.catch_up(self.round, keep_weights=self.cfg.algorithm == "noloco")
            if moved is not None:
                self.round = moved
        record["fingerprint"] = fingerprint(self.phi)
        m.outer_round.set(self.round)
        self._publish_snapshot()
        self._round_done(record, result.in_sync)
        self._choose_overlap()
        self._record_throughput(inner_tokens_per_s=self._inner_rate())
        self._write_info()
        logger.info("round %d done: %d/%d peers averaged in %.2fs (waited %.2fs), loss %.3f",
                    result.round, len(result.contributors), len(result.group), result.duration_s, result.gather_s, self.last_loss)

    def _publish_snapshot(self) -> None:
        """Offer joiners the round's φ and momentum (``gossip.state_server``: copied on the first request, until
        the outer optimizer next changes them); what the training loop moves on is taken now."""
        phi, round_no, fp = self.phi, self.round, fingerprint(self.phi)
        meta = {**run_settings(self.cfg), "error_feedback_decay": self.cfg.feedback_decay(), SCHEDULE_STEP: self.trainer.steps - self.inner_step}
        self.state_server.offer(lambda: StateSnapshot(
            round=round_no, tensors={"params": served_params(phi, self.attacker), "outer_momentum": self.outer.state_tensors(phi)},
            fingerprint=fp, meta=meta))

    # ---- throughput ----------------------------------------------------------------------------
    def _start_throughput(self) -> None:
        """What MFU needs: the model's FLOPs per token and the device's peak (``--peak-tflops`` or the table)."""
        self.flops_per_token = flops_per_token(self.model_cfg)
        self.peak_flops = peak_flops(self.device, self.cfg.peak_tflops)

    def _record_throughput(self, recent_tokens_per_s: float | None = None, inner_tokens_per_s: float | None = None) -> None:
        """Export the MFU of the recent rate (``locomesh_mfu``); the inner steps' rate and its MFU go in the summary."""
        record_throughput(self.summary, self.metrics, self.device, self.flops_per_token, self.peak_flops,
                          exported=recent_tokens_per_s, summarized=inner_tokens_per_s)

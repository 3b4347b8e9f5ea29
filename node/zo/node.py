"""The zeroth-order replica (``--algorithm zo``): fine-tune with forward passes only, one byte a step.

Lifecycle of ``node join --algorithm zo`` (the math is in ``gossip.zo``, the wire in ``gossip.zo_exchange``):

1. Weights: this node's own checkpoint in ``--checkpoint-dir`` (resume) > ``--init-from`` > ``--init-seed``.
2. With ``--initial-peers``: sync with a live peer (``node.zo.joiner``: replay its log of applied
   rounds, after downloading its snapshot only when the log does not start at this node's weights).
   A round entered mid-way is sat out (zero codes); ``--min-peers`` holds the first step until that
   many peers are in the run.
3. Every step: seed s(run, round, step, peer) → loss of its own batch at θ ± εz → one byte. θ stays
   fixed during a round of ``--inner-steps`` H steps.
4. Round end: DHT rendezvous (``gather_group``; the group is fixed there), fetch every member's codes
   (relayed by another member when the owner does not answer), vote on the fingerprints of the
   weights the members evaluated at. The majority's code sets are applied in the agreed order (by
   step, then peer id) and logged for joiners. A member in the minority — it started from other
   weights, e.g. because it missed a code set the others applied — resyncs from a majority peer
   (log replay, or snapshot + replay) once that peer finished the round. A member that finds others
   already past the round (it came late: they closed the round without it, or with it) replays
   their log instead of applying its own view, so it takes exactly what they applied, and joins
   their current round (sitting out its rest).
5. SIGTERM/SIGINT, ``--max-steps`` or ``--duration``: stop at a step boundary (after ``--max-steps``
   the last round's codes are served until the group fetched them, ≤ 5 s), evaluate, checkpoint, leave.

The lifecycle (start-up, heartbeat, status, checkpoint, leaving) is ``node.runtime.base``'s; this
module fills in what a zeroth-order replica does.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from gossip.deadline import AdaptiveDeadline
from gossip.fingerprint import fingerprint
from gossip.rendezvous import gather_group, round_members
from gossip.state_server import StateServer
from gossip.state_transfer import StateSnapshot
from gossip.votes import Tenure
from gossip.zo import apply_codes, encode_grad, expand, majority, pack_codes, spsa_estimate, step_seed
from gossip.zo_exchange import CodeExchange, CodeSet, LogEntry, Position, members_digest
from node.config import NodeConfig
from node.errors import JoinRefused, UserError
from node.runtime.base import NodeBase
from node.runtime.local_training import LocalTrainer
from node.runtime.network import Interrupted
from node.runtime.settings import run_settings
from node.runtime.status_service import StatusService
from node.zo.joiner import ZO_KEYS, Replica, ZOJoiner
from protocol.records import RoundEntry

logger = logging.getLogger("locomesh.node")
SNAPSHOT_EVERY = 4  # rounds between published weight snapshots (joiners replay the log since)
LOG_ROUNDS = 16  # applied rounds kept for joiners (and every round since the snapshot)
LINGER_S = 5.0


class ZONode(NodeBase):
    """One zeroth-order replica. ``run()`` blocks until the node stops and returns its exit code."""

    CODEC_LABEL = "one-byte"
    INTERRUPTED = "interrupted during a round"
    FINAL_LOG = "final: %d steps, %d rounds, train loss %.3f → %.3f, val loss %.3f"
    LEAVE_TIMEOUT_S = 5.0

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.rep = Replica([])
        self.last_group: list[str] = []
        self.position = Position(0, 0, "")
        self.tokens_per_s = 0.0

    @property
    def algorithm(self) -> str:
        return "zo"

    # ---- lifecycle (node.runtime.base) ------------------------------------------------------------
    def _prepare(self) -> None:
        cfg = self.cfg
        self._prepare_local()
        work = self.workload
        self.trainer = LocalTrainer(cfg=self.model_cfg, device=self.device, lr=cfg.lr, seed=cfg.model_seed, compile=cfg.compile, compile_mode=cfg.compile_mode)
        self.trainer.model.eval()  # never trained by backprop: no gradients, no optimizer state
        self.params = self.rep.params = self.trainer.parameters()
        self.batches = work.train_batches(cfg.batch_size, cfg.seed)
        checkpoint = self._own_checkpoint()
        if checkpoint is not None:
            self._resume(*checkpoint)
        elif work.init_weights is not None:
            self.trainer.load_weights(work.init_weights)
            self.event("init_from", checkpoint=work.init_source)
        self.fp = fingerprint(self.params)
        self.tenure = Tenure()  # whose fingerprint votes count (gossip.votes)
        self.reachable = self.reachable_members()
        self._set_position()

    def _services(self, status: StatusService) -> list[Any]:
        cfg, net = self.cfg, self.net
        self.exchange = CodeExchange(net.transport, cfg.run_id, lambda: self.position, self._meta(),
                                     serve_timeout=cfg.averaging_timeout, keep_log=LOG_ROUNDS)
        self.state_server = StateServer(net.transport, cfg.run_id, progress=lambda: self.step)
        self.deadline = AdaptiveDeadline.for_timeout(cfg.averaging_timeout, back_off=True)
        self.joiner = ZOJoiner(net=net, exchange=self.exchange, rep=self.rep, meta=self._meta(), peer_id=self.summary.peer_id,
                               publish_snapshot=self._publish_snapshot, round_steps=self._round_steps, metrics=self.metrics,
                               event=self.event, stop=self.stop, join_timeout=cfg.join_timeout,
                               wait_timeout=2 * cfg.averaging_timeout)
        return [self.exchange, self.state_server, status]

    def _join(self) -> None:
        if self.cfg.initial_peers:
            self._joined(self.joiner.join())
        self._publish_snapshot()

    def _join_hint(self) -> tuple[str, str]:
        return "", " --algorithm zo"

    def _work(self) -> None:
        self._train()

    def _record_fields(self) -> dict[str, Any]:
        return {"inner_step": self.step, "tokens_per_s": self.tokens_per_s}

    def _status_fields(self) -> dict[str, Any]:
        return {"inner_step": self.step, "tokens_per_s": self.tokens_per_s, "algorithm": "zo", "compression": self.cfg.codec,
                "fragments": 1, "round_steps": self._round_steps()}

    def _checkpoint_state(self) -> dict[str, Any]:
        weights = [p.detach().cpu().clone() for p in self.params]
        return {"inner_steps_total": self.summary.steps, "phi": weights, "theta": weights,
                "zo": {k: getattr(self.cfg, k) for k in ZO_KEYS}}

    def _wind_down(self) -> None:
        if not self.stop.is_set():
            self._linger()

    # ---- settings shared by the swarm --------------------------------------------------------
    round = property(lambda self: self.rep.round, lambda self, v: setattr(self.rep, "round", v))
    step = property(lambda self: self.rep.step, lambda self, v: setattr(self.rep, "step", v))
    fp = property(lambda self: self.rep.fp, lambda self, v: setattr(self.rep, "fp", v))
    codes = property(lambda self: self.rep.codes, lambda self, v: setattr(self.rep, "codes", v))
    snapshot_round = property(lambda self: self.rep.snapshot_round, lambda self, v: setattr(self.rep, "snapshot_round", v))

    def _meta(self) -> dict[str, Any]:
        return {**run_settings(self.cfg), **{k: getattr(self.cfg, k) for k in ZO_KEYS}}

    def _joined(self, joined: tuple[str, str] | None) -> None:
        if joined is None:
            self.event("join_alone", reason="no peer of this run answered within --join-timeout")
            return
        self.summary.joined_round = self.round
        self.event("joined", peer=joined[0], round=self.round, step=self.step, how=joined[1], fingerprint=self.fp)
        self._set_position()
        self.net.run(self._heartbeat(), self.stop)

    def _set_position(self) -> None:
        self.position = Position(self.round, self.step, self.fp)

    def _round_steps(self) -> int:
        return self.cfg.round_steps if self.cfg.inner_steps == "auto" else int(self.cfg.inner_steps)

    # ---- training ----------------------------------------------------------------------------
    def _train(self) -> None:
        cfg, model = self.cfg, self.trainer.model
        self.train_started = time.monotonic()
        tokens_per_step = cfg.batch_size * model.cfg.context
        self.codes = [0] * self.step
        while not self.stop.is_set() and not self._deadline_reached():
            if self.step >= self._round_steps():
                self._finish_round()
                continue
            x, y = (t.to(self.trainer.device) for t in self.batches.next())
            began = time.monotonic()
            seed = step_seed(cfg.run_id, self.round, self.step, self.summary.peer_id, cfg.zo_seed_pool)
            with self.trainer.autocast:
                g, plus, minus = spsa_estimate(lambda: self.trainer.forward_loss(x, y), self.params, seed, cfg.zo_eps)
            self.codes.append(encode_grad(g))
            self.step += 1
            self._set_position()
            self._count_steps(1, tokens_per_step, (plus + minus) / 2)
            self.tokens_per_s = tokens_per_step / max(time.monotonic() - began, 1e-6)
            self.metrics.tokens_per_second.set(self.tokens_per_s)
            if self.step >= self._round_steps():
                self._finish_round()

    def _finish_round(self) -> None:
        """Exchange this round's codes; apply the agreed code sets in the agreed order, or resync.

        The agreed sets are those of the members whose fingerprint (of the weights they evaluated at)
        has the majority, unless a member is past the round already (this node came late): then its
        log is replayed, so a late member never applies another set of codes than the others did."""
        cfg, net, me, m = self.cfg, self.net, self.summary.peer_id, self.metrics
        r, started = self.round, time.monotonic()
        own = CodeSet(me, r, self.fp, pack_codes(self.codes))
        net.run(self.exchange.publish(own), self.stop)
        net.run(self._heartbeat(), self.stop)
        deadline = self.deadline.value
        group, complete = net.run(gather_group(
            net.dht, net.validator, cfg.run_id, r, RoundEntry(peer_id=me, samples=len(self.codes), codec="zo"),
            lambda: self._members(r), deadline), self.stop)
        gathered = time.monotonic()
        self.deadline.observe(gathered - started, complete)
        self.last_group = [e.peer_id for e in group if e.peer_id != me]
        got = net.run(self.exchange.gather(self.last_group, r, cfg.averaging_timeout), self.stop)
        sets = {me: own, **got.sets}
        agreed, holder = majority({p: s.fingerprint for p, s in sets.items()}, r, me, self.tenure)
        self.tenure.observe(sets, r)
        chosen = tuple(sets[p] for p in sorted(sets) if sets[p].fingerprint == agreed)
        failures = {**got.failures, **{p: "out_of_sync" for p, s in sets.items() if s.fingerprint != agreed}}
        record: dict[str, Any] = {
            "t": round(time.time(), 3), "round": r, "nonzero_codes": sum(c != 0 for c in self.codes), "group": len(group),
            "contributors": len(chosen), "failures": failures, "gather_s": round(gathered - started, 3),
            "deadline_s": round(deadline, 3), "fingerprint_before": self.fp, "majority_fingerprint": agreed,
            "matched": self.fp == agreed, "late": False, "loss": self.last_loss}
        for kind in set(failures.values()) - {"relayed"}:
            m.errors.labels(kind).inc()
        # members past this round that applied other members than this node would: take their round
        digest = members_digest(s.peer for s in chosen)
        late = sorted(p for p, done in got.ahead.items() if done.members != digest)
        if late:
            record["matched"] = self._resync(late[0], r, "late") == "log"
            record.update(contributors=0, late=True)
        elif self.fp == agreed:
            before = self.fp
            messages = [msg for s in chosen for msg in expand(r, s.peer, s.codes)]
            record["applied"] = apply_codes(self.params, messages, cfg.run_id, cfg.zo_lr, pool=cfg.zo_seed_pool)
            self.fp = fingerprint(self.params)
            self.exchange.record(LogEntry(r, before, self.fp, chosen), self.snapshot_round)
            self.round, self.step = r + 1, 0
            self.summary.outer_rounds += 1
            m.outer_rounds.labels("alone" if len(chosen) == 1 else "completed").inc()
            odd = sorted(p for p, done in got.ahead.items() if done.after != self.fp)
            if odd:  # the same members, other weights: never expected; the fingerprint vote would catch it too
                record["matched"] = False
                self._resync(odd[0], r, "out_of_sync")
        else:
            self._resync(holder, r, "out_of_sync")
        self.codes = [0] * self.step
        self._set_position()
        record.update(fingerprint=self.fp, round_after=self.round, duration_s=round(time.monotonic() - started, 3))
        m.outer_round.set(self.round)
        m.group_size.set(len(chosen))
        m.round_duration.observe(record["duration_s"])
        if self.round - self.snapshot_round >= SNAPSHOT_EVERY:
            self._publish_snapshot()
        self._round_done(record, record["matched"])
        self._write_info()
        how = "came late: took the others' round" if record["late"] else "in sync" if record["matched"] else "resynced"
        logger.info("round %d: %d/%d members' codes applied (%s) in %.2fs, loss %.3f", r, record["contributors"], len(group),
                    how, record["duration_s"], self.last_loss)

    async def _members(self, round_no: int) -> set[str]:
        """The members round ``round_no``'s rendezvous waits for: those in it that answer a probe."""
        live = await round_members(self.net.dht, self.cfg.run_id, round_no)
        me = self.summary.peer_id
        return self.reachable.filter(live - {me}) | (live & {me})

    def _resync(self, peer: str, failed_round: int, why: str) -> str | None:
        """Take ``peer``'s weights and round once it finished ``failed_round``: "log" (replayed its log:
        this node's weights were right, it was only late), "snapshot+log", or None when that failed."""
        self.event(why, round=failed_round, peer=peer)
        self.metrics.outer_rounds.labels("late" if why == "late" else "failed").inc()
        if why != "late":
            self.metrics.errors.labels(why).inc()
        try:
            how = self.joiner.sync_from(peer, after_round=failed_round)
        except (Interrupted, JoinRefused):
            raise
        except Exception as e:
            self.event("resync_failed", peer=peer, round=failed_round, reason=str(e))
            self.step = 0
            return None
        self.event("resynced", peer=peer, how=how, round=self.round)
        return how

    def _publish_snapshot(self) -> None:
        self.snapshot_round = self.round
        self.state_server.renew(lambda: StateSnapshot(
            round=self.round, tensors={"params": [p.detach().to("cpu", torch.float32).clone() for p in self.params]},
            fingerprint=self.fp, meta=self._meta()))

    # ---- checkpoints and stopping ------------------------------------------------------------
    def _resume(self, path: Path, state: dict[str, Any]) -> None:
        weights = state.get("theta", state.get("phi"))
        if [tuple(t.shape) for t in weights] != [tuple(p.shape) for p in self.params]:
            raise UserError(f"checkpoint {path} holds tensors of other shapes; use another --checkpoint-dir or --fresh")
        self.trainer.load_weights(weights)
        saved = state.get("zo", {})
        if any(k in saved and saved[k] != getattr(self.cfg, k) for k in ZO_KEYS):
            logger.warning("checkpoint %s was written with %s; continuing with this node's settings", path, saved)
        self._resumed(path, state)

    def _linger(self) -> None:
        """Serve the last round's codes until every member of its group fetched them (≤ LINGER_S)."""
        until, last = time.monotonic() + LINGER_S, self.round - 1
        while time.monotonic() < until and not set(self.last_group) <= self.exchange.served.get(last, set()):
            if self.stop.wait(0.1):
                break

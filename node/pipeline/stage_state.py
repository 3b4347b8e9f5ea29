"""A stage server's state for other replicas: the snapshot it offers (φ, outer momentum, the stage's
progress), downloads of a stage's state from its replicas (joining, moving, rebuilding a neighbour), and the
resync of a replica that a round found out of sync.

A mixin of :class:`node.pipeline.stage_server.StageServer`, which holds the attributes it reads.
"""

from __future__ import annotations

import logging
import time

import torch

from gossip.byzantine import served_params
from gossip.fingerprint import fingerprint
from gossip.group_round import RoundResult
from gossip.rendezvous import list_peers
from gossip.state_sources import SourcePlan, plan_sources, rank_candidates
from gossip.state_transfer import StateSnapshot, download_state, meta_int, state_headers
from node.runtime.workload import identity
from protocol.records import PeerRecord
from swarm.lr_schedule import SCHEDULE_STEP, schedule_position
from swarm.stage_worker import StageWorker
from swarm.stages import Stage, stage_run

logger = logging.getLogger("locomesh.pipeline")

# A replica out of sync after round r waits for the replica it follows to publish round r's state: that one
# applies the round a moment after this one learned it is behind, and the state it offered until then is a
# round old. Taken at once, that state left this replica a round behind again, and the two replicas of a
# stage took turns being out of sync, round after round (seen in 2 of 3 clean runs of the hostile pipeline
# benchmark). Checked by the state's header (no download) every RESYNC_WAIT_S, RESYNC_TRIES times at most.
RESYNC_TRIES = 10
RESYNC_WAIT_S = 0.5


def _layout(module: torch.nn.Module) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
    """What a stage's state holds: its parameters and their outer momentum, fp32."""
    shapes = [(tuple(p.shape), torch.float32) for p in module.parameters()]
    return {"params": shapes, "outer_momentum": shapes}


class StageState:
    """Offering, downloading and resyncing a stage's state (attributes: ``StageServer``'s)."""

    def fetch_stage(self, index: int) -> tuple[Stage, PeerRecord | None]:
        """A neighbour stage's current weights, downloaded from one of its replicas."""
        module = self.new_stage(index)
        sub = stage_run(self.cfg.run_id, index)
        peers = self.net.call(list_peers(self.net.dht, sub), timeout=30)
        source = self._download(module, sub, peers, adopt=False)
        if source is None:
            raise RuntimeError(f"no replica of stage {index} answered")
        return module, peers.get(source)

    def _download(self, module: Stage, sub: str, peers: dict[str, PeerRecord], adopt: bool = True,
                  serving: StageWorker | None = None, ahead_of: int | None = None, prefer: str | None = None,
                  min_round: int | None = None) -> str | None:
        """Load a live replica's weights (and, with ``adopt``, outer momentum and round) into ``module``;
        returns its peer id. Replicas are asked as ``gossip.state_sources`` plans it: a state most of them
        report, from its holders and checked against their digests (``prefer`` first), else each by its own
        header (also when the majority holds a round below ``min_round``: the replicas have not all
        published the round just averaged); a replica announcing a round far ahead is not asked.
        ``serving``: the worker computing on ``module`` meanwhile, whose lock the copy takes (a request's
        backward pass must not see its weights change under it). ``ahead_of``: take only a state that
        holds more than this many stage steps (a resumed checkpoint's)."""
        net = self.net
        layout = _layout(module)
        rounds = {p: rec.round for p, rec in peers.items() if p != self.summary.peer_id and rec.role == "stage"}
        if self.reachable is not None and rounds:
            try:  # none answering: all of them (a private swarm may refuse this node's probes; downloads say so)
                live = net.call(self.reachable.check(set(rounds)), timeout=60)
                rounds = {p: r for p, r in rounds.items() if p in live} or rounds
            except Exception as e:
                logger.info("could not probe the replicas of %s: %s", sub, e)
        try:
            plan = net.call(plan_sources(net.transport, rounds, sub, layout, prefer=prefer, min_round=min_round, stripe=1,
                                         established=self.averager.tenure.established), timeout=30)
        except Exception as e:
            logger.warning("could not ask the replicas of %s for their state's digests: %s", sub, e)
            plan = SourcePlan([[p] for p in rank_candidates(rounds, prefer)[0]])
        poisoned = plan.left_out(sub)
        if poisoned:
            self.metrics.errors.labels("poisoned").inc(len(poisoned))
        for (source,) in plan.attempts:
            try:
                got = net.call(download_state(net.transport, source, sub, layout, trusted=plan.trusted), timeout=120)
            except Exception as e:
                logger.warning("could not download %s from %s: %s", sub, source, e)
                continue
            # the metadata is the source's word (digests cover tensors only): a value of the wrong type or out
            # of range is replaced, never raised out of this loop
            theirs = meta_int(got.snapshot.meta, "stage_steps", 0, 2**62, 0)
            if ahead_of is not None and not theirs > ahead_of:
                logger.info("replica %s of %s holds %s stage steps, this node's checkpoint %d: keeping the checkpoint",
                            source, sub, theirs, ahead_of)
                continue
            if serving is not None:
                serving.load_weights(got.snapshot.tensors["params"])
            else:
                with torch.no_grad():
                    for p, t in zip(module.parameters(), got.snapshot.tensors["params"]):
                        p.copy_(t)
            if adopt:
                self.outer.load_state_tensors(got.snapshot.tensors["outer_momentum"])
                # the replicas' warm-up, not a new one (it began no later than the round they hold)
                self.outer.first_round = meta_int(got.snapshot.meta, "first_round", 0, got.snapshot.round, 0)
                self.round = got.snapshot.round
                self.schedule_step = schedule_position(got.snapshot.meta, 0, self.schedule_step)
                self.stage_steps = max(self.stage_steps, theirs)
            self.metrics.state_downloads.labels("ok").inc()
            return source
        return None

    def publish_state(self) -> None:
        """Offer the stage's averaged weights and outer momentum to replicas that join or move in."""
        self.state_server.renew(lambda: StateSnapshot(
            round=self.round,
            tensors={"params": served_params(self.phi, self.averager.attacker), "outer_momentum": self.outer.state_tensors(self.phi)},
            fingerprint=fingerprint(self.phi),
            meta={"model": self.cfg.model, "stage": self.stage, "stages": self.cfg.stages, "first_round": self.outer.first_round,
                  "model_config": self.model_cfg.to_dict(), "checkfree_plus": self.cfg.checkfree_plus,
                  "tokenizer": identity(self.cfg)["tokenizer"], "stage_steps": self.stage_steps,
                  SCHEDULE_STEP: self.worker.steps if self.worker is not None else self.schedule_step},
        ))

    def resync(self, worker: StageWorker, result: RoundResult) -> None:
        """Out of sync after ``result``'s round: take the majority's φ from a replica, once it holds that
        round's state (see ``RESYNC_TRIES``; after them, the newest state it offers)."""
        assert self.stage is not None
        sub = stage_run(self.cfg.run_id, self.stage)
        peers = self.net.call(list_peers(self.net.dht, sub), timeout=30)
        source = result.sync_peer
        if source is not None and source in peers:
            layout = _layout(worker.stage)
            for _ in range(RESYNC_TRIES):
                try:
                    held = self.net.call(state_headers(self.net.transport, [source], sub, layout), timeout=15)
                except Exception:
                    held = {}
                if source not in held or held[source][0] >= result.round:
                    break
                time.sleep(RESYNC_WAIT_S)
        if self._download(worker.stage, sub, peers, serving=worker, prefer=source, min_round=result.round):
            self.phi = worker.snapshot(self.placement.device)
            self.round = max(self.round, result.round)
            self.publish_state()

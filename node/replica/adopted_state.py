"""What a whole-model replica takes over from its peers: a downloaded state (a join, a resync, a catch-up), and
the result of a round it was late for (``gossip.late_round``), with its own update kept on top.

:class:`AdoptedState` is a mixin of :class:`node.replica.node.Daemon`, whose state it reads and sets.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gossip.group_round import RoundResult
from gossip.state_transfer import DownloadedState
from node.replica.rounds import PendingRound
from swarm.lr_schedule import schedule_position


class AdoptedState:
    """The daemon's adoption of its peers' state."""

    cfg: Any
    trainer: Any
    round: int
    round_samples: int

    def _adopt(self, got: DownloadedState) -> None:
        """Take over a downloaded state, and the peer's progress into the round (so this node runs only
        the round's remaining inner steps)."""
        snap = got.snapshot
        self.phi = self.placement.copy_of(snap.tensors["params"])
        self.outer.load_state_tensors(snap.tensors["outer_momentum"])
        self.trainer.load_weights(self.phi)
        self.round = snap.round
        self._plan_round()
        self.inner_step = min(got.inner_step, self.pacer.pace.steps - 1)
        self.pacer.resume_at(self.inner_step, time.monotonic())
        self.trainer.steps = schedule_position(snap.meta, self.inner_step, self.trainer.steps,
                                               high=(snap.round + 1) * self.cfg.inner_steps_range[1])
        self.metrics.outer_round.set(self.round)

    def _follow_late_round(self, result: RoundResult, pending: PendingRound) -> None:
        """This node reached the round after most of its group closed without it (``gossip.late_round``): take the
        round's state from those members and keep this node's own update on top, its samples counted in the next round."""
        self.metrics.outer_rounds.labels("late").inc()
        self.event("late_for_round", round=result.round, members=[p[-8:] for p in result.late_for], samples=result.samples)
        before = self.round
        self.joiner.resync(result.sync_peer, result.round, members=result.late_for)
        if self.round <= before or result.late_update is None:  # no state adopted: the next round's vote decides
            return
        params = self.trainer.parameters()
        with torch.no_grad():  # θ = the round's φ − this node's own decoded Δ: its steps stay, and go out next round
            for i, own in zip(self.plan.fragments[pending.fragment], result.late_update):
                params[i].data.sub_(own.to(params[i].device, params[i].dtype))
        self.round_samples += result.samples
        self.event("late_update_kept", round=self.round, samples=self.round_samples)

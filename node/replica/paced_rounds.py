"""How a whole-model replica paces its rounds (``node.replica.pacing``'s plans), and the helper role:
a replica too slow to train helps instead (``--helper-below``).

A CPU among GPUs, or a laptop among desktops, would hold every round of a swarm paced by time to a step
of its own that takes longer than the others' whole budget, and add little: its update weighs by the few
samples it holds. Below ``--helper-below`` × the others' median speed for two rounds in a row, the daemon
stops its inner steps and says so. It then arrives at each round when the others' budget ends and joins
it with 0 samples: it votes, steps φ with the others' mean (so it stays bit-identical with them), owns
reduce-scatter parts, and serves joiners its state; its zero Δ weighs nothing (``gossip.diloco``). It
announces no speed, so the others' budgets do not wait for it. It stays a helper until it restarts: it
takes no steps, so it measures no new speed.

:class:`PacedRounds` is a mixin of :class:`node.replica.node.Daemon`, whose state it reads; it also plans
the daemon's rounds (``_plan_round``), which differ for a helper.
"""

from __future__ import annotations

import logging
import time

from gossip.diloco import DiLoCoAverager
from node.config import BY_REPLICAS
from node.replica.pacing import others_median, should_help

logger = logging.getLogger(__name__)


class PacedRounds:
    """The replica daemon's round plans (by time, by steps, or a helper's), when a round is due, whether it steps on
    through a round's rendezvous (``--step-while-gathering``) and when it stops, the helper's decision and its loop."""

    def _plan_round(self, start: float | None = None) -> None:
        """Plan the next round (``node.replica.pacing``): H steps, or under ``--inner-steps auto`` a time budget
        (from ``start``, if given: a round already under way)."""
        self.pacer.own_id = self.summary.peer_id
        tokens_per_step = self.cfg.batch_size * self.trainer.model.cfg.context
        shared = len(self.round_rates) > 1  # every member of the last round plans from the same entries
        # from the moment the round's result arrived (every member's is about the same), not after this node's
        # evaluation and checkpoint; an overlapped round paces from its start
        if start is None:
            start = self.round_ended if self.round_ended is not None and not self.overlapping else time.monotonic()
        rates = self.round_rates if shared else self.peer_rates
        if self.helping:
            pace = self.pacer.plan_helper(self._replicas(), rates, tokens_per_step, start, self.compute_tokens_per_s)
        else:
            pace = self.pacer.plan(self._replicas(), self.compute_tokens_per_s, rates, tokens_per_step, start, shared)
        self.metrics.round_inner_steps.set(pace.expected_steps)

    def _next_round(self) -> None:
        """After a round: plan the next one (and consider helping)."""
        before = self.pacer.pace.median_steps
        self._consider_helping()
        self._plan_round()
        if self.pacer.pace.median_steps != before and self.cfg.inner_steps in ("auto", BY_REPLICAS):
            logger.info("rounds of %d inner steps (at the median speed) from now on: %d replicas averaged in the last one",
                        self.pacer.pace.median_steps, self._replicas())

    def _gathers_first(self) -> bool:
        """Whether the swarm's fast peers step on through a round's rendezvous (``--step-while-gathering``): blocking
        DiLoCo rounds paced by time. Every peer's round is then due once its budget has run out (``RoundPacer.due``)."""
        cfg = self.cfg
        return cfg.step_while_gathering and not self.overlapping and self.pacer.by_time and isinstance(self.averager, DiLoCoAverager)

    def _steps_while_gathering(self) -> bool:
        """Whether this node's round registers ahead of its budget and its inner steps go on until it hands θ over
        (``node.replica.pacing``): every training node of a swarm whose peers step on, once it has a speed."""
        return self._gathers_first() and not self.helping and self.pacer.steps_while_gathering(self.compute_tokens_per_s)

    def _round_due(self, step_s: float) -> bool:
        """Whether this node's next round is due after a step of ``step_s`` (``RoundPacer.due``): a node that steps on
        through the rendezvous registers ahead of its budget, every other one when the budget is spent (with its
        peers stepping on) or at the nearer end of it."""
        return self.pacer.due(self.inner_step, time.monotonic(), step_s, spent=self._gathers_first(),
                              early=self._steps_while_gathering())

    def _steps_on_past_due(self) -> bool:
        """Whether a node whose round is due keeps stepping instead of waiting for the round before it (``--overlap``,
        asap and eager; ``delayed`` applies each result exactly one round late): that round still runs, and this round
        holds fewer than twice the steps it planned. The steps go into this round (its update weighs by the samples it
        holds), and the next round starts once the one in flight is applied. Without it the member that reaches the
        rendezvous first stands still every round: it waits there for the others in the background, then at its next
        round for the exchange it began earlier (docs/benchmarks.md, overlap on the CPU)."""
        cfg = self.cfg
        if not self.overlapping or cfg.overlap_mode == "delayed" or not self.rounds.running():
            return False
        if self.stop.is_set() or self._deadline_reached():  # at the node's deadline the steps so far go into a last round
            return False
        return self.inner_step < min(2 * max(self.pacer.pace.expected_steps, 1), self.pacer.step_cap)

    def _choose_overlap(self) -> None:
        """After a round is applied (none is in flight then): under ``--auto-overlap`` give the chooser the loop's
        counters and switch between blocking and overlapped rounds as it decides (``node.replica.overlap_choice``)."""
        chooser = self.overlap_chooser
        if chooser is None or self.helping:
            return
        decision = chooser.observe(time.monotonic(), self.summary.comm_wait_s, self.summary.steps)
        if decision is None:
            return
        self.overlapping = decision.overlap
        self.summary.overlap = chooser.state
        self.event(decision.event, round=self.round, **decision.why)
        if decision.event == "overlap_on":
            logger.info("rounds blocked %.0f %% of the training loop over the last %d rounds: overlapping them from round %d on "
                        "(it stays on if the inner steps get faster)", 100 * float(decision.why["blocked_share"]), chooser.window, self.round)
        elif decision.event == "overlap_off":
            logger.warning("overlap saved %.0f %% of the loop's time blocked but the inner steps got only %.1f %% faster "
                           "(needed %.1f %%): blocking rounds from round %d on", 100 * (float(decision.why["blocking_blocked_share"])
                           - float(decision.why["blocked_share"])), 100 * float(decision.why["speed_gain"]),
                           100 * float(decision.why["needed_gain"]), self.round)

    def _hand_over_due(self) -> bool:
        """Whether a node stepping on through its round's rendezvous stops now: a member waits for it (it asked for
        the contribution), the group is complete and the budget spent (and no member much slower than this node is
        still taking its last step: ``RoundPacer.waits_for_slower``), or the round holds the most steps it may."""
        rounds, now = self.rounds, time.monotonic()
        if rounds.waited_for() or self.inner_step >= self.pacer.step_cap:
            return True
        if not rounds.gathered() or not self.pacer.spent(now):
            return False
        longest = self.averager.deadline.value  # (a DiLoCo averager: _gathers_first)
        return not self.pacer.waits_for_slower(now, self.compute_tokens_per_s, rounds.group_rates(), longest)

    def _replicas(self) -> int:
        """How many replicas average together: the members of this node's last round in sync (every member of
        a round counts the same ones), before any round the trainers whose records this node sees."""
        if self.last_contributors:
            return self.last_contributors
        return 1 + sum(1 for p in self.peer_rates if p != self.summary.peer_id)

    def _announced_rate(self) -> float:
        """The speed this node announces (records, round entries): none while it helps, so it moves no budget."""
        return 0.0 if self.helping else self.compute_tokens_per_s

    def _consider_helping(self) -> None:
        """After a round: switch to helping when this node's inner steps ran below ``--helper-below`` × the others'
        median speed in two rounds in a row (rounds paced by time only: a helper arrives when the budget ends).
        A helper stays one until it restarts: it takes no steps, so it measures no new speed."""
        cfg = self.cfg
        if self.helping or not self.pacer.by_time or cfg.helper_below <= 0 or cfg.algorithm not in ("diloco", "sparseloco"):
            return
        rates = self.round_rates if len(self.round_rates) > 1 else self.peer_rates
        slow = should_help(self.compute_tokens_per_s, rates, self.summary.peer_id, cfg.helper_below)
        self.slow_rounds = self.slow_rounds + 1 if slow else 0
        if self.slow_rounds < 2:
            return
        median = others_median(rates, self.summary.peer_id)
        self.helping = True
        self.summary.role = "helper"
        self.event("helping", tokens_per_s=round(self.compute_tokens_per_s, 1), median_tokens_per_s=round(median, 1),
                   helper_below=cfg.helper_below)
        logger.warning("this node trains at %.0f tokens/s, under %.2f of the swarm's median %.0f: from round %d on it helps "
                       "(keeps φ with the others' rounds, serves joiners, owns reduce-scatter parts) without training; "
                       "restart it to train again, or set --helper-below 0 to always train",
                       self.compute_tokens_per_s, cfg.helper_below, median, self.round)

    def _help_round(self) -> None:
        """A helper's round: wait for the budget the others plan, then join it with 0 samples."""
        while not self.pacer.helper_due(time.monotonic()):
            left = self.pacer.pace.started + (self.pacer.pace.budget_s or 0.0) - time.monotonic()
            if self.stop.wait(min(0.2, max(left, 0.0))) or self._deadline_reached():
                return
        self._finish_pending()  # an overlapped round (--overlap) may still run
        self._start_round(0)
        self.helped_steps += self.pacer.pace.median_steps
        self._plan_round()

    def _deadline_reached(self) -> bool:
        cfg = self.cfg
        if self.helping and cfg.max_steps is not None and self.summary.steps + self.helped_steps >= cfg.max_steps:
            return True
        return super()._deadline_reached()

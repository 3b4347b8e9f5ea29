"""When a whole-model replica's next outer round is due.

Two ways to pace rounds:

- **Steps** (``--inner-steps N`` or ``by-replicas``): every peer takes the same H inner steps, so a
  fast peer stands still at the rendezvous until the slowest arrives.
- **Time** (``--inner-steps auto``, the default of diloco and sparseloco): a round is a wall-clock
  budget, the time the swarm's median-speed peer needs for the median H (``--round-steps``, or the
  by-replicas table's H for the replicas of the last round). Every peer, fast or slow, takes the steps
  that fit in it, counted from the end of its last round (all members leave a round together), so they
  all reach the next rendezvous together; a peer that slows down mid-round simply takes fewer steps.
  Updates weigh by the samples they hold (capped at ``AUTO_STEPS_MAX_FACTOR`` × the median's).

A peer far slower than the others (below ``--helper-below`` × the median for two rounds in a row) stops
training and **helps** (:func:`should_help`): it arrives when the budget ends (:meth:`RoundPacer.plan_helper`,
from the others' speeds alone), joins the round with 0 samples (it votes, keeps φ and owns reduce-scatter
parts; its Δ weighs nothing) and serves joiners. It announces no speed, so it moves nobody's budget.

The budget comes from the speeds the members announced in the entries of the last round (every member
of a round holds the same entries, so all plan the same budget and arrive together), or before a round
from the peers' records. Each speed is a claim, clipped to [1/factor, factor] × this node's own measured
speed, and only the median counts, so one liar moves it by one rank at most.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gossip.fragments import sync_interval
from node.config import AUTO_STEPS_MAX_FACTOR, NodeConfig


SLOWER_FACTOR = 1.5  # a member whose steps are at least this × a node's own takes its last step past the budget
REGISTER_LEAD = 0.1  # a node that steps on through a round's rendezvous registers this share of the budget before it runs out ...
REGISTER_LEAD_S = (0.25, 2.0)  # ... but at least and at most this many seconds (or one of its steps; never more than half the budget)


@dataclass(frozen=True)
class RoundPace:
    """The current round's plan: ``steps`` (time pacing: the most steps, a sample cap), ``budget_s`` (the
    round's wall-clock budget, None when pacing by steps) and ``started`` (``time.monotonic()``)."""

    steps: int
    budget_s: float | None
    started: float
    expected_steps: int  # what this node expects to take (status, metrics)
    median_steps: int  # the median-speed peer's steps in this round


class RoundPacer:
    """Plans each round of one replica and says when it is due."""

    def __init__(self, cfg: NodeConfig, own_id: str) -> None:
        self.cfg, self.own_id = cfg, own_id
        self.pace = RoundPace(steps=1, budget_s=None, started=0.0, expected_steps=1, median_steps=1)

    @property
    def by_time(self) -> bool:
        return self.cfg.inner_steps == "auto"

    @property
    def provisional(self) -> bool:
        """Paced by time, but this round counts steps until this node knows a speed (its first round)."""
        return self.by_time and self.pace.budget_s is None

    def median_steps(self, replicas: int) -> int:
        """The steps of a round at the swarm's median speed (H/P with ``--fragments`` P)."""
        cfg = self.cfg
        fixed = cfg.steps_for(replicas)
        steps = fixed if fixed is not None else cfg.median_steps(replicas)
        return sync_interval(max(steps, cfg.fragments), cfg.fragments)  # validation keeps a given H ≥ --fragments

    def median_rate(self, mine: float, rates: dict[str, float], shared: bool = False) -> float:
        """The median of the announced speeds (tokens/s), each clipped to [1/factor, factor] × this node's
        own, so one peer announcing 1e30 changes little. ``shared``: ``rates`` are a round's entries, this
        node's own included as it announced it (the same numbers on every member); else this node's
        measured speed stands for its own."""
        bound = AUTO_STEPS_MAX_FACTOR
        clipped = {p: min(max(r, mine / bound), mine * bound) for p, r in rates.items() if r > 0}
        if not shared or self.own_id not in clipped:
            clipped[self.own_id] = mine
        return statistics.median(clipped.values())

    def plan(self, replicas: int, mine: float, rates: dict[str, float], tokens_per_step: int, now: float,
             shared: bool = False) -> RoundPace:
        """Plan the round starting ``now``: ``mine`` is this node's measured speed (tokens/s, 0 before its
        first step), ``rates`` the announced ones (``shared``: the last round's entries, see :meth:`median_rate`)."""
        steps = self.median_steps(replicas)
        if not self.by_time or mine <= 0:  # time pacing needs a speed: until this node has one, the median's steps
            self.pace = RoundPace(steps=steps, budget_s=None, started=now, expected_steps=steps, median_steps=steps)
            return self.pace
        budget = steps * tokens_per_step / self.median_rate(mine, rates, shared)
        cap = steps * AUTO_STEPS_MAX_FACTOR
        expected = min(max(1, round(budget * mine / tokens_per_step)), cap)
        self.pace = RoundPace(steps=cap, budget_s=budget, started=now, expected_steps=expected, median_steps=steps)
        return self.pace

    def plan_helper(self, replicas: int, rates: dict[str, float], tokens_per_step: int, now: float, fallback_rate: float) -> RoundPace:
        """Plan a helper's round starting ``now``: no steps, and the budget the others plan, from the median of
        their announced speeds (``fallback_rate``, this node's last measured one, while it knows none). An
        inflated claim only brings the helper early; a deflated one is one rank of a median."""
        steps = self.median_steps(replicas)
        rate = others_median(rates, self.own_id) or fallback_rate
        budget = steps * tokens_per_step / rate if rate > 0 else None
        self.pace = RoundPace(steps=0, budget_s=budget, started=now, expected_steps=0, median_steps=steps)
        return self.pace

    def helper_due(self, now: float) -> bool:
        """Whether a helper's round is due: its budget has run out (at once when it has none)."""
        pace = self.pace
        return pace.budget_s is None or now - pace.started >= pace.budget_s

    def resume_at(self, progress_steps: int, now: float) -> None:
        """A joiner took over a round ``progress_steps`` inner steps in (its source's count): it runs what
        is left of it (by time: the median peer's share of the budget)."""
        pace = self.pace
        if pace.budget_s is None:
            return
        done = min(progress_steps / pace.median_steps, 0.9)
        self.pace = RoundPace(pace.steps, pace.budget_s, now - done * pace.budget_s, pace.expected_steps, pace.median_steps)

    def due(self, steps_taken: int, now: float, step_s: float, spent: bool = False, early: bool = False) -> bool:
        """Whether the round is due after ``steps_taken`` steps, the last of which took ``step_s``: by
        steps, at the plan's count; by time, once another step would end further past the budget than
        stopping now ends before it (at least one step, at most the cap); with ``spent`` (the swarm's fast
        peers step on until the group is complete), once the budget has run out: a slow peer then arrives
        late rather than early, and the others train meanwhile instead of the slow peer waiting for them.
        ``early``: this node steps on through the rendezvous; its round is due (it registers) ``register_lead``
        before the budget runs out, so that nobody waits for it to register."""
        pace = self.pace
        if steps_taken >= pace.steps:
            return True
        if pace.budget_s is None or steps_taken < 1:
            return False
        if early:
            return now - pace.started + register_lead(pace.budget_s, step_s) >= pace.budget_s
        return now - pace.started + (0.0 if spent else step_s / 2) >= pace.budget_s

    def due_at(self) -> float | None:
        """When this round's budget runs out (``time.monotonic()``), None pacing by steps or before speeds are known."""
        pace = self.pace
        return None if pace.budget_s is None else pace.started + pace.budget_s

    def spent(self, now: float) -> bool:
        """Whether the round's budget has run out (always, pacing by steps or before speeds are known): a node
        that steps on through the rendezvous hands θ over once its group is complete *and* this holds, unless a
        member already waits for it."""
        pace = self.pace
        return pace.budget_s is None or now - pace.started >= pace.budget_s

    def waits_for_slower(self, now: float, mine: float, rates: dict[str, float], longest_s: float) -> bool:
        """Whether a node of ``mine`` tokens/s whose budget is spent and whose group is complete steps on: a member of
        the group announced a speed of at most 1/``SLOWER_FACTOR`` of it (``rates``, the group's entries; helpers
        announce none), so that member's last step ends past the budget and it asks for this node's update once it
        has handed its own θ over (this node then hands over at the end of the step in progress). Until then this
        node trains instead of waiting in the exchange, for at most ``longest_s`` past the budget (the node passes its
        rendezvous deadline: as long as it would wait for a member that had not registered yet), so a member that
        claims to be slow and never asks holds it no longer than a late one would."""
        pace = self.pace
        if pace.budget_s is None or mine <= 0:
            return False
        if not any(p != self.own_id and 0 < r * SLOWER_FACTOR <= mine for p, r in rates.items()):
            return False
        return now - pace.started < pace.budget_s + longest_s

    def steps_while_gathering(self, mine: float) -> bool:
        """Whether a node of ``mine`` tokens/s takes inner steps while its round waits for the group: rounds paced
        by time, once it has a speed, whatever that speed. A slow node's round does not get longer for it: it hands
        θ over once the budget is spent, as a node that stops at the budget would, or at the end of the step in which
        a member asks for its update (about when the budget runs out: nobody hands over earlier); but its
        registration and DHT reads are done while it takes its last step instead of after it."""
        return self.by_time and mine > 0

    @property
    def step_cap(self) -> int:
        """The most steps a round paced by time may hold (a node stepping on through its rendezvous stops there)."""
        pace = self.pace
        return pace.steps if pace.budget_s is not None else pace.median_steps * AUTO_STEPS_MAX_FACTOR


def register_lead(budget_s: float, step_s: float = 0.0) -> float:
    """How long before its budget runs out a node that steps on through the rendezvous registers: the members'
    rounds start apart by the spread of the last round's end (and of what each does after it), and a node that
    registered late would keep the others standing still for it. At least one of its steps (``step_s``, the
    last one's time), so that a slow node's registration lands before the step that crosses the budget."""
    low, high = REGISTER_LEAD_S
    return min(max(REGISTER_LEAD * budget_s, low, step_s), high, budget_s / 2)


def should_help(mine: float, rates: dict[str, float], own_id: str, below: float) -> bool:
    """Whether a node whose inner steps run at ``mine`` tokens/s is too slow to train among peers announcing
    ``rates``: below ``below`` × the median of the others' speeds (0: never). Needs a speed of its own and at
    least one other trainer's."""
    median = others_median(rates, own_id)
    if below <= 0 or mine <= 0 or median is None:
        return False
    return mine < below * median


def others_median(rates: dict[str, float], own_id: str) -> float | None:
    """The median of the speeds other peers announce (0: not measured, or a helper's), None when there are none."""
    others = [r for p, r in rates.items() if p != own_id and r > 0]
    return statistics.median(others) if others else None


STALL_FACTOR = 4.0  # a step that took longer than this × the typical one was stalled (paused, swapped out), not slow


def stall_capped(step_s: float, typical_s: float) -> float:
    """A step's time as ``--slowdown`` and the typical step count it: at most ``STALL_FACTOR`` × the ``typical_s`` one
    (0: none measured yet), so a process paused for a minute mid-step (SIGSTOP, a laptop's sleep) counts as slow
    hardware no more than a few steps' worth."""
    return min(step_s, STALL_FACTOR * typical_s) if typical_s > 0 else step_s


def slowdown_sleep(slowdown: float, step_s: float, typical_s: float) -> float:
    """``--slowdown``'s pause after an inner step of ``step_s`` seconds: (slowdown − 1) × the step, stalls capped
    (:func:`stall_capped`), so a paused process does not then sleep (slowdown − 1) minutes more."""
    return (slowdown - 1) * stall_capped(step_s, typical_s) if slowdown > 1 else 0.0

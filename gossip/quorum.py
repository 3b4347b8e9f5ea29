"""A quorum and a grace window: a round's rendezvous stops waiting for its last members soon after most of them came.

Without it a round waits for every expected member until the adaptive deadline (``gossip.deadline``, 5 s at
least): one member that stalls (a laptop that slept, a GPU taken by a game, a process paused) holds every other
member's round that long, every time. With it a member closes its group ``grace`` seconds after a quorum of the
expected members (itself included) registered, or when all did, or at the deadline, whichever comes first. A member
that comes after the group closed is late for the round: the others refuse it, it follows the round and its update
enters the next one, weighted by the tokens it holds (``gossip.late_round``), so nothing it did is lost.

- **Quorum**: ``⌊fraction · n⌋ + 1`` of the ``n`` expected members (``--quorum``, 0.5: a strict majority), at most
  ``n``: with two members, both. A machine-wide hiccup that delays everyone never reaches a quorum early, so the
  grace can be shorter than the deadline's floor: it only ever cuts a minority.
- **Grace, learned**: each member keeps, from its recent rounds that completed, how long after the quorum the last
  member came (the arrival spread, as this member's polls saw it); its grace is ``multiplier`` × the largest recent
  spread, at least ``GRACE_FLOOR_S``. Each round that closed by the grace without a member doubles it (a member
  late by a steady margin is cut once or twice, not every round), until a round completes with everyone it
  expected beyond a quorum. Until it has seen
  ``LEARN_ROUNDS`` spreads a member has no grace yet and waits as before.
- **One grace per round**: every member registers its grace in its round entry, and a round's grace is the largest
  that the registered members propose, or none (wait to the deadline) when one of them proposes none (0: a member
  without the history, or of an older build). Members that read the same entries close under the same grace, so
  they close within a poll or two of each other, and the member they leave out comes later than any of them. A
  member that lies can lengthen a round's grace (to the deadline: the rule without a quorum), never shorten it.

What is left: the members close on their own polls, up to ``poll_interval`` apart plus the DHT's propagation; a member
that registers inside that window is counted by some and refused by others. The refusal rule
(``gossip.late_round``: late only when most members refused) and the next round's fingerprint vote settle it, as they
do at the deadline.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

GRACE_FLOOR_S = 1.0  # the shortest grace: members' polls are 0.2 s apart, and their entries spread through the DHT
GRACE_MULTIPLIER = 3.0  # grace = this × the largest recent arrival spread
GRACE_WINDOW = 8  # rounds whose spreads the grace looks at
LEARN_ROUNDS = 3  # complete rounds with a spread seen before a member proposes a grace
MAX_DOUBLINGS = 6


def quorum_size(expected: int, fraction: float) -> int:
    """How many of ``expected`` members (this one included) must have registered before the grace starts:
    ``⌊fraction · expected⌋ + 1``, at most ``expected`` (``fraction`` ≥ 1: every one of them)."""
    if expected <= 0:
        return 0
    if fraction >= 1:
        return expected
    return min(expected, math.floor(fraction * expected) + 1)


def round_grace(proposals: Iterable[float]) -> float | None:
    """The grace a round's members close under, from the proposals of the members registered so far: the largest,
    or None (no early close) when any of them proposes none (≤ 0, or not a finite number)."""
    values = list(proposals)
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        return None
    return max(values)


class GraceWindow:
    """One member's grace, learned from the arrival spreads of its recent complete rounds.

    :param floor: the shortest grace, seconds
    :param multiplier: grace = multiplier × the largest recent spread
    :param window: how many recent spreads count
    :param learn_rounds: spreads seen before there is a grace at all
    """

    def __init__(self, floor: float = GRACE_FLOOR_S, multiplier: float = GRACE_MULTIPLIER, window: int = GRACE_WINDOW,
                 learn_rounds: int = LEARN_ROUNDS) -> None:
        if floor <= 0 or multiplier < 1 or window < 1 or learn_rounds < 1:
            raise ValueError(f"need floor > 0, multiplier ≥ 1, window ≥ 1, learn_rounds ≥ 1; got {floor}, {multiplier}, "
                             f"{window}, {learn_rounds}")
        self.floor, self.multiplier, self.learn_rounds = floor, multiplier, learn_rounds
        self.spreads: deque[float] = deque(maxlen=window)
        self.seen = 0  # spreads observed in all
        self.doublings = 0  # rounds in a row closed by the grace without a member

    def observe(self, closed_by: str, spread_s: float | None) -> None:
        """One round's end: ``closed_by`` is ``complete``, ``grace`` or ``deadline``; ``spread_s`` is how long after the
        quorum the group completed (None when the quorum was the whole group, or the round did not complete)."""
        if closed_by == "complete" and spread_s is not None and spread_s >= 0:
            # (a complete round without a quorum smaller than its group, e.g. the member cut last time no longer
            # expected, says nothing about how late it comes: the back-off stays)
            self.doublings = 0
            self.spreads.append(spread_s)
            self.seen += 1
        elif closed_by == "grace":
            self.doublings = min(self.doublings + 1, MAX_DOUBLINGS)

    @property
    def value(self) -> float | None:
        """This member's grace in seconds, None while it has not learned one."""
        if self.seen < self.learn_rounds or not self.spreads:
            return None
        return max(self.floor, self.multiplier * max(self.spreads)) * 2**self.doublings

    def proposal(self) -> float:
        """What this member registers in its round entry: its grace, 0 for none."""
        value = self.value
        return 0.0 if value is None else value


@dataclass
class GatherTimes:
    """How a rendezvous ended, filled in by ``gossip.rendezvous.gather_group``: when the quorum was reached
    (``time.monotonic()``, None: never, or it was the whole group), the grace it closed under (None: none), and
    ``closed_by``: ``complete``, ``grace`` or ``deadline``."""

    quorum_at: float | None = None
    grace_s: float | None = None
    closed_by: str = ""

    def grace_start(self, grace_from: float | None) -> float:
        """When the grace counts from: the quorum, or ``grace_from`` (a member stepping through the rendezvous registers
        ahead of its budget, and the members' leads differ by seconds: its waiting only starts once its budget is
        spent), whichever is later. Needs ``quorum_at``."""
        assert self.quorum_at is not None
        return self.quorum_at if grace_from is None else max(self.quorum_at, grace_from)

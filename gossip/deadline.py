"""Backup-worker deadline for a round's rendezvous that adapts to how long rounds really take.

A round closes when every expected member arrived or the deadline passed. A fixed deadline is either
too short for a slow link (members are dropped for nothing) or too long when a member died (its
group idles). The deadline here is ``multiplier`` × the median of the recent waits of rounds that
completed, kept within [floor, ceiling]; until a round completes it is the ceiling. With
``back_off`` (whole-group rounds), each round in a row that closed without a member still expected
doubles it (up to the ceiling): a member that is
alive but late by about one deadline (after a resync on a slow link, say) would otherwise arrive
just after the others left, every round, and the swarm would stay split into members averaging
alone (seen at 5 Mbit/s: two DiLoCo nodes alone for 15 rounds in a row). A dead member's record
expires, so it stops being expected and costs no more than the first miss.

Under bandwidth caps (``--max-upload-mbit``, a member's announced cap) members reach a round later by
the time their last transfers took; ``slack``, that time, is added to every deadline, past the
ceiling too, so a capped member is not dropped every round.
"""

from __future__ import annotations

import statistics
from collections import deque

# the shortest deadline the daemons use: a member delayed a few seconds (a busy CPU, a GC pause, a
# joiner finishing its first steps) still makes the round
DEADLINE_FLOOR_S = 5.0


class AdaptiveDeadline:
    """How long a member waits for the rest of its group.

    :param ceiling: the longest wait ever (``--averaging-timeout``)
    :param floor: the shortest deadline, so a lucky streak of instant rounds cannot starve a slow peer
    :param multiplier: deadline = multiplier × median of recent complete waits
    :param window: how many recent rounds the median looks at
    :param back_off: double the deadline for each incomplete round in a row (whole-group rounds; a
        NoLoCo member left without a partner is normal and must not slow down)
    """

    def __init__(self, ceiling: float, floor: float = 2.0, multiplier: float = 3.0, window: int = 8, back_off: bool = False) -> None:
        if not 0 < floor <= ceiling or multiplier < 1 or window < 1:
            raise ValueError(f"need 0 < floor ≤ ceiling, multiplier ≥ 1, window ≥ 1; got {floor}, {ceiling}, {multiplier}, {window}")
        self.ceiling, self.floor, self.multiplier = ceiling, floor, multiplier
        self.waits: deque[float] = deque(maxlen=window)
        self.back_off = back_off
        self.misses = 0  # rounds in a row that closed without every expected member
        self.slack = 0.0  # seconds the last round's transfers took at least under the bandwidth caps in play

    @classmethod
    def for_timeout(cls, ceiling: float, back_off: bool = False) -> "AdaptiveDeadline":
        """The daemons' deadline under ``--averaging-timeout`` (the floor never above the ceiling)."""
        return cls(ceiling, floor=min(DEADLINE_FLOOR_S, ceiling), back_off=back_off)

    def observe(self, wait_s: float, complete: bool) -> None:
        """Record one round's wait; only rounds where everybody arrived say how long waiting takes."""
        if complete and wait_s >= 0:
            self.waits.append(wait_s)
        self.misses = 0 if complete or not self.back_off else min(self.misses + 1, 16)

    @property
    def value(self) -> float:
        if not self.waits:
            return self.ceiling + self.slack
        base = max(self.floor, self.multiplier * statistics.median(self.waits))
        return min(self.ceiling, base * 2**self.misses) + self.slack

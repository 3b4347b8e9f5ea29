"""The inner learning-rate schedule: a pure function from the schedule position (inner steps taken) to
a factor of the base learning rate, shared by whole-model replicas and pipeline stage servers.

Every schedule warms up linearly over ``warmup_steps`` (factor (s+1)/W at step s), then:

- ``constant``: 1 for ever (the behaviour before schedules existed);
- ``cosine``: half a cosine from 1 at step W down to ``floor`` at ``total_steps``, ``floor`` after;
- ``wsd`` (warm-up, stable, decay): 1 until the last ``decay_fraction`` of ``total_steps``, then linear
  down to ``floor`` at ``total_steps``, ``floor`` after.

The position is the swarm's, not the process's: a joiner takes it from the state it downloads and a
resumed node from its checkpoint, so neither restarts warm-up (``node.replica.node``, ``node.pipeline``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

Schedule = Literal["constant", "cosine", "wsd"]
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "wsd")
WSD_DECAY_FRACTION = 0.2  # WSD decays over the last 20% of the steps (Hägele et al. 2024 find 10–20% enough)
DEFAULT_FLOOR = 0.1
SCHEDULE_STEP = "schedule_step"  # in a state download's meta: the inner lr schedule's position at the start of the peer's round


@dataclass(frozen=True)
class LrSchedule:
    """``factor(step)``: the multiplier of the base lr at schedule position ``step`` (0-based)."""

    kind: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    floor: float = DEFAULT_FLOOR
    decay_fraction: float = WSD_DECAY_FRACTION

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; choose one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be at least 0, got {self.warmup_steps}")
        if not 0 <= self.floor <= 1:
            raise ValueError(f"the lr floor is a fraction of the lr in [0, 1], got {self.floor}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"the WSD decay fraction must lie in (0, 1], got {self.decay_fraction}")
        if self.kind != "constant":
            if self.total_steps is None:
                raise ValueError(f"lr schedule {self.kind} needs the run's length: give --total-steps or --max-steps")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(f"lr schedule {self.kind} decays after warm-up, but the run's {self.total_steps} steps do not "
                                 f"outlast --warmup-steps {self.warmup_steps}: raise --total-steps or lower --warmup-steps")

    @property
    def decay_start(self) -> float:
        """The step at which the factor starts to fall below 1 (the end of warm-up for cosine)."""
        if self.kind == "constant":
            return math.inf
        assert self.total_steps is not None
        if self.kind == "cosine":
            return self.warmup_steps
        return max(self.warmup_steps, self.total_steps - math.ceil(self.decay_fraction * self.total_steps))

    def factor(self, step: int) -> float:
        """The lr multiplier at schedule position ``step`` (negative positions count as 0)."""
        step = max(0, int(step))
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        if self.kind == "constant" or step < self.decay_start:
            return warm
        assert self.total_steps is not None
        span = self.total_steps - self.decay_start
        progress = min(1.0, (step - self.decay_start) / span)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return warm * (self.floor + (1.0 - self.floor) * shape)


def schedule_position(meta: dict[str, object], inner_step: int, own: int, high: int | None = None) -> int:
    """The lr schedule position a joiner continues from: the peer's position at the start of its round plus
    the steps it took into the round that the joiner skips (``inner_step``). A peer that does not say
    (an older version), or says more than ``high`` (the most steps the rounds so far can hold: a position
    is its holder's claim, and one at the schedule's end would leave the joiner at its final lr),
    leaves the joiner's ``own`` position."""
    start = meta.get(SCHEDULE_STEP)
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        return own
    if high is not None and start > high:
        logger.warning("a downloaded state's lr schedule position %d is past the %d steps its rounds can hold: "
                       "keeping this node's own (%d)", start, high, own)
        return own
    return start + inner_step

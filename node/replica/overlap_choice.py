"""Whether a replica hides its rounds behind its inner steps (``--auto-overlap``): measured, never assumed.

A node under ``--auto-overlap`` starts with blocking rounds and watches what they cost. Each applied round
closes a span of the training loop: its wall seconds, the seconds of it spent waiting for rounds, and the inner
steps taken in it. The first round is left out (it waits for peers to start). Over ``WINDOW`` rounds:

- **blocked share below ``THRESHOLD``**: rounds cost little; the node keeps measuring (a cap set later, a slower
  peer or a larger group can change that).
- **at or above it**: overlap goes on (``asap``: a round's result lands on the steps taken meanwhile). What it
  must buy is speed: the node compares its steps per wall second over the next ``WINDOW`` rounds with the
  blocking window's. Overlap stays on when the rate rose by at least ``PAYBACK`` of the share it no longer
  spends blocked; else it goes off for good (on two shared CPU cores the exchange slowed the steps beside it by
  as much as it stopped blocking them: docs/benchmarks.md, "Overlap steps on while the round before it still
  runs"), since a one-step-delayed update costs loss per step and must be paid for in steps.

Known limits (docs/benchmarks.md, "--auto-overlap"): a window of three short rounds can judge on noise, and each
member chooses alone, so a pair can end up half overlapped; both keep this opt-in.

Pure bookkeeping: :class:`OverlapChooser` takes the node's cumulative counters after each round and says what
to do; the node flips its own flag between rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

THRESHOLD = 0.10  # a blocked share of the loop worth hiding ("more than a few percent")
WINDOW = 3  # rounds per measurement
PAYBACK = 0.5  # of the blocked share saved, the share of speed overlap must gain to stay on

State = Literal["measuring", "trying", "on", "off"]


@dataclass(frozen=True)
class Span:
    """A stretch of the training loop between two applied rounds."""

    wall_s: float
    blocked_s: float
    steps: int

    @property
    def blocked_share(self) -> float:
        return self.blocked_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0


def combined(spans: list[Span]) -> Span:
    """One span for several in a row."""
    return Span(sum(s.wall_s for s in spans), sum(s.blocked_s for s in spans), sum(s.steps for s in spans))


@dataclass(frozen=True)
class Decision:
    """What the node reports (``event``: overlap_on, overlap_kept or overlap_off, with ``why`` its fields) and the
    mode it trains in from now on (``overlap``)."""

    event: str
    overlap: bool
    why: dict[str, float | str]


@dataclass
class OverlapChooser:
    """Turns ``--auto-overlap``'s measurements into decisions (see the module's docstring)."""

    threshold: float = THRESHOLD
    window: int = WINDOW
    payback: float = PAYBACK
    state: State = "measuring"
    spans: list[Span] = field(default_factory=list)
    baseline: Span | None = None
    _last: tuple[float, float, int] | None = None
    _skipped_first: bool = False

    @property
    def overlapping(self) -> bool:
        return self.state in ("trying", "on")

    def observe(self, now_s: float, blocked_s: float, steps: int) -> Decision | None:
        """Take the loop's counters (monotonic seconds, cumulative blocked seconds and inner steps) as a round is
        applied; returns a decision once a window is judged (nothing while it fills, or once the choice is made)."""
        last, self._last = self._last, (now_s, blocked_s, steps)
        if last is None or self.state in ("on", "off"):
            return None
        if not self._skipped_first:  # the first round waited for the swarm to start, not for its exchange
            self._skipped_first = True
            return None
        span = Span(max(now_s - last[0], 0.0), max(blocked_s - last[1], 0.0), max(steps - last[2], 0))
        self.spans = [*self.spans, span][-self.window:]
        if len(self.spans) < self.window:
            return None
        window, self.spans = combined(self.spans), []
        if self.state == "measuring":
            if window.blocked_share < self.threshold:
                return None
            self.state, self.baseline = "trying", window
            return Decision("overlap_on", True, {"blocked_share": round(window.blocked_share, 4), "steps_per_s": round(window.steps_per_s, 4),
                                   "threshold": self.threshold})
        assert self.baseline is not None  # trying: overlap's own window is in
        before = self.baseline.steps_per_s
        needed_gain = self.payback * max(self.baseline.blocked_share - window.blocked_share, 0.0)
        gain = window.steps_per_s / before - 1.0 if before > 0 else 0.0
        why: dict[str, float | str] = {
            "blocked_share": round(window.blocked_share, 4), "blocking_blocked_share": round(self.baseline.blocked_share, 4),
            "steps_per_s": round(window.steps_per_s, 4), "blocking_steps_per_s": round(before, 4),
            "speed_gain": round(gain, 4), "needed_gain": round(needed_gain, 4)}
        if window.steps_per_s > 0 and window.steps_per_s >= before * (1.0 + needed_gain):
            self.state = "on"
            return Decision("overlap_kept", True, why)
        self.state = "off"
        return Decision("overlap_off", False, {**why, "reason": "overlap did not make the inner steps faster by enough to pay for its "
                                                 "one-step-delayed update"})

"""Bounds on the tensors pipeline peers hand each other, against the recent ones of their kind.

A stage server takes an optimizer step on every ``backward`` and ``loss`` request, from whoever sends
it; a trainer passes a server's answer on to the next stage. Either side can be a modified peer, and
a finite tensor a million times too large passes every shape and NaN check. Each check compares the
root mean square of a tensor (independent of the batch size) with the median of the last ``window``
accepted ones of the same kind:

- **activations** beyond ``ratio`` × that median are refused (:meth:`ScaleCheck.check`): nothing
  downstream bounds them, and one such tensor turns a microbatch into noise. Honest activations move
  slowly: at most 3.7× their recent median in 24 seeds × 150 steps of `nano`
  (``benchmarks/results/stage_spikes.json``);
- **gradients** beyond it are scaled down to it (:meth:`ScaleCheck.clip`), not refused: an honest
  gradient spikes with the loss (124× its recent median in those runs, in a transient loss
  spike), and refusing it would ban an honest replica. The stage's own gradient clip bounds the step
  either way; this keeps one huge gradient from filling AdamW's second moments.

A bounded but misdirected tensor passes: that is the per-stage clip's and the stage averaging's to
contain. The scale of a whole stage can change for good (a stage rebuilt from its neighbours, weights
replaced by a round): after ``warmup`` refusals in a row with nothing accepted between them, the check
starts over from the tensors that follow, so a trainer is never locked out of a stage that changed. A
single liar cannot use that to get through. The reset needs refusals from at least half of the
sources (authenticated peers) whose tensors fill the recent window, and a liar's refused tensors never
entered it. On a stage server, where all clients share one check, one client alone cannot switch it
off. On a trainer, a lying server's first refused answer bans it. Any accepted tensor between tries
ends the streak.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

RATIO = 100.0  # refused beyond this multiple of the recent median
WINDOW = 64  # accepted tensors the median is taken over
WARMUP = 8  # accepted without a check until this many are known (nothing to compare with yet)


def rms(t: torch.Tensor) -> float:
    """Root mean square of ``t`` (0 for an empty tensor)."""
    return float(t.detach().float().pow(2).mean().sqrt()) if t.numel() else 0.0


class ScaleCheck:
    """The recent scales of one kind of tensor (say, stage 1's input activations) and the bound they set."""

    def __init__(self, what: str, ratio: float = RATIO, window: int = WINDOW, warmup: int = WARMUP) -> None:
        if ratio <= 1 or window < 1 or warmup < 1:
            raise ValueError(f"a scale check needs ratio > 1, window ≥ 1 and warmup ≥ 1; got {ratio}, {window}, {warmup}")
        self.what, self.ratio, self.warmup = what, ratio, warmup
        self.recent: deque[float] = deque(maxlen=window)
        self.sources: deque[str] = deque(maxlen=window)  # who sent each of ``recent``
        self.refused = 0
        self.clipped = 0
        self.streak = 0  # refusals since the last accepted tensor
        self.streak_sources: set[str] = set()  # who sent them

    def limit(self) -> float | None:
        """The largest RMS accepted now (None until ``warmup`` tensors are known, or while their median is 0)."""
        if len(self.recent) < self.warmup:
            return None
        median = statistics.median(self.recent)
        return self.ratio * median if median > 0 else None

    def check(self, t: torch.Tensor, source: str = "") -> str | None:
        """None when ``t`` is within the bound (then it joins the recent ones), else why it is refused.
        ``source``: who sent it (the authenticated peer), which decides whether a streak of refusals resets."""
        scale, limit = rms(t), self.limit()
        if limit is not None and scale > limit:
            self.refused += 1
            self.streak += 1
            self.streak_sources.add(source)
            why = (f"{self.what} has RMS {scale:.3g}, {scale * self.ratio / limit:.0f}× the median of the last "
                   f"{len(self.recent)} (refused beyond {self.ratio:g}×)")
            if self.streak >= self.warmup and self._shared_streak():  # the scale itself changed: learn it anew
                self.recent.clear()
                self.sources.clear()
                self.streak = 0
                self.streak_sources = set()
            return why
        self._remember(scale, source)
        return None

    def _shared_streak(self) -> bool:
        """Whether the refusals in a row came from at least half of those whose tensors fill the window."""
        known = set(self.sources)
        return 2 * len(self.streak_sources & known) >= len(known)

    def _remember(self, scale: float, source: str) -> None:
        self.streak = 0
        self.streak_sources = set()
        self.recent.append(scale)
        self.sources.append(source)

    def clip(self, t: torch.Tensor, source: str = "") -> tuple[torch.Tensor, float]:
        """``t`` scaled down to the bound when above it, and the factor applied (1.0: unchanged); the scale
        remembered is the one passed on."""
        scale, limit = rms(t), self.limit()
        if limit is None or scale <= limit:
            self._remember(scale, source)
            return t, 1.0
        self.clipped += 1
        self._remember(limit, source)
        factor = limit / scale
        return t * factor, factor

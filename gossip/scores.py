"""Contribution scores: what each member's update does to the loss, measured before it is averaged.

A robust aggregator bounds how far one update can move the model, but not which way: an update of
honest size that points uphill (``sign``, ``stale``, ``ipm``) still enters, and in ``sparse-mean`` a
coordinate only the attacker carries takes its value whole. The loss can tell. Each member scores
each contribution of a pseudo-gradient round (whole updates, all-gather) the way Templar's Gauntlet
does: the loss of the round's agreed weights φ on a scoring batch, against the loss of φ − Δᵢ (the
update applied alone, at step 1), on the same batch::

    gainᵢ = L(φ) − L(φ − Δᵢ)        scale = median over the round of |gainᵢ|

A contribution whose gain is below −``harm`` × scale (it raises the loss by at least half of what a
typical member's update changes it) or not finite is dropped from the round (``harmful_update``).
The screen depends on the round's inputs (φ, the decoded updates) and on a scoring batch each member
draws alike from its own data on its own hardware: members with other data or arithmetic may judge
a borderline update differently, so they drop what the majority of their verdicts drops
(``gossip.screen_votes``) and the replicas stay bit-identical.

Each member also keeps a decayed score per peer (``decay``; gains divided by the round's scale, so
rounds compare): shown in ``node status``, the round records and the metrics. It does not weigh
anything: members that joined at different times hold different histories, and a weight taken from
them would split the replicas; the per-round screen needs no history.

A round of fewer than three contributions is not screened: alone, a member would only throw away
its own work; with two, nobody can tell which one lies, and near a plateau both honest gains are
noise (a live 2-node run dropped an honest update whose gain was −0.005 against its partner's
+0.005). Members whose contributions were all dropped step by nothing that round.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

# the loss of φ − update on the round's scoring batch (``None``: of φ itself)
LossAt = Callable[[Sequence[torch.Tensor] | None], float]

HARM = 0.5  # a gain below −HARM × the round's scale drops the contribution
MIN_MEMBERS = 3  # fewer contributions than this are not screened: no majority to judge by
DECAY = 0.8  # weight of a peer's earlier score in its decayed score
CLAMP = 3.0  # a round adds at most ±CLAMP (in units of its scale) to a decayed score


@dataclass
class Screen:
    """One round's scores: each contributor's gain, the round's scale, and who was dropped."""

    peers: list[str]
    gains: dict[str, float]
    scale: float
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def kept(self) -> list[str]:
        return [p for p in self.peers if p not in self.dropped]


def screen(peers: Sequence[str], updates: Sequence[Sequence[torch.Tensor]], loss_at: LossAt, harm: float = HARM) -> Screen:
    """Score every contribution against φ and drop those that raise the loss (see the module docstring)."""
    if len(peers) < MIN_MEMBERS:
        return Screen(list(peers), {}, 0.0)
    base = loss_at(None)
    gains = {p: base - loss_at(u) for p, u in zip(peers, updates)}
    finite = [abs(g) for g in gains.values() if math.isfinite(g)]
    scale = statistics.median(finite) if finite and math.isfinite(base) else 0.0
    dropped = {}
    for p, g in gains.items():
        if not math.isfinite(g) or g < -harm * scale:  # scale 0 (most updates change nothing): any rise
            dropped[p] = "harmful_update"
    return Screen(list(peers), gains, scale, dropped)


class PeerScores:
    """Decayed scores per peer, from the rounds this member screened (reporting only: see the module docstring)."""

    SHOWN = 256  # peers a status answer carries: the most recently scored

    def __init__(self, decay: float = DECAY, limit: int = 4096) -> None:
        self.decay, self.limit = decay, limit
        self.scores: dict[str, float] = {}
        self.harmful: dict[str, int] = {}  # rounds in which each peer's contribution was dropped

    def record(self, result: Screen) -> None:
        for peer, gain in result.gains.items():
            unit = gain / result.scale if result.scale > 0 and math.isfinite(gain) else (-CLAMP if not math.isfinite(gain) else 0.0)
            unit = max(-CLAMP, min(CLAMP, unit))
            earlier = self.scores.pop(peer, 0.0)  # re-inserted: the dict runs from least to most recently scored
            self.scores[peer] = self.decay * earlier + (1 - self.decay) * unit
            if peer in result.dropped:
                self.harmful[peer] = self.harmful.get(peer, 0) + 1
        while len(self.scores) > self.limit:  # bounded whatever peers come and go: the least recently scored go first
            oldest = next(iter(self.scores))
            self.scores.pop(oldest)
            self.harmful.pop(oldest, None)

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        recent = list(self.scores.items())[-self.SHOWN:]
        return {p: {"score": round(s, 4), "harmful_rounds": self.harmful.get(p, 0)} for p, s in recent}


@dataclass
class ContributionScorer:
    """What a member needs to screen its rounds: the loss at φ − Δ on this round's scoring batch, and
    the decayed scores it keeps. ``loss_for(round_no, phi)`` returns the round's :data:`LossAt`."""

    loss_for: Callable[[int, Sequence[torch.Tensor]], LossAt]
    peers: PeerScores = field(default_factory=PeerScores)
    harm: float = HARM

    def __call__(self, round_no: int, phi: Sequence[torch.Tensor], contributions: Mapping[str, Sequence[torch.Tensor]]) -> Screen:
        peers = list(contributions)
        result = screen(peers, [contributions[p] for p in peers], self.loss_for(round_no, phi), self.harm)
        self.peers.record(result)
        return result

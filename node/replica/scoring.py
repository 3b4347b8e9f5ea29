"""A replica node's contribution scorer (``gossip.scores``): a copy of the model that evaluates the
round's agreed weights φ, and φ − Δ for each member's update Δ, on a scoring batch.

The scoring batches are drawn from the training split with a seed every member shares
(``SCORE_SEED``), so members on the same data score on the same text; members whose data or hardware
differ still drop the same contributions by the majority of their verdicts (``gossip.screen_votes``).
The held-out split stays untouched. ``--contribution-scores auto`` (the default) scores in open swarms and not in
private ones (``--swarm-key``), where every member holds the key.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from gossip.scores import ContributionScorer, LossAt
from swarm.models.presets import build_model

SCORE_SEED = 7_919  # the same on every member: the scoring batches must be too
SCORE_BATCHES = 8  # batches in rotation, one a round
SCORE_TOKENS = 2048  # tokens a batch: the gains of small sparse updates are a few thousandths of a nat, so fewer is noise


class ModelLoss:
    """The loss of φ − Δ on round ``r``'s scoring batch, from a model copy of its own on ``device``."""

    def __init__(self, model_cfg: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.model = build_model(model_cfg).to(device).eval()
        self.params = list(self.model.parameters())
        self.batches, self.device = list(batches), device

    def loss_for(self, round_no: int, phi: Sequence[torch.Tensor]) -> LossAt:
        x, y = (t.to(self.device) for t in self.batches[round_no % len(self.batches)])

        @torch.no_grad()
        def loss_at(update: Sequence[torch.Tensor] | None) -> float:
            for i, (p, f) in enumerate(zip(self.params, phi)):
                p.copy_(f if update is None else f.to(self.device, torch.float32) - update[i].to(self.device, torch.float32))
            return float(self.model(x, y)[1])

        return loss_at


def score_rows(context: int) -> int:
    """Sequences of ``context`` tokens in a scoring batch: about ``SCORE_TOKENS`` tokens, at least one."""
    return max(1, SCORE_TOKENS // context)


def scoring_batches(train_batches: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``SCORE_BATCHES`` batches from an iterator of the training split seeded with ``SCORE_SEED``."""
    return [train_batches.next() for _ in range(SCORE_BATCHES)]


def build_scorer(model_cfg: Any, workload: Any, device: torch.device) -> ContributionScorer:
    """The scorer of a node training ``model_cfg`` on ``workload``."""
    batches = scoring_batches(workload.train_batches(score_rows(model_cfg.context), SCORE_SEED))
    return ContributionScorer(ModelLoss(model_cfg, batches, device).loss_for)

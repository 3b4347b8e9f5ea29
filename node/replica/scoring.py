"""A replica node's contribution scorer (``gossip.scores``): a copy of the model that evaluates the
round's agreed weights φ, and φ − Δ for each member's update Δ, on a scoring batch.

The scoring batches are drawn from the training split with a seed every member shares
(``SCORE_SEED``), so members on the same data score on the same text; members whose data or hardware
differ still drop the same contributions by the majority of their verdicts (``gossip.screen_votes``).
The held-out split stays untouched. ``--contribution-scores auto`` (the default) scores in open swarms and not in
private ones (``--swarm-key``), where every member holds the key.

The same model copy judges a state that only its own holder vouches for before a resync adopts it
(:class:`StateJudge`): at a start-up tie the vote can pick any member's φ, a hostile one's included.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import torch

from gossip.scores import ContributionScorer, LossAt
from gossip.state_transfer import DownloadedState
from swarm.models.presets import build_model

SCORE_SEED = 7_919  # the same on every member: the scoring batches must be too
SCORE_BATCHES = 8  # batches in rotation, one a round
SCORE_TOKENS = 2048  # tokens a batch: the gains of small sparse updates are a few thousandths of a nat, so fewer is noise
WORSE_BY_NATS = 0.5  # a state may score this much worse than this node's own φ (honest states differ by a round's
WORSE_BY_SHARE = 0.1  # averaging: hundredths of a nat), or this share of its loss, whichever is larger


class ModelLoss:
    """The loss of φ − Δ on round ``r``'s scoring batch, from a model copy of its own on ``device``."""

    def __init__(self, model_cfg: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.model = build_model(model_cfg).to(device).eval()
        self.params = list(self.model.parameters())
        self.batches, self.device = list(batches), device
        self.lock = threading.Lock()  # the round's screen and a resync's judge share the copy from two threads

    def loss_for(self, round_no: int, phi: Sequence[torch.Tensor]) -> LossAt:
        x, y = (t.to(self.device) for t in self.batches[round_no % len(self.batches)])

        @torch.no_grad()
        def loss_at(update: Sequence[torch.Tensor] | None) -> float:
            with self.lock:
                for i, (p, f) in enumerate(zip(self.params, phi)):
                    if update is None:
                        p.copy_(f)
                    else:  # φ − Δ written straight into the copy's parameter: one pass, no temporary
                        torch.sub(f.to(self.device, torch.float32), update[i].to(self.device, torch.float32), out=p)
                return float(self.model(x, y)[1])

        return loss_at


def far_worse(own: float, theirs: float) -> str | None:
    """Why a state scoring ``theirs`` must not replace one scoring ``own`` (None: it may)."""
    bound = own + max(WORSE_BY_NATS, WORSE_BY_SHARE * abs(own)) if math.isfinite(own) else math.inf
    if math.isfinite(theirs) and theirs <= bound:
        return None
    return f"it scores {theirs:.4g} on the scoring batch against {own:.4g} for this node's own state (the bound is {bound:.4g})"


class StateJudge:
    """Refuses a downloaded state that scores far worse than this node's own φ (:func:`far_worse`).

    ``model_loss`` gives the scoring model copy: the contribution scorer's where the node has one, else
    one built for the judgment and let go after it (a resync without a majority is rare; a copy kept for
    it would cost a whole fp32 model)."""

    def __init__(self, model_loss: Callable[[], ModelLoss], own: Callable[[], Sequence[torch.Tensor]]) -> None:
        self.model_loss, self.own = model_loss, own

    def __call__(self, got: DownloadedState) -> str | None:
        loss, r = self.model_loss(), got.snapshot.round
        return far_worse(loss.loss_for(r, self.own())(None), loss.loss_for(r, got.snapshot.tensors["params"])(None))


def score_rows(context: int) -> int:
    """Sequences of ``context`` tokens in a scoring batch: about ``SCORE_TOKENS`` tokens, at least one."""
    return max(1, SCORE_TOKENS // context)


def scoring_batches(train_batches: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``SCORE_BATCHES`` batches from an iterator of the training split seeded with ``SCORE_SEED``."""
    return [train_batches.next() for _ in range(SCORE_BATCHES)]


def build_model_loss(model_cfg: Any, workload: Any, device: torch.device) -> ModelLoss:
    """The scoring model copy of a node training ``model_cfg`` on ``workload`` (for a
    :class:`ContributionScorer` and a :class:`StateJudge`)."""
    return ModelLoss(model_cfg, scoring_batches(workload.train_batches(score_rows(model_cfg.context), SCORE_SEED)), device)


def build_screening(cfg: Any, model_cfg: Any, workload: Any, device: torch.device,
                    own: Callable[[], Sequence[torch.Tensor]]) -> tuple[ContributionScorer | None, StateJudge | None]:
    """A replica node's contribution scorer (``cfg.scores_contributions``, in whole-model rounds: a fragment's
    φ is not a model to score) and resync judge (``cfg.judges_states``), sharing one model copy where both run."""
    def model_loss() -> ModelLoss:
        return build_model_loss(model_cfg, workload, device)

    scoring = model_loss() if cfg.scores_contributions and cfg.fragments == 1 else None
    scorer = ContributionScorer(scoring.loss_for) if scoring is not None else None
    judge = StateJudge(model_loss if scoring is None else lambda: scoring, own) if cfg.judges_states else None
    return scorer, judge

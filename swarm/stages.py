"""A model (GPT or Llama) cut into S contiguous pipeline stages (SWARM parallelism, Ryabinin et al. 2023).

Stage 0 owns the token embedding (and the GPT's position embedding), the last stage the final norm,
the head and the loss; blocks are dealt out as evenly as possible (earlier stages get the extra
block). Every replica of a stage builds it from the same full-model initialisation (seeded by the
run, not the node), so replicas start identical without a download and stage boundaries match a
single-process model. The head is untied from the embedding: the two live on different stages.

With CheckFree+ (``plus=True``) stage 1 also holds a replica of the embeddings and stage S−2 a replica
of the final norm and head, so that on out-of-order microbatches they can act as first or last stage
(``forward(..., embed=True)`` / ``head=True``), and a lost first or last stage can be restored from them.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.presets import ModelConfig, build_model


def block_range(n_layer: int, index: int, count: int) -> tuple[int, int]:
    """Blocks [start, end) of stage ``index`` of ``count``."""
    if not 1 <= count <= n_layer:
        raise ValueError(f"cannot cut {n_layer} blocks into {count} stages (1 ≤ stages ≤ blocks)")
    if not 0 <= index < count:
        raise ValueError(f"stage {index} does not exist in a {count}-stage pipeline")
    base, extra = divmod(n_layer, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def stage_run(run_id: str, stage: int) -> str:
    """The sub-run in which the replicas of one stage average and share state."""
    return f"{run_id}.s{stage}"


def model_seed(run_id: str) -> int:
    """The seed every replica of every stage initialises from (the same for the whole run)."""
    return zlib.crc32(run_id.encode()) & 0x7FFFFFFF


class Stage(nn.Module):
    """Stage ``index`` of ``count``. ``forward(x)`` maps tokens (stage 0) or activations (B, T, d) to
    activations, or, on the last stage with ``targets``, to the mean cross-entropy."""

    def __init__(self, cfg: ModelConfig, index: int, count: int, seed: int, plus: bool = False) -> None:
        super().__init__()
        start, end = block_range(cfg.n_layer, index, count)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            full = build_model(cfg)
        self.cfg, self.index, self.count = cfg, index, count
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self._take_embeddings(full)
        self.blocks = nn.ModuleList(full.blocks[start:end])
        if self.last:
            self.ln_f = full.ln_f
            self.head = _untied_head(full)
        self.plus = plus
        if plus and index == 1 and not self.first:
            self._take_embeddings(full)  # replica of stage 0's embeddings
        if plus and index == count - 2 and not self.last:
            self.ln_f = full.ln_f
            self.head = _untied_head(full)  # replica of the last stage's head

    def _take_embeddings(self, full: nn.Module) -> None:
        self.tok_emb = full.tok_emb
        if hasattr(full, "pos_emb"):  # GPT: learned positions; Llama rotates inside each attention layer
            self.pos_emb = full.pos_emb

    @property
    def can_embed(self) -> bool:
        return hasattr(self, "tok_emb")

    @property
    def can_head(self) -> bool:
        return hasattr(self, "head")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, embed: bool | None = None,
                head: bool | None = None) -> torch.Tensor:
        """``embed``/``head`` default to the stage's place in the normal order (first embeds, last has the head)."""
        embed = self.first if embed is None else embed
        head = self.last if head is None else head
        if (embed and not self.can_embed) or (head and not self.can_head):
            raise ValueError(f"stage {self.index} holds no {'embeddings' if embed and not self.can_embed else 'head'}")
        if embed:
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
                raise ValueError(f"stage 0 takes token ids of shape (batch, time), got {x.dtype} {list(x.shape)}")
            if x.shape[1] > self.cfg.context:
                raise ValueError(f"sequence of {x.shape[1]} tokens exceeds the model context of {self.cfg.context}")
            x = self.tok_emb(x)
            if hasattr(self, "pos_emb"):
                x = x + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        elif x.dim() != 3 or x.shape[-1] != self.cfg.d_model:
            raise ValueError(f"stage {self.index} takes activations (batch, time, {self.cfg.d_model}), got {list(x.shape)}")
        for block in self.blocks:
            x = block(x)
        if not head:
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def whole_model_names(stage: Stage) -> list[str | None]:
    """The name in the whole model of each of the stage's parameters (``parameters()`` order, blocks renumbered),
    None for a CheckFree+ replica of another stage's embeddings or head."""
    start, _ = block_range(stage.cfg.n_layer, stage.index, stage.count)
    names: list[str | None] = []
    for name, _ in stage.named_parameters():
        top = name.split(".", 1)[0]
        if top == "blocks":
            _, j, rest = name.split(".", 2)
            names.append(f"blocks.{start + int(j)}.{rest}")
        elif top in ("tok_emb", "pos_emb"):
            names.append(name if stage.first else None)
        else:  # the final norm and the head
            names.append(name if stage.last else None)
    return names


def stage_flops_per_token(stage: Stage) -> float:
    """Training FLOPs per token of the work a stage does for a microbatch in the normal order, as
    ``swarm.models.presets.model_flops_per_token`` counts them for a whole model: 6·N of its blocks (and
    of the head on the last stage; embeddings are lookups, CheckFree+ replicas idle) plus the attention
    term of its blocks. The backward request's recomputed forward pass is not model FLOPs."""
    used = list(stage.blocks.parameters()) + (list(stage.ln_f.parameters()) + list(stage.head.parameters()) if stage.last else [])
    n = sum(p.numel() for p in used)
    return float(6 * n + 12 * len(stage.blocks) * stage.cfg.d_model * stage.cfg.context)


def _untied_head(full: nn.Module) -> nn.Linear:
    """A head of its own, starting from the full model's (for a tied model: the token embedding)."""
    head = nn.Linear(full.head.in_features, full.head.out_features, bias=False)
    with torch.no_grad():
        head.weight.copy_(full.head.weight)
    return head

"""A Llama-style decoder (Touvron et al. 2023, https://arxiv.org/abs/2302.13971) laid out like
Hugging Face's ``LlamaForCausalLM``, so that weights move between the two by renaming alone.

Pre-norm blocks with RMSNorm, rotary position embeddings (the Hugging Face convention:
``rotate_half`` over the two halves of each head, inv_freq = 1/θ^(2i/head_dim)), grouped-query
attention through ``scaled_dot_product_attention`` (``enable_gqa``: k/v heads shared, not copied), a SwiGLU MLP
and no biases.
The top-level names match :class:`swarm.models.gpt.GPT` (``tok_emb``, ``blocks``, ``ln_f``, ``head``) so
that pipeline stages cut both the same way; there is no ``pos_emb``: every attention layer rotates
its own queries and keys, so a block is self-contained. Inside a block the names are Hugging Face's
(``self_attn.q_proj`` … ``mlp.down_proj``, ``input_layernorm``, ``post_attention_layernorm``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 4096  # from the tokenizer: see swarm.models.presets.with_vocab
    context: int = 128  # tokens per sequence (max_position_embeddings on export)
    n_layer: int = 4
    n_head: int = 4  # query heads
    d_model: int = 128
    n_kv_head: int = 2  # key/value heads (grouped-query attention; = n_head for plain multi-head)
    d_ff: int = 384  # SwiGLU hidden width (intermediate_size)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    family: str = "llama"

    def __post_init__(self) -> None:
        if self.family != "llama":
            raise ValueError(f"LlamaConfig family must be 'llama', got {self.family!r}")
        for name in ("vocab_size", "context", "n_layer", "n_head", "d_model", "n_kv_head", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def param_count(self) -> int:
        """Parameters of :class:`Llama` under this config (a tied head counted once), from the shapes alone."""
        d, q, kv = self.d_model, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        block = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * self.d_ff
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layer * block + d

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """x / rms(x) · w, computed in fp32 (as Hugging Face's ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(T: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions 0..T−1, each (T, head_dim), computed in fp32 then cast to ``dtype``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd): the halves, not interleaved
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, hd) by position."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.theta = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_theta
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # cos and sin of every position, in fp32, computed once: per step they would cost ~5 % of a GPU step.
        # Not persistent: checkpoints and exported weights do not carry them.
        cos, sin = rope_cos_sin(cfg.context, cfg.head_dim, cfg.rope_theta, torch.get_default_device(), torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = self.rope_cos[:T].to(q.dtype), self.rope_sin[:T].to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # each k/v head serves n_head / n_kv_head consecutive query heads, read in place (no repeated copies)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama decoder. ``forward(idx, targets)`` returns (logits, mean cross-entropy in nats or None)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # residual projections scaled as in GPT-2
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence of {T} tokens exceeds the model context of {self.cfg.context}")
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def hf_name(name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` name of a :class:`Llama` parameter (``blocks.3.mlp.up_proj.weight`` →
    ``model.layers.3.mlp.up_proj.weight``)."""
    top = {"tok_emb.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    if name.startswith("blocks."):
        return "model.layers." + name[len("blocks."):]
    raise ValueError(f"{name!r} is not a Llama parameter")


def hf_names(cfg: LlamaConfig) -> list[str]:
    """Hugging Face names of :class:`Llama`'s parameters in ``parameters()`` order (no ``lm_head`` when tied)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return [hf_name(n) for n, _ in model.named_parameters()]

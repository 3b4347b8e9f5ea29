"""Subspace projection of pipeline activations (Protocol Models): only k coordinates per token travel.

Both ends build the same orthonormal U ∈ R^{d×k} from a shared seed (QR of a seeded Gaussian, in
float64, rounded to float32). The sender projects the last dimension, c = x·U (bf16 or fp16 on the
wire), the receiver rebuilds x̂ = c·Uᵀ. When the model keeps its boundary activations inside span(U)
(residual writes go through U), decode∘encode is the identity up to the 16-bit rounding of c, which is
exact when c is representable; anything orthogonal to span(U) is dropped. Wire cost: 2k bytes per
token instead of 2d for dense bf16. For blockwise int8 activations use ``int8-block``.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from compression import memory
from compression.base import Codec, finite_range
from compression.errors import CodecError
from compression.payload import Payload
from compression.wire import owned_tensor_map, read_tensor

_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@lru_cache(maxsize=16)
def subspace_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """Orthonormal U (d×k float32, Uᵀ·U = I) from a seeded Gaussian; the same on every peer."""
    if not 1 <= k <= d:
        raise ValueError(f"a subspace basis needs 1 ≤ k ≤ d, got k={k}, d={d}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    gaussian = torch.randn(d, k, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(k, dtype=torch.float64))
    return q.to(torch.float32).contiguous()


class SubspaceProjection(Codec):
    """``subspace:k=K,d=D[,seed=S][,dtype=bf16|fp16]``: project the last dimension onto a fixed basis.

    Fields: ``coef`` (shape[:-1] + (k,), bf16 or fp16).

    :param k: subspace dimension (coefficients per token)
    :param d: size of the last dimension of every encoded tensor (fixed by the spec)
    :param seed: shared seed of the basis
    :param wire_dtype: ``"bf16"`` (default) or ``"fp16"`` for the coefficients
    """

    def __init__(self, k: int, d: int, seed: int = 0, wire_dtype: str = "bf16") -> None:
        if not 1 <= k <= d <= 1 << 20:
            raise ValueError(f"subspace needs 1 ≤ k ≤ d ≤ 2**20, got k={k}, d={d}")
        if not 0 <= seed < 1 << 63:
            raise ValueError(f"subspace seed must lie in [0, 2**63), got {seed}")
        if wire_dtype not in _WIRE:
            raise ValueError(f"subspace coefficients travel as bf16 or fp16, got {wire_dtype!r}")
        self.k, self.d, self.seed, self.wire_dtype = k, d, seed, wire_dtype

    @property
    def spec(self) -> str:
        seed = f",seed={self.seed}" if self.seed else ""
        dtype = f",dtype={self.wire_dtype}" if self.wire_dtype != "bf16" else ""
        return f"subspace:k={self.k},d={self.d}{seed}{dtype}"

    @property
    def basis(self) -> torch.Tensor:
        """U (d×k float32)."""
        return subspace_basis(self.d, self.k, self.seed)

    def _encode(self, x: torch.Tensor) -> Payload:
        if x.dim() == 0 or x.shape[-1] != self.d:
            raise ValueError(f"{self.spec} encodes tensors whose last dimension is {self.d}, got shape {list(x.shape)}")
        finite_range(x)
        coef = torch.matmul(x.to(torch.float32), self.basis)
        out = memory.empty(coef.shape, _WIRE[self.wire_dtype])
        out.copy_(coef)
        finite_range(out, "projected input")
        return Payload(self.spec, self.version, tuple(x.shape), {"coef": owned_tensor_map(out)})

    def _decode(self, payload: Payload) -> torch.Tensor:
        shape = payload.shape
        if len(shape) == 0 or shape[-1] != self.d:
            raise CodecError(f"{self.spec}: payload shape {list(shape)} does not end in d={self.d}")
        coef = read_tensor(payload.fields, "coef", [*shape[:-1], self.k], _WIRE[self.wire_dtype], self.spec)
        if coef.numel() and not bool(torch.isfinite(coef).all()):
            raise CodecError(f"{self.spec}: coefficients hold NaN or Inf")
        out = memory.empty(shape, torch.float32)
        torch.matmul(coef.to(torch.float32), self.basis.T, out=out)
        return out

"""DCT-domain top-k (DeMo): transform each chunk with an orthonormal DCT-II, keep the top-K coefficients.

2-D tensors are cut into s×s tiles (s = √C, 64×64 at C = 4096) and transformed as D·T·Dᵀ with the
orthonormal DCT matrix D (batched matmuls); other tensors use 1-D DCT-II over runs of C values,
computed through an FFT (Makhoul's reordering), O(C log C) per chunk. Decoding scatters the kept
coefficients and applies the inverse (Dᵀ·Ĉ·D, or DCT-III). Energy is preserved (orthonormal), so with
K = C the round trip is exact up to float32 rounding. DeMo pairs this with error feedback (β = 0.999)
and takes the sign of the aggregate; that step belongs to the optimizer, not to the codec.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from compression.chunking import ChunkLayout
from compression.topk import TopKCompression


@lru_cache(maxsize=8)
def dct_matrix(n: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (n×n, float32): D[k, j] = α_k·cos(π(2j+1)k / 2n), D·Dᵀ = I."""
    j = torch.arange(n, dtype=torch.float64)
    k = j.unsqueeze(1)
    d = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32)


@lru_cache(maxsize=8)
def _twiddles(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(n, dtype=torch.float64)
    w = torch.exp(-1j * math.pi * k / (2 * n))
    alpha = torch.full((n,), math.sqrt(2.0 / n), dtype=torch.float64)
    alpha[0] = math.sqrt(1.0 / n)
    return w.to(torch.complex64), alpha.to(torch.float32)


def dct_rows(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of each row of a (rows, n) float32 tensor, via one complex FFT per row."""
    n = x.shape[-1]
    w, alpha = _twiddles(n)
    v = torch.cat([x[..., ::2], x[..., 1::2].flip(-1)], dim=-1)
    return (torch.fft.fft(v, dim=-1) * w).real * alpha


def idct_rows(c: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct_rows` (orthonormal DCT-III)."""
    n = c.shape[-1]
    w, alpha = _twiddles(n)
    raw = c / alpha  # Σ_j x_j cos(π(2j+1)k / 2n)
    flipped = torch.zeros_like(raw)
    flipped[..., 1:] = raw[..., 1:].flip(-1)  # raw[n − k], with raw[n] = 0
    spectrum = torch.complex(raw, -flipped) * w.conj()
    v = torch.fft.ifft(spectrum, dim=-1).real
    half = (n + 1) // 2
    out = torch.empty_like(c)
    out[..., ::2] = v[..., :half]
    out[..., 1::2] = v[..., half:].flip(-1)
    return out


class DCTCompression(TopKCompression):
    """``dct:K/C[+qB]``: top-K DCT-II coefficients per chunk (DeMo). Fields as for ``topk``.

    :param k: coefficients kept per chunk (K), 1 ≤ K ≤ C
    :param chunk: values per chunk (C); a perfect square tiles 2-D tensors as √C×√C
    :param value_bits: None for float32 coefficients, or 8/4/2 to quantize them statistically
    """

    family = "dct"

    def kept(self, numel: int) -> int:
        """Always K: a padded chunk's energy spreads over all of its coefficients."""
        return self.k

    def _forward(self, block: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        s = layout.tile
        if s is None:
            return dct_rows(block)
        d = dct_matrix(s)
        tiles = block.view(-1, s, s)
        return torch.matmul(torch.matmul(d, tiles), d.T).reshape(block.shape)

    def _inverse(self, block: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        s = layout.tile
        if s is None:
            return idct_rows(block)
        d = dct_matrix(s)
        tiles = block.view(-1, s, s)
        return torch.matmul(torch.matmul(d.T, tiles), d).reshape(block.shape)

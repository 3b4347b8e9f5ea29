"""Randomized Hadamard rotation in blocks (DRIVE, NeurIPS 2021; EDEN, ICML 2022) and the seeded ±1 stream.

A vector padded to whole blocks of b = 2^k values is rotated as y = H_b·D·x per block: D is a diagonal
of random signs drawn from a shared seed, H_b the Sylvester-ordered Walsh–Hadamard matrix divided by
√b. H_b is orthonormal and symmetric, so it is its own inverse and x = D·H_b·y (D² = I). After the
rotation every coordinate is a ±-weighted sum of the whole block: near-Gaussian whatever the input's
tails, which is what lets :mod:`compression.rotation` use Gaussian-optimal quantization levels.

Transform. H_b = H_p ⊗ H_q with p·q = b (32·32 at the default b = 1024). A block read row-major as a
p×q matrix X maps to H_p·X·H_q: one matrix product (rows·p, q)×(q, q) and one batched (p, p)×(p, q),
i.e. 2·√b multiply-adds per value (64 at b = 1024) in two BLAS calls. On one CPU thread, 25M values:
≈ 0.04 s at b = 1024 and ≈ 0.07 s at b = 4096, against ≈ 0.3 s for a radix-2 butterfly written
with torch ops (log₂ b passes over memory) and far more for a dense H_b matmul (b per value).

Seeded stream. :func:`stream_seed` derives the seed of the generator for run ``index`` of a payload
seed (a splitmix64 mix); :func:`random_signs` reads ±1 values from the bits of 64-bit words drawn
from a CPU ``torch.Generator`` with that seed (bit j of byte m gives value 8m + j; a set bit is −1).
Same seed and torch build → bit-identical signs in any process, whatever the thread count.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

BLOCK = 1024
"""Default values per rotated block: 32×32 Kronecker factors, the fastest measured on CPU, and small
enough that one heavy-tailed value is spread over a block without dominating a whole tensor."""
MIN_BLOCK = 8  # one byte of 1-bit codes
_MASK64 = (1 << 64) - 1
_SIGN_TABLE = np.array([[1.0 - 2.0 * ((byte >> j) & 1) for j in range(8)] for byte in range(256)], dtype=np.float32)


def stream_seed(seed: int, index: int) -> int:
    """Generator seed for run ``index`` of the payload seed ``seed`` (splitmix64 finaliser, 63 bits)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for run ``index`` of ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(stream_seed(seed, index))
    return g


def signs_from(g: torch.Generator, out: torch.Tensor) -> torch.Tensor:
    """Fill the contiguous float32 ``out`` with ±1 from the bits of ⌈n/64⌉ 64-bit words drawn from ``g``."""
    n = out.numel()
    words = torch.empty(-(-n // 64), dtype=torch.int64).random_(-(1 << 63), None, generator=g)
    raw = words.view(torch.uint8).numpy()
    flat = out.view(-1)
    whole = n // 8
    if whole:
        np.take(_SIGN_TABLE, raw[:whole], axis=0, out=flat[: whole * 8].numpy().reshape(whole, 8), mode="clip")
    if n > whole * 8:
        flat[whole * 8 :] = torch.from_numpy(_SIGN_TABLE[raw[whole], : n - whole * 8])
    return out


def random_signs(seed: int, index: int, count: int) -> torch.Tensor:
    """The ``count`` signs (float32 ±1) of run ``index`` of ``seed``."""
    return signs_from(generator(seed, index), torch.empty(count))


def block_size(count: int, block: int = BLOCK) -> int:
    """Values per block for a vector of ``count`` values: ``block``, or for shorter vectors the smallest
    power of two ≥ count (at least 8, so 1-bit codes fill whole bytes)."""
    if count >= block:
        return block
    return max(MIN_BLOCK, 1 << max(0, count - 1).bit_length())


def padded_length(count: int, block: int = BLOCK) -> int:
    """``count`` rounded up to whole blocks of :func:`block_size` values."""
    b = block_size(count, block)
    return -(-count // b) * b


@lru_cache(maxsize=16)
def hadamard(n: int) -> torch.Tensor:
    """Sylvester Walsh–Hadamard matrix of order n = 2^k divided by √n (float32; orthonormal, symmetric)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32)


def factors(b: int) -> tuple[int, int]:
    """(p, q) with p·q = b, both powers of two, p ≤ q: the Kronecker factors of H_b."""
    k = b.bit_length() - 1
    return 1 << (k // 2), 1 << (k - k // 2)


def walsh_hadamard(x: torch.Tensor, b: int, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh–Hadamard transform of each block of ``b`` values of the contiguous vector ``x``
    (length a multiple of b), written to ``out``; ``work`` is scratch of the same length. Its own inverse."""
    p, q = factors(b)
    n = x.numel()
    half = torch.mm(x.view(-1, q), hadamard(q), out=work[:n].view(-1, q))  # X·H_q, row by row
    if p == 1:
        return out[:n].copy_(half.view(-1))
    torch.matmul(hadamard(p), half.view(-1, p, q), out=out[:n].view(-1, p, q))  # H_p·(X·H_q) per block
    return out[:n]

"""Elias–Fano coding of top-k positions: K sorted positions inside a chunk of C values.

A sorted set of K positions in [0, C) is split into low bits (the last ``l = ⌊log₂(C/K)⌋`` bits of
each position, packed at a fixed width) and high parts (position >> l, non-decreasing), written in
unary as a bitmap of K + ⌈C / 2^l⌉ bits in which bit ``high_i + i`` is set. Every chunk therefore
costs exactly ``K·(l + 1) + ⌈C / 2^l⌉`` bits: 8 bits per position for 64 of 4096 instead of 12
packed (2 + log₂(C/K) is close to the information-theoretic log₂ binom(C, K) / K ≈ 7.4). Both sides
derive the sizes from (K, C) alone, so the stream needs no lengths. Encoding and decoding are
vectorised over all chunks (the unary bitmap decodes by ``nonzero``).

A decoder checks what a forged stream could break: each chunk's bitmap has exactly K set bits, and the
decoded positions are strictly increasing and below C.
"""

from __future__ import annotations

import torch

from compression.bitpack import pack_bits, packed_size, unpack_bits
from compression.errors import CodecError


def low_bits(k: int, chunk: int) -> int:
    """l = ⌊log₂(C/K)⌋ (0 when K > C/2)."""
    return max(0, (chunk // k).bit_length() - 1)


def high_bits(k: int, chunk: int) -> int:
    """Bits of one chunk's unary bitmap: K ones and ⌈C / 2^l⌉ zeros at most."""
    return k + -(-chunk // (1 << low_bits(k, chunk)))


def chunk_bits(k: int, chunk: int) -> int:
    """Bits one chunk's K positions take."""
    return k * low_bits(k, chunk) + high_bits(k, chunk)


def stream_sizes(n_chunks: int, k: int, chunk: int) -> tuple[int, int]:
    """(bytes of the low stream, bytes of the high stream) for ``n_chunks`` chunks."""
    l = low_bits(k, chunk)
    return (packed_size(n_chunks * k, l) if l else 0), packed_size(n_chunks * high_bits(k, chunk), 1)


def encode(positions: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions``: (n_chunks, K) int64, each row strictly increasing in [0, C). Returns the packed
    (low, high) uint8 streams."""
    n_chunks, k = positions.shape
    l = low_bits(k, chunk)
    width = high_bits(k, chunk)
    low = pack_bits(positions & ((1 << l) - 1), l) if l else torch.empty(0, dtype=torch.uint8)
    bitmap = torch.zeros(n_chunks, width, dtype=torch.uint8)
    bitmap.scatter_(1, (positions >> l) + torch.arange(k), 1)
    return low, pack_bits(bitmap.reshape(-1), 1)


def decode(low: torch.Tensor, high: torch.Tensor, n_chunks: int, k: int, chunk: int, what: str) -> torch.Tensor:
    """Inverse of :func:`encode`: (n_chunks, K) int64 positions. CodecError (naming ``what``) on a
    stream no encoder makes."""
    l = low_bits(k, chunk)
    width = high_bits(k, chunk)
    bitmap = unpack_bits(high, 1, n_chunks * width).view(n_chunks, width)
    if n_chunks and not bool((bitmap.sum(dim=1, dtype=torch.int64) == k).all()):
        raise CodecError(f"{what}: a chunk's position bitmap does not hold exactly {k} positions")
    columns = torch.nonzero(bitmap)[:, 1].view(n_chunks, k)  # row-major: each row's set bits in order
    positions = (columns - torch.arange(k)) << l
    if l:
        positions |= unpack_bits(low, l, n_chunks * k).to(torch.int64).view(n_chunks, k)
    if n_chunks:
        if int(positions.max()) >= chunk:
            raise CodecError(f"{what}: an index points past the end of its {chunk}-value chunk")
        if k > 1 and not bool((positions[:, 1:] > positions[:, :-1]).all()):
            raise CodecError(f"{what}: a chunk repeats an index")
    return positions

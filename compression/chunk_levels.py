"""Two-bit values with a scale per chunk, for the K values top-k keeps in each chunk (``topk:K/C+q2``).

Each kept value travels as a sign bit and a magnitude bit: whether its magnitude is in the upper or
the lower class of its chunk's kept magnitudes. The chunk sends two float16 levels, the mean magnitude
of each class, and a value decodes to sign × its class's level. The split starts at the chunk's median
magnitude and takes a few Lloyd steps (split at the midpoint of the two levels, recompute the levels),
the two-level quantizer of least squared error: with heavy tails the upper class shrinks to the few
large values instead of pulling them down to the mean of the upper half (Student-t(2): normalised
squared error of ``topk:64/4096+q2`` 0.80 with the median split). Cost: 2 bits per value plus 32 bits
per chunk (2.5 bits per value at K = 64).

Why per chunk: a run of several tensors (``gossip.partition.Partition`` with ``flat``) holds values
whose scales differ by orders of magnitude (embeddings, attention, norms). One quantizer table for the
whole run (the statistical quantizer) maps a small-scale tensor's values onto levels set by the large
ones, and error feedback then chases the overshoot. A chunk of C consecutive values lies within one
tensor except at boundaries, so its levels fit it. Each level is a mean of the magnitudes it stands
for, so ‖x − x̂‖ < ‖x‖ for every chunk (contractive: error feedback converges).
"""

from __future__ import annotations

import torch

from compression.bitpack import pack_bits, packed_size, unpack_bits
from compression.errors import CodecError

FLOAT16_MAX = 65504.0
LLOYD_STEPS = 3  # refinements of the split after the median: each lowers the chunk's squared error


def encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values``: (n_chunks, K) float32. Returns (codes: packed uint8, 2 bits per value; levels:
    (n_chunks, 2) float16, the low and high level of each chunk)."""
    n_chunks, k = values.shape
    magnitude = values.abs()
    total = magnitude.sum(dim=1)
    threshold = magnitude.median(dim=1, keepdim=True).values if k else magnitude[:, :0]
    for _ in range(LLOYD_STEPS + 1):
        high = magnitude > threshold
        counts_high = high.sum(dim=1, dtype=torch.float32)
        sum_high = (magnitude * high).sum(dim=1)
        low_level = (total - sum_high) / (k - counts_high).clamp_min(1)
        high_level = sum_high / counts_high.clamp_min(1)
        threshold = ((low_level + high_level) / 2).unsqueeze(1)
    levels = torch.stack([low_level, high_level], dim=1).clamp_max(FLOAT16_MAX).to(torch.float16)
    codes = (values < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
    return pack_bits(codes.reshape(-1), 2), levels


def decode(codes: torch.Tensor, levels: torch.Tensor, n_chunks: int, k: int, what: str) -> torch.Tensor:
    """Inverse of :func:`encode`: (n_chunks, K) float32. CodecError (naming ``what``) on levels that are
    negative or not finite."""
    table = levels.to(torch.float32)
    if table.numel() and not bool((torch.isfinite(table) & (table >= 0)).all()):
        raise CodecError(f"{what}: a chunk's value levels are negative or not finite")
    unpacked = unpack_bits(codes, 2, n_chunks * k).view(n_chunks, k).to(torch.int64)
    magnitude = torch.gather(table, 1, unpacked >> 1)
    return torch.where((unpacked & 1).bool(), -magnitude, magnitude)


def sizes(n_chunks: int, k: int) -> tuple[int, list[int]]:
    """(bytes of the packed codes, shape of the levels) for ``n_chunks`` chunks of ``k`` values."""
    return packed_size(n_chunks * k, 2), [n_chunks, 2]

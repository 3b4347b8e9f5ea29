"""Shared-seed projection, block by block (``seed:r=R``): a seed, per-block counts and coefficients travel.

In the spirit of Ferret (Shu et al., "Ferret: Federated Full-Parameter Tuning at Scale for Large
Language Models", 2024): the flattened tensor is cut into blocks of ``BLOCK`` = 4096 values, block j
gets r_j random directions regenerated from (seed, j), and the sender transmits c_j = Z_jᵀ·x_j, where
the rows of Z_j ∈ {±1}^{r_j×b} (Rademacher, default) or N(0, 1) are the directions. The receiver
rebuilds the same Z_j and reconstructs

    v_j = Z_jᵀ·c_j ,   x̂_j = (‖c_j‖² / ‖v_j‖²)·v_j

i.e. the orthogonal projection of x_j onto the line through v_j (⟨x_j, v_j⟩ = ‖c_j‖², so the receiver
computes the scale itself). Hence ‖x_j − x̂_j‖² = ‖x_j‖² − ‖c_j‖⁴/‖v_j‖² < ‖x_j‖² for every x_j ≠ 0:
the codec is contractive, as error feedback needs (E‖x_j − x̂_j‖² ≈ (1 − r_j/(b + r_j))·‖x_j‖²), and
‖x̂_j‖ ≤ ‖x_j‖, so a reconstruction never overshoots. (The unbiased estimate Z·Zᵀx/R of a single
d×R projection has error ≈ ‖x‖²·d/R ≫ ‖x‖², so error feedback diverged with it.)

Budget: ``R`` is the average number of directions per block; the tensor's R·⌈d/b⌉ directions are
shared out in proportion to the block norms ‖x_j‖ (largest remainders, at most b_j per block, none
for an all-zero block), so the blocks holding the update get the directions. Cost is d·R random
numbers and multiply-adds per encode (and per decode), linear in d; R ≤ ``MAX_DIRECTIONS`` (64
Rademacher, 16 Gaussian directions) keeps one call on 1.6M values at 0.1–0.5 s on one thread. Wire:
32·R/4096 bits per value for the coefficients plus a 16-bit count per block.

Reproducibility: the payload seed is the one the caller requested (:func:`compression.seeds.payload_seed`
of run, round, peer and part), else ``seed_source``'s; block j's generator is seeded with ``stream_seed(seed, j)``
(:mod:`compression.hadamard`); directions are drawn row after row in slabs of at most ``SLAB``
numbers, so work is bounded per step and the same seed gives bit-identical directions in any process
(given the same torch build: peers pin one version).
"""

from __future__ import annotations

import math
import secrets
from typing import Callable

import torch

from compression import memory
from compression.base import Codec, finite_range
from compression.errors import CodecError
from compression.flat import flat_float32
from compression.hadamard import generator, signs_from
from compression.payload import Payload
from compression.seeds import MAX_SEED, requested_seed
from compression.wire import owned_tensor_map, read_scalar, read_tensor

BLOCK = 4096
MAX_DIRECTIONS = {"rademacher": 64, "gaussian": 16}  # a Gaussian draw costs ~10× a random sign
SLAB = 1 << 18  # random numbers drawn per step
DISTRIBUTIONS = ("rademacher", "gaussian")


def block_count(d: int) -> int:
    """Blocks of a tensor of ``d`` values (the last one may be shorter)."""
    return -(-d // BLOCK)


def _slabs(size: int, count: int) -> range:
    """First rows of the slabs in which ``count`` directions of ``size`` values are drawn."""
    return range(0, count, max(1, SLAB // max(size, 1)))


def _draw(g: torch.Generator, dist: str, out: torch.Tensor) -> torch.Tensor:
    if dist == "gaussian":
        return torch.randn(out.shape, generator=g, out=out)
    return signs_from(g, out)


def block_directions(seed: int, index: int, size: int, count: int, dist: str = "rademacher") -> torch.Tensor:
    """The ``count`` directions (rows, float32 (count, size)) of block ``index``; for tests and small sizes."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"projection distribution must be one of {DISTRIBUTIONS}, got {dist!r}")
    out = torch.empty(count, size)
    g = generator(seed, index)
    step = max(1, SLAB // max(size, 1))
    for first in _slabs(size, count):
        _draw(g, dist, out[first : first + step])
    return out


def allocate(norms: torch.Tensor, sizes: torch.Tensor, budget: int) -> torch.Tensor:
    """Directions per block: ``budget`` shared in proportion to ``norms`` (largest remainders), at most
    ``sizes`` per block, none for zero-norm blocks; int64. Capped blocks hand their surplus to the others."""
    counts = torch.zeros(norms.numel(), dtype=torch.int64)
    weights = norms.to(torch.float64)
    free = weights > 0
    left = budget
    while left > 0 and bool(free.any()):
        share = weights * free
        share = share * (left / float(share.sum()))
        add = share.floor().to(torch.int64)
        extra = left - int(add.sum())
        if extra > 0:  # the largest fractional parts among the free blocks get one more
            fraction = torch.where(free, share - add, torch.full_like(share, -1.0))
            add[torch.topk(fraction, extra).indices] += 1
        add = torch.minimum(add, sizes - counts)
        if int(add.sum()) == 0:
            break
        counts += add
        left -= int(add.sum())
        free &= counts < sizes
    return counts


class SeedProjection(Codec):
    """``seed:r=R[,dist=gaussian]``: contractive block-wise projection onto seeded random directions.

    Fields: ``seed`` (int in [0, 2⁶³)), ``counts`` (int16 directions per block of 4096 values, summing
    to at most R·blocks), ``coef`` (float32 c_j = Z_jᵀx_j, block after block).

    :param r: average directions per block (R), 1 ≤ R ≤ ``MAX_DIRECTIONS[dist]`` (64, or 16 for gaussian)
    :param dist: ``"rademacher"`` (±1 entries, default) or ``"gaussian"`` (about 10× slower to draw)
    :param seed_source: draws a seed for an encode that was not given one (default: the OS CSPRNG)
    """

    def __init__(self, r: int, dist: str = "rademacher", seed_source: Callable[[], int] | None = None) -> None:
        if dist not in DISTRIBUTIONS:
            raise ValueError(f"seed projection distribution must be one of {DISTRIBUTIONS}, got {dist!r}")
        if not 1 <= r <= MAX_DIRECTIONS[dist]:
            raise ValueError(
                f"seed projection takes 1 ≤ R ≤ {MAX_DIRECTIONS[dist]} {dist} directions per block of {BLOCK} "
                f"values (encoding and decoding each draw numel·R random numbers), got R={r}"
            )
        self.r, self.dist = r, dist
        self.seed_source = seed_source or (lambda: secrets.randbits(63))

    @property
    def spec(self) -> str:
        return f"seed:r={self.r}" + ("" if self.dist == "rademacher" else f",dist={self.dist}")

    def _encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x)
        d = flat.numel()
        requested = requested_seed()
        seed = int(self.seed_source()) if requested is None else requested
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
        norms = _block_norms(flat)
        counts = allocate(norms, _block_sizes(d), self.r * block_count(d))
        coef = torch.empty(int(counts.sum()), dtype=torch.float32)
        work = torch.empty(min(SLAB, max(int(counts.max()) if d else 0, 1) * BLOCK))
        offset = 0
        for j, count in enumerate(counts.tolist()):
            if not count:
                continue
            block = flat[j * BLOCK : (j + 1) * BLOCK]
            size, g = block.numel(), generator(seed, j)
            step = max(1, SLAB // size)
            for first in _slabs(size, count):
                rows = min(step, count - first)
                z = _draw(g, self.dist, work[: rows * size].view(rows, size))
                torch.mv(z, block, out=coef[offset + first : offset + first + rows])
            offset += count
        if not bool(torch.isfinite(coef).all()):
            raise ValueError("input is too large to project in float32; refusing to encode it")
        fields = {"seed": seed, "counts": owned_tensor_map(counts.to(torch.int16)), "coef": owned_tensor_map(coef)}
        return Payload(self.spec, self.version, tuple(x.shape), fields)

    def _decode(self, payload: Payload) -> torch.Tensor:
        seed = read_scalar(payload.fields, "seed", int, self.spec)
        if not 0 <= seed <= MAX_SEED:
            raise CodecError(f"{self.spec}: seed {seed} is outside [0, 2**63)")
        d = payload.numel
        n_blocks = block_count(d)
        counts = read_tensor(payload.fields, "counts", [n_blocks], torch.int16, self.spec).to(torch.int64)
        if n_blocks and bool(((counts < 0) | (counts > _block_sizes(d))).any()):
            raise CodecError(f"{self.spec}: a block's direction count is negative or above its number of values")
        total = int(counts.sum())
        if total > self.r * n_blocks:
            raise CodecError(f"{self.spec}: {total} directions exceed the budget of {self.r}·{n_blocks} blocks")
        coef = read_tensor(payload.fields, "coef", [total], torch.float32, self.spec)
        if total and not bool(torch.isfinite(coef).all()):
            raise CodecError(f"{self.spec}: coefficients hold NaN or Inf")
        out = memory.zeros(d, torch.float32)
        work = torch.empty(min(SLAB, max(int(counts.max()) if d else 0, 1) * BLOCK))
        offset = 0
        for j, count in enumerate(counts.tolist()):
            if not count:
                continue
            v = out[j * BLOCK : (j + 1) * BLOCK]
            size, g, c = v.numel(), generator(seed, j), coef[offset : offset + count]
            step = max(1, SLAB // size)
            for first in _slabs(size, count):
                rows = min(step, count - first)
                z = _draw(g, self.dist, work[: rows * size].view(rows, size))
                v.addmv_(z.T, c[first : first + rows])
            length = float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2
            energy = float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2
            if not math.isfinite(length):
                raise CodecError(f"{self.spec}: coefficients too large, block {j} overflows float32")
            v.mul_(energy / length if length > 0 else 0.0)  # x̂ = (‖c‖²/‖v‖²)·v
            offset += count
        return out.reshape(payload.shape)


def _block_sizes(d: int) -> torch.Tensor:
    sizes = torch.full((block_count(d),), BLOCK, dtype=torch.int64)
    if d % BLOCK:
        sizes[-1] = d % BLOCK
    return sizes


def _block_norms(flat: torch.Tensor) -> torch.Tensor:
    """‖x_j‖ per block (float64); ValueError on NaN/Inf."""
    d = flat.numel()
    if d == 0:
        return torch.zeros(0, dtype=torch.float64)
    whole = d // BLOCK * BLOCK
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, BLOCK), dim=1)] if whole else []
    if whole < d:
        parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    norms = torch.cat(parts)
    if not bool(torch.isfinite(norms).all()):
        finite_range(flat)  # NaN/Inf: ValueError; otherwise squares overflowed float32
        norms = torch.cat([torch.linalg.vector_norm(p.to(torch.float64)).reshape(1) for p in flat.split(BLOCK)])
    return norms.to(torch.float64)

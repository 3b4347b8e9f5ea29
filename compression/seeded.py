"""Shared-seed random projection (``seed:r=R``): only a seed and R numbers travel.

The sender draws a fresh seed, regenerates Z ∈ R^{d×R} (d = numel) from it and sends

    seed,  c = Zᵀx / R        (R float32 values)

and the receiver rebuilds x̂ = Z·c from the same seed. Entries of Z are Rademacher (±1, default) or
standard Gaussian, so E[Z Zᵀ] = R·I and E[x̂] = x: the estimate is unbiased, with per-coordinate
variance (‖x‖² − x_i²)/R for Rademacher. It is meant for error-feedback or many-peer averaging, where
the noise averages out; one round alone is very noisy.

Z is never materialised: both sides stream it in blocks of ``ROWS_PER_BLOCK`` rows, each drawn as one
``(rows, R)`` call on a CPU ``torch.Generator`` seeded with ``seed``. The same seed, d and R give a
bit-identical Z in any process (given the same torch build: peers pin one version).
"""

from __future__ import annotations

import secrets
from typing import Callable, Iterator

import torch

from compression import memory
from compression.base import Codec, finite_range
from compression.errors import CodecError
from compression.flat import flat_float32
from compression.payload import Payload
from compression.wire import owned_tensor_map, read_scalar, read_tensor

ROWS_PER_BLOCK = 1 << 14
DISTRIBUTIONS = ("rademacher", "gaussian")
MAX_SEED = (1 << 63) - 1


def projection_blocks(seed: int, d: int, r: int, dist: str = "rademacher") -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, block) pairs covering Z ∈ R^{d×r} top to bottom; blocks are float32 (rows, r)."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"projection distribution must be one of {DISTRIBUTIONS}, got {dist!r}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    for start in range(0, d, ROWS_PER_BLOCK):
        rows = min(ROWS_PER_BLOCK, d - start)
        if dist == "gaussian":
            block = torch.randn(rows, r, generator=generator, dtype=torch.float32)
        else:
            block = torch.randint(0, 2, (rows, r), generator=generator, dtype=torch.float32).mul_(2).sub_(1)
        yield start, block


def projection_matrix(seed: int, d: int, r: int, dist: str = "rademacher") -> torch.Tensor:
    """The whole Z (d×r float32); for tests and small d only."""
    out = torch.empty(d, r)
    for start, block in projection_blocks(seed, d, r, dist):
        out[start : start + block.shape[0]] = block
    return out


class SeedProjection(Codec):
    """``seed:r=R[,dist=gaussian]``: unbiased random projection onto R seeded directions.

    Fields: ``seed`` (int in [0, 2⁶³)), ``coef`` (R float32, already divided by R).

    :param r: number of random directions (R)
    :param dist: ``"rademacher"`` (±1 entries, default) or ``"gaussian"``
    :param seed_source: draws a fresh seed per encode (default: the OS CSPRNG); tests may fix it
    """

    def __init__(self, r: int, dist: str = "rademacher", seed_source: Callable[[], int] | None = None) -> None:
        if not 1 <= r <= 1 << 16:
            raise ValueError(f"seed projection needs 1 ≤ r ≤ 65536 directions, got {r}")
        if dist not in DISTRIBUTIONS:
            raise ValueError(f"seed projection distribution must be one of {DISTRIBUTIONS}, got {dist!r}")
        self.r, self.dist = r, dist
        self.seed_source = seed_source or (lambda: secrets.randbits(63))

    @property
    def spec(self) -> str:
        return f"seed:r={self.r}" + ("" if self.dist == "rademacher" else f",dist={self.dist}")

    def _encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x)
        if flat.numel():
            total = float(flat.sum())
            if total != total or total in (float("inf"), float("-inf")):
                finite_range(flat)
        seed = int(self.seed_source())
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
        coef = torch.zeros(self.r, dtype=torch.float64)
        for start, block in projection_blocks(seed, flat.numel(), self.r, self.dist):
            coef += (flat[start : start + block.shape[0]] @ block).to(torch.float64)
        coef = (coef / self.r).to(torch.float32)
        if not bool(torch.isfinite(coef).all()):
            raise ValueError("input is too large to project in float32; refusing to encode it")
        return Payload(self.spec, self.version, tuple(x.shape), {"seed": seed, "coef": owned_tensor_map(coef)})

    def _decode(self, payload: Payload) -> torch.Tensor:
        seed = read_scalar(payload.fields, "seed", int, self.spec)
        if not 0 <= seed <= MAX_SEED:
            raise CodecError(f"{self.spec}: seed {seed} is outside [0, 2**63)")
        coef = read_tensor(payload.fields, "coef", [self.r], torch.float32, self.spec)
        if not bool(torch.isfinite(coef).all()):
            raise CodecError(f"{self.spec}: coefficients hold NaN or Inf")
        d = payload.numel
        out = memory.empty(d, torch.float32)
        for start, block in projection_blocks(seed, d, self.r, self.dist):
            torch.mv(block, coef, out=out[start : start + block.shape[0]])
        return out.reshape(payload.shape)

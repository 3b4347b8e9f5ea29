"""How chunked codecs (top-k, DCT) cut a tensor into chunks of C values.

* 2-D tensors, when C is a perfect square s²: s×s tiles (64×64 for C = 4096), row-major over the
  tile grid; edge tiles are padded with zeros.
* Everything else (1-D, 0-d, ≥3-D, or C not a square): the flattened tensor in runs of C values,
  the last run padded with zeros.

Chunks are produced and consumed in bands of at most ``BAND`` values so temporaries stay in cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

BAND = 1 << 18  # values per band
Region = tuple[slice, slice] | slice  # rows × columns of a 2-D tensor, or a range of the flat one


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk geometry for one tensor shape.

    :param shape: the tensor's shape
    :param chunk: values per chunk (C)
    """

    shape: tuple[int, ...]
    chunk: int

    @property
    def tile(self) -> int | None:
        """Side s of the 2-D tiles, or None when the tensor is chunked flat."""
        side = math.isqrt(self.chunk)
        return side if len(self.shape) == 2 and side * side == self.chunk else None

    @property
    def grid(self) -> tuple[int, int]:
        """(tile rows, tile columns) for 2-D tiling; (chunks, 1) when flat."""
        s = self.tile
        if s is None:
            return -(-math.prod(self.shape) // self.chunk), 1
        rows, cols = self.shape
        return -(-rows // s), -(-cols // s)

    @property
    def n_chunks(self) -> int:
        """Number of chunks (0 for an empty tensor)."""
        if math.prod(self.shape) == 0:
            return 0
        a, b = self.grid
        return a * b

    def bands(self) -> Iterator[tuple[int, int, Region]]:
        """(first chunk, chunk count, region) per band; region indexes the 2-D tensor or the flat one."""
        per_band = max(1, BAND // self.chunk)
        s = self.tile
        if self.n_chunks == 0:
            return
        if s is None:
            total = self.n_chunks
            for first in range(0, total, per_band):
                count = min(per_band, total - first)
                yield first, count, slice(first * self.chunk, (first + count) * self.chunk)
            return
        tile_rows, tile_cols = self.grid
        for r in range(tile_rows):
            for c0 in range(0, tile_cols, per_band):
                count = min(per_band, tile_cols - c0)
                yield r * tile_cols + c0, count, (slice(r * s, (r + 1) * s), slice(c0 * s, (c0 + count) * s))

    def read_band(self, x: torch.Tensor, count: int, region: Region, out: torch.Tensor) -> torch.Tensor:
        """Copy one band of ``x`` (the tensor, or its flat view when chunked flat) into ``out[:count]``
        as (count, C) float32 chunks, zero-padding the tensor's edges."""
        block = out[:count]
        s = self.tile
        if s is None:
            assert isinstance(region, slice)
            src = x[region]
            m = src.numel()
            flat = block.view(-1)
            flat[:m].copy_(src)
            if m < flat.numel():
                flat[m:].zero_()
            return block
        assert isinstance(region, tuple)
        src = x[region]
        h, w = src.shape
        tiles = block.view(count, s, s)
        if h == s and w == count * s:
            tiles.copy_(src.unflatten(1, (count, s)).transpose(0, 1))
        else:
            full = torch.zeros(s, count * s)  # an edge band: pad, then tile
            full[:h, :w] = src
            tiles.copy_(full.unflatten(1, (count, s)).transpose(0, 1))
        return block

    def write_band(self, out: torch.Tensor, count: int, region: Region, block: torch.Tensor) -> None:
        """Inverse of :meth:`read_band`: write (count, C) chunks back into ``out``, dropping padding."""
        s = self.tile
        if s is None:
            assert isinstance(region, slice)
            dst = out[region]
            dst.copy_(block.reshape(-1)[: dst.numel()])
            return
        assert isinstance(region, tuple)
        dst = out[region]
        h, w = dst.shape
        tiles = block[:count].view(count, s, s).transpose(0, 1)  # (s, count, s)
        if h == s and w == count * s:
            dst.unflatten(1, (count, s)).copy_(tiles)
        else:
            dst.copy_(tiles.reshape(s, count * s)[:h, :w])

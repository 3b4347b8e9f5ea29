"""Chunked top-k sparsification (SparseLoCo): keep the K largest-magnitude values of every chunk.

Chunks follow :mod:`compression.chunking` (64×64 tiles for 2-D tensors at C = 4096, flat runs of C
otherwise). Per chunk the K positions are sent sorted and Elias–Fano coded (:mod:`compression.elias_fano`:
⌊log₂(C/K)⌋ + 1 bits each plus C/2^⌊log₂(C/K)⌋ bits per chunk, 8 bits a position for 64 of 4096),
or packed to ⌈log₂ C⌉ bits (12 for 4096) where that is smaller (K close to 1 or to C). The values
travel as float32; or, composed as ``topk:K/C+q2``, as a sign and a magnitude bit with two float16
levels per chunk (:mod:`compression.chunk_levels`); or, composed as ``topk:K/C+q4``/``+q8``, through
the statistical quantizer (one shift/table for the whole tensor); or, composed as ``topk:K/C+rot2``, through the rotation
quantizer (:mod:`compression.rotation`: the kept values, rotated in blocks of 1024, 2 bits each plus
one float32 scale per block). Wire cost per value: (index bits + value bits)·K/C bits, e.g.
(8 + 2.5)·64/4096 = 0.164 bits/param for ``topk:64/4096+q2`` ((8 + 2.03)·64/4096 for ``+rot2``),
plus a fixed ~250-byte header per payload.

A tensor with fewer than K elements keeps all of them (its single chunk is mostly padding).
Pair it with :class:`compression.ErrorFeedback` so dropped mass is sent in later rounds. With K = C
and no quantization the codec is lossless. A decoder refuses indices ≥ C and repeated indices.
"""

from __future__ import annotations

from typing import Any

import torch

from compression import memory
from compression.base import Codec, finite_range
from compression import chunk_levels, elias_fano
from compression.bitpack import pack_bits, packed_size, unpack_bits
from compression.chunking import BAND, ChunkLayout
from compression.errors import CodecError
from compression.payload import Payload
from compression.quantize import Quantized, dequantize, quantize, read_quantized
from compression.rotation import dequantize_rotated, read_rotated, rotate_quantize
from compression.wire import owned_tensor_map, read_tensor


def index_bits(chunk: int) -> int:
    """Bits needed for a position inside a chunk of ``chunk`` values (at least 1)."""
    return max(1, (chunk - 1).bit_length())


def uses_elias_fano(k: int, chunk: int) -> bool:
    """Whether K positions per chunk of C travel Elias–Fano coded (when it takes fewer bits than packing)."""
    return k > 0 and elias_fano.chunk_bits(k, chunk) < k * index_bits(chunk)


class TopKCompression(Codec):
    """``topk:K/C[+qB|+rotB]``: per chunk of C values keep the K of largest magnitude.

    Fields: ``idx_low``/``idx_high`` (the Elias–Fano streams of the sorted positions) or ``idx`` (packed
    uint8 indices, chunk by chunk, where packing is smaller: :func:`uses_elias_fano`), then ``values``
    (float32, n_chunks·K),
    the statistical quantizer's fields (:meth:`compression.quantize.Quantized.fields`) when
    ``value_bits`` is set, or the rotation
    quantizer's ``seed``/``scales``/``codes`` when ``rotated`` is also set.

    :param k: values kept per chunk (K), 1 ≤ K ≤ C
    :param chunk: values per chunk (C); a perfect square tiles 2-D tensors as √C×√C
    :param value_bits: None for float32 values, or 8/4/2 to quantize them statistically
        (8/4/2/1 with ``rotated``)
    :param rotated: quantize the values with the rotation codec (``+rotB``) instead of ``+qB``
    """

    family = "topk"
    # 2: ``+qB`` values carry the quantizer's outlier side channel; 3: Elias–Fano positions, ``+q2`` levels per chunk
    version = 3

    def __init__(self, k: int, chunk: int, value_bits: int | None = None, rotated: bool = False) -> None:
        if not 1 <= chunk <= 1 << 24:
            raise ValueError(f"{self.family} chunk size must be in 1..2**24, got {chunk}")
        if not 1 <= k <= chunk:
            raise ValueError(f"{self.family} must keep between 1 and C={chunk} values per chunk, got K={k}")
        if rotated and value_bits not in (1, 2, 4, 8):
            raise ValueError(f"{self.family} rotated values take 8, 4, 2 or 1 bits, got {value_bits}")
        if not rotated and value_bits not in (None, 2, 4, 8):
            raise ValueError(f"{self.family} values can be quantized to 8, 4 or 2 bits, got {value_bits}")
        self.k, self.chunk, self.value_bits, self.rotated = k, chunk, value_bits, rotated

    @property
    def chunk_local(self) -> bool:
        """Whether every chunk's values decode from that chunk's bytes alone (float32 or ``+q2``), so a
        payload may run across tensors of different scales (``gossip.partition.Partition`` with ``flat``)."""
        return self.value_bits is None or (self.value_bits == 2 and not self.rotated)

    @property
    def spec(self) -> str:
        suffix = f"+{'rot' if self.rotated else 'q'}{self.value_bits}" if self.value_bits else ""
        return f"{self.family}:{self.k}/{self.chunk}{suffix}"

    # chunk transforms: identity here, the DCT in compression.dct
    def _forward(self, block: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        return block

    def _inverse(self, block: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        return block

    def kept(self, numel: int) -> int:
        """Values kept per chunk for a tensor of ``numel`` elements: K, or all of them when fewer."""
        return min(self.k, numel)

    def _encode(self, x: torch.Tensor) -> Payload:
        layout = ChunkLayout(tuple(x.shape), self.chunk)
        source = x if layout.tile else x.reshape(-1)
        n_chunks, k = layout.n_chunks, self.kept(x.numel())
        indices = torch.empty(n_chunks, k, dtype=torch.int64)
        values = memory.empty((n_chunks, k), torch.float32)
        per_band = min(max(1, BAND // self.chunk), max(n_chunks, 1))
        work = torch.empty(per_band, self.chunk)
        magnitude = torch.empty(per_band, self.chunk)
        for first, count, region in layout.bands():
            block = self._forward(layout.read_band(source, count, region, work), layout)
            _check_band(block)
            mags = torch.abs(block, out=magnitude[:count])
            chosen = indices[first : first + count]
            chosen.copy_(torch.topk(mags, k, dim=1, sorted=False).indices)
            chosen.numpy().sort(axis=1)  # in place; numpy sorts short int rows ~3× faster than torch
            torch.gather(block, 1, chosen, out=values[first : first + count])
        fields: dict[str, Any] = {}
        if uses_elias_fano(k, self.chunk):
            low, high = elias_fano.encode(indices, self.chunk)
            fields.update(idx_low=owned_tensor_map(low), idx_high=owned_tensor_map(high))
        else:
            fields["idx"] = owned_tensor_map(pack_bits(indices.reshape(-1), index_bits(self.chunk)))
        if self.value_bits is None:
            fields["values"] = owned_tensor_map(values.reshape(-1))
        elif self.rotated:
            fields.update(rotate_quantize(values.reshape(-1), self.value_bits).fields())
        elif self.value_bits == 2:
            codes, levels = chunk_levels.encode(values)
            fields.update(codes=owned_tensor_map(codes), levels=owned_tensor_map(levels))
        else:
            fields.update(quantize(values.reshape(-1), self.value_bits).fields())
        return Payload(self.spec, self.version, tuple(x.shape), fields)

    def _decode(self, payload: Payload) -> torch.Tensor:
        layout = ChunkLayout(payload.shape, self.chunk)
        n_chunks, k = layout.n_chunks, self.kept(payload.numel)
        total = n_chunks * k
        if uses_elias_fano(k, self.chunk):
            low_size, high_size = elias_fano.stream_sizes(n_chunks, k, self.chunk)
            low = read_tensor(payload.fields, "idx_low", [low_size], torch.uint8, self.spec)
            high = read_tensor(payload.fields, "idx_high", [high_size], torch.uint8, self.spec)
            indices = elias_fano.decode(low, high, n_chunks, k, self.chunk, self.spec)
        else:
            bits = index_bits(self.chunk)
            packed = read_tensor(payload.fields, "idx", [packed_size(total, bits)], torch.uint8, self.spec)
            indices = unpack_bits(packed, bits, total).to(torch.int64).view(n_chunks, k)
            if total:  # (Elias–Fano decoding checks the same itself)
                if int(indices.max()) >= self.chunk:
                    raise CodecError(f"{self.spec}: an index points past the end of its {self.chunk}-value chunk")
                ordered = indices.sort(dim=1).values
                if k > 1 and bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                    raise CodecError(f"{self.spec}: a chunk repeats an index")
        if self.value_bits is None:
            values = read_tensor(payload.fields, "values", [total], torch.float32, self.spec)
            if total and not bool(torch.isfinite(values).all()):
                raise CodecError(f"{self.spec}: values hold NaN or Inf")
        elif self.rotated:
            values = dequantize_rotated(read_rotated(payload.fields, self.value_bits, total, self.spec), total)
        elif self.value_bits == 2:
            code_bytes, level_shape = chunk_levels.sizes(n_chunks, k)
            codes = read_tensor(payload.fields, "codes", [code_bytes], torch.uint8, self.spec)
            levels = read_tensor(payload.fields, "levels", level_shape, torch.float16, self.spec)
            values = chunk_levels.decode(codes, levels, n_chunks, k, self.spec)
        else:
            q: Quantized = read_quantized(payload.fields, self.value_bits, total, self.spec)
            values = dequantize(q, total)
        values = values.reshape(n_chunks, k)
        out = memory.empty(payload.shape if layout.tile else (payload.numel,), torch.float32)
        per_band = min(max(1, BAND // self.chunk), max(n_chunks, 1))
        work = torch.empty(per_band, self.chunk)
        for first, count, region in layout.bands():
            block = work[:count].zero_()
            block.scatter_(1, indices[first : first + count], values[first : first + count])
            layout.write_band(out, count, region, self._inverse(block, layout))
        return out.reshape(payload.shape)


def _check_band(block: torch.Tensor) -> None:
    """ValueError on NaN/Inf; a float32 sum over a cached band is finite unless one of those (or overflow)."""
    total = float(block.sum())
    if total != total or total in (float("inf"), float("-inf")):
        finite_range(block)

"""Statistical quantizer (q8 / q4 / q2): 256 / 16 / 4 bins of width 6σ/n_bins around the mean.

    shift = mean(x),  scale = 6·σ(x) / n_bins
    code  = clamp(round((x − shift)/scale + n_bins/2), 0, n_bins − 1)
    x̂     = shift + lut[code],  lut[b] = mean of (x − shift) over the elements with code b

Codes are bit-packed (four 2-bit or two 4-bit codes per byte); the lookup table (n_bins float32)
and the shift (float64) travel alongside. Mean and σ accumulate in float32 (cascade sum and dot
product); the per-bin sums behind the table accumulate in float64.

Error bound: every x̂ is the mean of the elements sharing x's code, so it lies within that bin's
value range. For an element in an interior bin (0 < code < n_bins − 1), |x − x̂| ≤ scale = 6σ/n_bins
(plus float32 rounding, ≤ 1e-6·(|x| + |shift|)). The two edge bins also collect everything beyond
≈ ±3σ, so there |x − x̂| is bounded only by that bin's spread. A constant tensor decodes exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from compression import memory
from compression.base import Codec, finite_range
from compression.bitpack import pack_bits, packed_size, unpack_bits
from compression.errors import CodecError
from compression.flat import flat_float32
from compression.payload import Payload
from compression.wire import owned_tensor_map, read_scalar, read_tensor

RANGE_IN_SIGMAS = 6.0
CHUNK = 1 << 18  # elements per pass: temporaries stay in cache; a multiple of 8 so codes pack per chunk
_MIN_SCALE = 2.0**-120  # keeps 1/scale finite in float32


@dataclass(frozen=True)
class Quantized:
    """Statistically quantized values: ``shift`` + ``lut[codes]``, codes packed at ``bits`` bits."""

    bits: int
    shift: float
    lut: torch.Tensor  # (n_bins,) float32, per-bin mean of x − shift
    packed: torch.Tensor  # (⌈n·bits/8⌉,) uint8

    def fields(self) -> dict[str, Any]:
        """Payload fields ``shift``, ``lut`` and ``codes``."""
        return {"shift": self.shift, "lut": owned_tensor_map(self.lut), "codes": owned_tensor_map(self.packed)}


def moments(flat: torch.Tensor) -> tuple[float, float]:
    """(mean, population σ) of a contiguous float32 vector; ``ValueError`` on NaN/Inf.

    Fast path: one float32 sum and one float32 dot. Falls back to float64 when those overflow and to a
    centred pass when |mean| ≫ σ makes E[x²] − mean² lose its digits.
    """
    n = flat.numel()
    if n == 0:
        return 0.0, 0.0
    total, squares = float(flat.sum()), float(torch.dot(flat, flat))
    if not (math.isfinite(total) and math.isfinite(squares)):
        finite_range(flat)  # NaN/Inf: ValueError; otherwise float32 overflowed, redo in float64
        wide = flat.to(torch.float64)
        total, squares = float(wide.sum()), float(torch.dot(wide, wide))
    mean = total / n
    var = squares / n - mean * mean
    if var <= 1e-3 * mean * mean:
        var = float(torch.var(flat.to(torch.float64), correction=0))
    return mean, math.sqrt(max(var, 0.0))


def quantize(flat: torch.Tensor, bits: int) -> Quantized:
    """Quantize a contiguous float32 vector with ``2**bits`` bins (bits ∈ {2, 4, 8})."""
    if bits not in (2, 4, 8):
        raise ValueError(f"the statistical quantizer supports 2, 4 or 8 bits, got {bits}")
    n_bins, n = 1 << bits, flat.numel()
    half = n_bins // 2
    shift, std = moments(flat)
    scale = RANGE_IN_SIGMAS * std / n_bins
    if not scale >= _MIN_SCALE:
        scale = 1.0  # (near-)constant input: everything lands in the centre bin and decodes exactly
    inv_scale = 1.0 / scale
    packed = memory.empty(packed_size(n, bits), torch.uint8)
    bin_sums = torch.zeros(n_bins, dtype=torch.float64)
    counts = torch.zeros(n_bins, dtype=torch.int64)
    chunk = min(CHUNK, max(n, 1))
    position, codes, index = torch.empty(chunk), torch.empty(chunk), torch.empty(chunk, dtype=torch.int32)
    wide = torch.empty(chunk, dtype=torch.float64)
    per = 8 // bits
    byte_weights = torch.tensor([float(1 << (j * bits)) for j in range(per)])
    byte_values = torch.empty(-(-chunk // per))
    for start in range(0, n, CHUNK):
        xc = flat[start : start + CHUNK]
        m = xc.numel()
        pos, code, idx = position[:m], codes[:m], index[:m]
        torch.sub(xc, shift, out=pos)
        pos.mul_(inv_scale).add_(half)  # (x − shift)/scale + n_bins/2
        torch.round(pos, out=code).clamp_(0, n_bins - 1)
        idx.copy_(code)
        bin_sums.index_add_(0, idx, wide[:m].copy_(xc))  # per-bin sums in float64
        counts += torch.bincount(idx, minlength=n_bins)
        offset = start * bits // 8
        target = packed[offset : offset + packed_size(m, bits)]
        if per == 1:
            target.copy_(code)
        elif m % per == 0:  # the codes of one byte as an exact small-integer dot product
            target.copy_(torch.mv(code.view(-1, per), byte_weights, out=byte_values[: m // per]))
        else:
            target.copy_(pack_bits(idx, bits))
    centres = (torch.arange(n_bins, dtype=torch.float64) - half) * scale
    means = bin_sums / counts.clamp_min(1) - shift
    lut = torch.where(counts > 0, means, centres).to(torch.float32)
    return Quantized(bits, float(shift), lut, packed)


def dequantize(q: Quantized, count: int) -> torch.Tensor:
    """Float32 vector of ``count`` values: ``shift + lut[codes]`` with one table lookup per packed byte."""
    per = 8 // q.bits
    table = (q.lut.to(torch.float64) + q.shift).to(torch.float32)  # (n_bins,) absolute values
    if per > 1:  # row p holds the `per` values packed in byte p
        table = table[unpack_bits(torch.arange(256, dtype=torch.uint8), q.bits, 256 * per).long()].reshape(256, per)
    else:
        table = table.reshape(256, 1)
    groups = q.packed.numel()
    out = memory.empty((groups, per), torch.float32)
    if groups:
        np.take(table.numpy(), q.packed.numpy(), axis=0, out=out.numpy(), mode="wrap")
    return out.reshape(-1)[:count]


def read_quantized(fields: Mapping[str, Any], bits: int, count: int, codec: str) -> Quantized:
    """Validate and read the ``shift``/``lut``/``codes`` fields of ``count`` quantized values."""
    shift = read_scalar(fields, "shift", float, codec)
    lut = read_tensor(fields, "lut", [1 << bits], torch.float32, codec)
    if not bool(torch.isfinite(lut).all()):
        raise CodecError(f"{codec}: the lookup table holds NaN or Inf")
    packed = read_tensor(fields, "codes", [packed_size(count, bits)], torch.uint8, codec)
    return Quantized(bits, shift, lut, packed)


class StatisticalQuantization(Codec):
    """``q8`` / ``q4`` / ``q2``: mean-centred uniform bins of 6σ/n_bins decoded by per-bin means.

    Fields: ``shift`` (float), ``lut`` (n_bins float32), ``codes`` (packed uint8).

    :param bits: 8, 4 or 2 bits per value (256, 16 or 4 bins)
    """

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"statistical quantization supports 8, 4 or 2 bits, got {bits}")
        self.bits = bits

    @property
    def spec(self) -> str:
        return f"q{self.bits}"

    def _encode(self, x: torch.Tensor) -> Payload:
        q = quantize(flat_float32(x), self.bits)
        return Payload(self.spec, self.version, tuple(x.shape), q.fields())

    def _decode(self, payload: Payload) -> torch.Tensor:
        q = read_quantized(payload.fields, self.bits, payload.numel, self.spec)
        return dequantize(q, payload.numel).reshape(payload.shape)

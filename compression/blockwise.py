"""Blockwise absmax int8 (``int8-block``): the SWARM activation default, also usable for gradients.

The flattened tensor is cut into blocks of B values (default 4096; the last block may be shorter).
Per block: scale = max|x| / 127 (float32), code = round(x / scale) ∈ [−127, 127] (int8).
Error bound: |x − x̂| ≤ scale / 2 = max|x_block| / 254 per element, plus float32 rounding.
Cost on the wire: 8 bits per value + 32 bits per block (8.0078 bits/value at B = 4096).
"""

from __future__ import annotations

import torch

from compression import memory
from compression.base import Codec
from compression.errors import CodecError
from compression.flat import flat_float32
from compression.payload import Payload
from compression.wire import owned_tensor_map, read_tensor

DEFAULT_BLOCK = 4096
_CHUNK = 1 << 18  # elements per pass


class BlockwiseInt8(Codec):
    """``int8-block[:B]``: int8 codes with one float32 absmax scale per block of B values.

    Fields: ``scales`` (⌈n/B⌉ float32), ``codes`` (n int8).

    :param block: values per block (B), default 4096
    """

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        if not 1 <= block <= 1 << 24:
            raise ValueError(f"int8-block block size must be in 1..2**24, got {block}")
        self.block = block

    @property
    def spec(self) -> str:
        return "int8-block" if self.block == DEFAULT_BLOCK else f"int8-block:{self.block}"

    def _encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x)
        n, b = flat.numel(), self.block
        n_blocks = -(-n // b)
        codes = memory.empty(n, torch.int8)
        scales = torch.empty(n_blocks, dtype=torch.float32)
        step = max(1, _CHUNK // b) * b
        work = torch.empty(min(step, n))
        for start in range(0, n, step):
            part = flat[start : start + step]
            m = part.numel()
            full = m // b * b
            first = start // b
            if full:
                rows = full // b
                self._quantize_blocks(
                    part[:full].view(rows, b), codes[start : start + full], scales[first : first + rows], work[:full]
                )
            if full < m:  # the short last block
                self._quantize_blocks(
                    part[full:].view(1, -1), codes[start + full : start + m], scales[n_blocks - 1 :], work[: m - full]
                )
        fields = {"scales": owned_tensor_map(scales), "codes": owned_tensor_map(codes)}
        return Payload(self.spec, self.version, tuple(x.shape), fields)

    @staticmethod
    def _quantize_blocks(blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, work: torch.Tensor) -> None:
        scaled = work.view(blocks.shape)
        absmax = torch.abs(blocks, out=scaled).amax(dim=1)  # NaN propagates
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("input contains NaN or Inf values; refusing to encode it")
        torch.div(absmax, 127.0, out=scales)
        inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
        torch.mul(blocks, inverse.unsqueeze(1), out=scaled)
        codes.view(blocks.shape).copy_(scaled.round_())

    def _decode(self, payload: Payload) -> torch.Tensor:
        n, b = payload.numel, self.block
        n_blocks = -(-n // b)
        scales = read_tensor(payload.fields, "scales", [n_blocks], torch.float32, self.spec)
        if n_blocks and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise CodecError(f"{self.spec}: block scales must be finite and non-negative")
        codes = read_tensor(payload.fields, "codes", [n], torch.int8, self.spec)
        out = memory.empty(n, torch.float32)
        step = max(1, _CHUNK // b) * b
        for start in range(0, n, step):
            m = min(step, n - start)
            full = m // b * b
            first = start // b
            if full:
                view = out[start : start + full].view(-1, b)
                view.copy_(codes[start : start + full].view(-1, b)).mul_(scales[first : first + full // b].unsqueeze(1))
            if full < m:
                out[start + full : start + m].copy_(codes[start + full : start + m]).mul_(scales[n_blocks - 1])
        return out.reshape(payload.shape)

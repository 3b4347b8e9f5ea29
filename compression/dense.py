"""Dense codecs: ``none`` (float32, lossless for fp32/fp16/bf16 inputs), ``fp16`` and ``bf16`` casts.

FP16 pseudo-gradients cost no measurable quality in DiLoCo (OpenDiLoCo); bf16 keeps fp32's range at
half fp16's precision, which suits activations.
"""

from __future__ import annotations

import torch

from compression import memory
from compression.base import Codec, check_finite, finite_range
from compression.payload import Payload
from compression.wire import owned_tensor_map, read_tensor

_FP16_MAX = float(torch.finfo(torch.float16).max)


class NoCompression(Codec):
    """``none``: the tensor as float32 (float64 inputs are rounded to float32). Field ``x``."""

    @property
    def spec(self) -> str:
        return "none"

    def _encode(self, x: torch.Tensor) -> Payload:
        if x.dtype == torch.float32 and x.is_contiguous():
            # pack straight from the caller's memory, then keep only views into the packed bytes:
            # one copy in all, and the payload never aliases the input
            check_finite(x)
            draft = Payload(self.spec, self.version, tuple(x.shape), {"x": owned_tensor_map(x)})
            return Payload.packed(draft, "x")
        out = memory.empty(x.shape, torch.float32)
        out.copy_(x)  # a private float32 copy, whatever the input's dtype and layout
        check_finite(out)
        return Payload(self.spec, self.version, tuple(x.shape), {"x": owned_tensor_map(out)})

    def _decode(self, payload: Payload) -> torch.Tensor:
        out = memory.empty(payload.shape, torch.float32)
        return out.copy_(read_tensor(payload.fields, "x", payload.shape, torch.float32, self.spec))

    def _decode_view(self, payload: Payload) -> torch.Tensor:
        return read_tensor(payload.fields, "x", payload.shape, torch.float32, self.spec)


class CastCompression(Codec):
    """``fp16`` / ``bf16``: round each value to a 16-bit float. Field ``x``.

    fp16 saturates finite values beyond ±65504 to ±65504 instead of turning them into Inf.
    Relative error per element ≤ 2⁻¹¹ (fp16, normal range) or 2⁻⁸ (bf16).

    :param dtype: ``torch.float16`` or ``torch.bfloat16``
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cast codec supports float16 and bfloat16, got {dtype}")
        self.dtype = dtype

    @property
    def spec(self) -> str:
        return "fp16" if self.dtype == torch.float16 else "bf16"

    def _encode(self, x: torch.Tensor) -> Payload:
        out = memory.empty(x.shape, self.dtype)
        out.copy_(x)
        try:
            finite_range(out)  # checks the (cheaper, contiguous) 16-bit copy
        except ValueError:
            check_finite(x)  # NaN/Inf in the input itself: refuse
            if self.dtype != torch.float16:
                raise ValueError("input values exceed the bfloat16 range; refusing to encode") from None
            out.copy_(x.clamp(-_FP16_MAX, _FP16_MAX))  # finite values beyond fp16's range saturate
        return Payload(self.spec, self.version, tuple(x.shape), {"x": owned_tensor_map(out)})

    def _decode(self, payload: Payload) -> torch.Tensor:
        out = memory.empty(payload.shape, torch.float32)
        return out.copy_(read_tensor(payload.fields, "x", payload.shape, self.dtype, self.spec))

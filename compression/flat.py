"""Input normalisation shared by the codecs: a contiguous float32 view of the whole tensor."""

from __future__ import annotations

import torch

from compression import memory


def flat_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous 1-D float32 tensor; a view when it already is one, else a private copy.

    Callers must not write into the result (it may be the caller's own tensor).
    """
    if x.dtype == torch.float32 and x.is_contiguous():
        return x.reshape(-1)
    out = memory.empty(x.shape, torch.float32)
    out.copy_(x)
    return out.reshape(-1)

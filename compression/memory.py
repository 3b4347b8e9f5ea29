"""Output buffers allocated through numpy.

numpy asks the kernel for transparent huge pages on large arrays (``madvise``); torch's CPU allocator
does not, so a fresh 100 MB torch tensor costs tens of milliseconds of page faults before any math
runs. Codecs allocate their large outputs here and wrap them as ordinary torch tensors.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_NUMPY: dict[torch.dtype, tuple[np.dtype, torch.dtype | None]] = {
    torch.float32: (np.dtype(np.float32), None),
    torch.float64: (np.dtype(np.float64), None),
    torch.float16: (np.dtype(np.float16), None),
    torch.bfloat16: (np.dtype(np.int16), torch.bfloat16),
    torch.uint8: (np.dtype(np.uint8), None),
    torch.int8: (np.dtype(np.int8), None),
    torch.int16: (np.dtype(np.int16), None),
    torch.int32: (np.dtype(np.int32), None),
    torch.int64: (np.dtype(np.int64), None),
}


def empty(shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose memory comes from numpy."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    np_dtype, view_as = _NUMPY[dtype]
    out = torch.from_numpy(np.empty(shape, dtype=np_dtype))
    return out.view(view_as) if view_as is not None else out


def zeros(shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor whose memory comes from numpy."""
    out = empty(shape, dtype)
    out.zero_()
    return out

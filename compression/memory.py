"""Output buffers allocated through numpy, and how the process keeps freed buffers (``tune_allocator``).

numpy asks the kernel for transparent huge pages on large arrays (``madvise``); torch's CPU allocator
does not, so a fresh 100 MB torch tensor costs tens of milliseconds of page faults before any math
runs. Codecs allocate their large outputs here and wrap them as ordinary torch tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to 32 MiB (a round's wire parts) come from the heap
ARENA_MAX = 1  # malloc arenas: one per thread by default, each keeping what its thread freed


def tune_allocator() -> bool:
    """Let glibc keep the memory a round frees for the next round instead of giving it back to the kernel,
    in few arenas.

    Every dense round allocates and frees the same buffers (wire parts of ~4 MB, decoded updates). By
    default glibc maps each block over 128 KiB-32 MiB fresh from the kernel and unmaps it on free, so every
    round pays a page fault per 4 KiB of its transient memory again (~60 ms per 100 MB here, as much as
    the copies themselves). With the mmap threshold at its largest and trimming off, those blocks come
    from the heap and are reused; the resident size stays at the round's peak between rounds (which
    ``node join --dry-run`` counts anyway). glibc also gives every thread that allocates its own arena (up to
    8 per core), and memory one thread freed stays in its arena: a daemon's training, network and worker
    threads held ~1.2 GB more of a llama-150m node than with one arena (peak 10.2 against 9.0 GiB, batch 1,
    measured once each; two arenas: 9.9), so the process keeps ``ARENA_MAX``. Call it before the daemon starts its threads.
    Returns False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(bool(mallopt(option, value)) for option, value in
               ((_M_ARENA_MAX, ARENA_MAX), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 1 << 30)))

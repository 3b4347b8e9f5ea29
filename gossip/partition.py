"""Split model tensors into wire-sized parts (row blocks of ≤ ``max_numel`` elements) and join them back.

Both sides of an exchange derive the same partition from the same shapes, so part ``i`` needs no
name on the wire. Row blocks keep 2-D structure for codecs that tile matrices.
"""

from __future__ import annotations

from typing import Sequence

import torch

DEFAULT_PART_NUMEL = 1 << 20


def part_shapes(shapes: Sequence[Sequence[int]], max_numel: int = DEFAULT_PART_NUMEL) -> list[tuple[int, ...]]:
    """The shape of every part, in order."""
    out: list[tuple[int, ...]] = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) == 0 or shape[0] == 0:
            out.append(shape)
            continue
        row = max(1, int(torch.tensor(shape[1:], dtype=torch.int64).prod().item()) if len(shape) > 1 else 1)
        rows_per_part = max(1, max_numel // row)
        for start in range(0, shape[0], rows_per_part):
            out.append((min(rows_per_part, shape[0] - start), *shape[1:]))
    return out


def split(tensors: Sequence[torch.Tensor], max_numel: int = DEFAULT_PART_NUMEL) -> list[torch.Tensor]:
    """Views of ``tensors`` cut into parts along their first dimension."""
    parts: list[torch.Tensor] = []
    for t in tensors:
        if t.dim() == 0 or t.shape[0] == 0:
            parts.append(t)
            continue
        row = t[0].numel() if t.dim() > 1 else 1
        parts.extend(torch.split(t, max(1, max_numel // max(row, 1)), dim=0))
    return parts


def join(parts: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], max_numel: int = DEFAULT_PART_NUMEL) -> list[torch.Tensor]:
    """Inverse of :func:`split` for tensors of the given shapes."""
    out: list[torch.Tensor] = []
    i = 0
    for shape in shapes:
        n = len(part_shapes([shape], max_numel))
        chunk = parts[i : i + n]
        i += n
        out.append(chunk[0].reshape(tuple(shape)) if n == 1 else torch.cat(list(chunk), dim=0))
    if i != len(parts):
        raise ValueError(f"{len(parts)} parts for shapes that need {i}")
    return out

"""Split model tensors into wire-sized parts and join them back: row blocks of ≤ ``max_numel``
elements per tensor, or (:class:`Partition` with ``flat``) runs of the tensors laid end to end.

Both sides of an exchange derive the same partition from the same shapes, so part ``i`` needs no
name on the wire. Row blocks keep 2-D structure for codecs that tile matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Partition:
    """How a round's tensors are cut into wire parts; both sides of an exchange derive the same parts.

    :param max_numel: elements per part at most
    :param flat: concatenate all tensors and cut runs of ``max_numel`` (one payload header for many small
        tensors, e.g. top-k's ~250 bytes per payload, which on a small model's 52 tensors cost as much as
        the indices); otherwise each tensor is cut into row blocks (:func:`split`), keeping 2-D structure
    """

    max_numel: int = DEFAULT_PART_NUMEL
    flat: bool = False

    def shapes(self, shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The shape of every part, in order."""
        if not self.flat:
            return part_shapes(shapes, self.max_numel)
        total = sum(math.prod(s) for s in shapes)
        return [(min(self.max_numel, total - start),) for start in range(0, total, self.max_numel)]

    def split(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` cut into parts (views for row blocks, a concatenated copy when flat)."""
        if not self.flat:
            return split(tensors, self.max_numel)
        if not sum(t.numel() for t in tensors):
            return []  # no runs, as :meth:`shapes` says (torch would give one empty run)
        return list(torch.cat([t.reshape(-1) for t in tensors]).split(self.max_numel))

    def join(self, parts: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Inverse of :meth:`split` for tensors of the given shapes."""
        if not self.flat:
            return join(parts, shapes, self.max_numel)
        expected = self.shapes(shapes)
        if [tuple(p.shape) for p in parts] != expected:
            raise ValueError(f"{len(parts)} parts for shapes that need {len(expected)} flat runs")
        if not parts:
            return [torch.empty(tuple(s)) for s in shapes]
        whole = torch.cat([p.reshape(-1) for p in parts])
        return [t.view(tuple(s)) for t, s in zip(whole.split([math.prod(s) for s in shapes]), shapes)]

"""Batches of token windows from prepared shards: a seeded, resumable training order and fixed validation.

:class:`TokenBatches` is the token counterpart of :class:`node.data.bytes.ByteBatches`. Each epoch
cuts every training shard into non-overlapping windows of ``context + 1`` tokens (all starting
at one offset below ``context`` drawn for the epoch, so successive epochs see other cuts) and
visits all of them once, in an order given by a keyed permutation of the window indices (a
Feistel network with cycle walking: O(1) memory however many windows there are). The order
depends only on the seed, so peers with different seeds see the data in different orders;
the state is a few integers (epoch, position), so a checkpointed node resumes exactly where
it was. Only the windows drawn are read from the memory-mapped shards.

:func:`token_validation_batches` gives fixed windows of the validation split, the same on
every node (like :func:`node.data.bytes.validation_batches`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from node.errors import UserError
from node.data.shard_format import ShardInfo, TokenDataset

__all__ = ["TokenBatches", "token_validation_batches", "permute", "epoch_layout"]

_ROUNDS = 4
_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _keys(*parts: object) -> list[int]:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return [int.from_bytes(digest[8 * r: 8 * r + 8], "little") for r in range(_ROUNDS)]


def permute(i: np.ndarray, n: int, keys: list[int]) -> np.ndarray:
    """Image of indices ``i`` (< ``n``) under a keyed bijection of ``range(n)``."""
    i = np.asarray(i, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(i)
    bits = max(2, (n - 1).bit_length())
    half = np.uint64((bits + 1) // 2)
    mask = np.uint64((1 << int(half)) - 1)
    ks = [np.uint64(k & _M64) for k in keys]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for k in ks:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    with np.errstate(over="ignore"):
        x = feistel(i)
        while (bad := x >= np.uint64(n)).any():  # cycle walking: the domain is < 4n, so ~2 passes
            x[bad] = feistel(x[bad])
    return x


@dataclass(frozen=True)
class Layout:
    """One epoch's windows: all start at ``shift + j·context``; shard ``s`` holds windows ``cum[s]..cum[s+1]-1``."""

    shift: int
    cum: np.ndarray
    keys: list[int]

    @property
    def windows(self) -> int:
        return int(self.cum[-1])

    def locate(self, g: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, start token) of global windows ``g``."""
        g = np.asarray(g, dtype=np.int64)
        shard = np.searchsorted(self.cum, g, side="right") - 1
        return shard, self.shift + (g - self.cum[shard]) * context


def _cum(lengths: np.ndarray, context: int, shift: int) -> np.ndarray:
    counts = np.maximum(0, (lengths - 1 - shift) // context)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def epoch_layout(lengths: np.ndarray, context: int, seed: int, epoch: int) -> Layout:
    """The windows of ``epoch`` over shards of ``lengths`` tokens, for a node seeded ``seed``."""
    keys = _keys("locomesh-token-batches", seed, epoch)
    shift = (keys[0] >> 8) % context
    cum = _cum(lengths, context, shift)
    if cum[-1] == 0:
        shift, cum = 0, _cum(lengths, context, 0)
    return Layout(int(shift), cum, keys)


def _gather(ds: TokenDataset, shards: list[ShardInfo], which: np.ndarray, starts: np.ndarray,
            context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (int64, ``(len(starts), context)``) of the windows; ids are checked against the vocabulary."""
    out = np.empty((len(starts), context + 1), dtype=ds.dtype)
    for row, (s, start) in enumerate(zip(which.tolist(), starts.tolist())):
        out[row] = ds.array(shards[s])[start: start + context + 1]
    for s in np.unique(which).tolist():
        ds.check_ids(out[which == s], shards[s])
    t = torch.from_numpy(out.astype(np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _check_args(batch_size: int, context: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")


class TokenBatches:
    """Endless training batches of token windows, in a seeded order that resumes exactly.

    ``next()`` returns ``(x, y)``, two ``int64`` tensors of shape ``(batch_size, context)``
    where ``y[:, t]`` is the token after ``x[:, t]``. ``state_dict()``/``load_state_dict()``
    carry the position (epoch and window) across a checkpoint.

    :param dataset: shards opened with :func:`node.data.shards.open_shards`
    :param batch_size: windows per batch
    :param context: tokens per window (the model's context)
    :param seed: this node's data-order seed
    :param split: ``train`` (default) or ``val``
    """

    def __init__(self, *, dataset: TokenDataset, batch_size: int, context: int, seed: int, split: str = "train") -> None:
        _check_args(batch_size, context)
        self.dataset = dataset
        self.batch_size = batch_size
        self.context = context
        self.seed = int(seed)
        self.split = split
        self.shards = dataset.shards(split)
        self._lengths = np.array([s.tokens for s in self.shards], dtype=np.int64)
        if _cum(self._lengths, context, 0)[-1] == 0:
            longest = int(self._lengths.max()) if len(self._lengths) else 0
            raise UserError(f"{dataset.root}: no {split} shard holds one window of context + 1 = {context + 1} tokens "
                            f"(the longest has {longest:,}); add data or use a model with a smaller context")
        self.epoch = 0
        self.position = 0
        self.batches_drawn = 0
        self._layout: Layout | None = None

    def layout(self, epoch: int) -> Layout:
        if self._layout is None or self._layout_epoch != epoch:
            self._layout, self._layout_epoch = epoch_layout(self._lengths, self.context, self.seed, epoch), epoch
        return self._layout

    def _next_windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        which, starts = [], []
        while n:
            lay = self.layout(self.epoch)
            take = min(n, lay.windows - self.position)
            g = permute(np.arange(self.position, self.position + take, dtype=np.uint64), lay.windows, lay.keys)
            s, st = lay.locate(g.astype(np.int64), self.context)
            which.append(s)
            starts.append(st)
            n -= take
            self.position += take
            if self.position == lay.windows:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(which), np.concatenate(starts)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)`` batch."""
        which, starts = self._next_windows(self.batch_size)
        self.batches_drawn += 1
        return _gather(self.dataset, self.shards, which, starts, self.context)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def state_dict(self) -> dict[str, Any]:
        """The resumable state: plain ints and strings (``kind``, ``seed``, ``epoch``, ``position``, ...)."""
        return {"kind": "token-batches", "seed": self.seed, "split": self.split, "context": self.context,
                "epoch": self.epoch, "position": self.position, "batches_drawn": self.batches_drawn,
                "dataset": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; ``ValueError`` if it was saved for other shards or another context."""
        if state.get("kind") != "token-batches":
            raise ValueError("not a TokenBatches state (a byte-level checkpoint?)")
        if state.get("dataset") != self.dataset.fingerprint():
            raise ValueError(f"the data-order state was saved for other shards ({state.get('dataset')}, "
                             f"these are {self.dataset.fingerprint()})")
        if int(state.get("context", self.context)) != self.context:
            raise ValueError(f"the data-order state was saved for context {state.get('context')}, not {self.context}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batches_drawn = int(state.get("batches_drawn", 0))
        if not 0 <= self.position < self.layout(self.epoch).windows:
            raise ValueError(f"data-order position {self.position} is outside epoch {self.epoch}")

    def __repr__(self) -> str:
        return (f"TokenBatches({self.dataset.tokens(self.split):,} {self.split} tokens, batch_size={self.batch_size}, "
                f"context={self.context}, seed={self.seed}, epoch={self.epoch}, position={self.position})")


def token_validation_batches(dataset: TokenDataset, batch_size: int, context: int, max_batches: int | None = None,
                             split: str = "val") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: non-overlapping windows of each ``split`` shard, in order.

    Window ``j`` of a shard is ``x = tokens[j·context : (j+1)·context]`` with ``y`` shifted by
    one. With ``max_batches``, only ``max_batches × batch_size`` windows are kept, evenly spaced
    over the split. The result depends only on the arguments: every node evaluates the same windows.
    """
    _check_args(batch_size, context)
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f"max_batches must be a positive integer or None, got {max_batches!r}")
    shards = dataset.shards(split)
    lay = Layout(0, _cum(np.array([s.tokens for s in shards], dtype=np.int64), context, 0), [])
    total = lay.windows
    if total == 0:
        what = "no validation documents (a single input document?)" if not shards else \
            f"fewer than context + 1 = {context + 1} tokens in every {split} shard"
        raise UserError(f"{dataset.root}: {what}; prepare more data or use a model with a smaller context")
    if max_batches is not None and total > max_batches * batch_size:
        keep = max_batches * batch_size
        g = (np.arange(keep, dtype=np.int64) * total) // keep
    else:
        g = np.arange(total, dtype=np.int64)
    which, starts = lay.locate(g, context)
    return [_gather(dataset, shards, which[i: i + batch_size], starts[i: i + batch_size], context)
            for i in range(0, len(g), batch_size)]

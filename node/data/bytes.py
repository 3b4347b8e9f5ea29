"""Byte-level training data: the byte vocabulary, and batching a byte stream.

The vocabulary is raw bytes (``VOCAB_SIZE = 256``), so any UTF-8 text trains without a
tokenizer; the corpora these streams come from (and their train/validation splits) are loaded
by :mod:`node.data.byte_corpus`.

Each node draws training windows at random offsets from its own seeded generator
(:class:`ByteBatches`), so peers see different orders of the same data, a given seed
always replays the same batches, and the generator state can be checkpointed and resumed.
Validation windows (:func:`validation_batches`) are fixed and identical on every node so
that their losses are comparable.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "VOCAB_SIZE",
    "ByteBatches",
    "bytes_tensor",
    "encode",
    "decode",
    "validation_batches",
]

VOCAB_SIZE = 256


# --------------------------------------------------------------------------- bytes <-> text


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``uint8`` tensor."""
    raw = text.encode("utf-8")
    return bytes_tensor(raw)


def decode(tokens: torch.Tensor | Sequence[int] | bytes) -> str:
    """Text of a byte sequence (tensor or ints in 0..255); invalid UTF-8 becomes U+FFFD."""
    if isinstance(tokens, (bytes, bytearray)):
        return bytes(tokens).decode("utf-8", errors="replace")
    t = torch.as_tensor(tokens).reshape(-1)
    if t.numel() == 0:
        return ""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"decode expects integer byte values, got a {t.dtype} tensor")
    if t.dtype != torch.uint8 and (int(t.min()) < 0 or int(t.max()) >= VOCAB_SIZE):
        raise ValueError(f"decode expects byte values in 0..{VOCAB_SIZE - 1}, got {int(t.min())}..{int(t.max())}")
    return bytes(t.to(torch.uint8).cpu().tolist()).decode("utf-8", errors="replace")


def bytes_tensor(raw: bytes | bytearray) -> torch.Tensor:
    """``raw`` as a 1-D ``uint8`` tensor (a copy)."""
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# --------------------------------------------------------------------------- batching


def _check_stream(data: torch.Tensor, batch_size: int, context: int, what: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise ValueError(f"{what} expects a 1-D tensor of bytes")
    if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise ValueError(f"{what} expects integer byte values, got {data.dtype}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")
    if data.numel() < context + 1:
        raise ValueError(
            f"{what}: the data holds {data.numel():,} bytes, fewer than one window of context + 1 = {context + 1}; "
            f"use a larger corpus or a smaller context"
        )
    data = data.detach().cpu()
    if data.dtype != torch.uint8:
        if int(data.min()) < 0 or int(data.max()) >= VOCAB_SIZE:
            raise ValueError(f"{what} expects byte values in 0..{VOCAB_SIZE - 1}")
        data = data.to(torch.uint8)
    return data.contiguous()


class ByteBatches:
    """Endless random training batches from a byte stream.

    ``next()`` returns ``(x, y)``, two ``int64`` tensors of shape ``(batch_size, context)``
    where ``y[:, t]`` is the byte after ``x[:, t]``. Window offsets are uniform over every
    position where a full window fits, drawn from a ``torch.Generator`` seeded with ``seed``:
    the same seed replays the same batches, and ``state_dict()``/``load_state_dict()``
    carry the generator state across a checkpoint so a resumed node continues its order.
    """

    def __init__(self, *, data: torch.Tensor, batch_size: int, context: int, seed: int) -> None:
        self.data = _check_stream(data, batch_size, context, "ByteBatches")
        self.batch_size = batch_size
        self.context = context
        self.seed = int(seed)
        self.batches_drawn = 0
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)
        self._steps = torch.arange(context, dtype=torch.int64)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)`` batch."""
        high = self.data.numel() - self.context  # offsets 0..high-1 leave room for the target byte
        offsets = torch.randint(0, high, (self.batch_size,), generator=self._gen, dtype=torch.int64)
        idx = offsets[:, None] + self._steps
        x = self.data[idx].long()
        y = self.data[idx + 1].long()
        self.batches_drawn += 1
        return x, y

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def state_dict(self) -> dict[str, Any]:
        """The resumable state: ``{"seed", "batches_drawn", "generator_state"}`` (a uint8 tensor)."""
        return {
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
            "generator_state": self._gen.get_state().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the generator state may be a tensor, bytes or a list of ints."""
        if "generator_state" not in state:
            raise ValueError("ByteBatches state is missing 'generator_state'")
        gs = state["generator_state"]
        if isinstance(gs, (bytes, bytearray)):
            gs = bytes_tensor(gs)
        gs = torch.as_tensor(gs, dtype=torch.uint8).cpu()
        try:
            self._gen.set_state(gs.clone())
        except RuntimeError as exc:
            raise ValueError(f"invalid ByteBatches generator state: {exc}") from exc
        self.seed = int(state.get("seed", self.seed))
        self.batches_drawn = int(state.get("batches_drawn", 0))

    def __repr__(self) -> str:
        return (
            f"ByteBatches({self.data.numel():,} bytes, batch_size={self.batch_size}, context={self.context}, "
            f"seed={self.seed}, batches_drawn={self.batches_drawn})"
        )


def validation_batches(
    data: torch.Tensor, batch_size: int, context: int, max_batches: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: non-overlapping windows in order.

    Window ``i`` is ``x = data[i*context : (i+1)*context]`` with ``y`` shifted by one, so the
    windows' targets cover every byte after the first exactly once (up to a final partial
    window). Windows are grouped into batches of ``batch_size`` (the last may be smaller).
    With ``max_batches``, only ``max_batches * batch_size`` windows are kept, evenly spaced
    over the split. The result depends only on the arguments, so every node evaluates the
    same windows.
    """
    data = _check_stream(data, batch_size, context, "validation_batches")
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f"max_batches must be a positive integer or None, got {max_batches!r}")
    n_windows = (data.numel() - 1) // context
    starts = torch.arange(n_windows, dtype=torch.int64) * context
    if max_batches is not None and n_windows > max_batches * batch_size:
        keep = max_batches * batch_size
        starts = starts[(torch.arange(keep, dtype=torch.int64) * n_windows) // keep]
    steps = torch.arange(context, dtype=torch.int64)
    batches = []
    for chunk in starts.split(batch_size):
        idx = chunk[:, None] + steps
        batches.append((data[idx].long(), data[idx + 1].long()))
    return batches

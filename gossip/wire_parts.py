"""The wire parts of a round: each part's shape and codec (``PartSpec``), the layout every member derives
alike, and how a received part is decoded and checked.

A received part is decoded on the event loop when it is small (``INLINE_DECODE_NUMEL`` values in at most
``SMALL_PAYLOAD_BYTES``, parsed by msgpack's C parser: well under a millisecond with any codec), else in a
thread, so the loop serves others and reads the next part meanwhile. A small model's ~240 parts each paid
a thread hop before, which on 2 busy cores cost more than the decode; a blob longer than its part needs (a
hostile one, parsed value by value) still goes to the thread.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from compression import Payload, get_codec
from compression.base import all_finite
from compression.payload import SMALL_PAYLOAD_BYTES
from protocol.errors import SchemaError

INLINE_DECODE_NUMEL = 1 << 15


@dataclass(frozen=True)
class PartSpec:
    """Shape and codec of one wire part."""

    shape: tuple[int, ...]
    codec: str


Layout = Callable[[int], Sequence[PartSpec]]


def fixed_layout(codec: str, shapes: Sequence[Sequence[int]]) -> Layout:
    """Every round sends the same parts with the same codec."""
    specs = [PartSpec(tuple(s), get_codec(codec).spec) for s in shapes]
    return lambda _round: specs


def decode_part(blob: bytes, i: int, spec: PartSpec, max_bytes: int) -> torch.Tensor:
    """Part ``i`` of a round decoded from its blob, checked against its spec (codec, shape, finite values);
    a read-only view into ``blob`` where the codec is lossless."""
    codec = get_codec(spec.codec)
    payload = Payload.from_bytes(blob, max_bytes=max_bytes, expected_shape=spec.shape)
    if payload.codec != codec.spec:
        raise SchemaError(f"part {i} is encoded with {payload.codec!r}, expected {codec.spec!r}")
    value = codec.decode_view(payload)
    if tuple(value.shape) != spec.shape:
        raise SchemaError(f"part {i} has shape {list(value.shape)}, expected {list(spec.shape)}")
    if not all_finite(value):
        raise SchemaError(f"part {i} holds NaN or Inf")
    return value


async def decode_received(blob: bytes | memoryview, i: int, spec: PartSpec, max_bytes: int) -> torch.Tensor:
    """:func:`decode_part` on the loop for a small part, in a thread for a large one (or an oversized blob)."""
    if math.prod(spec.shape) <= INLINE_DECODE_NUMEL and len(blob) <= SMALL_PAYLOAD_BYTES:
        return decode_part(blob, i, spec, max_bytes)
    return await asyncio.to_thread(decode_part, blob, i, spec, max_bytes)

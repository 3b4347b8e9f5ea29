"""Dense bit packing of small unsigned integers (quantizer codes, top-k indices).

Value i occupies bits [i·b, (i+1)·b) of a little-endian (LSB-first) bit stream, so n values take
exactly ⌈n·b/8⌉ bytes: four 2-bit or two 4-bit codes per byte, two 12-bit indices per three bytes.
Widths whose byte groups fit in 56 bits (every b ≤ 8, and 10, 12, 14, 16, 20, 24, ...) use shifts on
int64 groups; the other widths go through numpy's packbits. All paths are vectorised.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from compression import memory


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits occupy."""
    return (count * bits + 7) // 8


def _group(bits: int) -> tuple[int, int]:
    """(values, bytes) per byte-aligned group of ``bits``-bit values."""
    span = math.lcm(bits, 8)
    return span // bits, span // 8


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers < 2**bits (any integer dtype) into a uint8 tensor of ⌈n·b/8⌉ bytes.

    The caller guarantees the range; values are not checked here.
    """
    if not 1 <= bits <= 32:
        raise ValueError(f"bit width must be in 1..32, got {bits}")
    flat = values.reshape(-1)
    count = flat.numel()
    size = packed_size(count, bits)
    if bits == 8:
        out = memory.empty(count, torch.uint8)
        return out.copy_(flat)
    per, nbytes = _group(bits)
    groups = -(-count // per)
    if nbytes * 8 > 56:
        return _pack_generic(flat, bits, size)
    if 8 % bits == 0:  # 1, 2 or 4 bits: several values per byte, shift-or in uint8
        padded = memory.zeros(groups * per, torch.uint8)
        padded[:count] = flat
        lanes = padded.view(groups, per)
        out = lanes[:, 0].clone()
        for j in range(1, per):
            out |= lanes[:, j] << (j * bits)
        return out[:size]
    padded = torch.zeros(groups * per, dtype=torch.int64)
    padded[:count] = flat
    lanes = padded.view(groups, per)
    acc = lanes[:, 0].clone()
    for j in range(1, per):
        acc |= lanes[:, j] << (j * bits)
    out = torch.empty(groups, nbytes, dtype=torch.uint8)
    for i in range(nbytes):
        out[:, i] = (acc >> (8 * i)) & 0xFF
    return out.reshape(-1)[:size]


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` values, as uint8 when ``bits`` ≤ 8 else int64.

    ``packed`` must hold exactly ⌈count·bits/8⌉ bytes (callers validate the length first).
    """
    if not 1 <= bits <= 32:
        raise ValueError(f"bit width must be in 1..32, got {bits}")
    if packed.numel() != packed_size(count, bits):
        raise ValueError(f"{packed.numel()} packed bytes cannot hold exactly {count} values of {bits} bits")
    flat = packed.reshape(-1)
    if bits == 8:
        return memory.empty(count, torch.uint8).copy_(flat)
    per, nbytes = _group(bits)
    groups = -(-count // per)
    if nbytes * 8 > 56:
        return _unpack_generic(flat, bits, count)
    if 8 % bits == 0:
        out = memory.empty((groups, per), torch.uint8)
        mask = (1 << bits) - 1
        src = flat
        if src.numel() < groups:  # the last byte was cut to the bytes actually used
            src = torch.cat([src, torch.zeros(groups - src.numel(), dtype=torch.uint8)])
        for j in range(per):
            torch.bitwise_and(src >> (j * bits), mask, out=out[:, j])
        return out.reshape(-1)[:count]
    full = torch.zeros(groups * nbytes, dtype=torch.int64)
    full[: flat.numel()] = flat
    lanes = full.view(groups, nbytes)
    acc = lanes[:, 0].clone()
    for i in range(1, nbytes):
        acc |= lanes[:, i] << (8 * i)
    out = torch.empty(groups, per, dtype=torch.int64)
    mask = (1 << bits) - 1
    for j in range(per):
        out[:, j] = (acc >> (j * bits)) & mask
    values = out.reshape(-1)[:count]
    return values.to(torch.uint8) if bits <= 8 else values


def _pack_generic(flat: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    words = flat.to(torch.int64).numpy().astype("<u8")
    bitplanes = np.unpackbits(words.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")[:, :bits]
    return torch.from_numpy(np.packbits(bitplanes.reshape(-1), bitorder="little")[:size].copy())


def _unpack_generic(flat: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    stream = np.unpackbits(flat.numpy(), bitorder="little")[: count * bits].reshape(count, bits)
    wide = np.zeros((count, 64), dtype=np.uint8)
    wide[:, :bits] = stream
    values = np.packbits(wide, axis=1, bitorder="little").view("<u8").reshape(-1)
    return torch.from_numpy(values.astype(np.int64))

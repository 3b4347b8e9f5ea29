"""A small msgpack reader/writer that never copies ``bin`` blobs (codec payloads, and frames that carry bulk).

msgpack-python copies every ``bin`` value into a new ``bytes`` on both packing and unpacking; for a
100 MB tensor field those copies (and the page faults of the fresh buffers) cost more than the codec
itself. The wire format is unchanged — standard msgpack, readable by ``msgpack.unpackb`` — but:

* :func:`pack` emits a list of pieces whose ``bin`` blobs are the caller's buffers, joined once;
* :func:`unpack` returns ``bin`` values as read-only ``memoryview`` slices of the input.

Only the subset codec payloads use is accepted (nil, bool, int, float, str, bin, array, map with
string keys); anything else, including trailing bytes and over-deep nesting, raises ``ValueError``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

_MAX_DEPTH = 8
_PACK_SCALAR = msgpack.Packer(use_bin_type=True, autoreset=True)


def pack(obj: Any) -> bytes:
    """Standard msgpack encoding of ``obj`` (bytes-like values as ``bin``), copying each blob once."""
    pieces: list[Any] = []
    _pack_into(obj, pieces, 0)
    return b"".join(pieces)


def _pack_into(obj: Any, out: list[Any], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError("payload nesting is too deep to pack")
    if isinstance(obj, dict):
        n = len(obj)
        out.append(_header(n, 0x80, b"\xde", b"\xdf"))
        for key, value in obj.items():
            if not isinstance(key, str):
                raise ValueError(f"map keys must be strings, got {type(key).__name__}")
            out.append(_PACK_SCALAR.pack(key))
            _pack_into(value, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        n = len(obj)
        out.append(_header(n, 0x90, b"\xdc", b"\xdd"))
        for value in obj:
            _pack_into(value, out, depth + 1)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        n = obj.nbytes if isinstance(obj, memoryview) else len(obj)
        if n < 1 << 8:
            out.append(b"\xc4" + bytes([n]))
        elif n < 1 << 16:
            out.append(b"\xc5" + struct.pack(">H", n))
        elif n < 1 << 32:
            out.append(b"\xc6" + struct.pack(">I", n))
        else:
            raise ValueError("a bin value of 4 GiB or more cannot be packed")
        out.append(obj)
    else:
        out.append(_PACK_SCALAR.pack(obj))


def _header(n: int, fix: int, tag16: bytes, tag32: bytes) -> bytes:
    """Header of a map or array of ``n`` items: fix form below 16, else 16- or 32-bit count."""
    if n < 16:
        return bytes([fix | n])
    return tag16 + struct.pack(">H", n) if n < 1 << 16 else tag32 + struct.pack(">I", n)


class TooManyObjects(ValueError):
    """The data decodes to more objects than the caller allows."""


def unpack(data: bytes | bytearray | memoryview, *, max_items: int = 1 << 16, max_depth: int = _MAX_DEPTH,
           max_objects: int | None = None) -> Any:
    """Decode one msgpack object filling all of ``data``; ``bin`` values come back as read-only memoryviews.

    :param max_items: longest array or map
    :param max_depth: deepest nesting of arrays and maps
    :param max_objects: most values in all (containers, keys and elements), checked as each is read, so
        hostile data costs at most that many steps (:class:`TooManyObjects` past it)
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    view = view.toreadonly()
    reader = _Reader(view, max_items, max_depth, max_objects)
    obj = reader.read(0)
    if reader.pos != len(view):
        raise ValueError(f"{len(view) - reader.pos} trailing bytes after the msgpack object")
    return obj


class _Reader:
    __slots__ = ("buf", "pos", "max_items", "max_depth", "budget")

    def __init__(self, buf: memoryview, max_items: int, max_depth: int, max_objects: int | None) -> None:
        self.buf, self.pos, self.max_items, self.max_depth = buf, 0, max_items, max_depth
        self.budget = float("inf") if max_objects is None else max_objects

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"msgpack data ends {end - len(self.buf)} bytes short")
        piece = self.buf[self.pos : end]
        self.pos = end
        return piece

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def count(self, n: int) -> int:
        if n > self.max_items:
            raise ValueError(f"msgpack container of {n} items exceeds the limit of {self.max_items}")
        return n

    def read(self, depth: int) -> Any:
        if depth > self.max_depth:
            raise ValueError("msgpack nesting is too deep")
        self.budget -= 1
        if self.budget < 0:
            raise TooManyObjects("msgpack data holds more objects than allowed")
        b = self.unpack(">B")
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.read_map(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return self.read_array(b & 0x0F, depth)
        if 0xA0 <= b <= 0xBF:
            return self.read_str(b & 0x1F)
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        if b in _BIN:
            return self.take(self.unpack(_BIN[b]))
        if b in _NUM:
            return self.unpack(_NUM[b])
        if b in _STR:
            return self.read_str(self.unpack(_STR[b]))
        if b in _ARRAY:
            return self.read_array(self.unpack(_ARRAY[b]), depth)
        if b in _MAP:
            return self.read_map(self.unpack(_MAP[b]), depth)
        raise ValueError(f"unsupported msgpack type byte 0x{b:02x}")

    def read_str(self, n: int) -> str:
        return str(self.take(n), "utf-8")

    def read_array(self, n: int, depth: int) -> list[Any]:
        return [self.read(depth + 1) for _ in range(self.count(n))]

    def read_map(self, n: int, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(self.count(n)):
            key = self.read(depth + 1)
            if not isinstance(key, str):
                raise ValueError(f"msgpack map keys must be strings, got {type(key).__name__}")
            if key in out:
                raise ValueError(f"msgpack map repeats the key {key!r:.40}")
            out[key] = self.read(depth + 1)
        return out


_BIN = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}
_STR = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}
_ARRAY = {0xDC: ">H", 0xDD: ">I"}
_MAP = {0xDE: ">H", 0xDF: ">I"}
_NUM = {
    0xCA: ">f",
    0xCB: ">d",
    0xCC: ">B",
    0xCD: ">H",
    0xCE: ">I",
    0xCF: ">Q",
    0xD0: ">b",
    0xD1: ">h",
    0xD2: ">i",
    0xD3: ">q",
}

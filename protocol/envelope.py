"""Envelopes: the versioned msgpack object a frame carries, ``{"v": [major, minor], "k": kind, "b": body}``.

Encoding (a bulk value sent by reference, :func:`encode_pieces`), decoding under strict limits (a large
frame's bulk read as views of the frame, :func:`decode_message`) and the checks of a body's fields
(:func:`require`). The framing around them (length prefixes, timeouts, streams) is :mod:`protocol.frames`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import FrameTooLarge, MalformedFrame, SchemaError, VersionMismatch
from protocol.ids import PROTOCOL_MAJOR, PROTOCOL_MINOR
from protocol.msgpack_view import unpack

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
# Python objects one envelope may decode to: arrays, maps and their elements. Each costs a byte or two on
# the wire but ~50 bytes and a little time as a Python object, so 16 MiB of nested empty arrays (or 5
# arrays of a million 2-byte strings: ~274 MiB) would be a memory bomb decoded on the event loop.
# Envelopes carry tensors as bin fields and hold a few thousand objects at most. The count is checked as
# each container completes, and no array or map may be longer than the cap, so decoding stops within
# about twice the cap (~25 MiB of objects).
MAX_DECODED_OBJECTS = 1 << 18


class _TooManyObjects(Exception):
    """Raised from inside msgpack's hooks to stop decoding at the object cap."""


@dataclass(frozen=True)
class Message:
    """A decoded envelope."""

    kind: str
    body: dict[str, Any]
    version: tuple[int, int]


def encode_message(kind: str, body: dict[str, Any], version: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)) -> bytes:
    """msgpack bytes of an envelope (without the length prefix)."""
    return msgpack.packb({"v": list(version), "k": kind, "b": body}, use_bin_type=True)


BULK_BYTES = 1 << 16  # a body value this large travels by reference in :func:`encode_pieces`, never copied into the envelope
ZERO_COPY_BYTES = 1 << 20  # a frame this large is first read by the zero-copy reader (:func:`decode_message`)
_BULK_FRAME_OBJECTS = 1 << 12  # values a frame read that way may hold (a part's frame holds ~20)
_MAX_STR = 1 << 20


def encode_pieces(kind: str, body: dict[str, Any], version: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)) -> list[Any]:
    """The envelope's msgpack bytes as pieces: the same bytes as :func:`encode_message`, except that a
    top-level ``bytes`` value of ``BULK_BYTES`` or more is a piece of its own, by reference (a part of a
    round, a state blob: 4 MB or more that packing would copy once more)."""
    bulky = [k for k, v in body.items() if isinstance(v, (bytes, memoryview)) and len(v) >= BULK_BYTES]
    if not bulky:
        return [encode_message(kind, body, version)]
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[Any] = [packer.pack_map_header(3), packer.pack("v"), packer.pack(list(version)), packer.pack("k"),
                         packer.pack(kind), packer.pack("b"), packer.pack_map_header(len(body))]
    for key, value in body.items():
        pieces.append(packer.pack(key))
        if key in bulky:
            pieces += [b"\xc6" + len(value).to_bytes(4, "big"), value]  # bin 32 header, then the bytes themselves
        else:
            pieces.append(packer.pack(value))
    return pieces


def decode_message(data: bytes | bytearray | memoryview, max_size: int = DEFAULT_MAX_FRAME,
                   major: int = PROTOCOL_MAJOR) -> Message:
    """Decode and validate one envelope; raises a :class:`ProtocolError` subclass on anything off.

    A frame of :data:`ZERO_COPY_BYTES` or more that holds few objects (a round's part, a state chunk, an
    activation) is read without copying its bulk: ``bin`` values of :data:`BULK_BYTES` or more come back
    as read-only memoryviews of ``data``, smaller ones as ``bytes``. Any other frame, and any that the
    zero-copy reader does not take whole, is decoded by msgpack under the limits above."""
    if len(data) > max_size:
        raise FrameTooLarge(f"message of {len(data)} bytes exceeds the cap of {max_size} bytes")
    obj = _bulk_envelope(data) if len(data) >= ZERO_COPY_BYTES else None
    if obj is None:
        obj = _strict_envelope(data, max_size)
    if not isinstance(obj, dict) or set(obj) != {"v", "k", "b"}:
        raise MalformedFrame("envelope must be a map with exactly the keys 'v', 'k' and 'b'")
    version, kind, body = obj["v"], obj["k"], obj["b"]
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in version)
    ):
        raise MalformedFrame(f"envelope version must be [major, minor], got {version!r}")
    if version[0] != major:
        raise VersionMismatch(f"peer speaks protocol {version[0]}.{version[1]}, this node speaks {major}.x")
    if not isinstance(kind, str) or not kind:
        raise MalformedFrame("envelope kind must be a non-empty string")
    if not isinstance(body, dict):
        raise MalformedFrame("envelope body must be a map")
    return Message(kind=kind, body=body, version=(version[0], version[1]))


def _strict_envelope(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """msgpack's decoding of an envelope, every limit checked (``bin`` values copied into ``bytes``)."""
    objects = 0

    def counted(container: Any) -> Any:
        nonlocal objects
        objects += 1 + len(container) * (2 if isinstance(container, dict) else 1)
        if objects > MAX_DECODED_OBJECTS:
            raise _TooManyObjects
        return container

    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            list_hook=counted,
            object_hook=counted,
            max_bin_len=max_size,
            max_str_len=_MAX_STR,
            max_array_len=MAX_DECODED_OBJECTS,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except _TooManyObjects:
        raise MalformedFrame(f"envelope decodes to more than {MAX_DECODED_OBJECTS} arrays, maps and elements") from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise MalformedFrame(f"not a msgpack envelope ({type(e).__name__}: {e})") from None
    return obj


def _bulk_envelope(data: bytes | bytearray | memoryview) -> Any:
    """The envelope with its large ``bin`` values as read-only views of ``data``, or None where it holds
    more than :data:`_BULK_FRAME_OBJECTS` values, a long string or anything the zero-copy reader refuses
    (msgpack's decoding then decides, with its own limits and messages)."""
    try:
        return _own_small_bins(unpack(data, max_items=_BULK_FRAME_OBJECTS, max_depth=32, max_objects=_BULK_FRAME_OBJECTS))
    except ValueError:  # (UnicodeDecodeError and TooManyObjects included)
        return None


def _own_small_bins(obj: Any) -> Any:
    """``obj`` with its ``bin`` views under :data:`BULK_BYTES` turned into ``bytes`` (fields that hold keys,
    digests and codes keep their type); ValueError on a string longer than msgpack's limit here."""
    if isinstance(obj, memoryview):
        return obj if obj.nbytes >= BULK_BYTES else obj.tobytes()
    if isinstance(obj, dict):
        return {k: _own_small_bins(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own_small_bins(v) for v in obj]
    if isinstance(obj, str) and len(obj) > _MAX_STR:
        raise ValueError("string too long")
    return obj


def require(body: dict[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
    """Fetch ``body[field]`` and check its type, raising :class:`SchemaError` with a clear message."""
    if field not in body:
        raise SchemaError(f"missing field {field!r}")
    value = body[field]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise SchemaError(f"field {field!r} must be {kind}, got bool")
    if not isinstance(value, kind):
        raise SchemaError(f"field {field!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def require_token(body: dict[str, Any], field: str, max_len: int = 128) -> str:
    """``body[field]`` as a short token (letters, digits, ``_.:-``; fingerprints and digests are hex):
    a peer's claim that ends up in logs and votes, so no control characters and no megabytes pass."""
    value = require(body, field, str)
    if not value or len(value) > max_len or not _TOKEN_CHARS.issuperset(value):
        raise SchemaError(f"field {field!r} must be a token of at most {max_len} letters, digits or _.:-")
    return value

"""The compressed form of one tensor as it travels: codec spec and version, shape, codec fields.

Wire format: one msgpack map ``{"c": spec, "v": version, "s": [shape], "f": {name: value}}``. Field
values are msgpack scalars, short lists of numbers, or tensor wire maps (``protocol.tensors`` format).
Packing goes through :mod:`protocol.msgpack_view`, so tensor data is copied once when packed; a payload
over ``SMALL_PAYLOAD_BYTES`` is parsed in place too (its ``data`` fields are read-only memoryviews), a
smaller one by msgpack's C parser (its ``data`` fields are ``bytes`` copies: cheaper than the view's parse).
:meth:`Payload.from_bytes` checks everything that does not depend on the codec (sizes, types, tensor
map consistency); the codec's ``decode`` then checks lengths and ranges against the payload's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from compression.errors import CodecError
from protocol.msgpack_view import pack, unpack
from compression.wire import check_tensor_map, is_tensor_map
from protocol.errors import SchemaError
from protocol.tensors import check_shape

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
"""Default cap on an encoded payload accepted by :meth:`Payload.from_bytes` (1 GiB)."""
DEFAULT_MAX_NUMEL = 1 << 31
"""Default cap on the element count a payload may announce: a seed or top-k payload is small on the
wire but decodes to its full shape, so the announced shape is bounded separately from the bytes."""

SMALL_PAYLOAD_BYTES = 256 << 10
"""Payloads up to this size are parsed by msgpack's C parser, their tensor data copied into ``bytes``;
larger ones are parsed in place (:mod:`protocol.msgpack_view`), their tensor data left as views."""
_MAX_LIST = 1 << 16
_KEYS = {"c", "v", "s", "f"}


@dataclass(frozen=True)
class Payload:
    """One encoded tensor.

    :param codec: canonical spec of the codec that produced it (``Codec.spec``), e.g. ``"topk:64/4096+q2"``
    :param version: wire version of that codec's field layout
    :param shape: shape of the original tensor (and of the decoded one)
    :param fields: codec-specific, msgpack-ready values (scalars, number lists, tensor wire maps)
    """

    codec: str
    version: int
    shape: tuple[int, ...]
    fields: dict[str, Any]
    _wire: list[bytes] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    def to_bytes(self) -> bytes:
        """The msgpack encoding, computed once and kept (``nbytes`` and sending share it; a parsed
        payload returns the bytes it was parsed from)."""
        if not self._wire:
            body = {"c": self.codec, "v": self.version, "s": list(self.shape), "f": self.fields}
            self._wire.append(pack(body))
        return self._wire[0]

    @property
    def nbytes(self) -> int:
        """Exact size on the wire, headers included: ``len(self.to_bytes())``."""
        return len(self.to_bytes())

    @classmethod
    def packed(cls, draft: "Payload", tail: str) -> "Payload":
        """``draft`` packed once, its tensor field ``tail`` (the last field, a tensor wire map) then a read-only
        view of the packed bytes: the result no longer aliases the memory ``draft`` pointed at, and nothing is
        parsed back (a dense codec's small parts used to spend most of their encoding in that parse)."""
        raw = draft.to_bytes()
        value = draft.fields[tail]
        n = memoryview(value["data"]).nbytes
        header = _bin_header(n)
        last = list(draft.fields)[-1] == tail and list(value)[-1] == "data"
        if not last or raw[len(raw) - n - len(header):len(raw) - n] != header:  # laid out otherwise: parse it
            return cls.from_bytes(raw, max_bytes=len(raw), max_numel=None)
        fields = {**draft.fields, tail: {**value, "data": memoryview(raw)[len(raw) - n:]}}
        payload = cls(draft.codec, draft.version, draft.shape, fields)
        payload._wire.append(raw)
        return payload

    @classmethod
    def from_bytes(
        cls,
        data: bytes | bytearray | memoryview,
        *,
        max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_numel: int | None = DEFAULT_MAX_NUMEL,
        expected_shape: Sequence[int] | None = None,
    ) -> "Payload":
        """Parse and validate a payload; raises :class:`CodecError` saying what is wrong.

        Tensor fields of a result over ``SMALL_PAYLOAD_BYTES`` are read-only views into ``data`` (no copy):
        pass ``bytes``, or do not modify the buffer while the payload is in use.

        :param max_bytes: refuse larger inputs before parsing
        :param max_numel: refuse payloads announcing more elements than this (``None``: no cap)
        :param expected_shape: when given, the payload's shape must equal it
        """
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > max_bytes:
            raise CodecError(f"payload of {size} bytes exceeds the cap of {max_bytes} bytes")
        try:
            if size <= SMALL_PAYLOAD_BYTES:  # msgpack's C parser and a copy beat a view by ~10x at this size
                obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
                                      max_array_len=_MAX_LIST, max_map_len=_MAX_LIST)
            else:
                obj = unpack(data, max_items=_MAX_LIST)
        except msgpack.ExtraData as e:
            raise CodecError(f"payload is not valid msgpack: {len(e.extra)} trailing bytes after the msgpack object") from None
        except (ValueError, UnicodeDecodeError, TypeError, msgpack.UnpackException) as e:
            raise CodecError(f"payload is not valid msgpack: {e}") from None
        if not isinstance(obj, dict) or set(obj) != _KEYS:
            raise CodecError("payload must be a map with exactly the keys 'c', 'v', 's' and 'f'")
        spec, version, shape, fields = obj["c"], obj["v"], obj["s"], obj["f"]
        if not isinstance(spec, str) or not spec:
            raise CodecError(f"payload codec must be a non-empty string, got {spec!r:.60}")
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 1 << 16:
            raise CodecError(f"payload codec version must be a small non-negative int, got {version!r:.40}")
        try:
            checked_shape = check_shape(shape, max_numel)
        except SchemaError as e:
            raise CodecError(f"payload shape refused: {e}") from None
        if expected_shape is not None and tuple(expected_shape) != checked_shape:
            raise CodecError(f"payload shape {list(checked_shape)} does not match the expected {list(expected_shape)}")
        if not isinstance(fields, dict):
            raise CodecError("payload fields must be a map")
        for name, value in fields.items():
            _check_field(name, value)
        payload = cls(spec, version, checked_shape, fields)
        if isinstance(data, bytes):
            payload._wire.append(data)  # nbytes of a received payload: what actually arrived
        return payload


def _bin_header(n: int) -> bytes:
    """The msgpack ``bin`` header of an ``n``-byte blob (``protocol.msgpack_view.pack`` writes the same)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _check_field(name: Any, value: Any) -> None:
    if not isinstance(name, str) or not name:
        raise CodecError(f"payload field names must be non-empty strings, got {name!r:.40}")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        if isinstance(value, float) and not math.isfinite(value):
            raise CodecError(f"payload field {name!r} is not finite ({value})")
        return
    if isinstance(value, list):
        for item in value:
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise CodecError(f"payload field {name!r} must be a list of numbers")
            if isinstance(item, float) and not math.isfinite(item):
                raise CodecError(f"payload field {name!r} holds a non-finite number")
        return
    if is_tensor_map(value):
        check_tensor_map(value, f"payload field {name!r}")
        return
    raise CodecError(f"payload field {name!r} has an unsupported type {type(value).__name__}")

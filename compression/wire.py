"""Tensor fields inside a codec payload, in the ``protocol.tensors`` wire-map format.

A codec field holding a tensor is the map ``{"dtype": str, "shape": [int], "data": bytes}`` that
:func:`protocol.tensors.tensor_to_wire` writes and :func:`protocol.tensors.tensor_from_wire` reads.
The two helpers here keep that exact format but avoid the copies those general functions make, because
codec buffers run to hundreds of megabytes:

* :func:`owned_tensor_map` wraps a tensor the payload owns (freshly computed by the codec, never the
  caller's input) as a zero-copy ``memoryview``; msgpack packs it as ``bin`` like ``bytes``.
* :func:`read_tensor` validates dtype, shape and byte length against what the codec expects for the
  payload's shape and returns a read-only view over the received bytes. Decoders only read that view
  and always build a fresh output tensor.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import torch

from compression.errors import CodecError
from protocol.errors import SchemaError
from protocol.tensors import WIRE_DTYPES, check_shape, dtype_name

_KEYS = {"dtype", "shape", "data"}


def owned_tensor_map(tensor: torch.Tensor) -> dict[str, Any]:
    """A wire map over ``tensor``'s memory without copying; ``tensor`` must not be shared with anyone."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element sliced with a step is "contiguous" at any stride
        flat = flat.as_strided((1,), (1,))
    if flat.numel() == 0:
        data: Any = b""
    else:
        data = memoryview(flat.view(torch.uint8).numpy())
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "data": data}


def is_tensor_map(value: Any) -> bool:
    """Whether ``value`` has the shape of a tensor wire map (its contents are checked elsewhere)."""
    return isinstance(value, dict) and set(value) == _KEYS


def check_tensor_map(value: Any, where: str) -> None:
    """Structural check of one tensor wire map: known dtype, valid shape, byte length matching both."""
    if not is_tensor_map(value):
        raise CodecError(f"{where}: a tensor field must be a map with exactly 'dtype', 'shape' and 'data'")
    name, data = value["dtype"], value["data"]
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise CodecError(f"{where}: unknown tensor dtype {name!r:.40}; supported: {sorted(WIRE_DTYPES)}")
    try:
        shape = check_shape(value["shape"])
    except SchemaError as e:  # re-label the generic wire refusal as a codec refusal
        raise CodecError(f"{where}: {e}") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"{where}: tensor data must be bytes, got {type(data).__name__}")
    itemsize = WIRE_DTYPES[name].itemsize
    need = math.prod(shape) * itemsize
    have = len(data) if not isinstance(data, memoryview) else data.nbytes
    if have != need:
        raise CodecError(f"{where}: tensor data has {have} bytes, shape {list(shape)} of {name} needs {need}")


def read_tensor(
    fields: Mapping[str, Any], key: str, shape: Sequence[int], dtype: torch.dtype, codec: str = "codec"
) -> torch.Tensor:
    """The tensor in ``fields[key]``, checked to have exactly ``shape`` and ``dtype``; a read-only view."""
    if key not in fields:
        raise CodecError(f"{codec}: payload lacks the field {key!r}")
    value = fields[key]
    check_tensor_map(value, f"{codec}: field {key!r}")
    if value["dtype"] != dtype_name(dtype):
        raise CodecError(f"{codec}: field {key!r} has dtype {value['dtype']}, expected {dtype_name(dtype)}")
    if list(value["shape"]) != list(shape):
        raise CodecError(
            f"{codec}: field {key!r} has shape {list(value['shape'])}, expected {list(shape)} for this payload"
        )
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        # the received bytes object is immutable; decoders never write into this view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(value["data"], dtype=dtype, count=numel)
    return flat.reshape(tuple(shape))


def read_scalar(fields: Mapping[str, Any], key: str, kind: type | tuple[type, ...], codec: str = "codec") -> Any:
    """A scalar field of the given Python type(s); bools are refused where ints are expected."""
    if key not in fields:
        raise CodecError(f"{codec}: payload lacks the field {key!r}")
    value = fields[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise CodecError(f"{codec}: field {key!r} must be {'/'.join(k.__name__ for k in kinds)}, got bool")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise CodecError(
            f"{codec}: field {key!r} must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise CodecError(f"{codec}: field {key!r} must be finite, got {value}")
    return value

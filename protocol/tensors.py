"""Tensor payloads on the wire: a small header (dtype, shape) plus the raw little-endian bytes.

``tensor_to_wire`` yields a msgpack-ready map ``{"dtype": str, "shape": [int], "data": bytes}``.
``tensor_from_wire`` checks dtype, shape and byte length (and, when given, the expected shape and
dtype) before it builds a tensor, so a hostile header cannot make the receiver allocate.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from protocol.errors import SchemaError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
MAX_DIMS = 8


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; raises ``ValueError`` for dtypes the wire does not carry."""
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} cannot travel; supported: {sorted(WIRE_DTYPES)}")
    return _NAMES[dtype]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (CPU, contiguous, native little-endian)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    if flat.stride(0) != 1:  # one element sliced with a step is "contiguous" at any stride
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    """A msgpack-ready map describing ``tensor``."""
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "data": tensor_bytes(tensor)}


def check_shape(shape: Any, max_numel: int | None = None) -> tuple[int, ...]:
    """Validate a wire shape (list of non-negative ints) and return it as a tuple."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise SchemaError(f"tensor shape must be a list of at most {MAX_DIMS} ints, got {shape!r:.80}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
        raise SchemaError(f"tensor shape must hold non-negative ints, got {shape!r:.80}")
    numel = math.prod(shape)
    if max_numel is not None and numel > max_numel:
        raise SchemaError(f"tensor of {numel} elements exceeds the limit of {max_numel}")
    return tuple(shape)


def tensor_from_wire(
    wire: Any,
    expected_shape: Sequence[int] | None = None,
    expected_dtype: torch.dtype | None = None,
    max_numel: int | None = None,
) -> torch.Tensor:
    """Rebuild a tensor from its wire map, validating everything first."""
    if not isinstance(wire, dict) or set(wire) != {"dtype", "shape", "data"}:
        raise SchemaError("tensor must be a map with exactly 'dtype', 'shape' and 'data'")
    name, data = wire["dtype"], wire["data"]
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise SchemaError(f"unknown tensor dtype {name!r:.40}; supported: {sorted(WIRE_DTYPES)}")
    dtype = WIRE_DTYPES[name]
    shape = check_shape(wire["shape"], max_numel)
    if expected_shape is not None and tuple(expected_shape) != shape:
        raise SchemaError(f"tensor shape {list(shape)} does not match the expected {list(expected_shape)}")
    if expected_dtype is not None and dtype != expected_dtype:
        raise SchemaError(f"tensor dtype {name} does not match the expected {dtype_name(expected_dtype)}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError("tensor data must be bytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    if len(data) != numel * itemsize:
        raise SchemaError(f"tensor data has {len(data)} bytes, shape {list(shape)} of {name} needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)

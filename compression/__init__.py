"""Tensor compression for pseudo-gradients and pipeline activations.

``get_codec(spec)`` builds a codec from its spec string (see :mod:`compression.registry` for the
forms); ``codec.encode(tensor, state=None)`` returns a :class:`Payload` whose ``to_bytes()`` travels;
``Payload.from_bytes`` + ``codec.decode`` rebuild a float32 tensor, refusing anything malformed with
:class:`CodecError`. :class:`ErrorFeedback` is the caller-owned residual buffer for SparseLoCo/DeMo.
Depends on torch, numpy, msgpack and :mod:`protocol` only.
"""

from compression.base import Codec
from compression.errors import CodecError
from compression.feedback import ErrorFeedback
from compression.payload import DEFAULT_MAX_NUMEL, DEFAULT_MAX_PAYLOAD_BYTES, Payload
from compression.registry import SPEC_FORMS, get_codec

__all__ = [
    "DEFAULT_MAX_NUMEL",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "SPEC_FORMS",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Payload",
    "get_codec",
]

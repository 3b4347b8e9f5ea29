"""Tensor compression for pseudo-gradients and pipeline activations.

``get_codec(spec)`` builds a codec from its spec string (see :mod:`compression.registry` for the
forms); ``codec.encode(tensor, state=None)`` returns a :class:`Payload` whose ``to_bytes()`` travels;
``Payload.from_bytes`` + ``codec.decode`` rebuild a float32 tensor, refusing anything malformed with
:class:`CodecError`. :class:`ErrorFeedback` is the caller-owned residual buffer for SparseLoCo/DeMo.
Depends on torch, numpy, msgpack and :mod:`protocol` only.

Modules: ``base`` (Codec interface), ``payload`` (wire form), ``registry`` (specs), ``feedback``
(error feedback); codecs ``dense`` (none/fp16/bf16), ``quantize`` (q8/q4/q2), ``rotation``
(rot1/2/4/8), ``blockwise`` (int8-block), ``topk``, ``dct``, ``seeded`` (seed projection),
``activations`` (subspace); helpers ``bitpack``, ``chunking``, ``hadamard`` (randomized Hadamard
transform, seeded signs), ``wire`` (tensor fields), ``memory``
(huge-page friendly buffers), ``flat``, ``errors``.
"""

from compression.base import Codec
from compression.errors import CodecError
from compression.feedback import ErrorFeedback, feedback_state, load_feedback_state
from compression.payload import DEFAULT_MAX_NUMEL, DEFAULT_MAX_PAYLOAD_BYTES, Payload
from compression.registry import SPEC_FORMS, get_codec

__all__ = [
    "DEFAULT_MAX_NUMEL",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "SPEC_FORMS",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "feedback_state",
    "load_feedback_state",
    "Payload",
    "get_codec",
]

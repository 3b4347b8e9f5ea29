"""The codec interface: ``encode`` a float tensor into a :class:`Payload`, ``decode`` it back.

Every codec is one small class with a canonical ``spec`` string (what peers agree on, e.g.
``"topk:64/4096+q2"``) and a wire ``version`` for its field layout. ``encode`` accepts any floating
dtype, shape and memory layout and refuses NaN/Inf with ``ValueError``; ``decode`` checks that the
payload was made by this very codec and version, validates every length and range against the
payload's shape, and returns a fresh float32 tensor of the original shape.

Error feedback (SparseLoCo, DeMo) is opt-in per call: ``encode(t, state=ErrorFeedback(decay))``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from compression.errors import CodecError
from compression.payload import Payload
from compression.seeds import seed_for_encode

if TYPE_CHECKING:
    from compression.feedback import ErrorFeedback


class Codec(ABC):
    """Base of all codecs. Subclasses implement ``spec``, ``_encode`` and ``_decode``.

    ``_encode`` receives a detached CPU floating tensor (any layout) and must itself refuse
    non-finite values (each codec folds that check into a pass it makes anyway), and must never wrap
    its input's memory in the payload without copying (error feedback updates that tensor in place
    afterwards). ``_decode`` receives
    a payload whose codec and version were already checked and must validate the fields.
    """

    version: ClassVar[int] = 1

    @property
    @abstractmethod
    def spec(self) -> str:
        """Canonical spec string; ``get_codec(codec.spec)`` rebuilds an identical codec."""

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> Payload: ...

    @abstractmethod
    def _decode(self, payload: Payload) -> torch.Tensor: ...

    def encode(self, tensor: torch.Tensor, state: "ErrorFeedback | None" = None, seed: int | None = None) -> Payload:
        """Compress ``tensor``; with ``state``, compress the error-feedback residual instead.

        With ``state`` (decay β, buffer e): e' = β·e + tensor; payload = encode(e');
        e ← e' − decode(payload). The buffer is only updated when encoding succeeds.
        ``seed`` is the payload seed shared-seed codecs draw from (:func:`compression.seeds.payload_seed`);
        codecs without randomness ignore it.
        Raises ``ValueError`` for non-floating or non-finite input.
        """
        x = as_input(tensor)
        if state is None:
            with seed_for_encode(seed):
                return self._encode(x)
        residual = state.accumulate(x)
        with seed_for_encode(seed):
            payload = self._encode(residual)
        state.commit(residual, self._decode(payload))
        return payload

    def decode(self, payload: Payload) -> torch.Tensor:
        """Decompress a payload into a float32 tensor of ``payload.shape``; raises :class:`CodecError`."""
        if not isinstance(payload, Payload):
            raise TypeError(f"decode expects a Payload, got {type(payload).__name__}")
        if payload.codec != self.spec:
            raise CodecError(
                f"payload was encoded with codec {payload.codec!r:.80}, this receiver expects {self.spec!r}"
            )
        if payload.version != self.version:
            raise CodecError(
                f"payload uses version {payload.version} of codec {self.spec!r}, "
                f"this node speaks version {self.version}"
            )
        return self._decode(payload)

    def decode_view(self, payload: Payload) -> torch.Tensor:
        """:meth:`decode`, except that the result may be a read-only view into the payload's buffer (a
        lossless float32 payload costs no copy): callers must not write into it."""
        if payload.codec != self.spec or payload.version != self.version:
            return self.decode(payload)  # raises with decode's message
        return self._decode_view(payload)

    def _decode_view(self, payload: Payload) -> torch.Tensor:
        return self._decode(payload)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.spec))


def as_input(tensor: torch.Tensor) -> torch.Tensor:
    """Detach, move to CPU, and check the dtype is a real floating type (no copy when already there)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"codecs encode torch tensors, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"codecs encode floating-point tensors, got dtype {tensor.dtype}")
    return tensor.detach().to("cpu")


def finite_range(x: torch.Tensor, what: str = "input") -> tuple[float, float]:
    """(min, max) of ``x``; raises ``ValueError`` if any element is NaN or Inf (both propagate).

    One vectorised pass; ``(0.0, 0.0)`` for an empty tensor.
    """
    if x.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(x)
    low, high = float(lo), float(hi)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{what} contains NaN or Inf values; refusing to encode it")
    return low, high


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite: one pass, no temporary (``torch.isfinite(x).all()``
    allocates a bool per element and is ~20x slower on 100 MB)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise ``ValueError`` if any element of ``x`` is NaN or Inf."""
    finite_range(x, what)

"""Error feedback: the residual buffer that makes biased compressors converge (SparseLoCo, DeMo).

Per tensor the caller keeps one :class:`ErrorFeedback` and passes it to ``codec.encode(t, state=ef)``:

    e' = β·e + t ;  Ĉ = encode(e') ;  e ← e' − decode(Ĉ)

so whatever a round's compression dropped is re-sent later. With β = 0 and a lossless codec
(``topk:C/C``) e stays 0 and the decoded value equals t exactly — the outer step reduces to DiLoCo
with plain SGD. The state is explicit and owned by the caller so tests can drive it round by round.
"""

from __future__ import annotations

from typing import Sequence

import torch

from compression import memory


class ErrorFeedback:
    """Residual buffer for one tensor.

    :param decay: β in e' = β·e + t; 1.0 keeps the whole residual, 0.0 forgets it every round
    """

    def __init__(self, decay: float) -> None:
        decay = float(decay)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error-feedback decay must lie in [0, 1], got {decay}")
        self.decay = decay
        self.residual: torch.Tensor | None = None

    def accumulate(self, x: torch.Tensor) -> torch.Tensor:
        """β·e + x as a new float32 tensor (the buffer itself is untouched until :meth:`commit`)."""
        if self.residual is not None and tuple(self.residual.shape) != tuple(x.shape):
            raise ValueError(
                f"error-feedback buffer holds shape {list(self.residual.shape)}, "
                f"got a tensor of shape {list(x.shape)}; use one ErrorFeedback per tensor"
            )
        out = memory.empty(x.shape, torch.float32)
        if self.residual is None or self.decay == 0.0:
            return out.copy_(x)
        torch.mul(self.residual, self.decay, out=out)
        return out.add_(x)

    def commit(self, accumulated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep what the payload did not carry: e ← accumulated − decoded."""
        accumulated.sub_(decoded)
        self.residual = accumulated

    def reset(self) -> None:
        """Forget the residual (e.g. after the tensor's shape changed or a peer rejoined)."""
        self.residual = None

    def norm(self) -> float:
        """L2 norm of the residual (0 before the first round)."""
        return 0.0 if self.residual is None else float(self.residual.norm())

    def __repr__(self) -> str:
        return f"ErrorFeedback(decay={self.decay}, norm={self.norm():.4g})"


def feedback_state(buffers: Sequence[ErrorFeedback] | None) -> list[torch.Tensor | None] | None:
    """Copies of the residuals of ``buffers`` for a checkpoint (None where a buffer has not run a round).

    A residual is replaced, never changed in place, once a round commits it, so a copy taken while a
    round is in flight is the residual before or after that round, whole."""
    if buffers is None:
        return None
    return [None if b.residual is None else b.residual.clone() for b in buffers]


def load_feedback_state(buffers: Sequence[ErrorFeedback], saved: object, shapes: Sequence[Sequence[int]]) -> str | None:
    """Restore residuals saved by :func:`feedback_state` into ``buffers`` (one per tensor of ``shapes``).

    Returns None when they were restored, or why not (the buffers are then left empty, which costs the
    dropped mass of one round and nothing else)."""
    if not isinstance(saved, (list, tuple)):
        return "the checkpoint holds no error-feedback buffers"
    if len(saved) != len(buffers) or len(shapes) != len(buffers):
        return f"the checkpoint holds {len(saved)} error-feedback buffers, this run has {len(buffers)}"
    for i, (residual, shape) in enumerate(zip(saved, shapes)):
        if residual is None:
            continue
        if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != tuple(shape):
            got = list(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
            return f"error-feedback buffer {i} holds {got}, this run's part has shape {list(shape)}"
    for buffer, residual in zip(buffers, saved):
        buffer.reset()
        if residual is not None:
            buffer.residual = residual.to(torch.float32).contiguous().clone()
    return None

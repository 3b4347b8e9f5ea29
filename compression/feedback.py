"""Error feedback: the residual buffer that makes biased compressors converge (SparseLoCo, DeMo).

Per tensor the caller keeps one :class:`ErrorFeedback` and passes it to ``codec.encode(t, state=ef)``:

    e' = β·e + t ;  Ĉ = encode(e') ;  e ← e' − decode(Ĉ)

so whatever a round's compression dropped is re-sent later. With β = 0 and a lossless codec
(``topk:C/C``) e stays 0 and the decoded value equals t exactly — the outer step reduces to DiLoCo
with plain SGD. The state is explicit and owned by the caller so tests can drive it round by round.
"""

from __future__ import annotations

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

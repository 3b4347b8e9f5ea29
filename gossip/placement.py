"""Where the outer state of a whole-model replica lives, and how θ and φ cross to and from the model.

The outer state is φ (the agreed weights, fp32) and the outer optimizer's momentum, which follows
φ's device (``gossip.outer``); error-feedback buffers stay where the codecs run, on the CPU
(``compression.feedback``). ``--outer-device`` picks the device in one place,
:meth:`OuterPlacement.choose`:

- ``cpu`` (default): φ on the host. With the model on CUDA, φ and the θ snapshots of outer rounds are
  page-locked (pinned) so that θ → host and φ → model are DMA copies issued without waiting one by
  one (one synchronisation per batch of copies); the outer step runs on the CPU, and the GPU holds
  only the model, its gradients and the inner optimizer.
- ``same``: φ and the momentum on the model's device, where the outer step then runs (fast, but two
  more fp32 copies of the model in GPU memory); what goes on the wire is still copied to the host.

On a CPU-only machine both are the same, and every copy is the plain fp32 copy the node always made.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the asynchronous copies issued on the current streams of the CUDA devices of ``tensors``
    (so a pinned host buffer they read or write may be touched again); nothing to do on the CPU."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the CPU (themselves when already there): for codecs, the wire and checkpoints."""
    return [t if t.device.type == "cpu" else t.detach().to("cpu") for t in tensors]


class OuterPlacement:
    """Where φ and the outer momentum live and the outer step runs.

    :param device: the outer state's device
    :param pin: allocate host copies page-locked (only when the model is on CUDA and the state on the CPU)
    """

    def __init__(self, device: torch.device, pin: bool = False) -> None:
        self.device, self.pin = torch.device(device), bool(pin)
        if self.pin and self.device.type != "cpu":
            raise ValueError("only host memory can be pinned")

    @classmethod
    def choose(cls, model_device: torch.device, outer_device: str = "cpu") -> "OuterPlacement":
        """The placement for ``--outer-device`` (``cpu`` or ``same``) of a model on ``model_device``."""
        model_device = torch.device(model_device)
        if outer_device == "same":
            return cls(model_device)
        if outer_device != "cpu":
            raise ValueError(f"--outer-device must be cpu or same, got {outer_device!r}")
        return cls(torch.device("cpu"), pin=model_device.type == "cuda" and torch.cuda.is_available())

    def copy_of(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 copies of ``tensors`` on the outer device (φ from θ, a download or a checkpoint; θ's
        snapshot at the end of a round's inner steps). Copies from a CUDA model into pinned memory are
        issued without blocking and waited for once, at the end."""
        out = []
        for t in tensors:
            buf = torch.empty(tuple(t.shape), dtype=torch.float32, device=self.device, pin_memory=self.pin)
            buf.copy_(t.detach(), non_blocking=self.pin)
            out.append(buf)
        if self.pin:
            settle(tensors)
        return out

    def snapshot_of(self, tensors: Sequence[torch.Tensor], kept_still: bool) -> list[torch.Tensor]:
        """θ as a round reads it: ``tensors`` themselves (detached) where ``kept_still`` (nothing changes them
        while the round runs) and they already are fp32 on the outer device, else :meth:`copy_of` them."""
        if kept_still and all(t.dtype == torch.float32 and t.device == self.device for t in tensors):
            return [t.detach() for t in tensors]
        return self.copy_of(tensors)

    def __repr__(self) -> str:
        return f"OuterPlacement(device={self.device}, pin={self.pin})"

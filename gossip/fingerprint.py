"""Fingerprints of replica weights: members of a round compare them to detect a replica that drifted."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from protocol.tensors import tensor_bytes

_FULL_HASH_LIMIT = 1 << 26  # bytes; above this, hash a fixed strided sample of each tensor


def fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """A short hex digest of the tensors' exact bytes (a strided sample of very large ones)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        flat = t.detach().reshape(-1)
        if total > _FULL_HASH_LIMIT and flat.numel() > 4096:
            flat = flat[:: max(1, flat.numel() // 4096)]
        h.update(tensor_bytes(flat))
    return h.hexdigest()


def content_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A digest of every byte of the tensors, shapes and dtypes included: equal digests mean equal
    state (unlike :func:`fingerprint`, which samples very large tensors), so a download can be skipped."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        h.update(tensor_bytes(t.detach().reshape(-1)))
    return h.hexdigest()

"""Aggregation of a round's updates, plain or robust against broken and malicious peers.

Every member runs the same function on the same inputs in the same (peer-id) order, so all members
obtain bit-identical results. Norms are compared per sample (‖Δ‖ / samples), because an honest
peer's update grows with the inner steps it took.

- ``mean``: Σ wᵢΔᵢ / Σ wᵢ with wᵢ = samples.
- ``median-clip``: each update is scaled down to at most the lower-median per-sample norm times its
  samples, and claimed sample counts are capped at 4 × the lower median, then the weighted mean.
  A peer sending a 1000× update moves the model no more than an honest peer.
- ``sparse-mean``: per coordinate, Σ wᵢΔᵢ over the senders that carried it (Δᵢ ≠ 0) divided by their
  Σ wᵢ: for sparse payloads (top-k), where a coordinate one sender picked would otherwise be diluted
  by every sender that did not, although that sender has already removed it from its error feedback
  (SparseLoCo's reference code averages this way). Equal to ``mean`` wherever every sender's value is
  non-zero.
- ``trimmed-mean``: per coordinate, the ⌊trim·n⌋ (at least 1) largest and smallest values are
  dropped, the rest averaged with equal weights; with fewer than 3 updates it falls back to
  ``median-clip``.

In every mode an update whose per-sample norm exceeds ``reject_ratio`` × the lower median is
dropped and reported (an absurd norm is never an honest update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from gossip.outer import weighted_mean

METHODS = ("mean", "sparse-mean", "median-clip", "trimmed-mean")


@dataclass
class Aggregate:
    """The aggregate, which members it used, and why the others were dropped."""

    update: list[torch.Tensor]
    used: list[str]
    dropped: dict[str, str] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)


def _norm(update: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in update))


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def aggregate(
    peers: Sequence[str],
    updates: Sequence[Sequence[torch.Tensor]],
    samples: Sequence[int],
    method: str = "mean",
    reject_ratio: float = 100.0,
    trim: float = 0.2,
) -> Aggregate:
    """Combine ``updates`` (one list of tensors per peer, all with the same shapes)."""
    if method not in METHODS:
        raise ValueError(f"unknown aggregation {method!r}; choose one of {', '.join(METHODS)}")
    if not updates or not len(peers) == len(updates) == len(samples):
        raise ValueError("need one peer id, update and sample count per contribution")
    norms = {p: _norm(u) for p, u in zip(peers, updates)}
    per_sample = {p: norms[p] / max(1, s) for p, s in zip(peers, samples)}
    ref = _lower_median(list(per_sample.values()))
    dropped: dict[str, str] = {}
    kept = []
    for i, p in enumerate(peers):
        if ref > 0 and per_sample[p] > reject_ratio * ref:
            dropped[p] = "norm_outlier"
        else:
            kept.append(i)
    peers_k = [peers[i] for i in kept]
    updates_k = [list(updates[i]) for i in kept]
    samples_k = [samples[i] for i in kept]
    if method == "trimmed-mean" and len(kept) < 3:
        method = "median-clip"
    if method == "mean":
        out = weighted_mean(updates_k, samples_k)
    elif method == "sparse-mean":
        out = _sparse_mean(updates_k, samples_k)
    elif method == "median-clip":
        cap = 4 * _lower_median(samples_k)
        weights = [min(s, cap) for s in samples_k]
        clipped = []
        for p, u, s in zip(peers_k, updates_k, samples_k):
            limit = ref * s
            scale = min(1.0, limit / norms[p]) if norms[p] > 0 else 1.0
            clipped.append([t * scale for t in u] if scale < 1.0 else u)
        out = weighted_mean(clipped, weights)
    else:
        n = len(updates_k)
        b = max(1, int(trim * n))
        out = []
        for tensors in zip(*updates_k):
            stacked = torch.stack([t.float() for t in tensors])  # (n, ...)
            ordered = stacked.sort(dim=0).values
            out.append(ordered[b : n - b].mean(dim=0))
    return Aggregate(update=out, used=peers_k, dropped=dropped, norms=norms)


def _sparse_mean(updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Per coordinate, the weighted mean over the updates that are non-zero there (0 where none is);
    summed in the given order, so bit-identical on every member."""
    out = []
    for tensors in zip(*updates):
        total = torch.zeros_like(tensors[0], dtype=torch.float32)
        carried = torch.zeros_like(total)
        for t, w in zip(tensors, weights):
            t = t.to(torch.float32)
            total.add_(t, alpha=float(w))
            carried.add_((t != 0).to(torch.float32), alpha=float(w))
        out.append(torch.where(carried > 0, total / carried.clamp_min(1e-30), total))
    return out

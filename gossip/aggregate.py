"""Aggregation of a round's updates, plain or robust against broken and malicious peers.

Every member runs the same function on the same inputs in the same (peer-id) order, so all members
obtain bit-identical results. A sample count is a peer's claim: it is capped at what the run allows
a round (``max_samples``: the batch size × the most inner steps a round can hold) before it weighs
or scales anything, so a peer that claims 10⁹ samples weighs as much as an honest one that did a
full round, and its norm per sample is not made small by the lie. Where no such bound is known
(pipeline stage replicas, whose share of the work the router decides), ``claim_factor`` caps every
claim at that many times the round's lower-median claim instead: a bound every member computes
alike from the same claims (a cap from what one member stepped itself would differ between members,
and members that weigh alike would then step their φ apart). Norms are compared per (capped)
sample (‖Δ‖ / samples), because an honest peer's update grows with the inner steps it took.

The robust methods also bound a claim by what its update shows (:func:`supported_claims`): no claim
weighs more than ``SUPPORT_FACTOR`` × the samples its norm stands for at the norm per sample of the
round's lower-median claim (shorter updates brought there as √steps), and none is cut below that claim.
Under time pacing a round may hold up to 20 × the median's steps, so the run's cap alone let a member
that claims 10⁹ samples with an honest update take ~90 % of a round of three; now it weighs at most
twice an honest peer of its norm.
An honest peer that took k times the median's steps has an update about √k (independent steps) to k
(aligned steps) times as long, so its claim stands up to k = 4 whole, and a faster peer's weight is
cut to 2√k × the median's, never refused.

- ``mean``: Σ wᵢΔᵢ / Σ wᵢ with wᵢ = samples.
- ``centered-clip``: centered clipping (Karimireddy, He, Jaggi, ICML 2021): start at the
  coordinate-wise median v of the updates and iterate v ← v + Σᵢ wᵢ(xᵢ − v)·min(1, τ/‖xᵢ − v‖) / Σ wᵢ
  three times, with τ the lower median of the distances ‖xᵢ − v₀‖. An update far from the others
  moves v by at most τ·wᵢ/Σw, whatever its size or direction; honest updates near the median are
  barely touched. Starting from the median (not the previous round's aggregate, as the paper does)
  keeps it a function of this round's inputs alone, so members that missed a round still agree.
  With two updates no majority can tell which is honest (both are as far from their midpoint): each
  is clipped to the smaller norm per sample, as in ``median-clip``, so neither moves the model more
  than the other would.
- ``sparse-clip``: for sparse payloads (top-k): each update's norm is clipped to the lower-median
  norm per sample × its samples, each of its values to the lower median over updates of their
  largest magnitude (so a peer that piles its whole budget on a few coordinates is cut to an
  honest peer's largest value there), then ``sparse-mean``.
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
dropped and reported (an absurd norm is never an honest update); the clipping methods then take their
reference norm from the updates kept, so a dropped update changes nothing a member computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from gossip.outer import l2_norm, weighted_mean

METHODS = ("mean", "sparse-mean", "centered-clip", "sparse-clip", "median-clip", "trimmed-mean")
ROBUST = ("centered-clip", "sparse-clip", "median-clip", "trimmed-mean")  # bounded influence of any one update
CLIP_ITERATIONS = 3
CLIP_RUN = 1 << 22  # values: centered clipping joins small parts into runs of up to this many (gossip.aggregate._runs)
SUPPORT_FACTOR = 2.0  # a claim weighs at most this many times the samples its norm stands for (robust methods)


@dataclass
class Aggregate:
    """The aggregate, which members it used, and why the others were dropped."""

    update: list[torch.Tensor]
    used: list[str]
    dropped: dict[str, str] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    capped: dict[str, int] = field(default_factory=dict)  # peers whose claimed samples were cut: their claim
    clipped: dict[str, float] = field(default_factory=dict)  # robust methods: peers scaled down, by the factor kept
    weights: dict[str, int] = field(default_factory=dict)  # the samples each used peer weighed by (its claim, capped)


def _norm(update: Sequence[torch.Tensor]) -> float:
    return l2_norm(update)


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def claim_cap(samples: Sequence[int], max_samples: int | None = None, claim_factor: float | None = None) -> int | None:
    """The most samples any one claim of a round with these ``samples`` claims may weigh: ``max_samples``,
    and ``claim_factor`` × the lower median of the claims (both capped at ``max_samples`` first) where
    given, at least 1 (a liar's claim of 0 samples must not zero every weight); None: no cap."""
    cap = max_samples
    if claim_factor is not None and samples:
        relative = max(1, int(claim_factor * _lower_median([s if cap is None else min(s, cap) for s in samples])))
        cap = relative if cap is None else min(cap, relative)
    return cap


def supported_claims(norms: Sequence[float], samples: Sequence[int], factor: float = SUPPORT_FACTOR) -> list[int]:
    """Each claim bounded by the samples its update's norm stands for, never below the lower-median
    claim m: max(m, ``factor`` × ‖Δᵢ‖ / r), r the norm per sample of an update of m samples: the lower
    median of ‖Δᵢ‖·√(m / cᵢ) / m, cᵢ = min(claimᵢ, m). Claims enter r at most at m, so an inflated claim
    cannot make its own norm per sample the reference, and a claim of 1 with a huge norm cuts no honest
    claim below m. A shorter update is brought to m samples as √ (independent steps, the slowest honest
    growth): divided linearly, a slow peer's short update looked long per sample, raised r and cut honest
    fast peers (4 peers of speeds 1, 1, ½, ¼: claims of 2.2 × m cut by 8 %). Unchanged when no norm is
    positive."""
    m = _lower_median(samples) if samples else 0
    at_m = (n * math.sqrt(max(1, m) / max(1, min(s, m))) for n, s in zip(norms, samples))  # each norm at m samples
    per_sample = [x for x in (n / max(1, m) for n in at_m) if x > 0]
    if not per_sample:
        return list(samples)
    ref = _lower_median(per_sample)
    bounds = [factor * n / ref for n in norms]
    return [min(s, max(m, math.ceil(b))) if b < s else s for b, s in zip(bounds, samples)]  # (a NaN bound cuts nothing)


def aggregate(
    peers: Sequence[str],
    updates: Sequence[Sequence[torch.Tensor]],
    samples: Sequence[int],
    method: str = "mean",
    reject_ratio: float = 100.0,
    trim: float = 0.2,
    max_samples: int | None = None,
    claim_factor: float | None = None,
) -> Aggregate:
    """Combine ``updates`` (one list of tensors per peer, all with the same shapes).

    :param samples: the sample count each peer claims; capped at ``claim_cap(samples, max_samples, claim_factor)``
    :param max_samples: the most samples a round of this run can hold (batch size × inner steps)
    :param claim_factor: where given, no claim weighs more than this many times the lower-median claim
    """
    if method not in METHODS:
        raise ValueError(f"unknown aggregation {method!r}; choose one of {', '.join(METHODS)}")
    if not updates or not len(peers) == len(updates) == len(samples):
        raise ValueError("need one peer id, update and sample count per contribution")
    cap = claim_cap(samples, max_samples, claim_factor)
    capped = {p: s for p, s in zip(peers, samples) if cap is not None and s > cap}
    if cap is not None:
        samples = [min(s, cap) for s in samples]
    norms = {p: _norm(u) for p, u in zip(peers, updates)}
    if method in ROBUST:
        supported = supported_claims([norms[p] for p in peers], samples)
        capped.update({p: claim for p, claim, s in zip(peers, samples, supported) if s < claim and p not in capped})
        samples = supported
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
    # the clipping reference of the kept updates only: a member that received a dropped update and one
    # that never did (an attacker may send to some members only) clip alike and stay in agreement
    ref = _lower_median([per_sample[p] for p in peers_k])
    if method in ("trimmed-mean", "centered-clip") and len(kept) < 3:
        method = "median-clip"
    clip_factors: dict[str, float] = {}
    if method == "mean":
        out = weighted_mean(updates_k, samples_k)
    elif method == "centered-clip":
        out, factors = _centered_clip(updates_k, samples_k)
        clip_factors = {p: f for p, f in zip(peers_k, factors) if f < 1.0}
    elif method == "sparse-clip":
        limited, factors = _clip_sparse(updates_k, samples_k, [norms[p] for p in peers_k], ref)
        clip_factors = {p: f for p, f in zip(peers_k, factors) if f < 1.0}
        out = _sparse_mean(limited, samples_k)
    elif method == "sparse-mean":
        out = _sparse_mean(updates_k, samples_k)
    elif method == "median-clip":
        cap = 4 * _lower_median(samples_k)
        weights = [min(s, cap) for s in samples_k]
        clipped = []
        for p, u, s in zip(peers_k, updates_k, samples_k):
            limit = ref * s
            scale = min(1.0, limit / norms[p]) if norms[p] > 0 and per_sample[p] > ref else 1.0
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
    return Aggregate(update=out, used=peers_k, dropped=dropped, norms=norms, capped=capped, clipped=clip_factors,
                     weights=dict(zip(peers_k, samples_k)))


def _median_center(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median (the midpoint of the two middle values when their count is even)."""
    ordered = torch.stack([t.to(torch.float32) for t in tensors]).sort(dim=0).values
    n = len(tensors)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def _runs(shapes: Sequence[torch.Size], limit: int) -> list[list[int]]:
    """Consecutive part indices grouped into runs of at most ``limit`` values (a larger part is a run of its own)."""
    runs: list[list[int]] = []
    size = limit
    for i, shape in enumerate(shapes):
        n = shape.numel()
        if size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += n
    return runs


def _join_runs(update: Sequence[torch.Tensor], runs: list[list[int]]) -> list[torch.Tensor]:
    """One flat float32 tensor per run (a run of one part: a view of it where it is float32 and contiguous)."""
    return [update[r[0]].reshape(-1).to(torch.float32) if len(r) == 1
            else torch.cat([update[i].reshape(-1).to(torch.float32) for i in r]) for r in runs]


def _centered_clip(updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float],
                   iterations: int = CLIP_ITERATIONS) -> tuple[list[torch.Tensor], list[float]]:
    """Centered clipping around the coordinate-wise median; returns the aggregate and, per update, the
    smallest factor its distance from the centre was scaled by (1.0: never clipped). Small parts are clipped
    joined into runs of up to ``CLIP_RUN`` values: a reduce-scatter owner of a small model holds dozens of
    parts, and the per-part operations (a few thousand for four members) took most of a round's exchange."""
    n = len(updates)
    shapes = [t.shape for t in updates[0]]
    runs = _runs(shapes, CLIP_RUN)
    joined = [_join_runs(u, runs) for u in updates]
    center = [_median_center(tensors) for tensors in zip(*joined)]
    total = float(sum(weights))

    def distances(v: list[torch.Tensor]) -> list[float]:
        return [math.sqrt(sum(float(torch.linalg.vector_norm(t - c)) ** 2 for t, c in zip(u, v))) for u in joined]

    tau = _lower_median(distances(center))
    factors = [1.0] * n
    step = [torch.empty_like(c) for c in center]  # one buffer for every iteration, and the centre moves in place
    for _ in range(iterations):
        dist = distances(center)
        scales = [min(1.0, tau / d) if d > 0 else 1.0 for d in dist]
        factors = [min(f, s) for f, s in zip(factors, scales)]
        for acc in step:
            acc.zero_()
        for u, w, s in zip(joined, weights, scales):
            for acc, t, c in zip(step, u, center):
                acc.add_(t - c, alpha=float(w) * s / total)
        for c, d in zip(center, step):
            c.add_(d)
    out: list[torch.Tensor] = []
    for run, c in zip(runs, center):
        out += [piece.view(shapes[i]) for i, piece in zip(run, c.split([shapes[i].numel() for i in run]))]
    return out, factors


def _clip_sparse(updates: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], norms: Sequence[float],
                 per_sample_ref: float) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Each update's norm cut to the reference norm per sample × its weight, and each value to the lower
    median over updates of their largest magnitude; returns the updates and the norm factors."""
    peak = _lower_median([max(float(t.abs().max()) if t.numel() else 0.0 for t in u) for u in updates])
    out, factors = [], []
    for u, w, norm in zip(updates, weights, norms):
        limit = per_sample_ref * float(w)
        # compared per sample as ``aggregate`` computed it, so the reference update itself is never cut by rounding
        scale = min(1.0, limit / norm) if norm > 0 and limit > 0 and norm / max(1, w) > per_sample_ref else 1.0
        factors.append(scale)
        out.append([(t.to(torch.float32) * scale).clamp(-peak, peak) for t in u])
    return out, factors


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

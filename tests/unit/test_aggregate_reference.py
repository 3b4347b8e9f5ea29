"""Every aggregator against a slow float64 reference written from its docstring, on inputs that reach every branch.

The reference restates ``gossip/aggregate.py``'s definitions with plain Python loops, so an off-by-one
median, a clip factor above 1, a bound dropped from a clamp or a reduced-precision sum fails here even
where the robustness tests (which check bounds, not values) would pass.
"""

from __future__ import annotations

import math

import pytest
import torch

from gossip.aggregate import METHODS, _centered_clip, _clip_sparse, _median_center, _sparse_mean, aggregate

D = torch.float64


def _clip(updates, weights, per_sample_ref):
    return _clip_sparse(updates, weights, [_norm(u) for u in updates], per_sample_ref)


def _lower_median(values):
    return sorted(values)[(len(values) - 1) // 2]


def _norm(u):
    return math.sqrt(sum(float(t.to(D).pow(2).sum()) for t in u))


def _wmean(updates, weights):
    total = float(sum(weights))
    return [sum(t.to(D) * (w / total) for t, w in zip(ts, weights)) for ts in zip(*updates)]


def _median(tensors):
    stacked = torch.stack([t.to(D) for t in tensors]).sort(dim=0).values
    n = len(tensors)
    return (stacked[(n - 1) // 2] + stacked[n // 2]) / 2


def _ref_centered_clip(updates, weights, iterations=3):
    center = [_median(ts) for ts in zip(*updates)]
    dist = lambda v: [math.sqrt(sum(float((t.to(D) - c).pow(2).sum()) for t, c in zip(u, v))) for u in updates]  # noqa: E731
    tau = _lower_median(dist(center))
    factors = [1.0] * len(updates)
    total = float(sum(weights))
    for _ in range(iterations):
        scales = [min(1.0, tau / d) if d > 0 else 1.0 for d in dist(center)]
        factors = [min(f, s) for f, s in zip(factors, scales)]
        center = [c + sum((t.to(D) - c) * (w * s / total) for t, w, s in zip(ts, weights, scales))
                  for c, ts in zip(center, zip(*updates))]
    return center, factors


def _ref_sparse_mean(updates, weights):
    out = []
    for ts in zip(*updates):
        total = sum(t.to(D) * w for t, w in zip(ts, weights))
        carried = sum((t != 0).to(D) * w for t, w in zip(ts, weights))
        out.append(torch.where(carried > 0, total / carried.clamp_min(1e-300), total))
    return out


def _ref_clip_sparse(updates, weights, per_sample_ref):
    peak = _lower_median([max((float(t.abs().max()) if t.numel() else 0.0) for t in u) for u in updates])
    out, factors = [], []
    for u, w in zip(updates, weights):
        norm, limit = _norm(u), per_sample_ref * w
        scale = min(1.0, limit / norm) if norm > 0 and limit > 0 else 1.0
        factors.append(scale)
        out.append([(t.to(D) * scale).clamp(-peak, peak) for t in u])
    return out, factors


def _reference(peers, updates, samples, method, reject_ratio=100.0, trim=0.2, max_samples=None):
    """(update, used, dropped, capped, clipped) as the module docstring defines them."""
    capped = {p: s for p, s in zip(peers, samples) if max_samples is not None and s > max_samples}
    samples = [min(s, max_samples) if max_samples is not None else s for s in samples]
    norms = [_norm(u) for u in updates]
    if method in ("centered-clip", "sparse-clip", "median-clip", "trimmed-mean"):
        # a claim weighs at most twice the samples its norm stands for, never below the lower-median claim m;
        # the reference is the norm per sample of an update of m samples, a shorter one brought there as √
        m = _lower_median(samples)
        positive = [n * math.sqrt(max(1, m) / max(1, min(s, m))) / max(1, m) for n, s in zip(norms, samples) if n > 0]
        if positive:
            r = _lower_median(positive)
            support = [max(m, math.ceil(2.0 * n / r)) for n in norms]
            capped.update({p: s for p, s, c in zip(peers, samples, support) if c < s and p not in capped})
            samples = [min(s, c) for s, c in zip(samples, support)]
    per_sample = [n / max(1, s) for n, s in zip(norms, samples)]
    ref = _lower_median(per_sample)
    kept = [i for i in range(len(peers)) if not (ref > 0 and per_sample[i] > reject_ratio * ref)]
    dropped = {peers[i]: "norm_outlier" for i in range(len(peers)) if i not in kept}
    ups, ws, ps = [updates[i] for i in kept], [samples[i] for i in kept], [peers[i] for i in kept]
    ref = _lower_median([per_sample[i] for i in kept])  # clipping takes its reference from the kept updates
    if method in ("trimmed-mean", "centered-clip") and len(kept) < 3:
        method = "median-clip"
    clipped = {}
    if method == "mean":
        out = _wmean(ups, ws)
    elif method == "sparse-mean":
        out = _ref_sparse_mean(ups, ws)
    elif method == "centered-clip":
        out, factors = _ref_centered_clip(ups, ws)
        clipped = {p: f for p, f in zip(ps, factors) if f < 1.0}
    elif method == "sparse-clip":
        limited, factors = _ref_clip_sparse(ups, ws, ref)
        clipped = {p: f for p, f in zip(ps, factors) if f < 1.0}
        out = _ref_sparse_mean(limited, ws)
    elif method == "median-clip":
        cap = 4 * _lower_median(ws)
        scaled = [[t.to(D) * (min(1.0, ref * s / norms[i]) if norms[i] > 0 else 1.0) for t in updates[i]]
                  for i, s in zip(kept, ws)]
        out = _wmean(scaled, [min(s, cap) for s in ws])
    else:
        b = max(1, int(trim * len(ups)))
        out = [torch.stack([t.to(D) for t in ts]).sort(dim=0).values[b: len(ups) - b].mean(dim=0) for ts in zip(*ups)]
    return out, ps, dropped, capped, clipped


def _case(seed: int, n: int, sparse: bool):
    """``n`` updates of mixed scales (one 30× and, from 4 members, one all-zero), mixed sample counts,
    with an empty tensor among the parameters; sparse ones keep a quarter of their values."""
    g = torch.Generator().manual_seed(seed)
    updates = []
    for i in range(n):
        scale = 30.0 if i == 1 else 0.5 + float(torch.rand(1, generator=g))
        u = [torch.randn(40, generator=g) * 0.01 * scale, torch.randn(2, 3, generator=g) * 0.01 * scale, torch.zeros(0)]
        if sparse:
            u = [t * (torch.rand(t.shape, generator=g) < 0.25) for t in u]
        if i == 3:
            u = [torch.zeros_like(t) for t in u]
        updates.append(u)
    samples = [int(s) for s in torch.randint(1, 40, (n,), generator=g)]
    return [f"p{i}" for i in range(n)], updates, samples


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_aggregator_matches_its_reference(method: str, n: int, seed: int) -> None:
    peers, updates, samples = _case(seed, n, sparse=method.startswith("sparse"))
    for reject_ratio, max_samples in ((100.0, None), (8.0, 20)):
        got = aggregate(peers, updates, samples, method, reject_ratio=reject_ratio, max_samples=max_samples)
        want, used, dropped, capped, clipped = _reference(peers, updates, samples, method, reject_ratio, max_samples=max_samples)
        assert (got.used, got.dropped, got.capped) == (used, dropped, capped)
        assert got.clipped.keys() == clipped.keys()
        for peer, factor in clipped.items():
            assert got.clipped[peer] == pytest.approx(factor, rel=1e-4)
        for x, y in zip(got.update, want):
            assert x.dtype == torch.float32
            torch.testing.assert_close(x.to(D), y, rtol=1e-4, atol=1e-9)


def test_the_median_of_an_even_count_is_the_midpoint_of_the_middle_two() -> None:
    xs = [torch.tensor([1.0, -4.0]), torch.tensor([10.0, 0.0]), torch.tensor([2.0, 8.0]), torch.tensor([3.0, 1.0])]
    assert torch.equal(_median_center(xs), torch.tensor([2.5, 0.5]))
    assert torch.equal(_median_center(xs[:3]), torch.tensor([2.0, 0.0]))


def test_low_precision_inputs_are_combined_in_float32() -> None:
    """A bf16 update is upcast before any arithmetic: the median of two bf16 values (not a bf16 value itself),
    a clip factor applied in float32, and sums kept in float32."""
    a, b = torch.tensor([1.0, 3.0], dtype=torch.bfloat16), torch.tensor([1.0078125, 3.015625], dtype=torch.bfloat16)
    mid = _median_center([a, b])
    assert mid.dtype == torch.float32 and torch.equal(mid, (a.float() + b.float()) / 2)
    limited, _ = _clip([[a], [b], [a * 4]], [1, 1, 1], per_sample_ref=1.0)
    assert all(u[0].dtype == torch.float32 for u in limited)
    torch.testing.assert_close(limited[2][0].double(), (a.double() * 4 / (a.double() * 4).norm()).clamp(-3.015625, 3.015625), rtol=1e-6, atol=0)
    out = _sparse_mean([[a], [b]], [1, 1])
    assert out[0].dtype == torch.float32 and torch.equal(out[0], (a.float() + b.float()) / 2)


def test_clip_factors_are_exactly_one_for_updates_inside_the_radius() -> None:
    """An update at the centre (distance 0) or inside τ is never scaled, and its factor says 1, not more."""
    updates = [[torch.tensor([0.0, 0.0])], [torch.tensor([1.0, 0.0])], [torch.tensor([0.0, 1.0])], [torch.tensor([0.0, 0.0])]]
    center, factors = _centered_clip(updates, [1, 1, 1, 1])
    assert factors[0] == factors[3] == 1.0 and all(f <= 1.0 for f in factors)
    want, want_factors = _ref_centered_clip(updates, [1, 1, 1, 1])
    assert factors == pytest.approx(want_factors) and torch.allclose(center[0].double(), want[0])


def test_sparse_clip_factors_of_zero_updates_and_a_zero_reference_are_one() -> None:
    zero, one = [torch.zeros(3)], [torch.tensor([0.5, -0.25, 0.0])]
    _, factors = _clip([zero, one, zero], [1, 1, 1], per_sample_ref=0.0)
    assert factors == [1.0, 1.0, 1.0]
    _, factors = _clip([zero, one], [1, 1], per_sample_ref=0.1)
    assert factors[0] == 1.0 and factors[1] == pytest.approx(0.1 / math.sqrt(0.5**2 + 0.25**2))


def test_sparse_mean_divides_by_fractional_weights() -> None:
    """Weights below 1 (a caller may pass fractions) still divide: the mean of the carriers, not their sum."""
    out = _sparse_mean([[torch.tensor([2.0, 0.0])], [torch.tensor([0.0, 0.0])]], [0.5, 0.25])
    assert torch.equal(out[0], torch.tensor([2.0, 0.0]))
    out = _sparse_mean([[torch.tensor([2.0, 0.0])], [torch.tensor([4.0, 0.0])]], [0.25, 0.25])
    assert torch.equal(out[0], torch.tensor([3.0, 0.0]))


@pytest.mark.parametrize("run", [1, 37, 1 << 22])
def test_centered_clip_over_parts_joined_into_runs_matches_the_reference(monkeypatch, run: int) -> None:
    """Small parts are clipped joined into runs (fewer, larger operations); parts larger than a run go alone.
    The result, part by part in the parts' shapes, is the reference's (float64) to float32 rounding."""
    import gossip.aggregate as aggregate_module

    monkeypatch.setattr(aggregate_module, "CLIP_RUN", run)
    g = torch.Generator().manual_seed(3)
    shapes = [(4, 5), (3,), (64,), (2, 2, 2), (1,), (50,)]
    updates = [[torch.randn(s, generator=g) * (1 + k) for s in shapes] for k in range(5)]
    updates[4] = [t * 40 for t in updates[4]]  # one far away: clipped
    center, factors = _centered_clip(updates, [1, 2, 3, 4, 5])
    want, want_factors = _ref_centered_clip(updates, [1, 2, 3, 4, 5])
    assert factors == pytest.approx(want_factors, rel=1e-5) and factors[4] < 1.0
    assert [tuple(c.shape) for c in center] == shapes and all(c.is_contiguous() and c.dtype == torch.float32 for c in center)
    for c, w in zip(center, want):
        torch.testing.assert_close(c.double(), w, rtol=1e-5, atol=1e-5)

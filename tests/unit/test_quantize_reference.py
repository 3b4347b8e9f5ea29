"""The statistical quantizer's pieces against float64 brute force: bin widths, outlier picking, inlier statistics.

``test_compression_codecs.py`` checks the codec's error bounds end to end; these pin the numbers each
piece must produce (the module docstring's formulas), including the paths bounds alone cannot see:
float32 overflow, a mean much larger than σ, several chunks, fewer 64-value blocks than outliers,
tied magnitudes.
"""

from __future__ import annotations

import math

import pytest
import torch

from compression.quantize import CHUNK, OUTLIER_EVERY, _MIN_SCALE, bin_width, farthest, moments, outlier_count, split_outliers


def test_bin_widths_follow_the_formulas() -> None:
    assert bin_width(8, std=5.0, extent=127.0) == 1.0  # extent / (256/2 − 1)
    assert bin_width(4, std=2.0, extent=99.0) == 6 * 2.0 / 16
    assert bin_width(2, std=1.0, extent=99.0) == 6 * 1.0 / 4
    assert bin_width(8, std=0.0, extent=_MIN_SCALE * 127) == _MIN_SCALE  # the smallest width kept as is
    assert bin_width(8, std=0.0, extent=0.0) == 1.0 and bin_width(2, std=1e-40, extent=0.0) == 1.0


@pytest.mark.parametrize("n,k", [(5, 3), (63, 2), (64, 1), (100, 4), (640, 10), (640, 11), (4113, 70), (4113, 3)])
def test_farthest_finds_the_k_largest_in_order(n: int, k: int) -> None:
    magnitude = torch.rand(n, generator=torch.Generator().manual_seed(n + k))
    want = torch.topk(magnitude, k).indices.sort().values
    assert torch.equal(farthest(magnitude, k), want)


def test_farthest_with_tied_magnitudes_keeps_k_of_the_largest() -> None:
    magnitude = torch.zeros(64 * 40)
    magnitude[::64] = 1.0  # 40 blocks whose maxima tie
    magnitude[5 * 64 + 3] = 2.0
    got = farthest(magnitude, 10)
    assert got.numel() == 10 and torch.equal(got, got.unique()) and 5 * 64 + 3 in got.tolist()
    assert bool((magnitude[got] >= 1.0).all())


def test_split_outliers_with_huge_values_sums_in_float64() -> None:
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 3e19  # squares overflow float32
    centre = float(flat.double().mean())
    got = split_outliers(flat, centre)
    _, mean, std, extent = _reference_split(flat, centre)
    assert math.isfinite(got.std) and got.std == pytest.approx(std, rel=1e-5)
    assert got.mean == pytest.approx(mean, abs=1e-6 * std)


def _reference_split(flat: torch.Tensor, centre: float):
    d64 = flat.double() - centre
    index = []
    for start in range(0, flat.numel(), CHUNK):
        part = (flat[start: start + CHUNK] - centre).abs()
        k = outlier_count(part.numel())
        if k:
            index.append(torch.topk(part, k).indices.sort().values + start)
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    keep[index] = False
    inl = d64[keep]
    if inl.numel() == 0:
        return index, centre, 0.0, 0.0
    offset = float(inl.mean())
    std = float(inl.var(correction=0).sqrt())
    extent = max(float(inl.max()) - offset, offset - float(inl.min()), 0.0) if inl.numel() else 0.0
    return index, centre + offset, std, extent


@pytest.mark.parametrize("n", [0, 1, 1000, OUTLIER_EVERY, 5000, CHUNK + 2 * OUTLIER_EVERY + 5])
def test_split_outliers_matches_brute_force(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    torch.manual_seed(n)  # the Student-t sampler draws from the global generator
    flat = torch.distributions.StudentT(2.0).sample((n,)) if n else torch.zeros(0)
    flat = (flat + 3.0 + torch.rand(n, generator=g)).float().contiguous()  # centred away from 0: offsets matter
    centre = float(flat.double().mean()) if n else 0.0
    got = split_outliers(flat, centre)
    index, mean, std, extent = _reference_split(flat, centre)
    assert torch.equal(got.index, index) and torch.equal(got.value, flat[index])
    assert got.value.dtype == torch.float32
    # float32 sums of centred values per chunk: a millionth of σ is ~10⁴ below any bin width
    assert got.mean == pytest.approx(mean, abs=1e-6 * std + 1e-9)
    assert got.std == pytest.approx(std, rel=1e-5, abs=1e-9)
    assert got.extent == pytest.approx(extent, rel=1e-6, abs=1e-6 * std + 1e-9)


def test_split_outliers_of_nothing_reports_the_centre_and_zero_spread() -> None:
    got = split_outliers(torch.zeros(0), 2.5)
    assert (got.mean, got.std, got.extent) == (2.5, 0.0, 0.0) and got.index.numel() == 0


@pytest.mark.parametrize("case", ["plain", "overflows_float32", "mean_far_above_sigma", "constant", "single"])
def test_moments_are_the_float64_mean_and_population_sigma(case: str) -> None:
    g = torch.Generator().manual_seed(7)
    x = {
        "plain": torch.randn(3000, generator=g) * 2 - 1,
        "overflows_float32": torch.randn(3000, generator=g) * 3e19,  # x² overflows float32; float64 does not
        "mean_far_above_sigma": 1e4 + torch.randn(3000, generator=g) * 1e-2,
        "constant": torch.full((100,), 0.3),
        "single": torch.tensor([5.0]),
    }[case].float()
    mean, std = moments(x)
    assert mean == pytest.approx(float(x.double().mean()), rel=1e-6)
    assert std == pytest.approx(float(x.double().var(correction=0).sqrt()), rel=1e-4, abs=1e-6)
    assert math.isfinite(mean) and math.isfinite(std)


def test_moments_of_nothing_are_zero_and_of_nan_an_error() -> None:
    assert moments(torch.zeros(0)) == (0.0, 0.0)
    with pytest.raises(ValueError):
        moments(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError):
        moments(torch.tensor([1.0, float("inf")]))

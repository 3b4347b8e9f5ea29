"""Codec accuracy: analytic error bounds, top-k/DCT exactness, bit packing, property tests.

Bounds checked here (derivations in the codec modules' docstrings):
* statistical quantizer q{8,4,2}: the outliers of the payload's side channel decode exactly; an inlier
  whose position (x − shift)/scale + n/2 lies in an interior bin decodes within one bin width,
  |x − x̂| ≤ scale (``bin_width`` of the inliers' σ and extent); every x̂ lies within [min x, max x]
  (it is a mean of input values);
* int8-block: |x − x̂| ≤ max|x_block| / 254;
* top-k with K = C and float32 values, and ``none``: exact; DCT with K = C: float32 rounding only.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compression import CodecError, Payload, get_codec
from compression.bitpack import pack_bits, packed_size, unpack_bits
from compression.chunking import ChunkLayout
from compression.dct import dct_matrix, dct_rows, idct_rows
from compression.quantize import bin_width, outlier_count
from compression.wire import read_tensor
from tests.helpers.codec_checks import decode_corrupted, tensor_field, wire_roundtrip, with_fields

SPECS = ["none", "fp16", "bf16", "q8", "q4", "q2", "int8-block", "int8-block:5", "topk:64/4096", "topk:64/4096+q2",
         "topk:4/9", "topk:16/16", "dct:8/16+q4", "dct:16/16", "seed:r=2"]


def decode(spec: str, x: torch.Tensor) -> torch.Tensor:
    return wire_roundtrip(get_codec(spec), x)[2]


def quantizer_bound_holds(x: torch.Tensor, out: torch.Tensor, payload: Payload, bits: int) -> None:
    xd, od = x.double().reshape(-1), out.double().reshape(-1)
    if xd.numel() == 0:
        return
    lo, hi = float(xd.min()), float(xd.max())
    slack = 1e-6 * (abs(lo) + abs(hi)) + 1e-30
    assert float(od.min()) >= lo - slack and float(od.max()) <= hi + slack
    k = outlier_count(xd.numel())
    index = read_tensor(payload.fields, "outlier_index", [k], torch.int32).long()
    assert torch.equal(od[index], xd[index])  # the side channel is exact
    inlier = torch.ones(xd.numel(), dtype=torch.bool)
    inlier[index] = False
    xi, err = xd[inlier], (od - xd).abs()[inlier]
    mean = xi.mean()
    scale = bin_width(bits, float(xi.std(correction=0)), float((xi - mean).abs().max()))
    if scale == 1.0 and float(xi.max() - xi.min()) <= slack:  # constant inliers: the centre bin
        assert float(err.max()) <= slack
        return
    n_bins = 1 << bits
    pos = (xi - mean) / scale + n_bins / 2
    frac = (pos - pos.round()).abs()
    interior = (pos > 0.5 + 1e-3) & (pos < n_bins - 1.5 - 1e-3) & (frac < 0.5 - 1e-3)
    assert bool((err[interior] <= scale * (1 + 1e-3) + slack).all())


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("kind", ["normal", "cauchy", "shifted", "constant", "two-values"])
def test_statistical_quantizer_error_bound(bits: int, kind: str) -> None:
    g = torch.Generator().manual_seed(bits)
    x = {
        "normal": lambda: torch.randn(5000, generator=g),
        "cauchy": lambda: torch.randn(5000, generator=g) / torch.randn(5000, generator=g).abs().clamp_min(1e-3),
        "shifted": lambda: torch.randn(5000, generator=g) * 1e-3 + 50.0,
        "constant": lambda: torch.full((5000,), -2.75),
        "two-values": lambda: torch.tensor([0.0, 1.0]).repeat(2500),
    }[kind]()
    codec = get_codec(f"q{bits}")
    payload = codec.encode(x)
    out = codec.decode(Payload.from_bytes(payload.to_bytes()))
    quantizer_bound_holds(x, out, payload, bits)
    if kind in ("constant", "two-values"):
        assert torch.equal(out, x)  # each used bin holds one distinct value, and its mean is that value


def test_quantizer_lut_is_the_per_bin_mean() -> None:
    x = torch.randn(3001)
    out = decode("q4", x)
    for value in out.unique():
        members = x[out == value]
        assert math.isclose(float(members.double().mean()), float(value), rel_tol=1e-5, abs_tol=1e-6)


def student_t2(n: int, seed: int) -> torch.Tensor:
    """Student-t with 2 degrees of freedom: z / √(χ²₂/2), and χ²₂/2 = −ln U."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-12).log().neg().sqrt()


@pytest.mark.parametrize(("bits", "limit_t2", "limit_normal"), [(8, 0.05, 0.01), (4, 0.3, 0.12), (2, 0.45, 0.43)])
def test_quantizer_keeps_heavy_tails(bits: int, limit_t2: float, limit_normal: float) -> None:
    """Student-t(2) pseudo-gradients: q8 loses under 5% of the norm at ≤ 8.2 bits per value (clipping
    quantizers lose 51–68% there); Gaussian tensors lose no more than before the side channel."""
    n = 1 << 20
    for x, limit in ((student_t2(n, bits), limit_t2), (torch.randn(n, generator=torch.Generator().manual_seed(bits)), limit_normal)):
        payload = get_codec(f"q{bits}").encode(x)
        out = get_codec(f"q{bits}").decode(Payload.from_bytes(payload.to_bytes()))
        assert float((out - x).norm() / x.norm()) < limit
        assert 8 * payload.nbytes / n <= bits + 0.2


def test_quantizer_refuses_bad_outliers() -> None:
    codec = get_codec("q8")
    payload = codec.encode(torch.randn(4096))
    index = read_tensor(payload.fields, "outlier_index", [4], torch.int32)
    bad = {
        "unsorted": ("outlier_index", index.flip(0)),
        "past the end": ("outlier_index", torch.tensor([0, 1, 2, 4096], dtype=torch.int32)),
        "NaN": ("outlier_value", torch.tensor([0.0, float("nan"), 0.0, 0.0])),
    }
    for key, value in bad.values():
        fields = {**payload.fields, key: {"dtype": payload.fields[key]["dtype"], "shape": [4], "data": value.numpy().tobytes()}}
        with pytest.raises(CodecError):
            codec.decode(Payload.from_bytes(Payload(payload.codec, payload.version, payload.shape, fields).to_bytes()))


def test_quantizer_packs_codes_densely() -> None:
    n = 4000
    for bits in (8, 4, 2):
        payload = get_codec(f"q{bits}").encode(torch.randn(n))
        assert payload.fields["codes"]["shape"] == [n * bits // 8]
        assert payload.fields["lut"]["shape"] == [1 << bits]


@pytest.mark.parametrize("block", [4096, 5])
def test_int8_block_error_bound(block: int) -> None:
    x = torch.randn(3 * 4096 + 17) * torch.linspace(0.01, 100, 3 * 4096 + 17)
    out = decode("int8-block" if block == 4096 else f"int8-block:{block}", x)
    n_blocks = -(-x.numel() // block)
    padded = torch.zeros(n_blocks * block)
    padded[: x.numel()] = x
    absmax = padded.view(n_blocks, block).abs().amax(1).repeat_interleave(block)[: x.numel()]
    assert bool(((out - x).abs() <= absmax / 254 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("shape", [(4096 * 2 + 5,), (130, 70), (64, 64), (3, 5, 7), ()])
def test_topk_with_full_k_is_exact(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    assert torch.equal(decode("topk:4096/4096", x), x)
    assert torch.equal(decode("topk:9/9", x), x)


def test_topk_keeps_the_largest_per_chunk() -> None:
    x = torch.randn(10 * 1000)
    out = decode("topk:30/1000", x)
    for chunk_in, chunk_out in zip(x.view(10, 1000), out.view(10, 1000)):
        kept = chunk_out != 0
        assert int(kept.sum()) == 30
        assert torch.equal(chunk_out[kept], chunk_in[kept])  # float32 values travel exactly
        assert float(chunk_in[kept].abs().min()) >= float(chunk_in[~kept].abs().max())


def test_topk_tiles_2d_tensors_in_squares() -> None:
    x = torch.zeros(128, 128)
    x[0:64, 64:128] = 1.0  # one whole tile of ones: K=4 of it kept in that tile only
    x[100, 3] = 5.0
    out = decode("topk:4/4096", x)
    assert int((out[0:64, 64:128] != 0).sum()) == 4
    assert out[100, 3] == 5.0
    layout = ChunkLayout((130, 70), 4096)
    assert layout.tile == 64 and layout.grid == (3, 2) and layout.n_chunks == 6
    assert ChunkLayout((130, 70), 4000).tile is None  # not a square: flat chunks
    assert ChunkLayout((130, 70), 4000).n_chunks == 3


def test_topk_q2_bits_per_parameter() -> None:
    x = torch.randn(1024, 1024)
    payload = get_codec("topk:64/4096+q2").encode(x)
    assert 8 * payload.nbytes / x.numel() <= 0.17  # (8 + 2.5)·64/4096 = 0.164 plus a small header


def _with_field_bytes(payload: Payload, name: str, data: bytes) -> Payload:
    return with_fields(payload, **{name: tensor_field(payload, name, data=data)})


def test_topk_refuses_out_of_range_and_repeated_indices() -> None:
    codec = get_codec("topk:1/3000")  # one position: packed to 12 bits, so 3000..4095 are representable but invalid
    payload = codec.encode(torch.randn(6000))
    raw = bytes(payload.fields["idx"]["data"])
    with pytest.raises(CodecError, match="past the end"):
        codec.decode(Payload.from_bytes(_with_field_bytes(payload, "idx", b"\xff" * len(raw)).to_bytes()))
    with pytest.raises(CodecError):
        codec.decode(Payload.from_bytes(_with_field_bytes(payload, "idx", raw[:-1]).to_bytes()))
    codec = get_codec("topk:4/3000")  # Elias–Fano: 9 low bits, a 10-bit unary bitmap per chunk
    payload = codec.encode(torch.randn(6000))
    low, high = bytes(payload.fields["idx_low"]["data"]), bytes(payload.fields["idx_high"]["data"])
    with pytest.raises(CodecError, match="exactly 4 positions"):
        codec.decode(Payload.from_bytes(_with_field_bytes(payload, "idx_high", b"\xff" * len(high)).to_bytes()))
    # bitmap 1111000000 for both chunks: highs 0, 0, 0, 0; equal low bits repeat a position
    forged = _with_field_bytes(payload, "idx_high", bytes([0x0F, 0xC0, 0x03] + [0] * (len(high) - 3)))
    with pytest.raises(CodecError, match="repeats"):
        codec.decode(Payload.from_bytes(_with_field_bytes(forged, "idx_low", b"\x00" * len(low)).to_bytes()))
    # the last high value (6 = bitmap bit 9) with all-ones low bits is 6·512 + 511 = 3583 ≥ 3000
    forged = _with_field_bytes(payload, "idx_high", bytes([0x07, 0x3E, 0x00] + [0] * (len(high) - 3)))
    with pytest.raises(CodecError, match="past the end"):
        codec.decode(Payload.from_bytes(_with_field_bytes(forged, "idx_low", b"\xff" * len(low)).to_bytes()))
    with pytest.raises(CodecError):
        codec.decode(Payload.from_bytes(_with_field_bytes(payload, "idx_low", low[:-1]).to_bytes()))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(1, 300), st.integers(1, 5), st.integers(0, 2**31))
def test_elias_fano_round_trip_and_size(k: int, chunk: int, n_chunks: int, seed: int) -> None:
    from compression import elias_fano
    k = min(k, chunk)
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(chunk, generator=g)[:k].sort().values for _ in range(n_chunks)])
    low, high = elias_fano.encode(positions, chunk)
    assert (low.numel(), high.numel()) == elias_fano.stream_sizes(n_chunks, k, chunk)
    assert 8 * (low.numel() + high.numel()) <= n_chunks * elias_fano.chunk_bits(k, chunk) + 16
    assert torch.equal(elias_fano.decode(low, high, n_chunks, k, chunk, "test"), positions)


def test_dct_transforms_are_orthonormal_and_inverse() -> None:
    for n in (1, 2, 7, 64, 256):
        d = dct_matrix(n).double()
        assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
        x = torch.randn(3, n)
        assert torch.allclose(dct_rows(x).double(), x.double() @ d.T, atol=1e-5)
        assert torch.allclose(idct_rows(dct_rows(x)), x, atol=1e-5)
    n = 4096  # the FFT path at the default chunk size, against the definition for a few coefficients
    x = torch.randn(2, n, dtype=torch.float64)
    j = torch.arange(n, dtype=torch.float64)
    for k in (0, 1, 2047, 4095):
        alpha = math.sqrt((1.0 if k == 0 else 2.0) / n)
        expected = alpha * (x * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))).sum(-1)
        assert torch.allclose(dct_rows(x.float())[:, k].double(), expected, atol=1e-4)
    assert torch.allclose(idct_rows(dct_rows(x.float())), x.float(), atol=1e-5)


@pytest.mark.parametrize("shape", [(130, 70), (5000,), (3, 4, 5)])
def test_dct_with_full_k_is_exact_up_to_rounding(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    assert torch.allclose(decode("dct:4096/4096", x), x, atol=1e-5)


def test_dct_concentrates_smooth_signals() -> None:
    ramp = torch.outer(torch.linspace(-1, 1, 64), torch.linspace(0, 2, 64))
    out = decode("dct:32/4096", ramp)
    assert float((out - ramp).norm() / ramp.norm()) < 0.05


@pytest.mark.parametrize("bits", list(range(1, 17)) + [24, 31, 32])
def test_bitpack_roundtrip(bits: int) -> None:
    for n in (0, 1, 2, 3, 7, 8, 9, 100):
        values = torch.randint(0, 1 << bits, (n,), dtype=torch.int64)
        packed = pack_bits(values, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_size(n, bits)
        assert torch.equal(unpack_bits(packed, bits, n).to(torch.int64), values)


def test_bitpack_is_an_lsb_first_stream() -> None:
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


# ---- property tests ------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.one_of(st.integers(0, 9), st.sampled_from([63, 65, 130]))) for _ in range(ndim)]
    if math.prod(shape) > 20000:
        shape = [min(s, 9) for s in shape]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "cauchy", "constant", "tiny", "large"]))
    base = torch.randn(shape, generator=g)
    x = {
        "normal": base,
        "cauchy": base / torch.randn(shape, generator=g).abs().clamp_min(1e-2),
        "constant": torch.full(shape, draw(st.floats(-100, 100, allow_nan=False))),
        "tiny": base * 1e-20,
        "large": base * 1e4,
    }[kind]
    x = x.to(DTYPES[draw(st.sampled_from(sorted(DTYPES)))])
    if draw(st.booleans()) and x.dim() >= 2:
        x = x.transpose(0, -1)  # non-contiguous
    elif draw(st.booleans()) and x.dim() >= 1 and x.shape[0] >= 2:
        x = x[::2]  # strided
    return x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), spec=st.sampled_from(SPECS))
def test_property_roundtrip(x: torch.Tensor, spec: str) -> None:
    payload, _, out = wire_roundtrip(get_codec(spec), x)
    assert out.dtype == torch.float32 and out.shape == x.shape and bool(torch.isfinite(out).all())
    ref = x.float()
    if spec in ("none", "topk:16/16") or (spec == "topk:4/9" and x.numel() <= 4):
        assert torch.equal(out, ref)
    elif spec in ("fp16", "bf16"):
        dtype = DTYPES[spec]
        assert torch.equal(out, ref.clamp(-65504, 65504).to(dtype).float())
    elif spec in ("q8", "q4", "q2"):
        quantizer_bound_holds(ref, out, payload, int(spec[1]))
    elif spec == "int8-block" and x.numel():
        assert float((out - ref).abs().max()) <= float(ref.abs().max()) / 254 * (1 + 1e-5) + 1e-30
    elif spec == "dct:16/16":
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) if x.numel() else 0)


@settings(max_examples=80, deadline=None)
@given(spec=st.sampled_from(SPECS), position=st.integers(0, 10**6), value=st.integers(0, 255), cut=st.booleans())
def test_property_corrupted_bytes_raise_codec_error_or_decode(spec: str, position: int, value: int, cut: bool) -> None:
    out = decode_corrupted(get_codec(spec), torch.randn(40, 3), position, value, cut)
    assert out is None or out.dtype == torch.float32


def _two_level_reference(row: torch.Tensor, steps: int) -> tuple[float, float, torch.Tensor]:
    """An independent two-level Lloyd quantizer of one chunk's magnitudes, in float64: split at the
    median, then ``steps`` times at the midpoint of the class means. Returns (low, high, is_high, the
    threshold that split them)."""
    mags = sorted(abs(float(v)) for v in row)
    threshold = mags[(len(mags) - 1) // 2]  # torch.median: the lower of the two middle values
    magnitude = row.double().abs()
    for _ in range(steps + 1):
        split = threshold
        high = magnitude > split
        low_values, high_values = magnitude[~high], magnitude[high]
        low = float(low_values.mean()) if len(low_values) else 0.0
        top = float(high_values.mean()) if len(high_values) else 0.0
        threshold = (low + top) / 2
    return low, top, high, split


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(1, 6), st.floats(1e-6, 1e3), st.integers(0, 2**31))
def test_chunk_levels_match_a_reference_two_level_quantizer_per_chunk(k: int, n_chunks: int, scale: float, seed: int) -> None:
    from compression import chunk_levels
    g = torch.Generator().manual_seed(seed)
    # chunks of very different scales, as a flat run across tensors has them
    x = torch.randn(n_chunks, k, generator=g) * torch.logspace(0, -4, n_chunks).unsqueeze(1) * scale
    codes, levels = chunk_levels.encode(x)
    y = chunk_levels.decode(codes, levels, n_chunks, k, "test")
    for row_x, row_y, row_levels in zip(x, y, levels):
        low, high, is_high, split = _two_level_reference(row_x, chunk_levels.LLOYD_STEPS)
        got = row_levels.float()
        # float32 sums against float64 ones: equal up to float16's rounding of the level (2^-24: its
        # smallest step, below which a level flushes to 0)
        assert torch.allclose(got.double(), torch.tensor([low, high], dtype=torch.float64), rtol=2e-3, atol=2.0**-24), (got, low, high)
        # every value decodes to sign × the level of its class (the reference's class, except for a
        # magnitude within rounding of the split)
        mags = row_x.double().abs()
        near_split = (mags - split).abs() <= 1e-5 * max(split, 1e-30)
        classes = torch.where(row_y.abs() == got[1], True, False)
        assert bool(((row_y.abs() == got[0]) | (row_y.abs() == got[1])).all()), (row_y, got)
        assert got[0] == got[1] or bool(((classes == is_high) | near_split).all()), (row_x, row_y, got)
        assert torch.equal(torch.signbit(row_y), torch.signbit(row_x)) or bool((got == 0).any())
        # and each level is the mean magnitude it stands for, so the chunk's error is below its norm
        assert float((row_x - row_y).norm()) < float(row_x.norm()) * (1 + 1e-3) or float(row_x.norm()) == 0


def test_chunk_levels_reference_values() -> None:
    """One chunk worked by hand: magnitudes 1, 2, 3, 10 split at the median 2, then at (1.5 + 6.5)/2 = 4:
    levels 2 (for 1, 2, 3) and 10; the Lloyd split is what keeps 10 from being pulled down to 6.5."""
    from compression import chunk_levels
    x = torch.tensor([[1.0, -2.0, 3.0, -10.0]])
    codes, levels = chunk_levels.encode(x)
    assert levels.tolist() == [[2.0, 10.0]]
    assert chunk_levels.decode(codes, levels, 1, 4, "test").tolist() == [[2.0, -2.0, 2.0, -10.0]]


def test_chunk_levels_refuse_negative_or_infinite_levels() -> None:
    from compression import chunk_levels
    codes, levels = chunk_levels.encode(torch.randn(3, 8))
    for bad in (-1.0, float("inf"), float("nan")):
        forged = levels.clone()
        forged[1, 1] = bad
        with pytest.raises(CodecError, match="levels"):
            chunk_levels.decode(codes, forged, 3, 8, "test")


@pytest.mark.parametrize("spec", ["none", "fp16", "q8", "topk:4/9"])
def test_one_element_sliced_with_a_step_encodes(spec: str) -> None:
    """``x[::2]`` of two values is one element at stride 2, which torch calls contiguous: viewing its bytes
    raised (found by the property test)."""
    from protocol.tensors import tensor_bytes

    x = torch.tensor([1.541, 2.0])[::2]
    assert x.stride() == (2,) and x.is_contiguous()
    assert torch.allclose(decode(spec, x), x, atol=1e-3)
    assert tensor_bytes(x) == tensor_bytes(torch.tensor([1.541]))

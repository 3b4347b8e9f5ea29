"""Rotation codecs (rot1/2/4/8, topk+rotB): error targets per input distribution, wire size, round
trips, refusals, and bit-identical seeded signs across processes.

Targets on 1M-element Gaussian, Student-t(2) and rank-4 inputs, counting the whole serialized payload:
normalized squared error ‖x̂ − x‖²/‖x‖² ≤ 0.40 (1 bit), 0.13 (2), 0.012 (4); relative L2 error ≤ 1 %
(8 bits); at most B + 0.05 bits per value. (The Lloyd–Max distortions are 0.363, 0.118, 0.0095, 4·10⁻⁵.)
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compression import SPEC_FORMS, CodecError, ErrorFeedback, Payload, get_codec
from compression.bitpack import pack_bits, unpack_bits
from compression.hadamard import BLOCK, block_size, hadamard, padded_length, random_signs, walsh_hadamard
from compression.rotation import CHUNK, RotationQuantization, _Buffers, _pack_codes, lloyd_max_levels
from tests.helpers.codec_checks import (
    assert_encode_leaves_input_alone, decode_corrupted, run_child, sha, tensor_field, wire_roundtrip, with_fields, without_field,
)

BITS = (1, 2, 4, 8)
NSE_TARGET = {1: 0.40, 2: 0.13, 4: 0.012}
N = 1 << 20


def _student_t2(n: int, g: torch.Generator) -> torch.Tensor:
    """Student-t with 2 degrees of freedom: Z/√(χ²₂/2), and χ²₂/2 = −ln U is Exp(1)."""
    z = torch.randn(n, generator=g, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-300)
    return (z / (-u.log()).sqrt()).float()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "gaussian": torch.randn(N, generator=g),
        "student-t2": _student_t2(N, g),
        "low-rank": torch.randn(1024, 4, generator=g) @ torch.randn(4, 1024, generator=g),
    }


INPUTS = _inputs()


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    codec = get_codec(spec)
    payload, data, out = wire_roundtrip(codec, x)
    assert torch.equal(out, codec.decode(payload))
    return out, len(data)


def _nse(out: torch.Tensor, x: torch.Tensor) -> float:
    x64 = x.double()
    return float((out.double() - x64).square().sum() / x64.square().sum())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_error_and_size_targets(bits: int, kind: str) -> None:
    x = INPUTS[kind]
    out, nbytes = _roundtrip(f"rot{bits}", x)
    assert out.shape == x.shape and out.dtype == torch.float32
    nse = _nse(out, x)
    if bits == 8:
        assert math.sqrt(nse) <= 0.01
    else:
        assert nse <= NSE_TARGET[bits]
    assert 8 * nbytes / x.numel() <= bits + 0.05


def test_lloyd_max_levels_match_the_gaussian_tables() -> None:
    """Max (1960) / Lloyd: ±0.7979; ±0.4528, ±1.5104; 4 bits ±0.1284 … ±2.7326; distortion per level set."""
    assert lloyd_max_levels(1).tolist() == pytest.approx([-0.797885, 0.797885], abs=1e-6)
    assert lloyd_max_levels(2).tolist() == pytest.approx([-1.510418, -0.452780, 0.452780, 1.510418], abs=1e-5)
    four = [0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590]
    assert lloyd_max_levels(4)[8:].tolist() == pytest.approx(four, abs=1e-5)
    eight = lloyd_max_levels(8)
    assert eight.numel() == 256 and bool((eight[1:] > eight[:-1]).all())
    assert torch.equal(eight, -eight.flip(0))  # symmetric
    z = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for bits, distortion in ((1, 0.3634), (2, 0.1175), (4, 0.0095)):
        levels = lloyd_max_levels(bits).double()
        nearest = levels[(z.unsqueeze(1) - levels).abs().argmin(1)]
        assert float((z - nearest).square().mean()) == pytest.approx(distortion, rel=0.03)


def test_walsh_hadamard_is_the_orthonormal_sylvester_transform() -> None:
    for b in (8, 16, 32, 512, 1024, 4096):
        h = hadamard(b).double()
        rows = h[:: max(1, b // 64)]  # a sample of rows: orthonormal to every row
        assert torch.allclose(rows @ h, torch.eye(b, dtype=torch.float64)[:: max(1, b // 64)], atol=1e-6)
        x = torch.randn(3 * b)
        y = walsh_hadamard(x, b, torch.empty(3 * b), torch.empty(3 * b)).clone()
        assert torch.allclose(y.double(), (x.view(3, b).double() @ h).reshape(-1), atol=1e-5)
        back = walsh_hadamard(y, b, torch.empty(3 * b), torch.empty(3 * b))
        assert torch.allclose(back, x, atol=1e-5)
    assert [block_size(n) for n in (0, 1, 8, 9, 1000, 1024, 5000)] == [8, 8, 8, 16, 1024, 1024, 1024]
    assert padded_length(5000) == 5 * BLOCK and padded_length(3) == 8 and padded_length(0) == 0


def test_codes_use_the_bitpack_layout() -> None:
    codes = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    buf = _Buffers(4096)
    for bits in (1, 2, 4, 8):
        values = (codes.int() % (1 << bits)).to(torch.uint8).numpy()
        out = torch.empty(4096 * bits // 8, dtype=torch.uint8)
        _pack_codes(values, bits, out.numpy(), buf)
        assert torch.equal(out, pack_bits(torch.from_numpy(values), bits))
    x = torch.randn(3000)
    payload = get_codec("rot2").encode(x)
    packed = torch.frombuffer(bytearray(payload.fields["codes"]["data"]), dtype=torch.uint8)
    codes = unpack_bits(packed, 2, padded_length(3000))
    assert set(codes.unique().tolist()) <= {0, 1, 2, 3} and len(codes.unique()) == 4


@pytest.mark.parametrize("bits", BITS)
def test_reconstruction_is_contractive(bits: int) -> None:
    """The least-squares block scale makes every block's reconstruction a projection: ‖x − x̂‖ < ‖x‖
    even for inputs the Gaussian levels fit worst (one spike, a constant, two values)."""
    g = torch.Generator().manual_seed(bits)
    spike = torch.zeros(5000)
    spike[1234] = 7.0
    for x in (spike, torch.full((4096,), -3.0), torch.tensor([0.0, 1.0]).repeat(3000), torch.randn(777, generator=g)):
        out, _ = _roundtrip(f"rot{bits}", x)
        assert float((out - x).norm()) < float(x.norm())


def test_zero_blocks_decode_to_zero_and_scales_follow_blocks() -> None:
    x = torch.zeros(3 * BLOCK)
    x[BLOCK : 2 * BLOCK] = torch.randn(BLOCK)
    payload = get_codec("rot4").encode(x)
    scales = torch.frombuffer(bytearray(payload.fields["scales"]["data"]), dtype=torch.float32)
    assert scales.shape == (3,) and scales[0] == 0 and scales[2] == 0 and scales[1] > 0
    out = get_codec("rot4").decode(payload)
    assert torch.equal(out[:BLOCK], torch.zeros(BLOCK)) and torch.equal(out[2 * BLOCK :], torch.zeros(BLOCK))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (5, 3), (1025,), (70, 65), (2, 3, 4), (CHUNK + 9,)])
def test_roundtrip_shapes(bits: int, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    out, _ = _roundtrip(f"rot{bits}", x)
    assert out.shape == x.shape and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    if x.numel():
        assert float((out - x).norm()) < float(x.norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_and_layouts(dtype: torch.dtype) -> None:
    x = torch.randn(64, 130, generator=torch.Generator().manual_seed(9)).to(dtype).T  # non-contiguous
    out, _ = _roundtrip("rot4", x)
    assert out.shape == (130, 64) and out.dtype == torch.float32
    assert _nse(out, x.float()) <= NSE_TARGET[4]


@pytest.mark.parametrize("spec", ["rot1", "rot8", "topk:64/4096+rot2"])
def test_inputs_are_not_modified_and_payloads_do_not_alias_them(spec: str) -> None:
    assert_encode_leaves_input_alone(get_codec(spec), torch.randn(300, 70))


def test_encoding_is_deterministic_and_seeds_differ_between_tensors() -> None:
    codec = get_codec("rot2")
    x = torch.randn(5000)
    first, again = codec.encode(x), codec.encode(x.clone())
    assert first.to_bytes() == again.to_bytes()
    assert codec.encode(x * 2).fields["seed"] != first.fields["seed"]
    assert 0 <= first.fields["seed"] < 1 << 63


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_refused(bits: int, bad: float) -> None:
    x = torch.randn(3000)
    x[2047] = bad
    ef = ErrorFeedback(0.9)
    for spec in (f"rot{bits}", f"topk:8/64+rot{bits}"):
        with pytest.raises(ValueError, match="NaN or Inf"):
            get_codec(spec).encode(x)
        with pytest.raises(ValueError):
            get_codec(spec).encode(x, state=ef)
        assert ef.residual is None


@pytest.mark.parametrize("bits", BITS)
def test_huge_and_tiny_values(bits: int) -> None:
    g = torch.Generator().manual_seed(10)
    for scale in (1e30, 1e-30, 1e-35):  # squares overflow float32; squares underflow (float64 norms)
        x = torch.randn(4000, generator=g) * scale
        out, _ = _roundtrip(f"rot{bits}", x)
        assert _nse(out, x) <= NSE_TARGET.get(bits, 1e-4)
    subnormal = torch.randn(4000, generator=g) * 1e-41  # BLAS may flush these to zero: still no worse than 0
    out, _ = _roundtrip(f"rot{bits}", subnormal)
    assert float((out - subnormal).norm()) <= float(subnormal.norm())
    with pytest.raises(ValueError, match="too large"):
        get_codec(f"rot{bits}").encode(torch.full((100,), 3e38))


@pytest.mark.parametrize("spec", ["rot1", "rot2", "rot4", "rot8", "topk:16/256+rot2"])
def test_corrupted_fields_are_refused(spec: str) -> None:
    codec = get_codec(spec)
    payload = codec.encode(torch.randn(3000))
    scales = payload.fields["scales"]
    n_scales = scales["shape"][0]
    bad_scales = [
        torch.full((n_scales,), -1.0),
        torch.full((n_scales,), float("nan")),
        torch.full((n_scales,), float("inf")),
        torch.full((n_scales,), 1e38),  # the inverse rotation would overflow float32
    ]
    cases = [
        with_fields(payload, seed=-1),
        with_fields(payload, seed=1 << 63),
        with_fields(payload, seed="7"),
        with_fields(payload, seed=1.5),
        with_fields(payload, seed=True),
        *[with_fields(payload, scales=tensor_field(payload, "scales", data=t.numpy().tobytes())) for t in bad_scales],
        with_fields(payload, scales=tensor_field(payload, "scales", shape=[n_scales + 1], data=bytes(4 * (n_scales + 1)))),
        with_fields(payload, scales=tensor_field(payload, "scales", dtype="float16", data=b"\x00" * 2 * n_scales)),
        with_fields(payload, codes=tensor_field(payload, "codes", shape=[1], data=b"\x00")),
        Payload(payload.codec, payload.version, (6000,), payload.fields),
        *[without_field(payload, name) for name in ("seed", "scales", "codes")],
    ]
    for bad in cases:
        with pytest.raises(CodecError):
            codec.decode(Payload.from_bytes(bad.to_bytes()))


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(["rot1", "rot2", "rot8", "topk:8/64+rot4"]), position=st.integers(0, 10**6),
       value=st.integers(0, 255), cut=st.booleans())
def test_property_corrupted_bytes_raise_codec_error_or_decode(spec: str, position: int, value: int, cut: bool) -> None:
    out = decode_corrupted(get_codec(spec), torch.randn(40, 30), position, value, cut)
    assert out is None or (out.dtype == torch.float32 and bool(torch.isfinite(out).all()))


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.one_of(st.integers(0, 9), st.sampled_from([63, 65, 130, 1023, 1025]))) for _ in range(ndim)]
    if math.prod(shape) > 40000:
        shape = [min(s, 9) for s in shape]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-20, 1.0, 1e4]))
    x = torch.randn(shape, generator=g) * scale
    if draw(st.booleans()):
        x = x / torch.randn(shape, generator=g).abs().clamp_min(1e-2)  # heavy tails
    x = x.clamp(-6e4, 6e4).to(draw(st.sampled_from(DTYPES)))  # finite in float16 too
    if draw(st.booleans()) and x.dim() >= 2:
        x = x.transpose(0, -1)
    return x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), bits=st.sampled_from(BITS))
def test_property_roundtrip(x: torch.Tensor, bits: int) -> None:
    out, nbytes = _roundtrip(f"rot{bits}", x)
    assert out.dtype == torch.float32 and out.shape == x.shape and bool(torch.isfinite(out).all())
    ref = x.float()
    assert float((out.double() - ref.double()).norm()) <= float(ref.double().norm()) * (1 + 1e-4) + 1e-30
    padded = padded_length(x.numel())
    assert nbytes <= 200 + padded * bits // 8 + 4 * max(1, padded // block_size(x.numel()))


def test_topk_with_rotated_values() -> None:
    codec = get_codec("topk:64/4096+rot2")
    assert codec.spec == "topk:64/4096+rot2" and get_codec(codec.spec) == codec
    assert get_codec("topk:64/4096+q2") != codec
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(5))
    out, nbytes = _roundtrip(codec.spec, x)
    exact, _ = _roundtrip("topk:64/4096", x)
    kept = exact != 0
    assert bool((out[~kept] == 0).all())  # same positions as plain top-k
    assert _nse(out[kept], exact[kept]) <= NSE_TARGET[2]  # the kept values, quantized
    assert 8 * nbytes / x.numel() <= (12 + 2 + 0.05) * 64 / 4096 + 0.002
    small, _ = _roundtrip("topk:4/9+rot1", torch.randn(3, 5))
    assert small.shape == (3, 5)


@pytest.mark.parametrize("spec", ["rot", "rot3", "rot16", "rot2:1024", "topk:8/64+rot3", "topk:8/64+r2",
                                  "dct:8/64+rot2"])
def test_malformed_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        get_codec(spec)
    assert all(form in str(info.value) for form in SPEC_FORMS)


def test_specs_are_canonical() -> None:
    for spec in ("rot1", "rot2", "rot4", "rot8", "topk:8/64+rot1", "topk:64/4096+rot8"):
        codec = get_codec(spec)
        assert codec.spec == spec and get_codec(codec.spec) == codec
    assert isinstance(get_codec("rot4"), RotationQuantization)
    with pytest.raises(CodecError, match="encoded with codec"):
        get_codec("rot2").decode(get_codec("rot4").encode(torch.randn(10)))


def test_error_feedback_with_one_bit_stays_bounded() -> None:
    codec, ef = get_codec("rot1"), ErrorFeedback(decay=1.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        x = torch.randn(64, 64, generator=g)
        codec.encode(x, state=ef)
        assert ef.norm() <= 3 * float(x.norm())  # E‖e‖² = (1−δ)(‖e‖² + ‖x‖²), δ ≈ 0.64: settles near 0.75‖x‖


_CHILD = r"""
import hashlib, json, sys
import torch
from compression import Payload, get_codec
from compression.hadamard import random_signs
torch.set_num_threads(1)
payload = Payload.from_bytes(bytes.fromhex(sys.stdin.read()))
out = {
    "signs": hashlib.sha256(random_signs(987654321, 3, 100003).numpy().tobytes()).hexdigest(),
    "decoded": hashlib.sha256(get_codec(payload.codec).decode(payload).numpy().tobytes()).hexdigest(),
}
print(json.dumps(out))
"""


def test_signs_and_decodes_are_bit_identical_in_another_process() -> None:
    signs = random_signs(987654321, 3, 100003)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(signs.mean())) < 0.02
    assert torch.equal(random_signs(987654321, 3, 1000), signs[:1000])  # a prefix of the same stream
    assert not torch.equal(random_signs(987654321, 4, 1000), signs[:1000])  # runs draw independent signs
    codec = get_codec("rot2")
    payload = codec.encode(torch.randn(3, CHUNK // 2 + 77))  # two runs, the second one padded
    theirs = run_child(_CHILD, payload.to_bytes().hex())
    assert theirs["signs"] == sha(signs)
    assert theirs["decoded"] == sha(codec.decode(payload))


def test_wire_is_plain_msgpack() -> None:
    payload = get_codec("rot2").encode(torch.randn(2000))
    obj = msgpack.unpackb(payload.to_bytes(), raw=False)
    assert obj["c"] == "rot2" and set(obj["f"]) == {"seed", "scales", "codes"}
    assert obj["f"]["scales"]["shape"] == [2] and obj["f"]["codes"]["shape"] == [2 * BLOCK * 2 // 8]

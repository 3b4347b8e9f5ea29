"""Codec interface and wire format: round trips, exact sizes, refusals, spec parsing."""

from __future__ import annotations

import msgpack
import pytest
import torch

from compression import SPEC_FORMS, CodecError, ErrorFeedback, Payload, get_codec
from protocol.msgpack_view import pack, unpack
from protocol.errors import SchemaError
from tests.helpers.codec_checks import assert_encode_leaves_input_alone

DENSE = ["none", "fp16", "bf16"]
# every codec family, with the parameters the averaging code uses plus awkward ones
ALL_SPECS = [
    "none",
    "fp16",
    "bf16",
    "q8",
    "q4",
    "q2",
    "int8-block",
    "int8-block:7",
    "topk:64/4096",
    "topk:64/4096+q2",
    "topk:3/10+q8",
    "topk:5/3000+q4",
    "dct:32/4096",
    "dct:4/16+q2",
    "seed:r=4",
    "seed:r=3,dist=gaussian",
]
SHAPES = [(), (0,), (3, 0), (1,), (7,), (5, 3), (70, 65), (2, 3, 4), (4097,)]


def roundtrip(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(spec)
    payload = codec.encode(x)
    data = payload.to_bytes()
    assert isinstance(data, bytes)
    assert payload.nbytes == len(data)
    assert msgpack.unpackb(data, raw=False)["c"] == codec.spec  # standard msgpack on the wire
    again = Payload.from_bytes(data, max_bytes=len(data))
    assert again == payload
    assert again.codec == codec.spec and again.version == codec.version and again.shape == tuple(x.shape)
    out = codec.decode(again)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, codec.decode(payload))  # in-memory and parsed payloads decode alike
    return out


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_codec_roundtrips_with_exact_nbytes(spec: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    out = roundtrip(spec, x)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_is_canonical(spec: str) -> None:
    codec = get_codec(spec)
    assert get_codec(codec.spec) == codec
    assert get_codec(codec.spec).spec == codec.spec


def test_canonical_forms_drop_defaults() -> None:
    assert get_codec("int8-block:4096").spec == "int8-block"
    assert get_codec("seed:r=8,dist=rademacher").spec == "seed:r=8"
    assert get_codec("subspace:k=4,d=8,seed=0,dtype=bf16").spec == "subspace:k=4,d=8"


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (5, 3), (2, 3, 4)])
def test_none_is_exact(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    assert torch.equal(roundtrip("none", x), x)


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_round_to_nearest(spec: str, dtype: torch.dtype) -> None:
    x = torch.randn(33, 17)
    out = roundtrip(spec, x)
    assert torch.equal(out, x.to(dtype).float())
    # relative precision of the format: 2^-11 (fp16), 2^-8 (bf16)
    eps = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    big = x.abs() > 1e-4
    assert bool(((out - x).abs()[big] <= eps * x.abs()[big]).all())


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    assert roundtrip("fp16", x).tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("spec", [*ALL_SPECS, "subspace:k=2,d=3"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_refused(spec: str, bad: float) -> None:
    x = torch.randn(4, 3)
    x[2, 1] = bad
    ef = ErrorFeedback(0.9)
    with pytest.raises(ValueError):
        get_codec(spec).encode(x)
    with pytest.raises(ValueError):
        get_codec(spec).encode(x, state=ef)
    assert ef.residual is None  # a refused encode leaves the error-feedback state untouched


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_non_float_input_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        get_codec(spec).encode(torch.arange(6))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_wrong_codec_version_and_unknown_codec_are_refused(spec: str) -> None:
    payload = get_codec(spec).encode(torch.randn(40))
    other = "fp16" if spec != "fp16" else "none"
    with pytest.raises(CodecError, match="encoded with codec"):
        get_codec(other).decode(payload)
    future = Payload(payload.codec, payload.version + 1, payload.shape, payload.fields)
    with pytest.raises(CodecError, match="version"):
        get_codec(spec).decode(Payload.from_bytes(future.to_bytes()))
    unknown = Payload("gzip:9", payload.version, payload.shape, payload.fields)
    with pytest.raises(CodecError, match="gzip"):
        get_codec(spec).decode(Payload.from_bytes(unknown.to_bytes()))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_truncated_and_extended_bytes_are_refused(spec: str) -> None:
    data = get_codec(spec).encode(torch.randn(50)).to_bytes()
    for cut in sorted({0, 1, 2, len(data) // 2, len(data) - 1}):
        with pytest.raises(CodecError):
            Payload.from_bytes(data[:cut])
    with pytest.raises(CodecError, match="trailing"):
        Payload.from_bytes(data + b"\x00")
    with pytest.raises(CodecError, match="exceeds"):
        Payload.from_bytes(data, max_bytes=len(data) - 1)


def _tampered(data: bytes, edit) -> bytes:
    obj = msgpack.unpackb(data, raw=False)
    edit(obj)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if not s.startswith("seed")])
def test_flipped_length_fields_are_refused(spec: str) -> None:
    codec = get_codec(spec)
    data = codec.encode(torch.randn(300)).to_bytes()

    def grow_payload_shape(obj) -> None:
        obj["s"] = [6000]  # more chunks, blocks or values than the fields carry

    def shrink_tensor_shape(obj) -> None:
        field = next(v for v in obj["f"].values() if isinstance(v, dict))
        field["shape"] = [max(0, field["shape"][0] - 1)]

    def cut_tensor_data(obj) -> None:
        field = next(v for v in obj["f"].values() if isinstance(v, dict))
        field["data"] = field["data"][:-1]

    for edit in (grow_payload_shape, shrink_tensor_shape, cut_tensor_data):
        with pytest.raises(CodecError):
            codec.decode(Payload.from_bytes(_tampered(data, edit)))


def test_payload_structure_is_validated() -> None:
    good = msgpack.unpackb(get_codec("fp16").encode(torch.randn(3)).to_bytes(), raw=False)
    cases = [
        [1, 2, 3],
        {**good, "x": 1},
        {**good, "v": -1},
        {**good, "v": True},
        {**good, "c": ""},
        {**good, "s": [-1]},
        {**good, "s": [1.5]},
        {**good, "s": [2] * 9},
        {**good, "f": {"x": {"dtype": "complex64", "shape": [3], "data": b"\x00" * 24}}},
        {**good, "f": {"x": {"a": 1}}},
        {**good, "f": {"x": [1, "a"]}},
        {**good, "f": {"x": float("nan")}},
    ]
    for obj in cases:
        with pytest.raises(CodecError):
            Payload.from_bytes(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(CodecError):
        Payload.from_bytes(msgpack.packb({"a": 1}, use_bin_type=True) + b"\xc1")
    with pytest.raises(CodecError, match="limit"):
        Payload.from_bytes(msgpack.packb({**good, "s": [1 << 20, 1 << 20]}, use_bin_type=True), max_numel=1 << 30)
    with pytest.raises(CodecError, match="expected"):
        Payload.from_bytes(msgpack.packb(good, use_bin_type=True), expected_shape=(4,))
    assert issubclass(CodecError, SchemaError)


def test_missing_and_mistyped_fields_are_refused() -> None:
    codec = get_codec("topk:2/4+q2")
    payload = codec.encode(torch.randn(8))
    for name in payload.fields:
        fields = {k: v for k, v in payload.fields.items() if k != name}
        with pytest.raises(CodecError, match=name):
            codec.decode(Payload(payload.codec, payload.version, payload.shape, fields))
    with pytest.raises(CodecError, match="levels"):
        codec.decode(Payload(payload.codec, payload.version, payload.shape, {**payload.fields, "levels": "0"}))
    codec = get_codec("topk:2/4+q4")  # statistically quantized values
    payload = codec.encode(torch.randn(8))
    with pytest.raises(CodecError, match="shift"):
        codec.decode(Payload(payload.codec, payload.version, payload.shape, {**payload.fields, "shift": "0"}))


def test_msgpack_view_matches_msgpack() -> None:
    obj = {"a": [1, -1, 300, -300, 1 << 40, 2.5, None, True], "b": b"x" * 70000, "c": "é" * 40, "d": {"e": b""}}
    data = pack(obj)
    assert data == msgpack.packb(obj, use_bin_type=True)
    back = unpack(data)
    assert back == msgpack.unpackb(data, raw=False)
    assert isinstance(back["b"], memoryview) and back["b"].readonly


def test_unknown_or_malformed_specs_list_the_valid_forms() -> None:
    for spec in ["gzip", "q3", "topk", "topk:0/64", "topk:65/64", "topk:8/64+q3", "dct:1", "int8-block:0",
                 "seed", "seed:r=0", "seed:r=2,r=3", "seed:r=2,dist=uniform", "subspace:k=4", "subspace:k=9,d=8",
                 "subspace:k=2,d=4,dtype=fp32", "", "NONE", " fp16"]:
        with pytest.raises(ValueError) as info:
            get_codec(spec)
        assert all(form in str(info.value) for form in SPEC_FORMS)
    with pytest.raises(ValueError):
        get_codec(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_inputs_are_not_modified_and_payloads_do_not_alias_them(spec: str) -> None:
    assert_encode_leaves_input_alone(get_codec(spec), torch.randn(64, 70))


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 16383, 16384, 20000])
def test_a_packed_payload_equals_its_parse_without_parsing(numel: int) -> None:
    """``Payload.packed`` (the dense fp32 fast path) hands out a view of the packed bytes at the tensor's
    place, for every msgpack bin header (8, 16 and 32-bit lengths): the same fields a parse would give,
    read-only, not aliasing the input; a draft laid out otherwise is parsed instead, to the same result."""
    from compression.wire import owned_tensor_map

    x = torch.randn(numel)
    draft = Payload("none", 1, (numel,), {"x": owned_tensor_map(x)})
    packed = Payload.packed(draft, "x")
    parsed = Payload.from_bytes(packed.to_bytes(), max_numel=None)
    assert packed.fields["x"]["dtype"] == parsed.fields["x"]["dtype"] and packed.fields["x"]["shape"] == [numel]
    assert bytes(packed.fields["x"]["data"]) == bytes(parsed.fields["x"]["data"]) == x.numpy().tobytes()
    assert packed.fields["x"]["data"].readonly
    before = x.clone()
    x.add_(1.0)
    assert torch.equal(get_codec("none").decode(packed), before), "the payload does not alias its input"
    reordered = Payload("none", 1, (numel,), {"x": owned_tensor_map(x), "n": 3})  # "x" is not the last field
    fallback = Payload.packed(reordered, "x")
    assert fallback.fields["n"] == 3 and bytes(fallback.fields["x"]["data"]) == x.numpy().tobytes()

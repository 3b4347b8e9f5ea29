"""Codec interface: round trips, exact wire sizes, refusals, error feedback (dense codecs)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from compression import CodecError, ErrorFeedback, Payload, get_codec
from protocol.errors import SchemaError

DENSE = ["none", "fp16", "bf16"]


def roundtrip(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(spec)
    payload = codec.encode(x)
    data = payload.to_bytes()
    assert payload.nbytes == len(data)
    again = Payload.from_bytes(data, max_bytes=len(data))
    assert again == payload
    assert again.codec == codec.spec
    out = codec.decode(again)
    assert out.dtype == torch.float32 and out.shape == x.shape
    return out


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (5, 3), (2, 3, 4)])
def test_none_is_exact(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    assert torch.equal(roundtrip("none", x), x)


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_within_dtype_precision(spec: str, dtype: torch.dtype) -> None:
    x = torch.randn(33, 17)
    out = roundtrip(spec, x)
    assert torch.equal(out, x.to(dtype).float())  # round-to-nearest, nothing else


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    assert roundtrip("fp16", x).tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("spec", DENSE)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_refused(spec: str, bad: float) -> None:
    with pytest.raises(ValueError):
        get_codec(spec).encode(torch.tensor([1.0, bad, 2.0]))


@pytest.mark.parametrize("spec", DENSE)
def test_wrong_codec_and_version_are_refused(spec: str) -> None:
    payload = get_codec(spec).encode(torch.randn(4))
    other = "fp16" if spec != "fp16" else "none"
    with pytest.raises(CodecError, match="encoded with codec"):
        get_codec(other).decode(payload)
    future = Payload(payload.codec, payload.version + 1, payload.shape, payload.fields)
    with pytest.raises(CodecError, match="version"):
        get_codec(spec).decode(Payload.from_bytes(future.to_bytes()))


def test_truncated_and_malformed_bytes_are_refused() -> None:
    data = get_codec("fp16").encode(torch.randn(10)).to_bytes()
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        with pytest.raises(CodecError):
            Payload.from_bytes(data[:cut])
    with pytest.raises(CodecError, match="exceeds"):
        Payload.from_bytes(data, max_bytes=len(data) - 1)
    obj = msgpack.unpackb(data)
    obj["f"]["x"]["shape"] = [11]  # length field no longer matches the data
    with pytest.raises(CodecError):
        Payload.from_bytes(msgpack.packb(obj))
    assert issubclass(CodecError, SchemaError)


def test_error_feedback_with_lossless_codec_passes_input_through() -> None:
    codec, ef = get_codec("none"), ErrorFeedback(decay=0.0)
    for _ in range(3):
        x = torch.randn(6, 5)
        assert torch.equal(codec.decode(codec.encode(x, state=ef)), x)
        assert ef.norm() == 0.0


def test_unknown_spec_lists_valid_forms() -> None:
    with pytest.raises(ValueError, match="topk:K/C"):
        get_codec("gzip")

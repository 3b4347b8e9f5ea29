"""Wire format: envelopes, frames and tensor payloads round-trip, and every malformed input is refused."""

import asyncio
import math
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    FramedStream,
    FrameTooLarge,
    MalformedFrame,
    RemoteError,
    SchemaError,
    VersionMismatch,
    decode_message,
    encode_frame,
    encode_message,
    protocol_id,
    read_frame,
    tensor_from_wire,
    tensor_to_wire,
)
from protocol.records import PeerRecord, RoundEntry
from tests.helpers.memory_transport import Sink, ended_reader

bodies = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(kind=st.text(min_size=1, max_size=16), body=st.dictionaries(st.text(max_size=8), bodies, max_size=5))
@settings(max_examples=200, deadline=None)
def test_envelope_round_trip(kind, body):
    msg = decode_message(encode_message(kind, body))
    assert msg.kind == kind and msg.body == body and msg.version == (1, 0)


def test_minor_version_is_accepted_major_is_refused():
    assert decode_message(encode_message("x", {}, version=(1, 7))).version == (1, 7)
    with pytest.raises(VersionMismatch, match="2.0"):
        decode_message(encode_message("x", {}, version=(2, 0)))


@pytest.mark.parametrize(
    "raw, error",
    [
        (b"\xc1", MalformedFrame),  # reserved msgpack byte
        (b"", MalformedFrame),
        (msgpack.packb([1, 2, 3]), MalformedFrame),
        (msgpack.packb({"v": [1, 0], "k": "x"}), MalformedFrame),
        (msgpack.packb({"v": [1], "k": "x", "b": {}}), MalformedFrame),
        (msgpack.packb({"v": [1, 0], "k": "", "b": {}}), MalformedFrame),
        (msgpack.packb({"v": [1, 0], "k": "x", "b": []}), MalformedFrame),
        (msgpack.packb({"v": [True, 0], "k": "x", "b": {}}), MalformedFrame),
        (msgpack.packb({"v": [1, 0], "k": "x", "b": {}}) + b"\x00", MalformedFrame),
        (msgpack.packb({1: 2}), MalformedFrame),
    ],
)
def test_malformed_envelopes_are_refused(raw, error):
    with pytest.raises(error):
        decode_message(raw)


def test_oversized_message_refused():
    with pytest.raises(FrameTooLarge):
        decode_message(encode_message("x", {"data": b"\0" * 2000}), max_size=1000)


@given(st.binary(max_size=300))
@settings(max_examples=500, deadline=None)
def test_arbitrary_bytes_never_crash_the_decoder(raw):
    try:
        decode_message(raw)
    except (MalformedFrame, VersionMismatch, FrameTooLarge):
        pass


def test_frame_length_checked_before_reading_body():
    async def go():
        # announces 4 GiB - 1 but carries nothing: refused from the header alone
        with pytest.raises(FrameTooLarge, match="4294967295"):
            await read_frame(ended_reader(struct.pack(">I", 2**32 - 1)), max_size=1 << 20)
        with pytest.raises(MalformedFrame, match="ended after 3 of 10"):
            await read_frame(ended_reader(struct.pack(">I", 10) + b"abc"))
        with pytest.raises(MalformedFrame, match="header"):
            await read_frame(ended_reader(b"\x00\x00"))
        with pytest.raises(EOFError):
            await read_frame(ended_reader(b""))
        assert await read_frame(ended_reader(encode_frame(b"hello"))) == b"hello"

    asyncio.run(go())


def test_framed_stream_round_trip_and_error_frames():
    async def go():
        w = Sink()
        out = FramedStream(ended_reader(b""), w)
        n = await out.send("fetch", {"round": 3})
        assert n == len(w.data) == out.bytes_sent
        await out.send_error(SchemaError("bad round"))
        inp = FramedStream(ended_reader(bytes(w.data)), Sink())
        msg = await inp.recv(expect="fetch")
        assert msg.body == {"round": 3}
        with pytest.raises(RemoteError, match="bad round") as e:
            await inp.recv()
        assert e.value.remote_code == "schema"
        assert inp.bytes_received == len(w.data)

        w2 = Sink()
        await FramedStream(ended_reader(b""), w2).send("other", {})
        with pytest.raises(SchemaError, match="expected a fetch"):
            await FramedStream(ended_reader(bytes(w2.data)), Sink()).recv(expect="fetch")

    asyncio.run(go())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4)])
def test_tensor_round_trip(dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 10).to(dtype)
    wire = msgpack.unpackb(msgpack.packb(tensor_to_wire(t)))
    back = tensor_from_wire(wire)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_non_contiguous_tensor_round_trip():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(tensor_from_wire(tensor_to_wire(t)), t)


@pytest.mark.parametrize(
    "wire, match",
    [
        ({"dtype": "float32", "shape": [2], "data": b"\0" * 7}, "needs 8"),
        ({"dtype": "complex64", "shape": [1], "data": b"\0" * 8}, "unknown tensor dtype"),
        ({"dtype": "float32", "shape": [-1], "data": b""}, "non-negative"),
        ({"dtype": "float32", "shape": "2", "data": b""}, "list"),
        ({"dtype": "float32", "shape": [2], "data": "xxxxxxxx"}, "bytes"),
        ({"dtype": "float32", "shape": [2]}, "exactly"),
        ({"dtype": "float32", "shape": [1] * 9, "data": b"\0" * 4}, "at most 8"),
    ],
)
def test_bad_tensor_headers_are_refused(wire, match):
    with pytest.raises(SchemaError, match=match):
        tensor_from_wire(wire)


def test_tensor_expectations_and_allocation_limits():
    wire = tensor_to_wire(torch.zeros(4, 4))
    with pytest.raises(SchemaError, match="does not match the expected"):
        tensor_from_wire(wire, expected_shape=(4, 5))
    with pytest.raises(SchemaError, match="dtype"):
        tensor_from_wire(wire, expected_dtype=torch.float16)
    huge = {"dtype": "float32", "shape": [2**20, 2**20], "data": b""}
    with pytest.raises(SchemaError, match="exceeds the limit"):
        tensor_from_wire(huge, max_numel=10**9)


def test_protocol_ids():
    assert protocol_id("state") == "/locomesh/state/1.0"
    with pytest.raises(ValueError):
        protocol_id("a/b")


def test_records_validate():
    rec = PeerRecord(peer_id="p", round=3, maddrs=["/ip4/1.2.3.4/tcp/1"], loss=2.5)
    assert PeerRecord.from_value(rec.to_value()) == rec
    # no loss yet is NaN, which equals nothing (Python 3.13's dataclass __eq__ compares field by field)
    unknown = PeerRecord.from_value(PeerRecord(peer_id="p", round=3).to_value())
    assert math.isnan(unknown.loss) and (unknown.peer_id, unknown.round) == ("p", 3)
    for bad in [None, {"peer_id": 3}, {"peer_id": "p", "round": -1}, {"peer_id": "p", "round": True}, {"peer_id": "p", "maddrs": [1]}]:
        with pytest.raises(SchemaError):
            PeerRecord.from_value(bad)
    assert RoundEntry.from_value({"peer_id": "a", "samples": 4, "codec": "none"}).samples == 4
    with pytest.raises(SchemaError):
        RoundEntry.from_value({"peer_id": "a", "samples": -4, "codec": "none"})

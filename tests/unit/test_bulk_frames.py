"""A large frame's bulk is read without copies: decoded as views of the frame (protocol.frames), opened in
place (protocol.circuit), and decoding still says what msgpack says of every other frame."""

from __future__ import annotations

import os

import msgpack
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.circuit import FrameCipher
from protocol.errors import AuthError, MalformedFrame
from protocol.frames import BULK_BYTES, ZERO_COPY_BYTES, decode_message, encode_pieces

BLOB = bytes(range(256)) * (ZERO_COPY_BYTES // 256 + 8)


def _frame(body: dict) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in encode_pieces("part", body)))


def _plain(value: object) -> object:
    """``value`` with memoryviews as bytes, to compare with what msgpack decodes."""
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def test_a_bulk_value_is_a_read_only_view_of_the_frame_and_small_ones_stay_bytes() -> None:
    data = _frame({"i": 3, "digest": b"\x01" * 32, "note": "x", "payload": BLOB})
    msg = decode_message(data)
    payload = msg.body["payload"]
    assert isinstance(payload, memoryview) and payload.readonly and payload.tobytes() == BLOB
    assert isinstance(msg.body["digest"], bytes) and msg.body["i"] == 3 and msg.body["note"] == "x"
    data[len(data) - len(BLOB)] ^= 0xFF  # the view shares the frame's memory: no copy was made
    assert payload[0] == BLOB[0] ^ 0xFF


def test_a_large_frame_of_many_small_objects_is_decoded_by_msgpack_under_its_limits() -> None:
    body = {"records": [[i, str(i)] for i in range(50_000)], "pad": BLOB}
    data = _frame(body)
    assert len(data) >= ZERO_COPY_BYTES
    msg = decode_message(data)
    assert isinstance(msg.body["pad"], bytes)  # the strict decoder took it (more objects than a bulk frame holds)
    assert msg.body["records"][-1] == [49_999, "49999"]


def _envelope(*pairs: tuple) -> bytearray:
    """An envelope whose body map holds ``pairs`` as given (repeated keys included)."""
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack_map_header(3) + packer.pack("v") + packer.pack([1, 0]) + packer.pack("k") + packer.pack("part")
    body = packer.pack("b") + packer.pack_map_header(len(pairs)) + b"".join(packer.pack(k) + packer.pack(v) for k, v in pairs)
    return bytearray(head + body)


@pytest.mark.parametrize("pairs", [
    (("a", 1), ("pad", BLOB), ("a", 2)),  # a repeated key: msgpack keeps the last, so must this
    ((b"raw", 1), ("pad", BLOB)),  # a bin key
    ((1, "int key"), ("pad", BLOB)),
    (("s", "x" * ((1 << 20) + 1)), ("pad", BLOB)),  # a string over the limit
], ids=["repeated-key", "bin-key", "int-key", "long-string"])
def test_what_the_zero_copy_reader_refuses_is_decided_as_msgpack_decides_it(pairs: tuple) -> None:
    data = _envelope(*pairs)
    try:
        expected = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_str_len=1 << 20)
    except (ValueError, TypeError):
        with pytest.raises(MalformedFrame):
            decode_message(data)
        return
    assert _plain(decode_message(data).body) == expected["b"]


def test_a_truncated_bulk_frame_is_malformed() -> None:
    data = _frame({"payload": BLOB})
    with pytest.raises(MalformedFrame):
        decode_message(data[:-5])


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.recursive(st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.text(max_size=20)
                                    | st.binary(max_size=40) | st.floats(allow_nan=False),
                                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                                    max_leaves=20),
                       max_size=6))
def test_any_bulk_frame_decodes_to_what_msgpack_decodes(body: dict) -> None:
    body = {**body, "payload": BLOB}
    data = _frame(body)
    expected = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    got = decode_message(data)
    assert _plain(got.body) == expected["b"]
    assert all(not isinstance(v, memoryview) or v.nbytes >= BULK_BYTES for v in got.body.values())


@pytest.mark.parametrize("aead", [AESGCM, ChaCha20Poly1305])
def test_a_frame_read_into_its_own_buffer_is_opened_in_place(aead: type) -> None:
    key_a, key_b = os.urandom(32), os.urandom(32)
    sender, receiver = FrameCipher(key_a, key_b, aead), FrameCipher(key_b, key_a, aead)
    for size in (0, 1, 4095, (1 << 20) + 3):
        message = os.urandom(size)
        sealed = bytearray(b"".join(bytes(p) for p in sender.seal_pieces([message[: size // 3], message[size // 3:]])))
        opened = receiver.open(sealed, "peer")
        assert isinstance(opened, memoryview) and opened.obj is sealed and opened.tobytes() == message
    sealed = bytearray(b"".join(bytes(p) for p in sender.seal_pieces([b"x" * 100])))
    sealed[7] ^= 1
    with pytest.raises(AuthError):
        receiver.open(sealed, "peer")

"""Frames a stranger sends cannot exhaust a node: decoded objects are counted while decoding, and a private
swarm reads nothing bigger than a hello before the key is proved."""

import asyncio

import msgpack
import pytest

from protocol.auth import hello_body, server_hello
from protocol.errors import AuthError, FrameTooLarge, MalformedFrame
from protocol.frames import HELLO_MAX_FRAME, MAX_DECODED_OBJECTS, decode_message, encode_frame, encode_message
from tests.helpers.memory_transport import canned_stream


def test_an_envelope_of_a_million_empty_arrays_is_refused() -> None:
    data = msgpack.packb({"v": [1, 0], "k": "fetch", "b": {"x": [[] for _ in range(1 << 20)]}})
    assert len(data) < 1 << 21  # about a byte per array: under the 16 MiB frame cap
    with pytest.raises(MalformedFrame, match="array|more than"):
        decode_message(data)
    nested = msgpack.packb({"v": [1, 0], "k": "fetch", "b": {"x": [[[] for _ in range(1 << 17)] for _ in range(8)]}})
    with pytest.raises(MalformedFrame, match=f"more than {MAX_DECODED_OBJECTS} arrays, maps and elements"):
        decode_message(nested)


@pytest.mark.parametrize("arrays, length", [(5, 1 << 20), (5, 200_000)])
def test_elements_count_toward_the_cap_not_only_containers(arrays: int, length: int) -> None:
    """5 flat arrays of a million 2-byte strings fit a 15 MiB frame and passed a cap that counted only
    containers, decoding to ~274 MiB of objects on the event loop; now each array's length and all the
    elements together are capped, and decoding stops early."""
    import tracemalloc

    data = msgpack.packb({"v": [1, 0], "k": "fetch", "b": {f"x{i}": ["ab"] * length for i in range(arrays)}})
    assert len(data) < 16 << 20
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrame, match="array|more than"):
            decode_message(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"decoding peaked at {peak / 2**20:.0f} MiB before it was refused"


def test_honest_envelopes_with_many_fields_still_decode() -> None:
    body = {"parts": [[i, i + 1] for i in range(1 << 14)], "blob": b"\0" * (1 << 20)}
    assert decode_message(encode_message("contribution", body)).body["parts"][-1][0] == (1 << 14) - 1


def _hello_server(frame: bytes) -> None:
    async def run() -> None:
        stream, _ = canned_stream(frame, max_frame=1 << 24)
        await server_hello(stream, b"k" * 32, "/p/1", "client", "server")

    asyncio.run(run())


def test_a_private_swarm_decodes_no_first_frame_larger_than_a_hello() -> None:
    big = encode_frame(encode_message("hello", {"mac": b"\0" * 32, "pad": b"\0" * (HELLO_MAX_FRAME * 4)}))
    with pytest.raises(FrameTooLarge, match=str(HELLO_MAX_FRAME)):
        _hello_server(big)
    with pytest.raises(AuthError):
        _hello_server(encode_frame(encode_message("hello", {"mac": b"\0" * 32})))
    _hello_server(encode_frame(encode_message("hello", hello_body(b"k" * 32, "client", "/p/1", "client", "server"))))


def test_peer_text_is_made_safe_for_logs() -> None:
    from protocol.errors import RemoteError, printable
    from protocol.frames import require_token
    from protocol.errors import SchemaError

    forged = "bad\n12:00:00 INFO locomesh.node: round 5 done\x1b[2J"
    shown = printable(forged)
    assert "\n" not in shown and "\x1b" not in shown and "round 5 done" in shown
    error = RemoteError("x" * 1000, "y" * (1 << 20))
    assert len(str(error)) < 600 and "more characters" in str(error)
    assert require_token({"fp": "0123abcd"}, "fp") == "0123abcd"
    for bad in ("", "a" * 129, "12\n34", "\x1b[2J", "fp fp"):
        with pytest.raises(SchemaError):
            require_token({"fp": bad}, "fp")

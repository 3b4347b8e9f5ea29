"""Checks of the light client that must run in their own process (py-libp2p and hivemind cannot be
imported together, and pytest's process has imported hivemind). ``tests/integration/test_probe.py`` runs them.

``python -m tests.helpers.lite_checks stream``: the py-libp2p stream adapter against an in-memory stream.
``python -m tests.helpers.lite_checks cli ARGS...``: run ``node ARGS...`` in this process, then print the heavy
modules it loaded as ``LOADED [...]`` on stderr, and exit with the command's code.
``python -m tests.helpers.lite_checks batch JSON``: run ``node ARGS`` for each list of arguments in the JSON
list, one after the other in this process (the imports are paid once), and print a JSON list of
``{"code", "stdout", "stderr"}`` (``tests.helpers.cli_batch`` runs the commands in both modes).
"""

from __future__ import annotations

import json
import sys


def check_stream() -> None:
    import trio

    from protocol.auth import client_hello, hello_body
    from protocol.errors import AuthError, MalformedFrame, RemoteError, StreamTimeout
    from protocol.frames import encode_frame, encode_message
    from protocol.libp2p_transport import Libp2pStream

    class FakeNetStream:
        """Hands out the peer's bytes a few at a time, like a muxer delivering small packets."""

        def __init__(self, incoming: bytes, piece: int = 3, stall: bool = False) -> None:
            self.incoming, self.piece, self.stall = bytearray(incoming), piece, stall
            self.sent = bytearray()
            self.closed = False

        async def read(self, n: int | None = None) -> bytes:
            if self.stall:
                await trio.sleep_forever()
            await trio.sleep(0)
            if not self.incoming:
                raise EOFError("stream closed")  # what libp2p's StreamEOF is
            k = min(n or len(self.incoming), self.piece, len(self.incoming))
            data = bytes(self.incoming[:k])
            del self.incoming[:k]
            return data

        async def write(self, data: bytes) -> None:
            self.sent += data

        async def close(self) -> None:
            self.closed = True

    def frame(kind: str, body: dict) -> bytes:
        return encode_frame(encode_message(kind, body))

    async def main() -> None:
        # a reply split into 3-byte reads is reassembled; what we send is exactly the shared framing
        reply = frame("status", {"peer_id": "P", "steps": 7})
        raw = FakeNetStream(reply)
        stream = Libp2pStream(raw, peer="P")
        await stream.send("get_status", {})
        assert bytes(raw.sent) == frame("get_status", {}), raw.sent
        msg = await stream.recv(expect="status")
        assert msg.body == {"peer_id": "P", "steps": 7}, msg
        assert stream.bytes_received == len(reply)
        await stream.close()
        assert raw.closed

        # an error frame is the peer's refusal
        stream = Libp2pStream(FakeNetStream(frame("error", {"code": "auth", "message": "no"})), peer="P")
        try:
            await stream.recv(expect="status")
            raise AssertionError("an error frame must raise")
        except RemoteError as e:
            assert e.remote_code == "auth"

        # a stream that ends inside a frame is malformed, not a hang
        stream = Libp2pStream(FakeNetStream(reply[:-2]), peer="P")
        try:
            await stream.recv()
            raise AssertionError("a truncated frame must raise")
        except MalformedFrame:
            pass

        # EOF between frames is EOFError (the peer closed)
        stream = Libp2pStream(FakeNetStream(b""), peer="P")
        try:
            await stream.recv()
            raise AssertionError("EOF must raise")
        except EOFError:
            pass

        # a stalled peer trips the idle timeout (trio's cancel scopes, not asyncio's)
        stream = Libp2pStream(FakeNetStream(b"", stall=True), peer="P", idle_timeout=0.2)
        try:
            await stream.recv()
            raise AssertionError("a stall must time out")
        except StreamTimeout:
            pass

        # private swarm: our hello goes first, and the server's proof is checked before its reply
        key, proto = b"k" * 32, "/locomesh/status/1.0"
        good = frame("hello", hello_body(key, "server", proto, "C", "S")) + reply
        raw = FakeNetStream(good)
        stream = Libp2pStream(raw, peer="S")
        await client_hello(stream, key, proto, "C", "S")
        assert bytes(raw.sent) == frame("hello", hello_body(key, "client", proto, "C", "S"))
        assert (await stream.recv(expect="status")).body["steps"] == 7

        forged = frame("hello", hello_body(b"x" * 32, "server", proto, "C", "S")) + reply
        stream = Libp2pStream(FakeNetStream(forged), peer="S")
        await client_hello(stream, key, proto, "C", "S")
        try:
            await stream.recv(expect="status")
            raise AssertionError("a server without the key must be refused")
        except AuthError:
            pass

    trio.run(main)
    heavy = [m for m in ("torch", "hivemind") if m in sys.modules]
    assert not heavy, f"the light client imported {heavy}"
    print("stream checks passed")


def run_batch(runs: list[list[str]]) -> None:
    from tests.helpers.cli_batch import run

    print(json.dumps([run(args) for args in runs]))


def run_cli(args: list[str]) -> int:
    from tests.helpers.cli_batch import call

    code = call(args)
    loaded = sorted(m for m in ("torch", "hivemind", "libp2p", "trio") if m in sys.modules)
    print("LOADED " + json.dumps(loaded), file=sys.stderr)
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["stream"]:
        check_stream()
    elif sys.argv[1:2] == ["cli"]:
        sys.exit(run_cli(sys.argv[2:]))
    elif sys.argv[1:2] == ["batch"] and len(sys.argv) == 3:
        run_batch(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m tests.helpers.lite_checks stream | cli ARGS... | batch JSON")

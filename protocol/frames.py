"""Length-prefixed msgpack frames carrying versioned envelopes, and the streams that send and receive them.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. The msgpack object
is an envelope ``{"v": [major, minor], "k": kind, "b": body}`` (:mod:`protocol.envelope`). Receivers
check the length against their cap *before* reading the body, decode msgpack with strict limits, and
reject a different major version. An error reply is the envelope kind ``"error"`` with ``{"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import math
import struct
from typing import Any, Callable, Iterable

from protocol.errors import (
    FrameTooLarge,
    IncompatiblePeer,
    ProtocolError,
    RemoteError,
    SchemaError,
    StreamTimeout,
    TruncatedFrame,
)
from protocol.envelope import (  # noqa: F401 (the envelope's names, re-exported: callers import them from here)
    BULK_BYTES,
    DEFAULT_MAX_FRAME,
    MAX_DECODED_OBJECTS,
    ZERO_COPY_BYTES,
    Message,
    decode_message,
    encode_message,
    encode_pieces,
    require,
    require_token,
)
from protocol.version import OLD_VERSION, note_incompatible

HELLO_MAX_FRAME = 4096  # a stream's first frame (the hello), read before the peer has proved it holds a private swarm's key
_LENGTH = struct.Struct(">I")
ERROR_KIND = "error"


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    return _LENGTH.pack(len(payload)) + payload



MIN_FRAME_RATE = 125_000.0  # bytes/s (1 Mbit/s): a frame that has begun must keep at least this pace on average


async def read_frame(reader: asyncio.StreamReader, max_size: int = DEFAULT_MAX_FRAME,
                     stall_timeout: float | None = None, min_rate: float | None = None) -> bytes | bytearray:
    """Read one frame's bytes; the length is checked against ``max_size`` before the body is read.
    ``stall_timeout``: once the header has arrived, the longest wait for the body's next bytes (a peer
    that sends part of a frame and stops is refused with :class:`StreamTimeout`, however slow its link).
    ``min_rate``: with a stall timeout, the body must also arrive within ``stall_timeout`` + length ÷
    ``min_rate`` (a peer that trickles a byte now and then to stay under the stall timeout is refused)."""
    return await read_body(reader, await read_header(reader, max_size), stall_timeout, min_rate)


async def read_header(reader: asyncio.StreamReader, max_size: int = DEFAULT_MAX_FRAME) -> int:
    """A frame's announced length, checked against ``max_size``."""
    try:
        header = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise EOFError("stream closed") from None
        raise TruncatedFrame("stream ended inside a frame header") from None
    (length,) = _LENGTH.unpack(header)
    if length > max_size:
        raise FrameTooLarge(f"frame announces {length} bytes, the cap is {max_size} bytes")
    return length


async def read_body(reader: asyncio.StreamReader, length: int, stall_timeout: float | None = None,
                    min_rate: float | None = None) -> bytes | bytearray:
    """The ``length`` bytes of a frame whose header was read (timeouts as in :func:`read_frame`)."""
    if stall_timeout is None:
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise TruncatedFrame(f"stream ended after {len(e.partial)} of {length} frame bytes") from None
    body = bytearray(length)  # filled in place: one copy from the reader's buffer (none from a socket's), and no final one
    view, got = memoryview(body), 0
    readinto = getattr(reader, "readinto", None)  # protocol.socket_stream: straight from the socket into the frame
    loop = asyncio.get_running_loop()
    end = math.inf if not min_rate else loop.time() + stall_timeout + length / min_rate
    try:
        async with asyncio.timeout_at(min(loop.time() + stall_timeout, end)) as deadline:  # pushed back at every chunk
            while got < length:
                if readinto is not None:
                    k = await readinto(view[got:])
                else:
                    chunk = await reader.read(min(length - got, 1 << 22))
                    k = len(chunk)
                    view[got:got + k] = chunk
                if not k:
                    raise TruncatedFrame(f"stream ended after {got} of {length} frame bytes")
                got += k
                deadline.reschedule(min(loop.time() + stall_timeout, end))
    except TimeoutError:
        if min_rate and loop.time() >= end:
            raise StreamTimeout(f"a frame of {length} bytes came slower than {min_rate * 8 / 1e6:g} Mbit/s "
                                f"({got} bytes in {stall_timeout + length / min_rate:.0f}s)") from None
        raise StreamTimeout(f"a frame stopped after {got} of {length} bytes for {stall_timeout:.0f}s") from None
    return body


class FramedStream:
    """A bidirectional stream of envelopes over an asyncio reader/writer pair.

    :param peer: the remote peer id (for logs and error messages)
    :param max_frame: the largest frame this side accepts
    :param idle_timeout: longest wait for the next complete frame (a stalled peer is refused)
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str = "?",
        max_frame: int = DEFAULT_MAX_FRAME,
        idle_timeout: float | None = None,
    ) -> None:
        self.reader, self.writer, self.peer, self.max_frame = reader, writer, peer, max_frame
        self.idle_timeout = idle_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        # set by a client's hello (protocol.auth): checks the server's hello, the first frame it reads
        self.pending_hello: Callable[[Message], None] | None = None
        self.unread: Message | None = None  # a first request a server read while looking for a hello
        self.remote_addr = ""  # the connection's remote multiaddr, when the transport knows it
        self.relay = ""  # the peer id of the locomesh relay carrying this stream, if any
        self.cipher: Any = None  # a relayed stream's end-to-end seal (protocol.circuit.FrameCipher), once agreed
        self.stall_timeout: float | None = None  # longest pause inside a frame that has begun to arrive

    async def send(self, kind: str, body: dict[str, Any]) -> int:
        """Send one envelope; returns the bytes written (length prefix included).

        When the write fails because the peer already refused us and went away (a private swarm's
        wrong key, say), the refusal it sent first is read and raised as :class:`RemoteError`, so the
        caller learns why instead of seeing a bare broken stream."""
        pieces = encode_pieces(kind, body)
        if self.cipher is not None:
            pieces = self.cipher.seal_pieces(pieces)
        size = sum(len(p) for p in pieces)
        header = _LENGTH.pack(size)
        if len(pieces[0]) < BULK_BYTES:  # small frames (most of them) in one write
            header, pieces = header + pieces[0], pieces[1:]
        try:
            self.writer.write(header)
            for piece in pieces:
                self.writer.write(piece)
            await self.writer.drain()
        except (ConnectionError, OSError) as e:
            refusal = await self._pending_refusal()
            if refusal is not None:
                raise refusal from None
            raise ConnectionResetError(f"stream to {self.peer} broken while sending {kind!r}: {e}") from None
        self.bytes_sent += size + _LENGTH.size
        return size + _LENGTH.size

    async def _pending_refusal(self, timeout: float = 2.0) -> RemoteError | None:
        """The error frame the peer sent before closing, if one is waiting to be read (else None)."""
        saved, self.idle_timeout = self.idle_timeout, timeout
        try:
            msg = decode_message(await self._frame_payload(), self.max_frame)
        except Exception:  # nothing readable is waiting: the caller reports its own failure
            return None
        finally:
            self.idle_timeout = saved
        if msg.kind != ERROR_KIND:
            return None
        return RemoteError(str(msg.body.get("code", "?")), str(msg.body.get("message", "")))

    async def send_error(self, error: ProtocolError | str, message: str = "") -> None:
        """Tell the peer why its request was refused (best effort)."""
        code = error.code if isinstance(error, ProtocolError) else error
        text = str(error) if isinstance(error, ProtocolError) else message
        try:
            await self.send(ERROR_KIND, {"code": code, "message": text[:1000]})
        except (ConnectionError, RuntimeError, OSError, ProtocolError):
            pass

    async def refuse(self, error: ProtocolError | str, message: str = "") -> None:
        """Send the error frame, then read and drop whatever the peer still sends until it has read the
        error and closed its side (bounded by :meth:`wait_peer_closed`); the caller closes after that.

        Closing, or even half-closing, while the peer's request may still be arriving makes p2pd reset
        the libp2p stream (a socket closed with unread bytes reads as a connection reset; a closed read
        side answers later data with a reset), and a reset makes the peer's side drop data it has not
        read yet: the error frame would be lost and the peer would see only a broken stream."""
        await self.send_error(error, message)
        await self.wait_peer_closed()

    async def recv(self, expect: str | Iterable[str] | None = None, max_size: int | None = None) -> Message:
        """Receive one envelope; an error envelope raises :class:`RemoteError`, an unexpected kind
        raises :class:`SchemaError`. ``max_size`` caps this frame below the stream's ``max_frame``
        (a private swarm's hello, read before the peer is authenticated)."""
        if self.pending_hello is not None:
            check, self.pending_hello = self.pending_hello, None
            try:
                hello = await self.recv(expect="hello", max_size=HELLO_MAX_FRAME)
            except RemoteError as e:  # a server older than the hello read ours as an unknown request
                if e.remote_code == "schema" and "got 'hello'" in str(e):
                    raise IncompatiblePeer(note_incompatible(self.peer, OLD_VERSION, 1) or str(e)) from None
                raise
            check(hello)
        if self.unread is not None:
            msg, self.unread = self.unread, None
        else:
            data = await self._frame_payload(max_size)
            msg = decode_message(data, self.max_frame)
        if msg.kind == ERROR_KIND:
            raise RemoteError(str(msg.body.get("code", "?")), str(msg.body.get("message", "")))
        if expect is not None:
            allowed = {expect} if isinstance(expect, str) else set(expect)
            if msg.kind not in allowed:
                raise SchemaError(f"expected a {' or '.join(sorted(allowed))} message, got {msg.kind!r}")
        return msg

    async def _frame_payload(self, max_size: int | None = None) -> bytes:
        """The next frame's envelope bytes (at most ``max_size``, default ``max_frame``), opened when the
        stream is sealed."""
        cap = self.max_frame if max_size is None else min(max_size, self.max_frame)
        data = await self._next_frame(cap if self.cipher is None else cap + self.cipher.overhead)
        self.bytes_received += len(data) + _LENGTH.size
        return data if self.cipher is None else self.cipher.open(data, self.peer)

    async def _next_frame(self, max_size: int | None = None) -> bytes:
        """The next frame's bytes (at most ``max_size``, default ``max_frame``). The only asyncio-specific
        part of receiving: an adapter for another event loop (``protocol.libp2p_transport`` runs on trio)
        overrides it.

        An opened stream waits ``idle_timeout`` for the whole answer (the server's work included). A served
        stream (no ``stall_timeout``) waits ``idle_timeout`` for a request to begin; its body may then take
        as long as it keeps moving (no pause of ``idle_timeout``) at :data:`MIN_FRAME_RATE` or more
        on average, so a slow link, or this node's own download cap, can deliver a frame of any size."""
        cap = max_size or self.max_frame
        if self.stall_timeout is not None or self.idle_timeout is None:
            try:
                return await asyncio.wait_for(read_frame(self.reader, cap, self.stall_timeout), self.idle_timeout)
            except asyncio.TimeoutError:  # (a stall inside the frame raises its own StreamTimeout)
                raise StreamTimeout(f"no complete frame from {self.peer} within {self.idle_timeout:.0f}s") from None
        try:
            async with asyncio.timeout(self.idle_timeout):
                length = await read_header(self.reader, cap)
        except TimeoutError:
            raise StreamTimeout(f"no frame from {self.peer} began within {self.idle_timeout:.0f}s") from None
        bucket = getattr(self.reader, "bucket", None)  # this node's own download cap, when it has one
        floor = MIN_FRAME_RATE if bucket is None else min(MIN_FRAME_RATE, bucket.rate / 2)
        return await read_body(self.reader, length, self.idle_timeout, floor)

    async def wait_peer_closed(self, timeout: float = 10.0, max_bytes: int = 1 << 22) -> None:
        """Wait until the peer closes its side (it has read everything), so closing ours cannot cut a
        reply short. Bytes it still sends are read and dropped, up to ``max_bytes``."""

        try:
            await asyncio.wait_for(drain(self.reader, max_bytes), timeout=timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    async def close(self) -> None:
        """Close the writing side; never raises."""
        try:
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), timeout=2)
        except (ConnectionError, OSError, RuntimeError, asyncio.TimeoutError):
            pass


async def drain(reader: Any, max_bytes: int) -> None:
    """Read and drop what the peer still sends until it closes its side (or ``max_bytes`` were dropped)."""
    dropped = 0
    while dropped <= max_bytes:
        chunk = await reader.read(1 << 16)
        if not chunk:
            return
        dropped += len(chunk)

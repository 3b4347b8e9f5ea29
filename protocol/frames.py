"""Length-prefixed msgpack frames carrying versioned envelopes.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. The msgpack object
is an envelope ``{"v": [major, minor], "k": kind, "b": body}``. Receivers check the length against
their cap *before* reading the body, decode msgpack with strict limits, and reject a different
major version. An error reply is the envelope kind ``"error"`` with ``{"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgpack

from protocol.msgpack_view import unpack

from protocol.errors import (
    FrameTooLarge,
    IncompatiblePeer,
    MalformedFrame,
    ProtocolError,
    RemoteError,
    SchemaError,
    StreamTimeout,
    TruncatedFrame,
    VersionMismatch,
)
from protocol.ids import PROTOCOL_MAJOR, PROTOCOL_MINOR
from protocol.version import OLD_VERSION, note_incompatible

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
HELLO_MAX_FRAME = 4096  # a stream's first frame (the hello), read before the peer has proved it holds a private swarm's key
# Python objects one envelope may decode to: arrays, maps and their elements. Each costs a byte or two on
# the wire but ~50 bytes and a little time as a Python object, so 16 MiB of nested empty arrays (or 5
# arrays of a million 2-byte strings: ~274 MiB) would be a memory bomb decoded on the event loop.
# Envelopes carry tensors as bin fields and hold a few thousand objects at most. The count is checked as
# each container completes, and no array or map may be longer than the cap, so decoding stops within
# about twice the cap (~25 MiB of objects).
MAX_DECODED_OBJECTS = 1 << 18
_LENGTH = struct.Struct(">I")
ERROR_KIND = "error"


class _TooManyObjects(Exception):
    """Raised from inside msgpack's hooks to stop decoding at the object cap."""


@dataclass(frozen=True)
class Message:
    """A decoded envelope."""

    kind: str
    body: dict[str, Any]
    version: tuple[int, int]


def encode_message(kind: str, body: dict[str, Any], version: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)) -> bytes:
    """msgpack bytes of an envelope (without the length prefix)."""
    return msgpack.packb({"v": list(version), "k": kind, "b": body}, use_bin_type=True)


BULK_BYTES = 1 << 16  # a body value this large travels by reference in :func:`encode_pieces`, never copied into the envelope
ZERO_COPY_BYTES = 1 << 20  # a frame this large is first read by the zero-copy reader (:func:`decode_message`)
_BULK_FRAME_OBJECTS = 1 << 12  # values a frame read that way may hold (a part's frame holds ~20)
_MAX_STR = 1 << 20


def encode_pieces(kind: str, body: dict[str, Any], version: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)) -> list[Any]:
    """The envelope's msgpack bytes as pieces: the same bytes as :func:`encode_message`, except that a
    top-level ``bytes`` value of ``BULK_BYTES`` or more is a piece of its own, by reference (a part of a
    round, a state blob: 4 MB or more that packing would copy once more)."""
    bulky = [k for k, v in body.items() if isinstance(v, (bytes, memoryview)) and len(v) >= BULK_BYTES]
    if not bulky:
        return [encode_message(kind, body, version)]
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[Any] = [packer.pack_map_header(3), packer.pack("v"), packer.pack(list(version)), packer.pack("k"),
                         packer.pack(kind), packer.pack("b"), packer.pack_map_header(len(body))]
    for key, value in body.items():
        pieces.append(packer.pack(key))
        if key in bulky:
            pieces += [b"\xc6" + _LENGTH.pack(len(value)), value]  # bin 32 header, then the bytes themselves
        else:
            pieces.append(packer.pack(value))
    return pieces


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    return _LENGTH.pack(len(payload)) + payload


def decode_message(data: bytes | bytearray | memoryview, max_size: int = DEFAULT_MAX_FRAME,
                   major: int = PROTOCOL_MAJOR) -> Message:
    """Decode and validate one envelope; raises a :class:`ProtocolError` subclass on anything off.

    A frame of :data:`ZERO_COPY_BYTES` or more that holds few objects (a round's part, a state chunk, an
    activation) is read without copying its bulk: ``bin`` values of :data:`BULK_BYTES` or more come back
    as read-only memoryviews of ``data``, smaller ones as ``bytes``. Any other frame, and any that the
    zero-copy reader does not take whole, is decoded by msgpack under the limits above."""
    if len(data) > max_size:
        raise FrameTooLarge(f"message of {len(data)} bytes exceeds the cap of {max_size} bytes")
    obj = _bulk_envelope(data) if len(data) >= ZERO_COPY_BYTES else None
    if obj is None:
        obj = _strict_envelope(data, max_size)
    if not isinstance(obj, dict) or set(obj) != {"v", "k", "b"}:
        raise MalformedFrame("envelope must be a map with exactly the keys 'v', 'k' and 'b'")
    version, kind, body = obj["v"], obj["k"], obj["b"]
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in version)
    ):
        raise MalformedFrame(f"envelope version must be [major, minor], got {version!r}")
    if version[0] != major:
        raise VersionMismatch(f"peer speaks protocol {version[0]}.{version[1]}, this node speaks {major}.x")
    if not isinstance(kind, str) or not kind:
        raise MalformedFrame("envelope kind must be a non-empty string")
    if not isinstance(body, dict):
        raise MalformedFrame("envelope body must be a map")
    return Message(kind=kind, body=body, version=(version[0], version[1]))


def _strict_envelope(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """msgpack's decoding of an envelope, every limit checked (``bin`` values copied into ``bytes``)."""
    objects = 0

    def counted(container: Any) -> Any:
        nonlocal objects
        objects += 1 + len(container) * (2 if isinstance(container, dict) else 1)
        if objects > MAX_DECODED_OBJECTS:
            raise _TooManyObjects
        return container

    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            list_hook=counted,
            object_hook=counted,
            max_bin_len=max_size,
            max_str_len=_MAX_STR,
            max_array_len=MAX_DECODED_OBJECTS,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except _TooManyObjects:
        raise MalformedFrame(f"envelope decodes to more than {MAX_DECODED_OBJECTS} arrays, maps and elements") from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise MalformedFrame(f"not a msgpack envelope ({type(e).__name__}: {e})") from None
    return obj


def _bulk_envelope(data: bytes | bytearray | memoryview) -> Any:
    """The envelope with its large ``bin`` values as read-only views of ``data``, or None where it holds
    more than :data:`_BULK_FRAME_OBJECTS` values, a long string or anything the zero-copy reader refuses
    (msgpack's decoding then decides, with its own limits and messages)."""
    try:
        return _own_small_bins(unpack(data, max_items=_BULK_FRAME_OBJECTS, max_depth=32, max_objects=_BULK_FRAME_OBJECTS))
    except ValueError:  # (UnicodeDecodeError and TooManyObjects included)
        return None


def _own_small_bins(obj: Any) -> Any:
    """``obj`` with its ``bin`` views under :data:`BULK_BYTES` turned into ``bytes`` (fields that hold keys,
    digests and codes keep their type); ValueError on a string longer than msgpack's limit here."""
    if isinstance(obj, memoryview):
        return obj if obj.nbytes >= BULK_BYTES else obj.tobytes()
    if isinstance(obj, dict):
        return {k: _own_small_bins(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own_small_bins(v) for v in obj]
    if isinstance(obj, str) and len(obj) > _MAX_STR:
        raise ValueError("string too long")
    return obj


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


def require(body: dict[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
    """Fetch ``body[field]`` and check its type, raising :class:`SchemaError` with a clear message."""
    if field not in body:
        raise SchemaError(f"missing field {field!r}")
    value = body[field]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise SchemaError(f"field {field!r} must be {kind}, got bool")
    if not isinstance(value, kind):
        raise SchemaError(f"field {field!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def require_token(body: dict[str, Any], field: str, max_len: int = 128) -> str:
    """``body[field]`` as a short token (letters, digits, ``_.:-``; fingerprints and digests are hex):
    a peer's claim that ends up in logs and votes, so no control characters and no megabytes pass."""
    value = require(body, field, str)
    if not value or len(value) > max_len or not _TOKEN_CHARS.issuperset(value):
        raise SchemaError(f"field {field!r} must be a token of at most {max_len} letters, digits or _.:-")
    return value

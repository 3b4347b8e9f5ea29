"""In-memory stand-ins for the p2pd transport and its streams, for unit tests of protocol logic in one process.

:class:`MemoryTransport` on a :class:`Network` connects several members: ``open`` runs the target
member's handler on the other end of a pipe of real FramedStreams, refusals travel as error frames, and
every byte is counted per member. A ``MemoryTransport`` given ``reply`` instead answers every stream with
those bytes (a scripted or hostile peer: fuzzing, refusals). :func:`canned_stream` is one such stream on
its own (e.g. the request a handler reads), :func:`frames` encodes the messages such bytes hold.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Awaitable, Callable

from protocol.errors import ProtocolError
from protocol.frames import FramedStream, encode_frame, encode_message

Handler = Callable[[FramedStream], Awaitable[None]]


def frames(*messages: tuple[str, dict]) -> bytes:
    """The wire bytes of ``(kind, body)`` messages, one frame each."""
    return b"".join(encode_frame(encode_message(k, b)) for k, b in messages)


def ended_reader(data: bytes) -> asyncio.StreamReader:
    """A reader holding ``data`` and then the end of the stream."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


class Sink:
    """The write end of a canned stream: keeps what was written in ``data``; with ``breaks_after``, a
    write that would take it past that many bytes raises ``ConnectionResetError`` (a link that dropped)."""

    def __init__(self, breaks_after: int | None = None) -> None:
        self.data = bytearray()
        self.breaks_after = breaks_after

    def write(self, b: bytes) -> None:
        if self.breaks_after is not None and len(self.data) + len(b) > self.breaks_after:
            raise ConnectionResetError("link dropped")
        self.data += b

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


def canned_stream(data: bytes, max_frame: int = 1 << 20, peer: str = "remote") -> tuple[FramedStream, Sink]:
    """A stream whose other end sent ``data`` and then closed, and the sink that collects what is written to it."""
    sink = Sink()
    return FramedStream(ended_reader(data), sink, peer=peer, max_frame=max_frame), sink  # type: ignore[arg-type]


class PipeWriter:
    """The write end of an in-memory stream: bytes land in the peer's reader."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, b: bytes) -> None:
        self.reader.feed_data(b)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.reader.at_eof():
            self.reader.feed_eof()

    async def wait_closed(self) -> None:
        pass


class Network:
    """The members' handlers by (peer, protocol), bytes sent per member, and members that are down
    (streams to them fail)."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], Handler] = {}
        self.sent: dict[str, int] = defaultdict(int)
        self.down: set[str] = set()
        self.tasks: list[asyncio.Task] = []

    def transport(self, peer_id: str) -> "MemoryTransport":
        return MemoryTransport(self, peer_id)


class MemoryTransport:
    """One member's transport on a :class:`Network` (a network of its own if none is given).

    :param reply: when set (it may be changed between streams), every stream ``open`` returns is answered
        with these bytes and then ends, whoever it is opened to; no handler runs
    """

    def __init__(self, network: Network | None = None, peer_id: str = "self", reply: bytes | None = None) -> None:
        self.network = Network() if network is None else network
        self.peer_id, self.reply = peer_id, reply
        self.protocols: list[str] = []

    async def serve(self, protocol: str, handler: Handler) -> None:
        self.network.handlers[(self.peer_id, protocol)] = handler
        self.protocols.append(protocol)

    async def open(self, peer: str, protocol: str) -> FramedStream:
        if self.reply is not None:
            return canned_stream(self.reply)[0]
        if peer in self.network.down:
            raise ConnectionError(f"{peer} is down")
        handler = self.network.handlers.get((peer, protocol))
        if handler is None:
            raise ConnectionError(f"{peer} does not serve {protocol}")
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        server = FramedStream(to_server, PipeWriter(to_client), peer=self.peer_id, max_frame=1 << 26)  # type: ignore[arg-type]
        client = FramedStream(to_client, PipeWriter(to_server), peer=peer, max_frame=1 << 26)  # type: ignore[arg-type]
        self.network.tasks.append(asyncio.ensure_future(self._serve(peer, handler, server)))
        return client

    async def _serve(self, peer: str, handler: Handler, stream: FramedStream) -> None:
        try:
            await handler(stream)
        except ProtocolError as e:
            await stream.refuse(e)
        except (ConnectionError, EOFError, asyncio.IncompleteReadError):
            pass
        finally:
            self.network.sent[peer] += stream.bytes_sent
            await stream.close()

    def account(self, protocol: str, stream: FramedStream) -> None:
        self.network.sent[self.peer_id] += stream.bytes_sent


def byte_flipper(offset: int, mask: int = 1) -> Callable[[bytes], bytes]:
    """A tamperer for a stream's chunks in order: XORs the byte at ``offset`` of the whole stream with ``mask``."""
    passed = [0]

    def tamper(chunk: bytes) -> bytes:
        start, passed[0] = passed[0], passed[0] + len(chunk)
        if start <= offset < passed[0]:
            i = offset - start
            return chunk[:i] + bytes([chunk[i] ^ mask]) + chunk[i + 1:]
        return chunk

    return tamper
